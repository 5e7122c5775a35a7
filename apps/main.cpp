// The `flexdemo` command: parses the arguments (CLI11) and runs the chosen subcommand. Any error
// becomes one line on stderr and a non-zero exit: 2 for bad input, 1 for a failure while running.
#include "subcommand.h"

#include "flexdemo/comm.h"
#include "flexdemo/runtime.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// "...; accepted: a, b" for a missing subcommand: those of the deepest one given.
std::string accepted_subcommands(const CLI::App& app) {
  const CLI::App* level = &app;
  for (bool deeper = true; deeper;) {
    deeper = false;
    for (const CLI::App* sub : level->get_subcommands({})) {
      if (sub->parsed()) {
        level = sub;
        deeper = true;
        break;
      }
    }
  }
  std::string accepted;
  for (const CLI::App* sub : level->get_subcommands({})) {
    accepted += (accepted.empty() ? "" : ", ") + sub->get_name();
  }
  return accepted.empty() ? "" : "; accepted: " + accepted;
}

}  // namespace

int main(int argc, char** argv) {
  flexdemo::use_native_blas(argv);
  using flexdemo::app::Subcommand;
  CLI::App app{"flexdemo: FlexDeMo training — hybrid sharding inside nodes, DeMo between nodes"};
  app.require_subcommand(1);
  std::vector<Subcommand> commands = flexdemo::app::add_bench(app);
  for (auto add :
       {flexdemo::app::add_train, flexdemo::app::add_eval, flexdemo::app::add_generate,
        flexdemo::app::add_export, flexdemo::app::add_report, flexdemo::app::add_supervise}) {
    commands.push_back(add(app));
  }

  try {
    std::vector<std::string> args(argv + 1, argv + argc);
    for (const Subcommand& c : commands) {
      if (c.expand_args && std::find(args.begin(), args.end(), c.cli->get_name()) != args.end()) {
        c.expand_args(args);
      }
    }
    std::reverse(args.begin(), args.end());  // CLI11 takes the arguments last first
    app.parse(std::move(args));
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "flexdemo: error: %s\n", e.what());
    return 2;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "flexdemo: error: %s%s (see --help)\n", e.what(),
                 accepted_subcommands(app).c_str());
    return 2;
  }
  // MPI lives until after an error is printed: every rank reports before any of them exits.
  std::unique_ptr<flexdemo::comm::MpiRuntime> mpi;
  try {
    for (const Subcommand& c : commands) {
      if (!c.cli->parsed()) continue;
      if (!c.uses_mpi) return c.run(nullptr);
      mpi = std::make_unique<flexdemo::comm::MpiRuntime>(&argc, &argv);
      return c.run(mpi->world());
    }
  } catch (const std::invalid_argument& e) {  // bad input: exit 2, like a bad command line
    // Input is validated alike on every rank before any work, so all of them are here.
    std::fprintf(stderr, "flexdemo: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {  // a failure while running
    std::fprintf(stderr, "flexdemo: error: %s\n", e.what());
    std::fflush(stderr);
    // Other ranks may wait in a collective that will never complete: end the whole job.
    if (mpi && mpi->world()->size() > 1) flexdemo::comm::MpiRuntime::abort_job(1);
    return 1;
  }
  return 0;
}
