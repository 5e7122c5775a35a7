// The DeMo step's CUDA kernels themselves (device code; launched by cuda_kernels.cu): one block per
// chunk of the bucket, the chunk in shared memory, every element computed by chunk_math.h's
// functions in their fixed order; all reductions whose order could change a bit (sums of floats)
// run in one fixed order, the others (counts, maxima, ORs) are order-free. Also compiled for the
// host by tests/test_cuda_emulation.cpp, whose emulation of blocks and threads runs them on a CPU.
// Include once per translation unit.
#pragma once

#include "demo/cuda/cuda_kernels.h"

#include <cstdint>

// The emulation's performance model (tests/cuda_emulation.h, bench/gpu_model.cpp) records each
// access of the kernels' hot paths, with its memory (shared, global, a shared atomic) and size,
// and the multiply-adds; on a GPU these are nothing.
#ifndef FLEXDEMO_TRACE_SHARED
#define FLEXDEMO_TRACE_SHARED(p, bytes)
#define FLEXDEMO_TRACE_GLOBAL(p, bytes)
#define FLEXDEMO_TRACE_ATOMIC(p)
#define FLEXDEMO_TRACE_FMA(count)
#endif

// A kernel's dynamic shared memory, as an array of T named `name`.
#ifndef FLEXDEMO_DYNAMIC_SHARED
#define FLEXDEMO_DYNAMIC_SHARED(T, name) extern __shared__ __align__(16) T name[]
#endif

