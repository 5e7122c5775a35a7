// flexdemo/data.h — tokens for the trainer: token data of a corpus (tokenized once, cached) and
// a sampler whose global batches depend only on the seed, the step and the global batch size.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace flexdemo::data {

// ====== Token data ======
// The train and validation tokens of a corpus, tokenized by the `flexdemo-tokenize` helper
// (which runs SentencePiece in its own process: Debian's SentencePiece bundles a protobuf that
// clashes with LibTorch's) and cached as llm.c shards. `data` is a text file or folder, or an
// llm.c shard (then `tokenizer` is ignored; its last 5% of tokens are the validation split, or
// a sibling file with "train" replaced by "val" in its name).
struct TokenData {
  std::vector<int32_t> train, val;
  int32_t vocab_size = 0;
  int32_t eot = 0;              // end-of-text id
  std::string tokenizer_model;  // the BPE model file ("" for bytes and llm.c shards)
};
TokenData load_token_data(const std::string& data, const std::string& tokenizer, int32_t vocab,
                          const std::string& helper);
// The helper: $FLEXDEMO_TOKENIZE if set, else flexdemo-tokenize beside the running executable.
std::string default_tokenize_helper();

// ====== Batches ======
// Sequences of seq_len + 1 tokens (inputs, and next-token targets shifted by one).
class BatchSampler {
 public:
  BatchSampler(std::vector<int32_t> tokens, int64_t seq_len, uint64_t seed);
  // Rows [first, first + count) of step `step`'s global batch: int64 [count, seq_len + 1].
  // Row i of step s starts at a position drawn from (seed, s, i) alone, so the global batch
  // does not depend on how many ranks share it, and a resumed run continues it exactly.
  at::Tensor rows(int64_t step, int64_t first, int64_t count) const;
  // The i-th of the non-overlapping windows from the start (evaluation), int64 [count, seq+1].
  at::Tensor windows(int64_t first, int64_t count) const;
  int64_t num_windows() const;
  int64_t seq_len() const { return seq_len_; }

 private:
  std::vector<int32_t> tokens_;
  int64_t seq_len_;
  uint64_t seed_;
};

}  // namespace flexdemo::data
