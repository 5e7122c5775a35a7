// The deterministic samplers: a step's rows drawn from (seed, step, row) alone, windows of a
// token stream (BatchSampler) or translation pairs (PairSampler).
#include "flexdemo/data.h"

#include <ATen/ATen.h>

#include <random>
#include <stdexcept>

namespace flexdemo::data {

namespace {

// Draws row `row` of step `step` among n choices: from (seed, step, row) alone.
uint64_t draw(uint64_t seed, int64_t step, int64_t row, uint64_t n) {
  std::seed_seq seq{uint32_t(seed), uint32_t(seed >> 32),
                    uint32_t(step), uint32_t(uint64_t(step) >> 32),
                    uint32_t(row),  uint32_t(uint64_t(row) >> 32)};
  std::mt19937_64 rng(seq);
  return rng() % n;
}

}  // namespace

// ====== Sampler ======
BatchSampler::BatchSampler(std::vector<int32_t> tokens, int64_t seq_len, uint64_t seed)
    : tokens_(std::move(tokens)), seq_len_(seq_len), seed_(seed) {
  if (seq_len < 1)
    throw std::invalid_argument("--seq must be >= 1, got " + std::to_string(seq_len));
  if (int64_t(tokens_.size()) < seq_len + 1) {
    throw std::invalid_argument("the data holds " + std::to_string(tokens_.size()) +
                                " tokens, fewer than one sequence of --seq " +
                                std::to_string(seq_len) + " + 1");
  }
}

at::Tensor BatchSampler::rows(int64_t step, int64_t first, int64_t count) const {
  at::Tensor out = at::empty({count, seq_len_ + 1}, at::kLong);
  auto o = out.accessor<int64_t, 2>();
  const uint64_t starts = tokens_.size() - uint64_t(seq_len_);  // valid start positions
  for (int64_t r = 0; r < count; ++r) {
    const uint64_t start = draw(seed_, step, first + r, starts);
    for (int64_t t = 0; t <= seq_len_; ++t) o[r][t] = tokens_[start + t];
  }
  return out;
}

int64_t BatchSampler::num_windows() const {
  return (int64_t(tokens_.size()) - 1) / seq_len_;
}

at::Tensor BatchSampler::windows(int64_t first, int64_t count) const {
  at::Tensor out = at::empty({count, seq_len_ + 1}, at::kLong);
  auto o = out.accessor<int64_t, 2>();
  for (int64_t r = 0; r < count; ++r) {
    const int64_t start = ((first + r) % num_windows()) * seq_len_;
    for (int64_t t = 0; t <= seq_len_; ++t) o[r][t] = tokens_[start + t];
  }
  return out;
}

// ====== Pairs ======
PairSampler::PairSampler(const std::vector<int32_t>& tokens, int32_t eot, int64_t source_len,
                         int64_t target_len, uint64_t seed)
    : tokens_(tokens), source_len_(source_len), target_len_(target_len), seed_(seed) {
  if (source_len < 2 || target_len < 2) {
    throw std::invalid_argument("translation pairs need --seq and --target-seq >= 2, got " +
                                std::to_string(source_len) + " and " + std::to_string(target_len));
  }
  std::vector<Span> sides;
  size_t begin = 0;
  for (size_t i = 0; i < tokens_.size(); ++i) {
    if (tokens_[i] == eot) {
      sides.push_back({begin, i + 1});
      begin = i + 1;
    }
  }
  if (sides.size() % 2 != 0 || begin != tokens_.size()) {
    throw std::invalid_argument("the pair data is not source/target pairs ended by end-of-text");
  }
  for (size_t i = 0; i < sides.size(); i += 2) pairs_.push_back({sides[i], sides[i + 1]});
  if (pairs_.empty()) throw std::invalid_argument("the pair data holds no pairs");
}

void PairSampler::fill(at::Tensor& out, int64_t row, size_t pair) const {
  auto o = out.accessor<int64_t, 2>();
  int64_t at = 0;
  for (const auto& [side, len] :
       {std::pair{pairs_[pair].first, source_len_}, std::pair{pairs_[pair].second, target_len_}}) {
    const int64_t n = std::min<int64_t>(int64_t(side.end - side.begin), len);
    for (int64_t t = 0; t < n - 1; ++t) o[row][at + t] = tokens_[side.begin + size_t(t)];
    o[row][at + n - 1] = tokens_[side.end - 1];  // end-of-text, even when cut
    for (int64_t t = n; t < len; ++t) o[row][at + t] = kPad;
    at += len;
  }
}

at::Tensor PairSampler::rows(int64_t step, int64_t first, int64_t count) const {
  at::Tensor out = at::empty({count, source_len_ + target_len_}, at::kLong);
  for (int64_t r = 0; r < count; ++r) fill(out, r, draw(seed_, step, first + r, pairs_.size()));
  return out;
}

int64_t PairSampler::scored_tokens(const at::Tensor& rows) const {
  return (rows.narrow(1, source_len_, target_len_) != kPad).sum().item<int64_t>();
}

at::Tensor PairSampler::windows(int64_t first, int64_t count) const {
  at::Tensor out = at::empty({count, source_len_ + target_len_}, at::kLong);
  for (int64_t r = 0; r < count; ++r) fill(out, r, size_t((first + r) % num_windows()));
  return out;
}

}  // namespace flexdemo::data
