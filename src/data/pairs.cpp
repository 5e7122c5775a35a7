// Translation pairs for sequence-to-sequence training: from the gettext catalogues installed on
// the machine (msgunfmt turns a catalogue back into a PO file, libgettextpo reads it), or from a
// TSV or JSONL file. No LibTorch here: the flexdemo-tokenize helper links this file.
#include "flexdemo/text.h"

#include <gettext-po.h>
#include <zlib.h>
#include <nlohmann/json.hpp>

#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <stdexcept>

namespace flexdemo::data {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// libgettextpo reports problems through callbacks; a fatal one must not return. The PO files
// come from msgunfmt, so a problem here is a broken installation: say which file, and stop.
std::string g_reading;
void po_error(int severity, po_message_t, const char*, size_t, size_t, int, const char* text) {
  if (severity == PO_SEVERITY_WARNING) return;
  std::fprintf(stderr, "flexdemo-tokenize: error: cannot read the catalogue %s: %s\n",
               g_reading.c_str(), text);
  std::exit(1);
}
void po_error2(int severity, po_message_t, const char*, size_t, size_t, int, const char* text,
               po_message_t, const char*, size_t, size_t, int, const char*) {
  po_error(severity, nullptr, nullptr, 0, 0, 0, text);
}

// msgid -> msgstr of one catalogue: translated, not fuzzy, not obsolete, not the header.
std::vector<TextPair> read_catalogue(const std::string& mo) {
  namespace fs = std::filesystem;
  const fs::path po =
      fs::temp_directory_path() / ("flexdemo-catalogue-" + std::to_string(getpid()) + ".po");
  const std::string cmd = "msgunfmt -o " + quote(po.string()) + " " + quote(mo) + " 2>/dev/null";
  if (std::system(cmd.c_str()) != 0) {
    fs::remove(po);
    throw std::runtime_error("msgunfmt could not read " + mo +
                             " (is the gettext package installed? scripts/install-deps.sh)");
  }
  g_reading = mo;
  const po_xerror_handler handler = {po_error, po_error2};
  po_file_t file = po_file_read(po.c_str(), &handler);
  fs::remove(po);
  std::vector<TextPair> pairs;
  po_message_iterator_t it = po_message_iterator(file, nullptr);
  for (po_message_t m; (m = po_next_message(it)) != nullptr;) {
    if (po_message_is_obsolete(m) || po_message_is_fuzzy(m)) continue;
    const char* plural = po_message_msgid_plural(m);
    const char* target = plural ? po_message_msgstr_plural(m, 0) : po_message_msgstr(m);
    const std::string source = po_message_msgid(m);
    if (source.empty() || target == nullptr || *target == '\0' || source == target) continue;
    pairs.push_back({source, target});
  }
  po_message_iterator_free(it);
  po_file_free(file);
  return pairs;
}

std::vector<TextPair> read_pair_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument("--data: cannot read " + path);
  const bool jsonl = ends_with(path, ".jsonl");
  std::vector<TextPair> pairs;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    auto bad = [&](const std::string& why) {
      return std::invalid_argument("--data " + path + " line " + std::to_string(n) + ": " + why);
    };
    if (jsonl) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_object() || !j.contains("source") || !j.contains("target") ||
          !j["source"].is_string() || !j["target"].is_string()) {
        throw bad("expected {\"source\": \"...\", \"target\": \"...\"}");
      }
      pairs.push_back({j["source"].get<std::string>(), j["target"].get<std::string>()});
    } else {
      const size_t tab = line.find('\t');
      if (tab == std::string::npos || line.find('\t', tab + 1) != std::string::npos) {
        throw bad("expected SOURCE<TAB>TARGET (one tab)");
      }
      pairs.push_back({line.substr(0, tab), line.substr(tab + 1)});
    }
  }
  return pairs;
}

uint32_t crc_of(const std::string& s, uint32_t crc = 0) {
  return uint32_t(crc32_z(crc, reinterpret_cast<const Bytef*>(s.data()), s.size()));
}

}  // namespace

PairCorpus read_pairs(const std::string& data, int val_every) {
  PairCorpus corpus;
  std::vector<TextPair> all;
  if (data.rfind("gettext:", 0) == 0) {
    corpus.files = gettext_catalogues(data.substr(8));
    for (const std::string& mo : corpus.files) {
      for (TextPair& p : read_catalogue(mo)) all.push_back(std::move(p));
    }
  } else {
    corpus.files = {data};
    all = read_pair_file(data);
  }
  std::set<std::string> seen;
  uint32_t crc = 0;
  for (TextPair& p : all) {
    if (!seen.insert(p.source).second) continue;
    crc = crc_of(p.target + '\0', crc_of(p.source + '\0', crc));
    const bool val = val_every > 0 && crc_of(p.source) % uint32_t(val_every) == 0;
    (val ? corpus.val : corpus.train).push_back(std::move(p));
  }
  if (corpus.train.empty() || corpus.val.empty()) {
    throw std::invalid_argument("--data " + data + ": " + std::to_string(seen.size()) +
                                " distinct pairs, too few for a train and a validation split");
  }
  char hex[9];
  std::snprintf(hex, sizeof(hex), "%08x", crc);
  corpus.checksum = hex;
  return corpus;
}

TokenSplit tokenize_pairs(const PairCorpus& corpus, const Tokenizer& tokenizer) {
  TokenSplit split;
  for (auto [pairs, stream] : {std::pair{&corpus.train, &split.train}, {&corpus.val, &split.val}}) {
    for (const TextPair& p : *pairs) {
      for (const std::string* text : {&p.source, &p.target}) {
        const std::vector<int32_t> ids = tokenizer.encode(*text);
        stream->insert(stream->end(), ids.begin(), ids.end());
        stream->push_back(tokenizer.eot());
      }
    }
  }
  return split;
}

}  // namespace flexdemo::data