namespace flexdemo::kernels::cuda {
namespace {

namespace cm = chunk_math;
namespace codec = demo::codec;

constexpr int kThreads = 256;
constexpr int kWarp = 32;
// The transforms' register tiles: a warp computes 2 x 32 outputs along one axis (two per lane,
// consecutive lanes on consecutive addresses) by kTile along the other (the same for the whole
// warp, so those operands are broadcast, 8 at a time in two 16-byte loads). Every output is
// still one dot product in chunk_math.h's order (fma32 from 0, index ascending).
constexpr int kTile = 8;
constexpr int kLanesSpan = 2 * kWarp;

// p[0, kTile): 16-byte aligned on the device, where it is two vector loads.
#define FLEXDEMO_LOAD_TILE(space, p, out) \
  do {                                    \
    FLEXDEMO_TRACE_##space((p), 16);      \
    FLEXDEMO_TRACE_##space((p) + 4, 16);  \
    load_tile((p), (out));                \
  } while (0)
__device__ inline void load_tile(const float* p, float (&out)[kTile]) {
#if defined(__CUDA_ARCH__)
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
#else
  for (int t = 0; t < kTile; ++t) out[t] = p[t];
#endif
}

// A chunk's rows padded to whole tiles (the encode's chunk in shared memory).
__device__ inline int padded_width(int w) {
  return (w + kTile - 1) / kTile * kTile;
}
// An odd row stride of at least w: lanes writing one column of consecutive rows hit 32 banks.
__device__ inline int odd_stride(int w) {
  return w % 2 == 0 ? w + 1 : w;
}

// Where chunk `c` of tensor t lies: its rows and columns inside the tensor (the rest is padding).
struct Place {
  int64_t ci, cj;  // chunk row and column
  int valid_h, valid_w;
};
__device__ Place place_of(const TensorDesc& t, int64_t c) {
  Place p;
  p.ci = c / t.col_chunks;
  p.cj = c % t.col_chunks;
  p.valid_h = int(min(int64_t(t.chunk_h), t.rows - p.ci * t.chunk_h));
  p.valid_w = int(min(int64_t(t.chunk_w), t.cols - p.cj * t.chunk_w));
  return p;
}

// This thread's share [begin, end) of n positions, in position order across the block. Shares
// are an odd number of positions long, so that lanes reading the q-th of their shares hit 32
// different banks.
__device__ void my_range(int n, int& begin, int& end) {
  const int per = (n + int(blockDim.x) - 1) / int(blockDim.x) | 1;
  begin = min(n, int(threadIdx.x) * per);
  end = min(n, begin + per);
}

// Exclusive prefix sum of one int per thread, in thread order; *total gets the sum.
__device__ int exclusive_scan(int v, int* scan, int* total) {
  scan[threadIdx.x] = v;
  __syncthreads();
  for (unsigned offset = 1; offset < blockDim.x; offset <<= 1) {
    const int add = threadIdx.x >= offset ? scan[threadIdx.x - offset] : 0;
    __syncthreads();
    scan[threadIdx.x] += add;
    __syncthreads();
  }
  const int exclusive = scan[threadIdx.x] - v;
  *total = scan[blockDim.x - 1];
  __syncthreads();
  return exclusive;
}

// ====== Encode ======
// The k-th largest magnitude of x[0, n) by radix selection over its 31 bits, the exponent first
// (bits 30-23, over whose bins a chunk's values spread; bits 31-24 would put them in a few and
// serialise the histogram's atomics), then 22-15, 14-7 and 6-0; and how many entries equal to it
// belong to the top-k (those of lowest position). The bin holding the k-th is found by a scan of
// the bins' counts from the top, each thread summing its own bins.
__device__ void kth_magnitude(const float* x, int n, int k, uint32_t* hist, int* scan,
                              uint32_t* threshold, int* take_equal) {
  __shared__ uint32_t prefix;
  __shared__ int remaining;
  if (threadIdx.x == 0) prefix = 0, remaining = k;
  uint32_t mask = 0;
  const int shifts[4] = {23, 15, 7, 0};
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = shifts[pass], bins = pass == 3 ? 128 : 256;
    const uint32_t digit = uint32_t(bins - 1);
    for (int b = threadIdx.x; b < bins; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
      FLEXDEMO_TRACE_SHARED(x + e, 4);
      const uint32_t m = cm::magnitude_bits(x[e]);
      if ((m & mask) != prefix) continue;
      FLEXDEMO_TRACE_ATOMIC(&hist[(m >> shift) & digit]);
      atomicAdd(&hist[(m >> shift) & digit], 1u);
    }
    __syncthreads();
    const int want = remaining;
    const int per = (bins + int(blockDim.x) - 1) / int(blockDim.x);
    const int top = bins - 1 - int(threadIdx.x) * per;  // this thread's bins: top, top - 1, ...
    int mine = 0;
    for (int q = 0; q < per && top - q >= 0; ++q) mine += int(hist[top - q]);
    int total;
    const int above = exclusive_scan(mine, scan, &total);
    if (above < want && above + mine >= want) {  // exactly one thread: the bins holding the k-th
      int acc = above;
      for (int q = 0; q < per; ++q) {
        const int b = top - q;
        if (acc + int(hist[b]) >= want) {
          remaining = want - acc;
          prefix |= uint32_t(b) << shift;
          break;
        }
        acc += int(hist[b]);
      }
    }
    mask |= digit << shift;
    __syncthreads();
  }
  *threshold = prefix;
  *take_equal = remaining;
}

// The chunk's top-k positions into selected[0, k), ascending: the entries above the k-th
// magnitude and, of those equal to it, the lowest positions. Ends with a barrier.
__device__ void chunk_topk(const float* x, int n, int k, uint32_t* hist, int* scan,
                           int32_t* selected) {
  uint32_t threshold;
  int take_equal;
  kth_magnitude(x, n, k, hist, scan, &threshold, &take_equal);
  int begin, end;
  my_range(n, begin, end);
  int equal = 0;
  for (int e = begin; e < end; ++e) {
    FLEXDEMO_TRACE_SHARED(x + e, 4);
    equal += cm::magnitude_bits(x[e]) == threshold;
  }
  int total;
  int equal_before = exclusive_scan(equal, scan, &total);
  int mine = 0;
  for (int e = begin; e < end; ++e) {
    FLEXDEMO_TRACE_SHARED(x + e, 4);
    const uint32_t m = cm::magnitude_bits(x[e]);
    mine += m > threshold || (m == threshold && equal_before++ < take_equal);
  }
  int slot = exclusive_scan(mine, scan, &total);
  equal_before = exclusive_scan(equal, scan, &total);
  for (int e = begin; e < end; ++e) {
    FLEXDEMO_TRACE_SHARED(x + e, 4);
    const uint32_t m = cm::magnitude_bits(x[e]);
    if (m > threshold || (m == threshold && equal_before++ < take_equal)) selected[slot++] = e;
  }
  __syncthreads();
}

// The encode's transform of the chunk in x (h rows of stride xs, zero padding) along both axes:
// y[u][j] = sum_i B_h[u][i] x[i][j] into yt (column-major: yt[j * h + u]), then
// c[u][v] = sum_j B_w[v][j] y[u][j] into c (row stride cs). Lanes run over u in both passes;
// each thread keeps 2 x kTile sums in registers. Ends with a barrier.
__device__ void forward_transform(const TensorDesc& t, const float* x, int xs, float* yt, float* c,
                                  int cs) {
  const int h = t.chunk_h, w = t.chunk_w;
  const int warp = int(threadIdx.x) / kWarp, lane = int(threadIdx.x) % kWarp;
  const int warps = int(blockDim.x) / kWarp;
  const int u_tiles = (h + kLanesSpan - 1) / kLanesSpan, w_tiles = (w + kTile - 1) / kTile;
  // Along the columns: per i, x[i][j0, j0 + 8) broadcast, B_h^T[i][u] coalesced.
  for (int tile = warp; tile < u_tiles * w_tiles; tile += warps) {
    const int ua = tile / w_tiles * kLanesSpan + lane, ub = ua + kWarp;
    const int j0 = tile % w_tiles * kTile;
    float acc[2][kTile] = {};
    for (int i = 0; i < h; ++i) {
      float xs8[kTile];
      FLEXDEMO_LOAD_TILE(SHARED, x + i * xs + j0, xs8);
      const float* bt = t.basis_rows_t + i * t.basis_rows_stride;
      if (ua < h) FLEXDEMO_TRACE_GLOBAL(bt + ua, 4);
      if (ub < h) FLEXDEMO_TRACE_GLOBAL(bt + ub, 4);
      FLEXDEMO_TRACE_FMA(2 * kTile);
      const float ba = ua < h ? bt[ua] : 0.0f, bb = ub < h ? bt[ub] : 0.0f;
      for (int q = 0; q < kTile; ++q) {
        acc[0][q] = cm::fma32(ba, xs8[q], acc[0][q]);
        acc[1][q] = cm::fma32(bb, xs8[q], acc[1][q]);
      }
    }
    for (int q = 0; q < kTile && j0 + q < w; ++q) {
      if (ua < h) FLEXDEMO_TRACE_SHARED(yt + (j0 + q) * h + ua, 4);
      if (ub < h) FLEXDEMO_TRACE_SHARED(yt + (j0 + q) * h + ub, 4);
      if (ua < h) yt[(j0 + q) * h + ua] = acc[0][q];
      if (ub < h) yt[(j0 + q) * h + ub] = acc[1][q];
    }
  }
  __syncthreads();
  // Along the rows: per j, B_w^T[j][v0, v0 + 8) broadcast, y[u][j] (yt) consecutive.
  for (int tile = warp; tile < u_tiles * w_tiles; tile += warps) {
    const int ua = tile / w_tiles * kLanesSpan + lane, ub = ua + kWarp;
    const int v0 = tile % w_tiles * kTile;
    float acc[2][kTile] = {};
    for (int j = 0; j < w; ++j) {
      float b8[kTile];
      FLEXDEMO_LOAD_TILE(GLOBAL, t.basis_cols_t + j * t.basis_cols_stride + v0, b8);
      if (ua < h) FLEXDEMO_TRACE_SHARED(yt + j * h + ua, 4);
      if (ub < h) FLEXDEMO_TRACE_SHARED(yt + j * h + ub, 4);
      FLEXDEMO_TRACE_FMA(2 * kTile);
      const float ya = ua < h ? yt[j * h + ua] : 0.0f, yb = ub < h ? yt[j * h + ub] : 0.0f;
      for (int q = 0; q < kTile; ++q) {
        acc[0][q] = cm::fma32(b8[q], ya, acc[0][q]);
        acc[1][q] = cm::fma32(b8[q], yb, acc[1][q]);
      }
    }
    for (int q = 0; q < kTile && v0 + q < w; ++q) {
      if (ua < h) FLEXDEMO_TRACE_SHARED(c + ua * cs + v0 + q, 4);
      if (ub < h) FLEXDEMO_TRACE_SHARED(c + ub * cs + v0 + q, 4);
      if (ua < h) c[ua * cs + v0 + q] = acc[0][q];
      if (ub < h) c[ub * cs + v0 + q] = acc[1][q];
    }
  }
  __syncthreads();
}

__global__ void encode_kernel(TensorTable table, float beta, float alpha, uint8_t* payloads) {
  FLEXDEMO_DYNAMIC_SHARED(float, shared);
  __shared__ uint32_t hist[256];
  __shared__ int scan[kThreads];
  __shared__ codec::ChunkScales scales;
  const int64_t chunk = blockIdx.x;
  const TensorDesc& t = table.tensors[table.chunk_tensor[chunk]];
  const int64_t c = chunk - t.first_chunk;
  const int h = t.chunk_h, w = t.chunk_w, n = h * w, k = int(t.body.k);
  const Place place = place_of(t, c);
  const int xs = padded_width(w), cs = odd_stride(w);
  float* a = shared;                                  // the chunk (stride xs), then its DCT (cs)
  float* x = shared + int64_t(h) * (xs + 1);          // the transform along the columns, then
  int32_t* selected = reinterpret_cast<int32_t*>(a);  // the new residual; the top-k's positions
  float* residual = t.residual + place.ci * h * t.padded_cols + place.cj * w;

  // 1. The chunk (zeros outside the tensor), transformed along each axis, folded into the residual.
  if (t.grad != nullptr) {
    const float* src = t.grad + place.ci * h * t.cols + place.cj * w;
    for (int e = threadIdx.x; e < h * xs; e += blockDim.x) {
      const int i = e / xs, j = e % xs;
      if (i < place.valid_h && j < place.valid_w) FLEXDEMO_TRACE_GLOBAL(src + i * t.cols + j, 4);
      FLEXDEMO_TRACE_SHARED(a + e, 4);
      a[e] = i < place.valid_h && j < place.valid_w ? src[i * t.cols + j] : 0.0f;
    }
    __syncthreads();
    forward_transform(t, a, xs, x, a, cs);
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
      const int u = e / w, v = e % w;
      float& r = residual[u * t.padded_cols + v];
      FLEXDEMO_TRACE_GLOBAL(&r, 4);  // read, then written
      FLEXDEMO_TRACE_GLOBAL(&r, 4);
      FLEXDEMO_TRACE_SHARED(a + u * cs + v, 4);
      FLEXDEMO_TRACE_SHARED(x + e, 4);
      r = cm::accumulate(beta, r, alpha, a[u * cs + v]);
      x[e] = r;
    }
  } else {  // a zero gradient scales the residual only (the CPU path's residual.mul_(beta))
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
      float& r = residual[(e / w) * t.padded_cols + e % w];
      r = beta * r;
      x[e] = r;
    }
  }
  __syncthreads();

  // 2. Top-k: entries above the k-th magnitude, and of those equal to it the lowest positions.
  chunk_topk(x, n, k, hist, scan, selected);

  // 3. The payload's entries; what a receiver decodes leaves the residual (error feedback).
  uint8_t* body = payloads + t.payload_offset + codec::kHeaderBytes;
  const compress::ValueEncoding encoding = table.encoding;
  if (threadIdx.x == 0) {
    scales = codec::chunk_scales(encoding, x, selected, k);
    codec::put_scales(body, t.body, encoding, c, scales);
  }
  __syncthreads();
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    const int pos = selected[j];
    codec::put_position<codec::AtomicBytes>(body, t.body, c, j, pos);
    const float sent =
        codec::put_value<codec::AtomicBytes>(body, t.body, encoding, c * k + j, x[pos], scales);
    float& r = residual[(pos / w) * t.padded_cols + pos % w];
    r = r + -1.0f * sent;  // compress::add_selected with alpha -1
  }
}

