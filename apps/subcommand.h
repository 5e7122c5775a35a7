// The `flexdemo` subcommands: each file adds its own to the command line and says how it runs;
// main.cpp only parses and dispatches.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace flexdemo::comm {
class Communicator;
}

namespace flexdemo::app {

struct Subcommand {
  CLI::App* cli = nullptr;  // parsed() when the user chose it
  bool uses_mpi = false;    // run() gets the MPI world (otherwise nullptr)
  std::function<int(std::shared_ptr<comm::Communicator> world)> run;
  // Before parsing, when the arguments name this subcommand: rewrites them (e.g. --config).
  std::function<void(std::vector<std::string>& args)> expand_args;
};

Subcommand add_train(CLI::App& app);               // train_command.cpp
Subcommand add_eval(CLI::App& app);                // inference_commands.cpp
Subcommand add_generate(CLI::App& app);            // inference_commands.cpp
Subcommand add_export(CLI::App& app);              // inference_commands.cpp
Subcommand add_report(CLI::App& app);              // report_command.cpp
Subcommand add_supervise(CLI::App& app);           // supervise_command.cpp
std::vector<Subcommand> add_bench(CLI::App& app);  // bench/command.cpp: optimizer, exchange

}  // namespace flexdemo::app
