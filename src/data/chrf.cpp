// chrF as sacreBLEU (2.x) defines it by default: character n-grams of orders 1..6 with
// whitespace removed, counts summed over the corpus, precision and recall averaged over the
// orders both sides have, F with beta 2, times 100. No LibTorch here.
#include "flexdemo/text.h"

#include <map>
#include <stdexcept>

namespace flexdemo::data {
namespace {

// Code points of UTF-8 text (an invalid byte stands for itself), without Python's whitespace.
std::u32string code_points_without_space(const std::string& text) {
  std::u32string out;
  for (size_t i = 0; i < text.size();) {
    const auto b = static_cast<unsigned char>(text[i]);
    size_t len = b < 0x80 ? 1 : b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 0;
    bool valid = len > 0 && i + len <= text.size();
    char32_t c = len == 1 ? b : char32_t(b & (0xFF >> (len + 1)));
    for (size_t k = 1; valid && k < len; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      valid = (next & 0xC0) == 0x80;
      c = (c << 6) | (next & 0x3F);
    }
    if (!valid) c = b, len = 1;
    i += len;
    const bool space = (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 ||
                       c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
                       c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
    if (!space) out.push_back(c);
  }
  return out;
}

std::map<std::u32string, int64_t> ngrams(const std::u32string& s, size_t n) {
  std::map<std::u32string, int64_t> counts;
  for (size_t i = 0; i + n <= s.size(); ++i) ++counts[s.substr(i, n)];
  return counts;
}

}  // namespace

double chrf(const std::vector<std::string>& hypotheses,
            const std::vector<std::string>& references) {
  if (hypotheses.size() != references.size()) {
    throw std::invalid_argument("chrF: " + std::to_string(hypotheses.size()) + " hypotheses for " +
                                std::to_string(references.size()) + " references");
  }
  constexpr size_t kOrder = 6;
  constexpr double kBetaSquared = 4.0;
  int64_t hyp_total[kOrder] = {}, ref_total[kOrder] = {}, matches[kOrder] = {};
  for (size_t s = 0; s < hypotheses.size(); ++s) {
    const std::u32string hyp = code_points_without_space(hypotheses[s]);
    const std::u32string ref = code_points_without_space(references[s]);
    for (size_t n = 1; n <= kOrder; ++n) {
      const auto h = ngrams(hyp, n), r = ngrams(ref, n);
      for (const auto& [gram, count] : h) {
        hyp_total[n - 1] += count;
        if (const auto it = r.find(gram); it != r.end())
          matches[n - 1] += std::min(count, it->second);
      }
      for (const auto& [gram, count] : r) ref_total[n - 1] += count;
    }
  }
  double precision = 0.0, recall = 0.0;
  int effective = 0;
  for (size_t n = 0; n < kOrder; ++n) {
    if (hyp_total[n] > 0 && ref_total[n] > 0) {
      precision += double(matches[n]) / double(hyp_total[n]);
      recall += double(matches[n]) / double(ref_total[n]);
      ++effective;
    }
  }
  if (effective == 0 || precision + recall == 0.0) return 0.0;
  precision /= effective;
  recall /= effective;
  return 100.0 * (1 + kBetaSquared) * precision * recall / (kBetaSquared * precision + recall);
}

}  // namespace flexdemo::data