// ====== Decode and step ======
__global__ void decode_step_kernel(TensorTable table, const uint8_t* gathered, int64_t bucket_bytes,
                                   int replicas, cm::SgdConstants sgd, cm::AdamWConstants adamw,
                                   bool use_adamw) {
  FLEXDEMO_DYNAMIC_SHARED(float, shared);
  __shared__ int scan[kThreads];
  const int64_t chunk = blockIdx.x;
  const TensorDesc& t = table.tensors[table.chunk_tensor[chunk]];
  const int64_t c = chunk - t.first_chunk;
  const int h = t.chunk_h, w = t.chunk_w, n = h * w, k = int(t.body.k);
  const Place place = place_of(t, c);
  float* X = shared;                                          // sums, then the mean coefficients
  uint32_t* count = reinterpret_cast<uint32_t*>(shared + n);  // then the nonzeros' positions
  int32_t* nonzero = reinterpret_cast<int32_t*>(count);
  float* rows_done = shared + 2 * n;  // the inverse along the rows, of the rows holding any
  int32_t* row_of = reinterpret_cast<int32_t*>(shared + 3 * n);  // by slot: its row
  int32_t* row_start = row_of + h + 1;  // by slot: its first nonzero (then one past the last)
  const int warp = int(threadIdx.x) / kWarp, lane = int(threadIdx.x) % kWarp;
  const int warps = int(blockDim.x) / kWarp;

  // 1. Per coefficient, the sum over the replicas that sent it, rank by rank, and their count.
  for (int e = threadIdx.x; e < n; e += blockDim.x) X[e] = 0.0f, count[e] = 0;
  __syncthreads();
  for (int r = 0; r < replicas; ++r) {  // positions are distinct within one replica's chunk
    const uint8_t* body = gathered + r * bucket_bytes + t.payload_offset + codec::kHeaderBytes;
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
      const int pos = int(codec::get_position(body, t.body, c, j));
      FLEXDEMO_TRACE_SHARED(X + pos, 4);  // X and count read and written
      FLEXDEMO_TRACE_SHARED(X + pos, 4);
      FLEXDEMO_TRACE_SHARED(count + pos, 4);
      FLEXDEMO_TRACE_SHARED(count + pos, 4);
      X[pos] += codec::get_value(body, t.body, table.encoding, c * k + j);
      count[pos] += 1;
    }
    __syncthreads();
  }
  for (int e = threadIdx.x; e < n; e += blockDim.x) X[e] = cm::mean_of(X[e], count[e]);
  __syncthreads();

  // 2. The nonzero coefficients' positions, ascending, and the rows they lie in. A zero adds
  //    nothing to a dot product (fma(b, +-0, s) == s for the sums here, never -0), so the
  //    inverse over the nonzeros alone is the dense inverse bit for bit.
  int begin, end, total;
  my_range(n, begin, end);
  int mine = 0;
  for (int e = begin; e < end; ++e) {
    FLEXDEMO_TRACE_SHARED(X + e, 4);
    mine += X[e] != 0.0f;
  }
  int slot = exclusive_scan(mine, scan, &total);
  for (int e = begin; e < end; ++e) {
    if (X[e] != 0.0f) nonzero[slot++] = e;
  }
  const int nnz = total;
  __syncthreads();
  my_range(nnz, begin, end);
  mine = 0;
  for (int q = begin; q < end; ++q) mine += q == 0 || nonzero[q] / w != nonzero[q - 1] / w;
  slot = exclusive_scan(mine, scan, &total);
  for (int q = begin; q < end; ++q) {
    if (q == 0 || nonzero[q] / w != nonzero[q - 1] / w) {
      row_of[slot] = nonzero[q] / w;
      row_start[slot++] = q;
    }
  }
  const int rows = total;
  if (threadIdx.x == 0) row_start[rows] = nnz;
  __syncthreads();

  // 3. Along the rows, for the rows holding coefficients: rows_done[s][j] = sum_v B_w[v][j] X[u][v]
  //    over the row's nonzeros (v ascending); B_w[v][j] coalesced over j.
  for (int s = warp; s < rows; s += warps) {
    for (int j = lane; j < w; j += kWarp) {
      float acc = 0.0f;
      for (int q = row_start[s]; q < row_start[s + 1]; ++q) {
        const int e = nonzero[q];
        FLEXDEMO_TRACE_SHARED(nonzero + q, 4);
        FLEXDEMO_TRACE_SHARED(X + e, 4);
        FLEXDEMO_TRACE_GLOBAL(t.basis_cols + (e % w) * t.basis_cols_stride + j, 4);
        FLEXDEMO_TRACE_FMA(1);
        acc = cm::fma32(t.basis_cols[(e % w) * t.basis_cols_stride + j], X[e], acc);
      }
      FLEXDEMO_TRACE_SHARED(rows_done + s * w + j, 4);
      rows_done[s * w + j] = acc;
    }
  }
  __syncthreads();

  // 4. Along the columns, over those rows only (u ascending): x[i][j] = sum_u B_h[u][i] y[u][j];
  //    lanes over j, B_h[u][i0, i0 + 8) broadcast; then the step on the parameters in the tensor.
  const int i_tiles = (h + kTile - 1) / kTile, j_tiles = (w + kLanesSpan - 1) / kLanesSpan;
  for (int tile = warp; tile < i_tiles * j_tiles; tile += warps) {
    const int i0 = tile / j_tiles * kTile;
    const int ja = tile % j_tiles * kLanesSpan + lane, jb = ja + kWarp;
    float acc[kTile][2] = {};
    for (int s = 0; s < rows; ++s) {
      float b8[kTile];
      FLEXDEMO_TRACE_SHARED(row_of + s, 4);
      FLEXDEMO_LOAD_TILE(GLOBAL, t.basis_rows + row_of[s] * t.basis_rows_stride + i0, b8);
      if (ja < w) FLEXDEMO_TRACE_SHARED(rows_done + s * w + ja, 4);
      if (jb < w) FLEXDEMO_TRACE_SHARED(rows_done + s * w + jb, 4);
      FLEXDEMO_TRACE_FMA(2 * kTile);
      const float ya = ja < w ? rows_done[s * w + ja] : 0.0f;
      const float yb = jb < w ? rows_done[s * w + jb] : 0.0f;
      for (int q = 0; q < kTile; ++q) {
        acc[q][0] = cm::fma32(b8[q], ya, acc[q][0]);
        acc[q][1] = cm::fma32(b8[q], yb, acc[q][1]);
      }
    }
    for (int q = 0; q < kTile && i0 + q < place.valid_h; ++q) {
      for (int side = 0; side < 2; ++side) {
        const int j = side == 0 ? ja : jb;
        if (j >= place.valid_w) continue;
        const int64_t at = (place.ci * h + i0 + q) * t.cols + place.cj * w + j;
        FLEXDEMO_TRACE_GLOBAL(t.param + at, 4);  // read, then written
        FLEXDEMO_TRACE_GLOBAL(t.param + at, 4);
        if (use_adamw) {
          cm::adamw_step(t.param[at], t.exp_avg[at], t.exp_avg_sq[at], acc[q][side], adamw);
        } else {
          t.param[at] = cm::sgd_step(t.param[at], acc[q][side], sgd);
        }
      }
    }
  }
}

