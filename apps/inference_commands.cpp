// `flexdemo eval` and `flexdemo generate`: a trained checkpoint's validation loss, and text.
#include "subcommand.h"

#include "flexdemo/train.h"

namespace flexdemo::app {

Subcommand add_eval(CLI::App& app) {
  struct Args {
    std::string checkpoint;
    train::EvalOptions options;
  };
  auto args = std::make_shared<Args>();
  Subcommand c;
  c.cli = app.add_subcommand(
      "eval", "validation loss and perplexity of a checkpoint (translation: and chrF)");
  c.cli->add_option("checkpoint", args->checkpoint, "a run folder (or its checkpoint/)")
      ->required()
      ->check(CLI::ExistingDirectory);
  c.cli->add_option("--eval-seqs", args->options.eval_seqs, "validation sequences")
      ->capture_default_str();
  c.cli
      ->add_option("--translate", args->options.translate,
                   "translation: the first N validation pairs translated for chrF (0: none)")
      ->capture_default_str();
  c.cli->add_option("--beam", args->options.beam, "translation: beam search width (1: greedy)")
      ->capture_default_str();
  c.cli->add_option("--tokens", args->options.tokens,
                    "gpt-*, llama-*: score these token ids instead (a JSON file of id lists of "
                    "one length): their mean next-token loss");
  c.cli->add_option("--logits", args->options.logits,
                    "with --tokens: write their next-token logits to this safetensors file");
  c.uses_mpi = true;
  c.run = [args](std::shared_ptr<comm::Communicator> world) {
    return train::run_eval(args->checkpoint, args->options, std::move(world));
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
  c.cli = app.add_subcommand(
      "generate", "text from a GPT checkpoint, or the translation of --prompt by a T5 one");
  c.cli->add_option("checkpoint", args->checkpoint, "a run folder (or its checkpoint/)")
      ->required()
      ->check(CLI::ExistingDirectory);
  c.cli->add_option("--prompt", o.prompt, "text to continue (translation: to translate)")
      ->capture_default_str();
  c.cli->add_option("--tokens", o.tokens, "tokens to generate (translation: at most)")
      ->capture_default_str();
  c.cli->add_option("--temperature", o.temperature, "GPT: sampling temperature (0: greedy)")
      ->capture_default_str();
  c.cli->add_option("--top-k", o.top_k, "GPT: sample among the k likeliest tokens (0: all)")
      ->capture_default_str();
  c.cli->add_option("--beam", o.beam, "translation: beam search width (1: greedy)")
      ->capture_default_str();
  c.cli->add_option("--seed", o.seed, "sampling seed")->capture_default_str();
  c.uses_mpi = true;
  c.run = [args](std::shared_ptr<comm::Communicator> world) {
    return train::run_generate(args->checkpoint, args->options, std::move(world));
  };
  return c;
}

Subcommand add_export(CLI::App& app) {
  struct Args {
    std::string checkpoint;
    train::ExportOptions options;
  };
  auto args = std::make_shared<Args>();
  Subcommand c;
  c.cli = app.add_subcommand(
      "export", "a GPT or LLaMA checkpoint as a Hugging Face transformers model folder");
  c.cli->add_option("checkpoint", args->checkpoint, "a run folder (or its checkpoint/)")
      ->required()
      ->check(CLI::ExistingDirectory);
  c.cli->add_option("--format", args->options.format, "hf: transformers' format")
      ->capture_default_str();
  c.cli->add_option("--out", args->options.out, "the folder to write (must not exist)")->required();
  c.uses_mpi = true;
  c.run = [args](std::shared_ptr<comm::Communicator> world) {
    return train::run_export(args->checkpoint, args->options, std::move(world));
  };
  return c;
}

}  // namespace flexdemo::app
