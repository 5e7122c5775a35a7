// Per-parameter dim-0 sharding in whole chunk-rows (vectors: whole chunks): which elements of
// a parameter each rank of a shard group holds, and the chunk plan of its part.
#include "flexdemo/shard.h"

#include <algorithm>
#include <stdexcept>

namespace flexdemo::shard {

ShardSpec make_shard_spec(at::IntArrayRef shape, int64_t chunk, dct::ChunkMode mode, int shard_rank,
                          int shard_size) {
  if (shard_size < 1 || shard_rank < 0 || shard_rank >= shard_size) {
    throw std::invalid_argument("shard rank " + std::to_string(shard_rank) +
                                " is outside a shard group of " + std::to_string(shard_size));
  }
  ShardSpec spec;
  spec.shape = shape.vec();
  spec.plan = dct::make_chunk_plan(shape, chunk, mode);
  const dct::ChunkPlan& p = spec.plan;
  const bool matrix = p.rows > 1;
  const int64_t units = matrix ? p.row_chunks() : p.col_chunks();  // the last may be partial
  spec.unit_numel = matrix ? p.chunk_rows * p.cols : p.chunk_cols;
  spec.shard_numel = (units + shard_size - 1) / shard_size * spec.unit_numel;
  spec.begin = std::min(shard_rank * spec.shard_numel, p.numel());
  spec.end = std::min((shard_rank + 1) * spec.shard_numel, p.numel());
  const int64_t n = spec.end - spec.begin;

  dct::ChunkPlan& s = spec.shard_plan;
  s.chunk_rows = p.chunk_rows;
  s.chunk_cols = p.chunk_cols;
  if (matrix) {
    s.rows = n / p.cols;
    s.cols = p.cols;
    s.padded_rows = (s.rows + p.chunk_rows - 1) / p.chunk_rows * p.chunk_rows;
    s.padded_cols = p.padded_cols;
  } else {
    s.rows = 1;
    s.cols = n;
    s.padded_rows = 1;
    s.padded_cols = (n + p.chunk_cols - 1) / p.chunk_cols * p.chunk_cols;
  }
  return spec;
}

}  // namespace flexdemo::shard