// ====== Checksums (zlib's CRC-32) and screening ======
// The byte-at-a-time table, built by the block. Ends with a barrier.
__device__ void crc_table(uint32_t* table) {
  for (int b = threadIdx.x; b < 256; b += blockDim.x) {
    uint32_t c = uint32_t(b);
    for (int i = 0; i < 8; ++i) c = c & 1u ? (c >> 1) ^ codec::kCrcPoly : c >> 1;
    table[b] = c;
  }
  __syncthreads();
}
// crc(A B) from crc(A), crc(B) and |B| (zlib's crc32_combine); x2n[k] = x^(2^k) mod p.
__device__ uint32_t crc_combine(uint32_t a, uint32_t b, int64_t b_bytes, const uint32_t* x2n) {
  uint32_t shift = 1u << 31;  // x^(8 |B|)
  for (int k = 3; b_bytes != 0; b_bytes >>= 1, ++k) {
    if (b_bytes & 1) shift = codec::multmodp(x2n[k & 31], shift);
  }
  return codec::multmodp(shift, a) ^ b;
}

// Each thread one segment (kChecksumSegment bytes of a body, the last one shorter) of one
// replica's bucket: its CRC-32 into crcs[replica * num_segments + segment].
__global__ void crc_segments_kernel(TensorTable table, const uint8_t* buckets, int64_t bucket_bytes,
                                    int replicas, uint32_t* crcs) {
  __shared__ uint32_t crc8[256];
  crc_table(crc8);
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= replicas * table.num_segments) return;
  const int64_t r = g / table.num_segments, s = g % table.num_segments;
  const TensorDesc& t = table.tensors[table.segment_tensor[s]];
  const int64_t start = (s - t.first_segment) * kChecksumSegment;
  const int64_t len = min(kChecksumSegment, t.body.body_bytes - start);
  const uint8_t* p = buckets + r * bucket_bytes + t.payload_offset + codec::kHeaderBytes + start;
  uint32_t c = 0xffffffffu;
  for (int64_t i = 0; i < len; ++i) {
    FLEXDEMO_TRACE_GLOBAL(p + i, 1);
    FLEXDEMO_TRACE_SHARED(crc8 + ((c ^ p[i]) & 255u), 4);
    c = crc8[(c ^ p[i]) & 255u] ^ (c >> 8);
  }
  crcs[g] = c ^ 0xffffffffu;
}

