// Corpora (text documents, llm.c token shards) and the train/validation split by document.
// No LibTorch here: the flexdemo-tokenize helper links this file too.
#include "flexdemo/text.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>

namespace flexdemo::data {
namespace {

bool looks_like_text(const std::string& bytes) {
  return bytes.find('\0') == std::string::npos;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path.string());
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// Splits at lines holding only "%" if there are any, else at blank lines.
void split_documents(const std::string& text, std::vector<std::string>& out) {
  const bool fortune = text.rfind("%\n", 0) == 0 || text.find("\n%\n") != std::string::npos;
  std::string doc;
  std::istringstream lines(text);
  std::string line;
  auto flush = [&] {
    while (!doc.empty() && doc.back() == '\n') doc.pop_back();
    if (!doc.empty()) out.push_back(doc);
    doc.clear();
  };
  while (std::getline(lines, line)) {
    const bool separator =
        fortune ? line == "%" : line.find_first_not_of(" \t\r") == std::string::npos;
    if (separator) {
      flush();
    } else {
      doc += line;
      doc += '\n';
    }
  }
  flush();
}

}  // namespace

std::string cache_dir() {
  namespace fs = std::filesystem;
  if (const char* own = std::getenv("FLEXDEMO_CACHE"); own != nullptr && *own != '\0') return own;
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  const fs::path cache = xdg != nullptr && *xdg != '\0'
                             ? fs::path(xdg)
                             : fs::path(home != nullptr ? home : "/tmp") / ".cache";
  return (cache / "flexdemo").string();
}

std::string token_cache_dir(const std::string& corpus_path, const std::string& tokenizer,
                            int32_t vocab_size) {
  namespace fs = std::filesystem;
  const fs::path corpus = fs::absolute(corpus_path).lexically_normal();
  const std::string suffix =
      ".flexdemo-" + (tokenizer == "bpe" ? "bpe-" + std::to_string(vocab_size) : tokenizer);
  const std::string key = std::to_string(std::hash<std::string>{}(corpus.string()));
  std::string name = corpus.filename().string();
  if (name.empty()) name = corpus.parent_path().filename().string();  // "folder/"
  return (fs::path(cache_dir()) / (name + "-" + key + suffix)).string();
}

std::vector<std::string> read_text_documents(const std::string& path) {
  namespace fs = std::filesystem;
  if (!fs::exists(path)) throw std::invalid_argument("--data: no such file or folder: " + path);
  std::vector<fs::path> files;
  if (fs::is_directory(path)) {
    for (const auto& entry : fs::directory_iterator(path)) {
      if (entry.is_regular_file() && !entry.is_symlink() &&
          entry.path().filename().string()[0] != '.') {
        files.push_back(entry.path());
      }
    }
    std::sort(files.begin(), files.end());  // the same documents in the same order everywhere
  } else {
    files.push_back(path);
  }
  std::vector<std::string> documents;
  for (const auto& f : files) {
    const std::string text = read_file(f);
    if (looks_like_text(text)) split_documents(text, documents);
  }
  if (documents.empty()) throw std::invalid_argument("--data: no text documents in " + path);
  return documents;
}

// ====== gettext catalogues ======
bool is_pair_source(const std::string& data) {
  auto ends_with = [&data](const std::string& suffix) {
    return data.size() >= suffix.size() &&
           data.compare(data.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return data.rfind("gettext:", 0) == 0 || ends_with(".tsv") || ends_with(".jsonl");
}

std::vector<std::pair<std::string, std::string>> gettext_domains() {
  return {{"coreutils", "coreutils"},
          {"git", "git"},
          {"gas", "binutils-common"},
          {"binutils", "binutils-common"},
          {"bfd", "binutils-common"},
          {"ld", "binutils-common"},
          {"gold", "binutils-common"},
          {"opcodes", "binutils-common"},
          {"gprof", "binutils-common"},
          {"gnupg2", "gnupg-l10n"},
          {"libc", "libc-l10n"},
          {"dpkg", "dpkg"},
          {"dpkg-dev", "libdpkg-perl"},
          {"bash", "bash"},
          {"tar", "tar"},
          {"wget", "wget"},
          {"make", "make"},
          {"apt", "apt"},
          {"diffutils", "diffutils"},
          {"findutils", "findutils"},
          {"sed", "sed"},
          {"grep", "grep"},
          {"gettext-tools", "gettext"},
          {"gettext-runtime", "gettext-base"},
          {"procps-ng", "procps"},
          {"shadow", "login"},
          {"xz", "xz-utils"},
          {"adduser", "adduser"},
          {"man-db", "man-db"},
          {"psmisc", "psmisc"},
          {"m4", "m4"}};
}

std::vector<std::string> gettext_catalogues(const std::string& lang) {
  namespace fs = std::filesystem;
  const bool word =
      !lang.empty() &&
      lang.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_@") ==
          std::string::npos;
  if (!word) {
    throw std::invalid_argument("--data gettext:" + lang +
                                ": LANG must be a locale name such as fr, de or pt_BR");
  }
  const fs::path dir = fs::path("/usr/share/locale") / lang / "LC_MESSAGES";
  std::vector<std::string> files;
  for (const auto& [domain, package] : gettext_domains()) {
    const fs::path mo = dir / (domain + ".mo");
    if (fs::is_regular_file(mo)) files.push_back(mo.string());
  }
  if (files.empty()) {
    throw std::invalid_argument("--data gettext:" + lang + ": no catalogues in " + dir.string() +
                                " (scripts/install-deps.sh installs the packages that hold them)");
  }
  return files;
}

// ====== llm.c shards ======
constexpr int32_t kLlmcMagic = 20240520;

std::vector<int32_t> read_llmc_shard(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument("cannot read token shard " + path);
  int32_t header[256] = {};
  in.read(reinterpret_cast<char*>(header), sizeof(header));
  if (!in || header[0] != kLlmcMagic || header[1] != 1 || header[2] < 0) {
    throw std::invalid_argument(path + " is not an llm.c token shard (magic 20240520, version 1)");
  }
  std::vector<uint16_t> raw(static_cast<size_t>(header[2]));
  in.read(reinterpret_cast<char*>(raw.data()), std::streamsize(raw.size() * 2));
  if (in.gcount() != std::streamsize(raw.size() * 2)) {
    throw std::invalid_argument(path + " is truncated: its header promises " +
                                std::to_string(header[2]) + " tokens");
  }
  return std::vector<int32_t>(raw.begin(), raw.end());
}

void write_llmc_shard(const std::string& path, const std::vector<int32_t>& tokens) {
  int32_t header[256] = {kLlmcMagic, 1, int32_t(tokens.size())};
  std::vector<uint16_t> raw;
  for (int32_t t : tokens) {
    if (t < 0 || t > 65535) throw std::invalid_argument("token " + std::to_string(t) + " > 65535");
    raw.push_back(uint16_t(t));
  }
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header), sizeof(header));
  out.write(reinterpret_cast<const char*>(raw.data()), std::streamsize(raw.size() * 2));
  if (!out) throw std::runtime_error("cannot write " + path);
}

TokenSplit tokenize_documents(const std::vector<std::string>& documents, const Tokenizer& tokenizer,
                              int val_every) {
  TokenSplit split;
  for (size_t d = 0; d < documents.size(); ++d) {
    std::vector<int32_t>& stream =
        (val_every > 0 && d % val_every == size_t(val_every - 1)) ? split.val : split.train;
    const std::vector<int32_t> ids = tokenizer.encode(documents[d]);
    stream.insert(stream.end(), ids.begin(), ids.end());
    stream.push_back(tokenizer.eot());
  }
  return split;
}

}  // namespace flexdemo::data
