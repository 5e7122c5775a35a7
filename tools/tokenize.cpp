// `flexdemo-tokenize`: tokenizes a text corpus or translation pairs into llm.c shards (train.bin,
// val.bin), with the byte tokenizer or a SentencePiece BPE trained on it, and decodes ids back
// to text. A process
// of its own: Debian's SentencePiece bundles a protobuf that clashes with LibTorch's.
#include "flexdemo/text.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <system_error>

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  CLI::App app{"flexdemo-tokenize: text corpus -> llm.c token shards (train.bin, val.bin)"};
  std::string data, tokenizer = "bpe", out_dir, model;
  int32_t vocab = 4096;
  int val_every = 20;
  app.add_option("--data", data,
                 "text file or folder of text files, or pairs: gettext:LANG, *.tsv, *.jsonl");
  app.add_option("--tokenizer", tokenizer, "bpe or bytes")
      ->check(CLI::IsMember({"bpe", "bytes"}))
      ->capture_default_str();
  app.add_option("--vocab", vocab, "BPE vocabulary size")->capture_default_str();
  app.add_option("--val-every", val_every, "every N-th document is validation")
      ->capture_default_str();
  app.add_option("--out-dir", out_dir, "where train.bin, val.bin, meta.json (and the model) go");
  std::string model_file;
  app.add_option("--model-file", model_file,
                 "bpe: tokenize with this SentencePiece model instead of training one");
  bool lines = false;
  auto* decode = app.add_subcommand("decode", "token ids on stdin -> text on stdout");
  decode->add_option("--model", model, "the BPE model (none: bytes)");
  decode->add_flag("--lines", lines,
                   "one sequence of ids per line -> one JSON string per line (batches)");
  auto* encode = app.add_subcommand("encode", "text on stdin -> token ids on stdout");
  encode->add_option("--model", model, "the BPE model (none: bytes)");
  encode->add_flag("--lines", lines, "one JSON string per line -> one line of ids per line");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  std::string tmp;  // the output folder being written; removed if tokenizing fails
  try {
    if (encode->parsed() || decode->parsed()) {
      const std::unique_ptr<flexdemo::data::Tokenizer> tok =
          model.empty() ? flexdemo::data::make_byte_tokenizer()
                        : flexdemo::data::load_or_train_bpe({}, 4096, model);
      auto encode_one = [&](const std::string& text) {
        for (int32_t id : tok->encode(text)) std::cout << id << " ";
        std::cout << "\n";
      };
      // Ids past the vocabulary are T5's sentinels: "<extra_id_N>" for vocabulary + N, the
      // ids between them decoded run by run.
      auto decode_one = [&](std::istream& in) {
        std::string text;
        std::vector<int32_t> run;
        for (int32_t id; in >> id;) {
          if (id < tok->vocab_size()) {
            run.push_back(id);
            continue;
          }
          text += tok->decode(run) + "<extra_id_" + std::to_string(id - tok->vocab_size()) + ">";
          run.clear();
        }
        return text + tok->decode(run);
      };
      if (!lines) {
        if (encode->parsed()) encode_one(std::string(std::istreambuf_iterator<char>(std::cin), {}));
        if (decode->parsed()) std::cout << decode_one(std::cin);
        return 0;
      }
      for (std::string line; std::getline(std::cin, line);) {
        if (encode->parsed()) {
          encode_one(nlohmann::json::parse(line).get<std::string>());
        } else {
          std::istringstream ids(line);
          std::cout << nlohmann::json(decode_one(ids)).dump() << "\n";
        }
      }
      return 0;
    }
    if (data.empty() || out_dir.empty())
      throw std::invalid_argument("--data and --out-dir are required");
    // Text documents, or translation pairs (the BPE learns both sides' text).
    const bool pairs = flexdemo::data::is_pair_source(data);
    flexdemo::data::PairCorpus corpus;
    std::vector<std::string> documents;
    if (pairs) {
      corpus = flexdemo::data::read_pairs(data, val_every);
      for (const auto& p : corpus.train) {
        documents.push_back(p.source);
        documents.push_back(p.target);
      }
    } else {
      documents = flexdemo::data::read_text_documents(data);
    }
    tmp = out_dir + ".tmp" + std::to_string(getpid());
    fs::create_directories(tmp);
    std::unique_ptr<flexdemo::data::Tokenizer> tok;
    if (tokenizer == "bytes") {
      tok = flexdemo::data::make_byte_tokenizer();
    } else if (!model_file.empty()) {
      fs::copy_file(model_file, tmp + "/tokenizer.model");
      tok = flexdemo::data::load_or_train_bpe({}, vocab, tmp + "/tokenizer.model");
    } else {
      std::fprintf(stderr, "flexdemo-tokenize: training a %d-piece BPE on %zu documents...\n",
                   vocab, documents.size());
      tok = flexdemo::data::load_or_train_bpe(documents, vocab, tmp + "/tokenizer.model");
    }
    const flexdemo::data::TokenSplit split =
        pairs ? flexdemo::data::tokenize_pairs(corpus, *tok)
              : flexdemo::data::tokenize_documents(documents, *tok, val_every);
    flexdemo::data::write_llmc_shard(tmp + "/train.bin", split.train);
    flexdemo::data::write_llmc_shard(tmp + "/val.bin", split.val);
    nlohmann::ordered_json meta = {{"data", data},
                                   {"format", pairs ? "pairs" : "text"},
                                   {"tokenizer", tok->name()},
                                   {"vocab_size", tok->vocab_size()},
                                   {"eot", tok->eot()},
                                   {"documents", documents.size()},
                                   {"train_tokens", split.train.size()},
                                   {"val_tokens", split.val.size()}};
    if (pairs) {
      meta["train_pairs"] = corpus.train.size();
      meta["val_pairs"] = corpus.val.size();
      meta["checksum"] = corpus.checksum;
      meta["files"] = corpus.files;
    }
    std::ofstream(tmp + "/meta.json") << meta.dump(2) << "\n";
    fs::remove_all(out_dir);
    fs::rename(tmp, out_dir);  // all or nothing
    std::fprintf(stderr, "flexdemo-tokenize: %zu train and %zu validation tokens in %s\n",
                 split.train.size(), split.val.size(), out_dir.c_str());
  } catch (const std::exception& e) {
    std::error_code ignored;
    if (!tmp.empty()) fs::remove_all(tmp, ignored);
    std::fprintf(stderr, "flexdemo-tokenize: error: %s\n", e.what());
    // Bad input (an empty or binary corpus, a bad vocabulary) exits 2, like flexdemo itself.
    return dynamic_cast<const std::invalid_argument*>(&e) ? 2 : 1;
  }
  return 0;
}
