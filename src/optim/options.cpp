// The optimizer's options by name (FLEXDEMO_OPTIMIZER_OPTIONS in optim.h): the presets, the
// options a front door asks for, and each option read and written as a word.
#include "flexdemo/optim.h"

#include "flexdemo/value_encoding.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>
#include <sstream>
#include <type_traits>

namespace flexdemo::optim {
namespace {

template <class T>
std::string type_of() {
  if constexpr (std::is_same_v<T, bool>) {
    return "bool";
  } else if constexpr (std::is_same_v<T, std::string>) {
    return "str";
  } else if constexpr (std::is_floating_point_v<T>) {
    return "float";
  } else if constexpr (std::is_integral_v<T>) {
    return "int";
  } else {
    std::string words;
    for (const std::string& w : names_of<T>()) words += (words.empty() ? "" : "|") + w;
    return words;
  }
}

template <class T>
std::string word_of(const T& value) {
  if constexpr (std::is_same_v<T, bool>) {
    return value ? "true" : "false";
  } else if constexpr (std::is_same_v<T, std::string>) {
    return value;
  } else if constexpr (std::is_floating_point_v<T>) {
    std::ostringstream s;
    s.precision(17);
    s << value;
    return s.str();
  } else if constexpr (std::is_integral_v<T>) {
    return std::to_string(value);
  } else {
    return name_of(value);
  }
}

template <class T>
T parse_word(const std::string& name, const std::string& word) {
  auto bad = [&](const std::string& wanted) {
    throw OptionsError("{" + name + "} '" + word + "': " + wanted);
  };
  if constexpr (std::is_same_v<T, bool>) {
    if (word == "true" || word == "1") return true;
    if (word == "false" || word == "0") return false;
    bad("accepted: true, false");
  } else if constexpr (std::is_same_v<T, std::string>) {
    return word;
  } else if constexpr (std::is_floating_point_v<T>) {
    char* end = nullptr;
    const double v = std::strtod(word.c_str(), &end);
    if (word.empty() || *end != '\0') bad("not a number");
    return T(v);
  } else if constexpr (std::is_integral_v<T>) {
    char* end = nullptr;
    const long long v = std::strtoll(word.c_str(), &end, 10);
    if (word.empty() || *end != '\0') bad("not an integer");
    if (std::is_unsigned_v<T> && v < 0) bad("must be >= 0");
    return T(v);
  } else {
    try {
      return parse_name<T>(word);
    } catch (const std::invalid_argument& e) {
      bad(e.what());
    }
  }
  return T{};
}

}  // namespace

bool Range::holds(double v) const {
  const bool too_low = low && (low_open ? !(v > *low) : !(v >= *low));
  const bool too_high = high && (high_open ? !(v < *high) : !(v <= *high));
  return !too_low && !too_high && !std::isnan(v);
}

std::string Range::text() const {
  auto number = [](double v) {
    std::ostringstream s;
    s << v;
    return s.str();
  };
  std::string bound;
  if (high) {
    bound = std::string("in ") + (low_open ? "(" : "[") + number(low.value_or(0)) + ", " +
            number(*high) + (high_open ? ")" : "]");
  } else if (low) {
    bound = std::string(low_open ? "> " : ">= ") + number(*low);
  }
  return bound + note;
}

std::string spell(const std::string& text,
                  const std::function<std::string(const std::string&)>& spelling) {
  std::string out;
  for (size_t at = 0; at < text.size();) {
    const size_t open = text.find('{', at), close = text.find('}', open);
    if (open == std::string::npos || close == std::string::npos) {
      out += text.substr(at);
      break;
    }
    out += text.substr(at, open - at) + spelling(text.substr(open + 1, close - open - 1));
    at = close + 1;
  }
  return out;
}

OptimizerOptions preset(Preset p) {
  OptimizerOptions o;  // the declaration's defaults: the flexdemo step
  switch (p) {
    case Preset::FlexDemo:
      break;
    case Preset::FlexDemoAdamW:
      // AdamW's first moment on top of DeMo's residual (itself a momentum) trains worse:
      // docs/results/equal-steps.md.
      o.inner = InnerKind::AdamW;
      o.beta1 = 0.0;
      o.lr = 5e-4;
      o.rms_cap = 0.0;
      o.precondition = false;
      o.fold_lr = true;
      o.topk = 32;
      o.values = compress::ValueEncoding::Bf16;
      break;
    case Preset::DeMo:
      o.sign = true;
      o.rms_cap = 0.0;
      o.precondition = false;
      o.fold_lr = true;
      o.topk = 32;
      o.values = compress::ValueEncoding::Fp32;
      break;
  }
  return o;
}

Preset preset_for(InnerKind inner) {
  return inner == InnerKind::AdamW ? Preset::FlexDemoAdamW : Preset::FlexDemo;
}

std::vector<OptionInfo> option_infos() {
  std::vector<OptionInfo> infos;
#define FLEXDEMO_OPTION_INFO(name, type, default_value, range, help) \
  infos.push_back({#name, type_of<type>(), range, help});
  FLEXDEMO_OPTIMIZER_OPTIONS(FLEXDEMO_OPTION_INFO)
#undef FLEXDEMO_OPTION_INFO
  return infos;
}

std::string option_value(const OptimizerOptions& o, const std::string& name) {
#define FLEXDEMO_OPTION_GET(field, type, default_value, range, help) \
  if (name == #field) return word_of<type>(o.field);
  FLEXDEMO_OPTIMIZER_OPTIONS(FLEXDEMO_OPTION_GET)
#undef FLEXDEMO_OPTION_GET
  throw OptionsError("no option '" + name + "'");
}

void set_option(OptimizerOptions& o, const std::string& name, const std::string& value) {
#define FLEXDEMO_OPTION_SET(field, type, default_value, range, help) \
  if (name == #field) {                                       \
    o.field = parse_word<type>(name, value);                  \
    return;                                                   \
  }
  FLEXDEMO_OPTIMIZER_OPTIONS(FLEXDEMO_OPTION_SET)
#undef FLEXDEMO_OPTION_SET
  std::string known;
  for (const OptionInfo& info : option_infos()) known += (known.empty() ? "" : ", ") + info.name;
  throw OptionsError("no option '" + name + "'; the options: " + known);
}

OptimizerOptions options_for(Preset p,
                             const std::vector<std::pair<std::string, std::string>>& given) {
  OptimizerOptions o = preset(p);
  std::set<std::string> set;
  for (const auto& [name, value] : given) {
    set_option(o, name, value);
    set.insert(name);
  }
  auto unset = [&](const char* name) { return set.count(name) == 0; };
  if (unset("rms_cap")) {
    o.rms_cap = p == Preset::FlexDemo && o.inner == InnerKind::Sgd && !o.sign &&
                        o.update_rms == 0.0 && !o.normalize
                    ? preset(p).rms_cap
                    : 0.0;
  }
  if (unset("precondition")) o.precondition = preset(p).precondition && o.inner_steps == 1;
  if (unset("topk") && o.chunk > 0) o.topk = std::min(o.topk, o.chunk * o.chunk);
  o.validate();
  // A top-k given above the chunk's coefficients is a mistake at a front door (the library
  // itself clamps it to each chunk).
  if (!unset("topk") && o.topk > o.chunk * o.chunk) {
    throw OptionsError("{topk} " + std::to_string(o.topk) + " exceeds the " +
                       std::to_string(o.chunk * o.chunk) + " coefficients of a {chunk} " +
                       std::to_string(o.chunk) + " chunk");
  }
  return o;
}

}  // namespace flexdemo::optim
