// Token data for the trainer: tokenized once by the flexdemo-tokenize helper (a subprocess:
// SentencePiece's protobuf and LibTorch's never share a process) and cached as llm.c shards in
// flexdemo's cache folder (text.h's cache_dir), or an llm.c shard read as it is.
#include "flexdemo/data.h"

#include "flexdemo/text.h"

#include <zlib.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>
#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
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

}  // namespace flexdemo::data
