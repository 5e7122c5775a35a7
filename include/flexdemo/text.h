// flexdemo/text.h — text to tokens, without LibTorch: tokenizers (byte-level, or SentencePiece
// BPE trained on the corpus and cached), corpora of documents, llm.c token shards, and the
// train/validation split by document. Lives in libflexdemo_text, which the `flexdemo-tokenize`
// helper links: Debian's SentencePiece bundles a protobuf that clashes with LibTorch's, so the
// two never share a process.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace flexdemo::data {

// ====== Tokenizers ======
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int32_t> encode(const std::string& text) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int32_t vocab_size() const = 0;  // every id is below this, the end-of-text id included
  virtual int32_t eot() const = 0;         // separates documents
  virtual std::string name() const = 0;    // "bytes" or "bpe-<vocab>"
};

// 256 byte values, then the end-of-text id 256.
std::unique_ptr<Tokenizer> make_byte_tokenizer();

// SentencePiece BPE of vocab_size pieces (its end-of-sentence piece is end-of-text): loaded from
// cache_path if present, else trained on the documents and saved there (atomically).
std::unique_ptr<Tokenizer> load_or_train_bpe(const std::vector<std::string>& documents,
                                             int32_t vocab_size, const std::string& cache_path);
// flexdemo's cache folder, for every cache (never next to the data): $FLEXDEMO_CACHE when set,
// else $XDG_CACHE_HOME/flexdemo, else ~/.cache/flexdemo.
std::string cache_dir();
// Where a corpus's tokens (and BPE model) are cached: a folder of cache_dir() named by the
// corpus's name, a hash of its absolute path, the tokenizer and the vocabulary.
std::string token_cache_dir(const std::string& corpus_path, const std::string& tokenizer,
                            int32_t vocab_size);

// ====== Corpora ======
// A text file, or a folder of them (files that are not text are skipped). Documents are
// separated by lines holding only "%" (the fortune format) where a file has them, else by
// blank lines.
std::vector<std::string> read_text_documents(const std::string& path);

// llm.c token shards: a header of 256 int32 (magic 20240520, version 1, token count), then the
// tokens as uint16.
std::vector<int32_t> read_llmc_shard(const std::string& path);
void write_llmc_shard(const std::string& path, const std::vector<int32_t>& tokens);

struct TokenSplit {
  std::vector<int32_t> train;  // documents joined, each followed by end-of-text
  std::vector<int32_t> val;    // every val_every-th document, held out whole
};
TokenSplit tokenize_documents(const std::vector<std::string>& documents, const Tokenizer& tokenizer,
                              int val_every = 20);

// ====== Translation pairs ======
// A source text and its translation (sequence-to-sequence training).
struct TextPair {
  std::string source, target;
};
struct PairCorpus {
  std::vector<TextPair> train, val;
  std::vector<std::string> files;  // what was read, in order
  std::string checksum;            // CRC-32 (hex) of every pair in order: the same corpus or not
};
// Whether --data names pairs: "gettext:LANG", or a file ending in .tsv (source TAB target per
// line) or .jsonl ({"source": ..., "target": ...} per line).
bool is_pair_source(const std::string& data);
// gettext:LANG: the message catalogues of gettext_domains() installed for LANG
// (/usr/share/locale/LANG/LC_MESSAGES/DOMAIN.mo), each turned into msgid/msgstr pairs by
// `msgunfmt` and read with libgettextpo: English source, LANG target; untranslated and
// identical pairs skipped, plural forms as their singular, format placeholders kept. In every
// source, pairs are deduplicated by source text (the first kept), and a pair is validation when
// the CRC-32 of its source text is a multiple of val_every, so a string never lands in both.
PairCorpus read_pairs(const std::string& data, int val_every = 20);
// The catalogue files gettext:LANG reads (those of gettext_domains() present), in order.
std::vector<std::string> gettext_catalogues(const std::string& lang);
// The text domains and the Debian packages that install them (scripts/install-deps.sh installs
// them all, so the corpus is the same on every machine of one Debian release).
std::vector<std::pair<std::string, std::string>> gettext_domains();
// Pairs as one stream: source, end-of-text, target, end-of-text, ...
TokenSplit tokenize_pairs(const PairCorpus& corpus, const Tokenizer& tokenizer);

// ====== Scores ======
// chrF of hypotheses against one reference each, as sacreBLEU 2.x computes it by default
// (character 6-grams without whitespace, corpus statistics, beta 2): 0 to 100.
double chrf(const std::vector<std::string>& hypotheses, const std::vector<std::string>& references);

}  // namespace flexdemo::data
