// Text to tokens without LibTorch: documents, tokenizers (bytes and SentencePiece BPE round
// trips), llm.c shards, and the split that holds validation out by document.
#include "flexdemo/text.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

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
