// Text to tokens without LibTorch: documents, tokenizers (bytes and SentencePiece BPE round
// trips), llm.c shards, the split that holds validation out by document, translation pairs
// (TSV, JSONL, gettext catalogues) and chrF.
#include "flexdemo/text.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <set>

namespace fs = std::filesystem;
using namespace flexdemo::data;

namespace {

fs::path scratch(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("flexdemo-test-" + std::to_string(getpid())) / name;
  fs::create_directories(p.parent_path());
  return p;
}

std::vector<std::string> sample_documents() {
  std::vector<std::string> docs;
  const char* words[] = {"the", "quick", "brown", "fox",  "jumps", "over",   "lazy", "dog",
                         "and", "runs",  "away",  "from", "a",     "hungry", "wolf", "tonight"};
  for (int d = 0; d < 60; ++d) {
    std::string text;
    for (int w = 0; w < 40; ++w)
      text += std::string(words[(d * 7 + w * 3) % 16]) + (w % 9 == 8 ? "\n" : " ");
    docs.push_back(text + "Numbers 1234, symbols %&; unicode: café.");
  }
  return docs;
}

}  // namespace

TEST(Text, SplitsFortuneFilesAndParagraphs) {
  const fs::path dir = scratch("corpus");
  fs::create_directories(dir);
  std::ofstream(dir / "a") << "first fortune\nline two\n%\nsecond\n%\n";
  std::ofstream(dir / "b") << "para one\n\npara two\nmore\n\n\n";
  std::ofstream(dir / "b.dat", std::ios::binary) << std::string("\0\1binary", 8);
  const auto docs = read_text_documents(dir.string());
  ASSERT_EQ(docs.size(), 4u);
  EXPECT_EQ(docs[0], "first fortune\nline two");
  EXPECT_EQ(docs[1], "second");
  EXPECT_EQ(docs[3], "para two\nmore");
  EXPECT_THROW(read_text_documents((dir / "missing").string()), std::invalid_argument);
}

TEST(Text, ByteTokenizerRoundTrip) {
  auto tok = make_byte_tokenizer();
  const std::string text = "héllo\n\tworld \x01";
  EXPECT_EQ(tok->decode(tok->encode(text)), text);
  EXPECT_EQ(tok->vocab_size(), 257);
  EXPECT_EQ(tok->eot(), 256);
}

TEST(Text, BpeTokenizerRoundTripAndCache) {
  const auto docs = sample_documents();
  const fs::path model = scratch("bpe.model");
  auto tok = load_or_train_bpe(docs, 400, model.string());
  EXPECT_TRUE(fs::exists(model));
  EXPECT_EQ(tok->vocab_size(), 400);
  for (const auto& d : docs) EXPECT_EQ(tok->decode(tok->encode(d)), d);
  EXPECT_LT(tok->encode(docs[0]).size(), docs[0].size() / 2);  // it does compress
  auto cached = load_or_train_bpe({}, 400, model.string());    // no documents: from cache
  EXPECT_EQ(cached->encode(docs[3]), tok->encode(docs[3]));
  EXPECT_THROW(load_or_train_bpe(docs, 10, scratch("tiny.model").string()), std::invalid_argument);
}

// One rule for every cache: $FLEXDEMO_CACHE, else $XDG_CACHE_HOME/flexdemo, else
// ~/.cache/flexdemo; never beside the corpus, even where that folder is writable.
TEST(Text, TokenCacheIsUnderTheCacheFolderNeverBesideTheData) {
  const fs::path corpus = fs::temp_directory_path() / "flexdemo-cache-rule" / "corpus.txt";
  auto under = [](const std::string& dir, const fs::path& root) {
    return fs::path(dir).parent_path() == root;
  };
  ::setenv("FLEXDEMO_CACHE", "/tmp/own-cache", 1);
  EXPECT_TRUE(under(token_cache_dir(corpus.string(), "bpe", 4096), "/tmp/own-cache"));
  ::unsetenv("FLEXDEMO_CACHE");
  ::setenv("XDG_CACHE_HOME", "/tmp/xdg", 1);
  EXPECT_TRUE(under(token_cache_dir(corpus.string(), "bpe", 4096), "/tmp/xdg/flexdemo"));
  const std::string a = token_cache_dir(corpus.string(), "bpe", 4096);
  EXPECT_NE(a, token_cache_dir(corpus.string(), "bpe", 8192));          // the vocabulary
  EXPECT_NE(a, token_cache_dir(corpus.string(), "bytes", 4096));        // the tokenizer
  EXPECT_NE(a, token_cache_dir("/elsewhere/corpus.txt", "bpe", 4096));  // the path
  ::unsetenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  ASSERT_NE(home, nullptr);
  EXPECT_TRUE(
      under(token_cache_dir(corpus.string(), "bpe", 4096), fs::path(home) / ".cache" / "flexdemo"));
}

TEST(Text, LlmcShardRoundTripAndRejection) {
  const fs::path path = scratch("tokens.bin");
  const std::vector<int32_t> tokens = {0, 1, 65535, 42, 7};
  write_llmc_shard(path.string(), tokens);
  EXPECT_EQ(read_llmc_shard(path.string()), tokens);
  EXPECT_EQ(fs::file_size(path), 256 * 4 + tokens.size() * 2);
  std::ofstream(scratch("bad.bin"), std::ios::binary) << "not a shard";
  EXPECT_THROW(read_llmc_shard(scratch("bad.bin").string()), std::invalid_argument);
  fs::resize_file(path, 256 * 4 + 4);  // promises 5 tokens, holds 2
  EXPECT_THROW(read_llmc_shard(path.string()), std::invalid_argument);
}

