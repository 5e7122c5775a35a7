// `flexdemo train`: its options come from the one declaration in train_options.h, and
// `--config FILE` (TOML) turns into the same options.
#include "subcommand.h"

#include "flexdemo/train.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <type_traits>

namespace flexdemo::app {

namespace {

// One declared option on the command line, by its type.
template <class T>
void add_option(CLI::App& cmd, T& field, const train::OptionSpec& spec) {
  const std::string flag = spec.flag();
  CLI::Option* option = nullptr;
  if constexpr (std::is_same_v<T, bool>) {
    option = cmd.add_flag(flag + ",!--no-" + flag.substr(2), field, spec.help_text());
  } else if constexpr (std::is_same_v<T, std::optional<bool>>) {
    option = cmd.add_flag_function(
        flag + ",!--no-" + flag.substr(2), [&field](int64_t count) { field = count > 0; },
        spec.help_text());
  } else if constexpr (std::is_enum_v<T>) {
    option =
        cmd.add_option_function<std::string>(
               flag, [&field](const std::string& word) { field = parse_name<T>(word); }, spec.help_text())
            ->check(CLI::IsMember(names_of<T>()))
            ->default_str(name_of(field));
  } else if constexpr (train::is_optional<T>::value) {
    using V = typename T::value_type;
    if constexpr (std::is_arithmetic_v<V>) {
      option = cmd.add_option_function<V>(
          flag, [&field](V value) { field = value; }, spec.help_text());
    } else {
      option = cmd.add_option_function<std::string>(
                      flag, [&field](const std::string& word) { field = parse_name<V>(word); },
                      spec.help_text())
                   ->check(CLI::IsMember(names_of<V>()));
    }
  } else {
    option = cmd.add_option(flag, field, spec.help_text())->capture_default_str();
    if (spec.accepts.words) option->check(CLI::IsMember(spec.accepts.words()));
  }
  if (spec.accepts.env) option->envname(spec.accepts.env);
}

// `train --config FILE`: CLI11 2.1 does not read a config file set on a subcommand, so the file
// is read here with CLI11's TOML reader and its items become arguments before the command
// line's (a key is an option's name without --, or its config.json key); an option given on the
// command line wins over the file. Throws std::invalid_argument
// for a missing or binary file and for keys that are not options of `cmd`.
void expand_config_file(std::vector<std::string>& args, const CLI::App& cmd) {
  auto at = std::find(args.begin(), args.end(), "--config");
  std::string file;
  if (at != args.end() && std::next(at) != args.end()) {
    file = *std::next(at);
  } else {
    at = std::find_if(args.begin(), args.end(),
                      [](const std::string& a) { return a.rfind("--config=", 0) == 0; });
    if (at == args.end()) return;
    file = at->substr(9);
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) throw std::invalid_argument("--config " + file + ": no such file");
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (text.find('\0') != std::string::npos) {
    throw std::invalid_argument("--config " + file +
                                " is not a text file (expected key = value lines)");
  }
  std::vector<std::string> from_file;
  for (const CLI::ConfigItem& item : CLI::ConfigTOML().from_file(file)) {
    if (item.name == "++" || item.name == "--") continue;  // section markers
    std::string option = "--" + item.name;                 // config.json's snake_case keys work too
    std::replace(option.begin(), option.end(), '_', '-');
    if (!item.parents.empty() || cmd.get_option_no_throw(option) == nullptr ||
        option == "--config") {
      throw std::invalid_argument(
          "--config " + file + ": unknown key '" + item.fullname() +
          "'; accepted: the options that flexdemo train --help lists, without --");
    }
    const bool given = std::any_of(args.begin(), args.end(), [&](const std::string& a) {
      return a == option || a.rfind(option + "=", 0) == 0;
    });
    if (given) continue;
    std::string value;
    for (const std::string& v : item.inputs) value += (value.empty() ? "" : " ") + v;
    from_file.push_back(option + "=" + value);
  }
  args.insert(std::find(args.begin(), args.end(), "train") + 1, from_file.begin(), from_file.end());
}

}  // namespace

Subcommand add_train(CLI::App& app) {
  auto config = std::make_shared<train::TrainConfig>();
  Subcommand c;
  c.cli = app.add_subcommand(
      "train", "train a GPT or T5 with FlexDeMo (or a dense baseline); run under mpirun");
  c.cli->add_option("--config",
                    "read options from a TOML file (key = value, the option names "
                    "without --); the command line wins");
  c.cli->add_flag_callback(
      "--help-markdown",
      [] {
        std::printf("%s", train::options_markdown().c_str());
        throw CLI::Success();
      },
      "print the option reference as Markdown (docs/options.md) and exit");
  train::for_each_option(*config, [cmd = c.cli](auto& field, const train::OptionSpec& spec) {
    add_option(*cmd, field, spec);
  });
  c.uses_mpi = true;
  c.run = [config](std::shared_ptr<comm::Communicator> world) {
    return train::run_training(*config, std::move(world));
  };
  c.expand_args = [cmd = c.cli](std::vector<std::string>& args) { expand_config_file(args, *cmd); };
  return c;
}

}  // namespace flexdemo::app
