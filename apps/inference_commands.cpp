// `flexdemo eval` and `flexdemo generate`: a trained checkpoint's validation loss, and text.
#include "subcommand.h"

#include "flexdemo/train.h"

namespace flexdemo::app {

Subcommand add_eval(CLI::App& app) {
  struct Args {
    std::string checkpoint;
    int64_t eval_seqs = 256;
  };
  auto args = std::make_shared<Args>();
  Subcommand c;
  c.cli = app.add_subcommand("eval", "validation loss and perplexity of a checkpoint");
  c.cli->add_option("checkpoint", args->checkpoint, "a run folder (or its checkpoint/)")
      ->required()
      ->check(CLI::ExistingDirectory);
  c.cli->add_option("--eval-seqs", args->eval_seqs, "validation sequences")->capture_default_str();
  c.uses_mpi = true;
  c.run = [args](std::shared_ptr<comm::Communicator> world) {
    return train::run_eval(args->checkpoint, args->eval_seqs, std::move(world));
  };
  return c;
}

Subcommand add_generate(CLI::App& app) {
  struct Args {
    std::string checkpoint;
    train::GenerateOptions options;
  };
  auto args = std::make_shared<Args>();
  train::GenerateOptions& o = args->options;
  Subcommand c;
  c.cli = app.add_subcommand("generate", "text from a GPT checkpoint");
  c.cli->add_option("checkpoint", args->checkpoint, "a run folder (or its checkpoint/)")
      ->required()
      ->check(CLI::ExistingDirectory);
  c.cli->add_option("--prompt", o.prompt, "text to continue")->capture_default_str();
  c.cli->add_option("--tokens", o.tokens, "tokens to generate")->capture_default_str();
  c.cli->add_option("--temperature", o.temperature, "sampling temperature (0: greedy)")
      ->capture_default_str();
  c.cli->add_option("--top-k", o.top_k, "sample among the k likeliest tokens (0: all)")
      ->capture_default_str();
  c.cli->add_option("--seed", o.seed, "sampling seed")->capture_default_str();
  c.uses_mpi = true;
  c.run = [args](std::shared_ptr<comm::Communicator> world) {
    return train::run_generate(args->checkpoint, args->options, std::move(world));
  };
  return c;
}

}  // namespace flexdemo::app