TEST(Text, ValidationIsHeldOutByDocument) {
  auto tok = make_byte_tokenizer();
  std::vector<std::string> docs;
  for (int d = 0; d < 40; ++d) docs.push_back("doc" + std::to_string(d));
  const TokenSplit split = tokenize_documents(docs, *tok, 20);
  const std::vector<int32_t> expected_val = [&] {
    std::vector<int32_t> v;
    for (int d : {19, 39}) {
      for (int32_t t : tok->encode(docs[d])) v.push_back(t);
      v.push_back(tok->eot());
    }
    return v;
  }();
  EXPECT_EQ(split.val, expected_val);
  size_t train_tokens = 0;
  for (int d = 0; d < 40; ++d) train_tokens += d % 20 == 19 ? 0 : docs[d].size() + 1;
  EXPECT_EQ(split.train.size(), train_tokens);
}

TEST(Pairs, ReadFromTsvAndJsonlDeduplicatedAndSplitBySource) {
  const fs::path tsv = scratch("pairs.tsv"), jsonl = scratch("pairs.jsonl");
  {
    std::ofstream t(tsv), j(jsonl);
    for (int i = 0; i < 100; ++i) {
      t << "source " << i << "\ttarget " << i << "\n";
      j << nlohmann::json({{"source", "source " + std::to_string(i)},
                           {"target", "target\t" + std::to_string(i)}})
               .dump()
        << "\n";
    }
    t << "source 3\tanother translation of a source already seen\n";
  }
  const PairCorpus a = read_pairs(tsv.string()), b = read_pairs(jsonl.string());
  EXPECT_EQ(a.train.size() + a.val.size(), 100u);  // the repeated source kept once
  EXPECT_EQ(b.train.size() + b.val.size(), 100u);
  EXPECT_EQ(b.train[0].target.find('\t'), 6u);  // JSON strings hold what TSV cannot
  // Validation is decided by the source text: the same pairs in both files, the same split.
  ASSERT_EQ(a.val.size(), b.val.size());
  for (size_t i = 0; i < a.val.size(); ++i) EXPECT_EQ(a.val[i].source, b.val[i].source);
  EXPECT_GT(a.val.size(), 0u);
  EXPECT_EQ(a.checksum, read_pairs(tsv.string()).checksum);
  EXPECT_NE(a.checksum, b.checksum);
  std::ofstream(scratch("bad.tsv")) << "fine\tpair\nno tab here\n";
  try {
    read_pairs(scratch("bad.tsv").string());
    FAIL() << "a line without a tab was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("line 2"), std::string::npos) << e.what();
  }
  std::ofstream(scratch("bad.jsonl")) << "{\"source\": \"x\"}\n";
  EXPECT_THROW(read_pairs(scratch("bad.jsonl").string()), std::invalid_argument);
  EXPECT_TRUE(is_pair_source("gettext:fr") && is_pair_source("x.tsv") && !is_pair_source("x.txt"));
}

TEST(Pairs, GettextCataloguesGiveEnglishFrenchPairs) {
  // The installed catalogues (scripts/install-deps.sh installs their packages): coreutils'
  // French translation of a message it has carried for decades, read through msgunfmt.
  const PairCorpus fr = read_pairs("gettext:fr");
  EXPECT_GT(fr.train.size(), 10000u);
  std::set<std::string> sources;
  bool found = false;
  for (const auto* split : {&fr.train, &fr.val}) {
    for (const TextPair& p : *split) {
      EXPECT_TRUE(sources.insert(p.source).second) << "duplicate source: " << p.source;
      EXPECT_NE(p.source, p.target);
      found = found || (p.source == "memory exhausted" && p.target == "mémoire insuffisante");
    }
  }
  EXPECT_TRUE(found);
  EXPECT_EQ(fr.checksum, read_pairs("gettext:fr").checksum);  // the same corpus twice
  EXPECT_THROW(read_pairs("gettext:../etc"), std::invalid_argument);
  EXPECT_THROW(read_pairs("gettext:xx_NOWHERE"), std::invalid_argument);
}

TEST(Chrf, EqualsSacreBleu) {
  // Expected values printed by sacreBLEU 2.6.0: CHRF().corpus_score(hyps, [refs]).score.
  const std::vector<std::string> hyps = {"Le chat est sur le tapis.", "Fichier introuvable : %s",
                                         "Impossible d'ouvrir « %s »", "", "ok"};
  const std::vector<std::string> refs = {"Le chat est assis sur le tapis.",
                                         "fichier %s introuvable", "impossible d'ouvrir %s", "vide",
                                         "ok"};
  EXPECT_NEAR(chrf(hyps, refs), 71.88801205111837, 1e-9);
  EXPECT_NEAR(chrf({hyps[0]}, {refs[0]}), 68.9409522915008, 1e-9);
  // Whitespace (Unicode's too) does not count; characters are code points.
  EXPECT_NEAR(chrf({"\u00e9t\u00e9\u3000x\u00a0y"}, {"\u00e9t\u00e9 xy"}), 100.0, 1e-9);
  // By hand: orders 1-3 count (precision = recall = 2/3, 1/2, 0); 4-6 have no n-grams.
  EXPECT_NEAR(chrf({"abc"}, {"abd"}), 100.0 * 7.0 / 18.0, 1e-9);
  EXPECT_THROW(chrf({"a"}, {}), std::invalid_argument);
}
