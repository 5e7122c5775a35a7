// The option reference (docs/options.md) generated from the options' one declaration:
// `flexdemo train --help-markdown`. A test compares the page with what this writes.
#include "options.h"

#include "flexdemo/train.h"

#include <fmt/core.h>

#include <optional>
#include <string>
#include <type_traits>

namespace flexdemo::train {

namespace {

template <class T>
struct unwrapped {
  using type = T;
};
template <class T>
struct unwrapped<std::optional<T>> {
  using type = T;
};

// What an option accepts, in words: "[0, 1)", "> 0", "a, b", and its environment variable.
template <class T>
std::string accepted_text(const OptionSpec& spec) {
  const Accepts& a = spec.accepts;
  std::string text;
  using V = typename unwrapped<T>::type;
  if constexpr (std::is_same_v<V, bool>) {
    text = "a switch: " + spec.flag() + ", --no-" + spec.flag().substr(2);
  } else if constexpr (std::is_enum_v<V>) {
    for (const std::string& w : names_of<V>()) text += (text.empty() ? "" : ", ") + w;
  } else if (a.words) {
    for (const std::string& w : a.words()) text += (text.empty() ? "" : ", ") + w;
  } else if (a.range.low) {  // ">= 1 (note)", or "[0, 1)" for a range closed above
    text = a.range.text();
    if (text.rfind("in ", 0) == 0) text = text.substr(3);
  }
  if (a.env) text += fmt::format("{}env {}", text.empty() ? "" : "; ", a.env);
  return text;
}

std::string role_text(OptionRole role) {
  switch (role) {
    case OptionRole::Model:
      return "model: kept";
    case OptionRole::State:
      return "state: kept";
    case OptionRole::Run:
      return "may change";
    case OptionRole::Unsaved:
      return "not saved";
  }
  return "";
}

std::string cell(std::string text) {  // a Markdown table cell: | escaped
  std::string out;
  for (char ch : text) out += ch == '|' ? std::string("\\|") : std::string(1, ch);
  return out;
}

}  // namespace

std::string options_markdown() {
  std::string md =
      "# `flexdemo train` options\n\n"
      "Generated from the options' one declaration (`include/flexdemo/train_options.h`) by\n"
      "`flexdemo train --help-markdown`; a test fails when this page and the declarations differ.\n"
      "Every option is also a key of `--config FILE` (TOML, the name without `--`) and of a run's\n"
      "`config.json`. *On resume*: `model: kept` and `state: kept` options must equal the\n"
      "checkpoint's (`--resume` refuses otherwise), `may change` ones may differ, `not saved` "
      "ones\n"
      "are not written to `config.json`. A default of `null` leaves the choice to "
      "`--optimizer`.\n\n"
      "| option | default | on resume | accepts | meaning |\n|---|---|---|---|---|\n";
  const TrainConfig defaults;
  for_each_option(defaults, [&md](const auto& value, const OptionSpec& spec) {
    using T = std::decay_t<decltype(value)>;
    md += fmt::format("| `{}` | `{}` | {} | {} | {} |\n", spec.flag(), cell(json_of(value).dump()),
                      role_text(spec.role), cell(accepted_text<T>(spec)), cell(spec.help_text()));
  });
  return md;
}

}  // namespace flexdemo::train
