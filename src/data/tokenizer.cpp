// The byte-level tokenizer and the SentencePiece BPE tokenizer (trained once per corpus and
// vocabulary size, then loaded from its cache file).
#include "flexdemo/text.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>

namespace flexdemo::data {
namespace {

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(const std::string& text) const override {
    return std::vector<int32_t>(reinterpret_cast<const uint8_t*>(text.data()),
                                reinterpret_cast<const uint8_t*>(text.data()) + text.size());
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string text;
    for (int32_t id : ids) {
      if (id >= 0 && id < 256) text.push_back(char(id));
    }
    return text;
  }
  int32_t vocab_size() const override { return 257; }
  int32_t eot() const override { return 256; }
  std::string name() const override { return "bytes"; }
};

class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(const std::string& model_path) {
    const auto status = sp_.Load(model_path);
    if (!status.ok()) {
      throw std::runtime_error("cannot load tokenizer " + model_path + ": " + status.ToString());
    }
  }
  std::vector<int32_t> encode(const std::string& text) const override {
    const std::vector<int> ids = sp_.EncodeAsIds(text);
    return std::vector<int32_t>(ids.begin(), ids.end());
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::vector<int> pieces;
    for (int32_t id : ids) {
      if (id != eot()) pieces.push_back(id);
    }
    return sp_.DecodeIds(pieces);
  }
  int32_t vocab_size() const override { return sp_.GetPieceSize(); }
  int32_t eot() const override { return sp_.eos_id(); }
  std::string name() const override { return "bpe-" + std::to_string(vocab_size()); }

 private:
  sentencepiece::SentencePieceProcessor sp_;
};

// Feeds the trainer one line at a time (SentencePiece limits the length of a "sentence").
class LineIterator final : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(const std::vector<std::string>& documents) : documents_(documents) {
    advance();
  }
  bool done() const override { return doc_ >= documents_.size(); }
  void Next() override { advance(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void advance() {
    while (doc_ < documents_.size()) {
      const std::string& d = documents_[doc_];
      if (pos_ >= d.size()) {
        ++doc_;
        pos_ = 0;
        continue;
      }
      size_t end = d.find('\n', pos_);
      if (end == std::string::npos) end = d.size();
      line_ = d.substr(pos_, end - pos_);
      pos_ = end + 1;
      if (!line_.empty()) return;
    }
  }
  const std::vector<std::string>& documents_;
  size_t doc_ = 0, pos_ = 0;
  std::string line_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_byte_tokenizer() {
  return std::make_unique<ByteTokenizer>();
}

std::unique_ptr<Tokenizer> load_or_train_bpe(const std::vector<std::string>& documents,
                                             int32_t vocab_size, const std::string& cache_path) {
  namespace fs = std::filesystem;
  if (vocab_size < 260 || vocab_size > 65535) {
    throw std::invalid_argument("--vocab must be in [260, 65535], got " +
                                std::to_string(vocab_size));
  }
  if (!fs::exists(cache_path)) {
    fs::create_directories(fs::path(cache_path).parent_path());
    std::ostringstream args;
    args << "--model_type=bpe --vocab_size=" << vocab_size
         << " --character_coverage=1.0 --byte_fallback=true --normalization_rule_name=identity"
         << " --remove_extra_whitespaces=false --split_digits=true --minloglevel=2"
         << " --unk_id=0 --bos_id=-1 --eos_id=1 --pad_id=-1";
    LineIterator lines(documents);
    std::string model;
    const auto status = sentencepiece::SentencePieceTrainer::Train(args.str(), &lines, &model);
    if (!status.ok()) {
      // SentencePiece refuses a vocabulary the corpus cannot fill: bad input, not a crash.
      std::string why(status.message());
      if (const size_t at = why.rfind("] "); at != std::string::npos) why = why.substr(at + 2);
      throw std::invalid_argument("cannot train a " + std::to_string(vocab_size) +
                                  "-piece BPE on --data: " + why +
                                  " (use a smaller --vocab, or --tokenizer bytes)");
    }
    const std::string tmp = cache_path + ".tmp" + std::to_string(getpid());
    std::ofstream(tmp, std::ios::binary).write(model.data(), std::streamsize(model.size()));
    fs::rename(tmp, cache_path);
  }
  return std::make_unique<BpeTokenizer>(cache_path);
}

}  // namespace flexdemo::data
