// `flexdemo report`: compares run folders in a Markdown table and PNG plots.
#include "subcommand.h"

#include "report.h"

#include <cstdio>

namespace flexdemo::app {

Subcommand add_report(CLI::App& app) {
  struct Args {
    std::vector<std::string> runs;
    std::string out = "report";
  };
  auto args = std::make_shared<Args>();
  Subcommand c;
  c.cli = app.add_subcommand("report", "compare run folders: Markdown table and PNG plots");
  c.cli
      ->add_option("runs", args->runs,
                   "run folders (each with config.json, metrics.jsonl, "
                   "summary.json)")
      ->required()
      ->check(CLI::ExistingDirectory);
  c.cli->add_option("--out", args->out, "where report.md and the plots go")->capture_default_str();
  c.run = [args](std::shared_ptr<comm::Communicator>) {
    std::printf("%s", write_report(args->runs, args->out).c_str());
    std::printf("report and plots in %s\n", args->out.c_str());
    return 0;
  };
  return c;
}

}  // namespace flexdemo::app