// One block per (replica, tensor): the body's CRC-32 from its segments' (each thread combines a
// run of them, then the runs pairwise), then the header written with it (errors == nullptr: seal)
// or compared with the received one (errors[r * tensors + i] |= 1 for the header, 2 for the
// checksum).
__global__ void crc_finish_kernel(TensorTable table, uint8_t* buckets, int64_t bucket_bytes,
                                  const uint32_t* crcs, uint32_t* errors) {
  __shared__ uint32_t x2n[32];  // the host's table (indexed at run time: from shared memory)
  __shared__ uint32_t part[kThreads];
  __shared__ int64_t part_bytes[kThreads];
  const int64_t r = blockIdx.x / table.num_tensors, i = blockIdx.x % table.num_tensors;
  const TensorDesc& t = table.tensors[i];
  for (int k = threadIdx.x; k < 32; k += blockDim.x) x2n[k] = table.crc_x2n[k];
  __syncthreads();
  const int64_t segments = (t.body.body_bytes + kChecksumSegment - 1) / kChecksumSegment;
  const int64_t per = (segments + blockDim.x - 1) / blockDim.x;
  const int64_t a = min(segments, int64_t(threadIdx.x) * per), b = min(segments, a + per);
  uint32_t c = 0;  // the CRC-32 of nothing
  int64_t bytes = 0;
  for (int64_t s = a; s < b; ++s) {
    const int64_t len = min(kChecksumSegment, t.body.body_bytes - s * kChecksumSegment);
    c = crc_combine(c, crcs[r * table.num_segments + t.first_segment + s], len, x2n);
    bytes += len;
  }
  part[threadIdx.x] = c;
  part_bytes[threadIdx.x] = bytes;
  __syncthreads();
  for (unsigned stride = 1; stride < blockDim.x; stride <<= 1) {
    if (threadIdx.x % (2 * stride) == 0 && threadIdx.x + stride < blockDim.x) {
      part[threadIdx.x] = crc_combine(part[threadIdx.x], part[threadIdx.x + stride],
                                      part_bytes[threadIdx.x + stride], x2n);
      part_bytes[threadIdx.x] += part_bytes[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  uint8_t* payload = buckets + r * bucket_bytes + t.payload_offset;
  const uint32_t crc = part[0];
  if (errors == nullptr) {
    for (int q = 0; q < 32; ++q) payload[q] = t.header[q];
    for (int q = 0; q < 4; ++q) payload[32 + q] = uint8_t(crc >> (8 * q));
    return;
  }
  uint32_t bad = 0;
  for (int q = 0; q < 32; ++q) bad |= payload[q] != t.header[q] ? 1u : 0u;
  uint32_t stored = 0;
  for (int q = 0; q < 4; ++q) stored |= uint32_t(payload[32 + q]) << (8 * q);
  if (stored != crc) bad |= 2u;
  if (bad != 0) atomicOr(&errors[r * table.num_tensors + i], bad);
}

// A thread's read of n bytes at p, as the performance model records it: 8 bytes at a time (on a
// GPU, nothing).
__device__ void trace_bytes(const uint8_t* p, int64_t n) {
  for (int64_t o = 0; o < n; o += 8) FLEXDEMO_TRACE_GLOBAL(p + o, int(min(int64_t(8), n - o)));
}

// One thread per (replica, chunk), on its own (no barrier, no shared memory): the chunk's
// positions (errors[r * tensors + i] |= 4 unless k strictly ascending ones inside the chunk, so
// that the decode never writes outside it) and its values (|= 8 for one that is not finite; their
// sum of squares into chunk_squares[r * num_chunks + chunk]).
__global__ void screen_chunks_kernel(TensorTable table, const uint8_t* gathered,
                                     int64_t bucket_bytes, int replicas, double* chunk_squares,
                                     uint32_t* errors) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= replicas * table.num_chunks) return;
  const int64_t r = g / table.num_chunks, chunk = g % table.num_chunks;
  const int32_t i = table.chunk_tensor[chunk];
  const TensorDesc& t = table.tensors[i];
  const int64_t c = chunk - t.first_chunk;
  const codec::Layout& l = t.body;
  const uint8_t* body = gathered + r * bucket_bytes + t.payload_offset + codec::kHeaderBytes;
  // What the thread reads (the model's record): its chunk's positions and values.
  trace_bytes(body + (l.index_bytes > 0 ? c * l.k * l.index_bytes : c * l.record_bytes),
              l.index_bytes > 0 ? l.k * l.index_bytes : l.record_bytes);
  trace_bytes(body + l.values_at + codec::value_bytes(table.encoding, c * l.k),
              codec::value_bytes(table.encoding, l.k));
  uint32_t bad = codec::positions_valid(body, l, c) ? 0u : 4u;
  bool finite = true;
  chunk_squares[g] = codec::chunk_squares(body, l, table.encoding, c, &finite);
  if (!finite) bad |= 8u;
  if (bad != 0) atomicOr(&errors[r * table.num_tensors + i], bad);
}

// One block per (replica, tensor): the tensor's chunk sums added in codec.h's order (each thread
// one run of codec::kScreenRun chunks, then thread 0 the runs in order) into
// squares[r * tensors + i].
__global__ void screen_sums_kernel(TensorTable table, const double* chunk_squares,
                                   double* squares) {
  __shared__ double runs[kThreads];
  const int64_t r = blockIdx.x / table.num_tensors, i = blockIdx.x % table.num_tensors;
  const TensorDesc& t = table.tensors[i];
  const double* sums = chunk_squares + r * table.num_chunks + t.first_chunk;
  const int64_t chunks = t.body.chunks;
  const int64_t run_count = (chunks + codec::kScreenRun - 1) / codec::kScreenRun;
  double total = 0.0;
  for (int64_t first = 0; first < run_count; first += kThreads) {  // runs[] holds kThreads
    const int64_t q = first + threadIdx.x;
    if (threadIdx.x < kThreads && q < run_count) {
      double run = 0.0;
      const int64_t end = min(chunks, (q + 1) * codec::kScreenRun);
      for (int64_t c = q * codec::kScreenRun; c < end; ++c) {
        FLEXDEMO_TRACE_GLOBAL(sums + c, 8);
        run += sums[c];
      }
      runs[threadIdx.x] = run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const int64_t n = min(int64_t(kThreads), run_count - first);
      for (int64_t j = 0; j < n; ++j) total += runs[j];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) squares[blockIdx.x] = total;
}

}  // namespace
}  // namespace flexdemo::kernels::cuda
