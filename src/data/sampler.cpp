// Token data for the trainer (tokenized once by the flexdemo-tokenize helper, cached as llm.c
// shards) and the deterministic batch sampler.
#include "flexdemo/data.h"

#include "flexdemo/text.h"

#include <ATen/ATen.h>
#include <zlib.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>
#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>

namespace flexdemo::data {

std::string default_tokenize_helper() {
  namespace fs = std::filesystem;
  if (const char* env = std::getenv("FLEXDEMO_TOKENIZE")) return env;
  const fs::path self = fs::read_symlink("/proc/self/exe");
  return (self.parent_path() / "flexdemo-tokenize").string();
}

namespace {

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Where gettext:LANG's tokens are cached: under the cache folder, named by the language and a
// hash of its catalogues' paths, sizes and modification times (an upgraded package is a new
// corpus, tokenized again).
std::string gettext_cache_dir(const std::string& data, const std::string& tokenizer,
                              int32_t vocab) {
  namespace fs = std::filesystem;
  std::string key;
  for (const std::string& file : gettext_catalogues(data.substr(8))) {
    key += file + ":" + std::to_string(fs::file_size(file)) + ":" +
           std::to_string(fs::last_write_time(file).time_since_epoch().count()) + ";";
  }
  const std::string suffix =
      ".flexdemo-" + (tokenizer == "bpe" ? "bpe-" + std::to_string(vocab) : tokenizer);
  return (fs::path(cache_dir()) / ("gettext-" + data.substr(8) + "-" +
                                   std::to_string(std::hash<std::string>{}(key)) + suffix))
      .string();
}

// Draws row `row` of step `step` among n choices: from (seed, step, row) alone.
uint64_t draw(uint64_t seed, int64_t step, int64_t row, uint64_t n) {
  std::seed_seq seq{uint32_t(seed), uint32_t(seed >> 32),
                    uint32_t(step), uint32_t(uint64_t(step) >> 32),
                    uint32_t(row),  uint32_t(uint64_t(row) >> 32)};
  std::mt19937_64 rng(seq);
  return rng() % n;
}

}  // namespace

TokenData load_token_data(const std::string& data, const std::string& tokenizer, int32_t vocab,
                          const std::string& helper, const std::string& tokenizer_model) {
  namespace fs = std::filesystem;
  const bool gettext = data.rfind("gettext:", 0) == 0;
  if (!gettext && !fs::exists(data)) {
    throw std::invalid_argument("--data: no such file or folder: " + data);
  }
  TokenData out;
  // An llm.c shard: tokens as they are.
  if (fs::is_regular_file(data) && data.size() > 4 && data.substr(data.size() - 4) == ".bin") {
    std::vector<int32_t> tokens = read_llmc_shard(data);
    std::string val_path = data;
    const size_t at = val_path.rfind("train");
    if (at != std::string::npos) val_path.replace(at, 5, "val");
    if (val_path != data && fs::exists(val_path)) {
      out.train = std::move(tokens);
      out.val = read_llmc_shard(val_path);
    } else {
      const size_t cut = tokens.size() - tokens.size() / 20;
      out.val.assign(tokens.begin() + cut, tokens.end());
      tokens.resize(cut);
      out.train = std::move(tokens);
    }
    for (const auto* s : {&out.train, &out.val}) {
      for (int32_t t : *s) out.vocab_size = std::max(out.vocab_size, t + 1);
    }
    out.eot = out.vocab_size - 1;  // GPT-2's <|endoftext|> is its largest id
    return out;
  }
  if (tokenizer != "bytes" && tokenizer != "bpe") {
    throw std::invalid_argument("unknown tokenizer '" + tokenizer + "'; accepted: bpe, bytes");
  }
  // A given SentencePiece model names its own cache ("spm-<CRC-32 of the model>").
  std::string cache_name = tokenizer, model_arg;
  if (!tokenizer_model.empty()) {
    if (!fs::is_regular_file(tokenizer_model)) {
      throw std::invalid_argument("--tokenizer-model: no such file: " + tokenizer_model);
    }
    std::ifstream in(tokenizer_model, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    char hex[9];
    std::snprintf(hex, sizeof(hex), "%08lx",
                  crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), uInt(bytes.size())));
    cache_name = std::string("spm-") + hex;
    model_arg = " --model-file " + quote(tokenizer_model);
  }
  const std::string dir = gettext ? gettext_cache_dir(data, cache_name, vocab)
                                  : token_cache_dir(data, cache_name, vocab);
  auto cached = [&] {  // a cache from before "eot" was recorded is stale
    if (!fs::exists(fs::path(dir) / "meta.json")) return false;
    return nlohmann::json::parse(std::ifstream(fs::path(dir) / "meta.json")).contains("eot");
  };
  if (!cached()) {
    const std::string cmd = quote(helper) + " --data " + quote(data) + " --tokenizer " + tokenizer +
                            " --vocab " + std::to_string(vocab) + model_arg + " --out-dir " +
                            quote(dir);
    // The helper's progress is passed on as it comes; its error line becomes this exception.
    const std::string error_prefix = "flexdemo-tokenize: error: ";
    std::string error;
    FILE* pipe = popen((cmd + " 2>&1").c_str(), "r");
    if (pipe == nullptr) throw std::runtime_error("cannot start " + helper);
    char line[4096];
    while (std::fgets(line, sizeof(line), pipe) != nullptr) {
      std::string text(line);
      if (text.rfind(error_prefix, 0) == 0) {
        error = text.substr(error_prefix.size());
        if (!error.empty() && error.back() == '\n') error.pop_back();
      } else {
        std::fputs(line, stdout);  // progress, not an error
      }
    }
    const int status = pclose(pipe);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (code == 2) throw std::invalid_argument(error);  // bad input, already explained
    if (code != 0) {
      throw std::runtime_error("tokenizing " + data + " failed (" + cmd + " exited with " +
                               std::to_string(code) + (error.empty() ? "" : ": " + error) + ")");
    }
  }
  const nlohmann::json meta = nlohmann::json::parse(std::ifstream(fs::path(dir) / "meta.json"));
  out.vocab_size = meta.at("vocab_size").get<int32_t>();
  out.eot = meta.at("eot").get<int32_t>();
  out.train = read_llmc_shard((fs::path(dir) / "train.bin").string());
  out.val = read_llmc_shard((fs::path(dir) / "val.bin").string());
  if (tokenizer == "bpe") out.tokenizer_model = (fs::path(dir) / "tokenizer.model").string();
  out.pairs = meta.value("format", "text") == "pairs";
  if (out.pairs) {
    out.checksum = meta.at("checksum").get<std::string>();
    out.train_pairs = meta.at("train_pairs").get<int64_t>();
    out.val_pairs = meta.at("val_pairs").get<int64_t>();
  }
  return out;
}

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
