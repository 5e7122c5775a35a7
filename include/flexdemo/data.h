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
// clashes with LibTorch's) and cached as llm.c shards. `data` is a text file or folder, an llm.c
// shard (then `tokenizer` is ignored; its last 5% of tokens are the validation split, or a
// sibling file with "train" replaced by "val" in its name), or translation pairs (gettext:LANG,
// *.tsv, *.jsonl: text.h's read_pairs; cached as source, end-of-text, target, end-of-text, ...;
// a gettext corpus under the cache folder, keyed by its catalogues' sizes and times).
struct TokenData {
  std::vector<int32_t> train, val;
  int32_t vocab_size = 0;
  int32_t eot = 0;              // end-of-text id
  std::string tokenizer_model;  // the BPE model file ("" for bytes and llm.c shards)
  bool pairs = false;           // translation pairs, not running text
  std::string checksum;         // pairs: the corpus's CRC-32 (text.h's PairCorpus)
  int64_t train_pairs = 0, val_pairs = 0;
};
// tokenizer_model: a SentencePiece model to tokenize with instead of training a BPE on the data
// (tokenizer "bpe"); its tokens are cached apart, named by the model file's CRC-32.
TokenData load_token_data(const std::string& data, const std::string& tokenizer, int32_t vocab,
                          const std::string& helper, const std::string& tokenizer_model = "");
// The helper: $FLEXDEMO_TOKENIZE if set, else flexdemo-tokenize beside the running executable.
std::string default_tokenize_helper();

// ====== Batches ======
// Rows of a step's global batch and the validation rows. Row i of step s is drawn from
// (seed, s, i) alone, so the global batch does not depend on how many ranks share it, and a
// resumed run continues it exactly.
class Batches {
 public:
  virtual ~Batches() = default;
  // Rows [first, first + count) of step `step`'s global batch: int64 [count, width].
  virtual at::Tensor rows(int64_t step, int64_t first, int64_t count) const = 0;
  // Validation rows in order (row i wraps around num_windows()): int64 [count, width].
  virtual at::Tensor windows(int64_t first, int64_t count) const = 0;
  virtual int64_t num_windows() const = 0;
  // How many tokens of these rows a loss scores (evaluation weighs batches by it).
  virtual int64_t scored_tokens(const at::Tensor& rows) const = 0;
};

// Windows of seq_len + 1 tokens of running text (inputs, and next-token targets shifted by one);
// a row starts at a drawn position, validation windows do not overlap.
class BatchSampler final : public Batches {
 public:
  BatchSampler(std::vector<int32_t> tokens, int64_t seq_len, uint64_t seed);
  at::Tensor rows(int64_t step, int64_t first, int64_t count) const override;
  at::Tensor windows(int64_t first, int64_t count) const override;
  int64_t num_windows() const override;
  int64_t scored_tokens(const at::Tensor& rows) const override { return rows.size(0) * seq_len_; }
  int64_t seq_len() const { return seq_len_; }

 private:
  std::vector<int32_t> tokens_;
  int64_t seq_len_;
  uint64_t seed_;
};

// Translation pairs (TokenData::pairs): a row is [source | target], int64 [count, source_len +
// target_len], each side ending in end-of-text and padded with kPad; a side longer than its
// length is cut, keeping its end-of-text. A row of a step is a drawn pair; validation rows are
// the pairs in order.
class PairSampler final : public Batches {
 public:
  static constexpr int64_t kPad = -1;
  PairSampler(const std::vector<int32_t>& tokens, int32_t eot, int64_t source_len,
              int64_t target_len, uint64_t seed);
  at::Tensor rows(int64_t step, int64_t first, int64_t count) const override;
  at::Tensor windows(int64_t first, int64_t count) const override;
  int64_t num_windows() const override { return int64_t(pairs_.size()); }
  int64_t scored_tokens(const at::Tensor& rows) const override;  // the targets' tokens

 private:
  struct Span {
    size_t begin, end;  // [begin, end): the tokens, end-of-text last
  };
  void fill(at::Tensor& out, int64_t row, size_t pair) const;

  std::vector<int32_t> tokens_;
  std::vector<std::pair<Span, Span>> pairs_;
  int64_t source_len_, target_len_;
  uint64_t seed_;
};

}  // namespace flexdemo::data
