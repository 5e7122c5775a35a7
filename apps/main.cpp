// The `flexdemo` command: parses arguments (CLI11) and dispatches to the subcommands.
// Any error becomes one line on stderr and a non-zero exit.
#include "bench/bench.h"
#include "flexdemo/comm.h"
#include "flexdemo/report.h"
#include "flexdemo/train.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <fstream>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

void add_demo_bench_flags(CLI::App* cmd, flexdemo::bench::DemoBenchArgs& args) {
  cmd->add_option("--scale", args.scale, "GPT-2-124M shapes scaled by S (0.25: 3.8M params)")
      ->capture_default_str();
  cmd->add_option("--topk", args.topk, "coefficients kept per chunk")->capture_default_str();
  cmd->add_option("--chunk", args.chunk, "target chunk edge")->capture_default_str();
  cmd->add_option("--values", args.values, "wire value encoding")
      ->check(CLI::IsMember({"fp32", "bf16", "int8", "1bit"}))
      ->capture_default_str();
  cmd->add_option("--steps", args.steps, "optimizer steps (timed: the median is reported)")
      ->capture_default_str();
  cmd->add_option("--inner", args.inner, "DeMo's inner optimizer: sgd (sign-SGD) or adamw")
      ->check(CLI::IsMember({"sgd", "adamw"}))
      ->capture_default_str();
  cmd->add_flag("--json", args.json, "print one JSON object (rank 0)");
}

// `train --config FILE`: CLI11 2.1 does not read a config file set on a subcommand, so the file
// is read here with CLI11's TOML reader and its items become arguments before the command
// line's; an option given on the command line wins over the file. Throws std::invalid_argument
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
    const std::string option = "--" + item.name;
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

int main(int argc, char** argv) {
  CLI::App app{"flexdemo: FlexDeMo training — hybrid sharding inside nodes, DeMo between nodes"};
  app.require_subcommand(1);
  auto* bench = app.add_subcommand("bench", "benchmarks that print ratios measured in one run");
  bench->require_subcommand(1);

  flexdemo::bench::OptimizerBenchArgs opt;
  auto* optimizer = bench->add_subcommand(
      "optimizer", "time a DeMo step (one replica) against an AdamW step on GPT-2-shaped params");
  add_demo_bench_flags(optimizer, opt);
  optimizer->add_option("--threads", opt.threads, "intra-op threads")->capture_default_str();

  flexdemo::bench::ExchangeBenchArgs ex;
  auto* exchange = bench->add_subcommand(
      "exchange", "under mpirun: DeMo's bytes between replicas against a dense all-reduce");
  add_demo_bench_flags(exchange, ex);
  exchange->add_option("--replicator", ex.replicator, "exchange between nodes")
      ->check(CLI::IsMember({"demo", "full", "none", "random"}))
      ->capture_default_str();
  exchange
      ->add_option("--ranks-per-node", ex.ranks_per_node,
                   "ranks per node (0: ranks sharing a host, from MPI)")
      ->envname("FLEXDEMO_RANKS_PER_NODE")
      ->capture_default_str();
  exchange
      ->add_option("--shard-size", ex.shard_size,
                   "ranks per shard group, dividing the node (0: the whole node)")
      ->capture_default_str();

  flexdemo::train::TrainConfig tc;
  auto* train = app.add_subcommand(
      "train", "train a GPT with FlexDeMo (or a dense baseline); run under mpirun");
  std::string config_file;
  train->add_option("--config", config_file,
                    "read options from a TOML file (key = value, the option names without --); "
                    "the command line wins");
  train
      ->add_option("--model", tc.model,
                   "preset: gpt-nano, gpt-micro, gpt2-small, t5-nano, t5-small (T5: span "
                   "corruption)")
      ->check(CLI::IsMember({"gpt-nano", "gpt-micro", "gpt2-small", "t5-nano", "t5-small"}))
      ->capture_default_str();
  train->add_option("--width", tc.width, "d_model (0: the preset's)")->capture_default_str();
  train->add_option("--layers", tc.layers, "blocks (0: the preset's)")->capture_default_str();
  train->add_option("--heads", tc.heads, "attention heads (0: the preset's)")
      ->capture_default_str();
  train->add_option("--context", tc.context, "longest sequence (0: the preset's)")
      ->capture_default_str();
  train->add_option("--dropout", tc.dropout, "dropout probability")->capture_default_str();
  train->add_option("--data", tc.data, "text file or folder, or an llm.c token shard (.bin)")
      ->capture_default_str();
  train->add_option("--tokenizer", tc.tokenizer, "bpe (SentencePiece, trained on --data) or bytes")
      ->check(CLI::IsMember({"bpe", "bytes"}))
      ->capture_default_str();
  train->add_option("--vocab", tc.vocab, "BPE vocabulary size")->capture_default_str();
  train->add_option("--steps", tc.steps, "optimizer steps")->capture_default_str();
  train->add_option("--batch", tc.batch, "global batch in sequences, divided across ranks")
      ->capture_default_str();
  train
      ->add_option("--micro-batch", tc.micro_batch,
                   "sequences per forward on a rank; accumulates (0: the rank's share)")
      ->capture_default_str();
  train->add_option("--seq", tc.seq, "tokens per sequence")->capture_default_str();
  train->add_option("--lr", tc.lr, "peak learning rate")->capture_default_str();
  train->add_option("--warmup", tc.warmup, "linear warmup steps, then cosine decay")
      ->capture_default_str();
  train->add_option("--min-lr-ratio", tc.min_lr_ratio, "final lr as a fraction of --lr")
      ->capture_default_str();
  train->add_option("--clip", tc.clip, "gradient clipping by global norm (0: off)")
      ->capture_default_str();
  train->add_option("--weight-decay", tc.weight_decay, "decoupled weight decay")
      ->capture_default_str();
  train
      ->add_option("--optimizer", tc.optimizer,
                   "flexdemo (DeMo between nodes + sign-SGD), flexdemo-adamw (+ AdamW), "
                   "adamw or sgd (dense, full exchange)")
      ->check(CLI::IsMember({"flexdemo", "flexdemo-adamw", "adamw", "sgd"}))
      ->capture_default_str();
  train
      ->add_option("--replicator", tc.replicator,
                   "exchange between nodes: demo, full, none, random (default: the optimizer's)")
      ->check(CLI::IsMember({"demo", "full", "none", "random"}));
  train->add_flag_callback(
      "--sign", [&tc] { tc.sign = 1; },
      "apply sign(update) (default: on for flexdemo, off otherwise)");
  train->add_flag_callback(
      "--no-sign", [&tc] { tc.sign = 0; }, "apply the update itself");
  train->add_option("--topk", tc.topk, "DCT coefficients kept per chunk")->capture_default_str();
  train->add_option("--chunk", tc.chunk, "DCT chunk edge")->capture_default_str();
  train->add_option("--decay", tc.decay, "DeMo residual decay")->capture_default_str();
  train->add_option("--values", tc.values, "wire value encoding: fp32, bf16, int8, 1bit")
      ->check(CLI::IsMember({"fp32", "bf16", "int8", "1bit"}))
      ->capture_default_str();
  train->add_option("--replicate-every", tc.replicate_every, "exchange every N steps")
      ->capture_default_str();
  train->add_flag("--overlap-step", tc.overlap_step,
                  "run each exchange between nodes through the next step and apply it there (one "
                  "step stale), hiding it behind that step's forward and backward");
  train->add_flag("--exchange-in-backward", tc.exchange_in_backward,
                  "start each unit's exchange between nodes during the backward, as soon as its "
                  "gradients are final (the same result as without; needs --clip 0 and "
                  "--on-nonfinite stop)");
  train->add_option("--ranks-per-node", tc.ranks_per_node, "ranks per node (0: from MPI)")
      ->envname("FLEXDEMO_RANKS_PER_NODE")
      ->capture_default_str();
  train->add_option("--shard-size", tc.shard_size, "ranks per shard group (0: the node)")
      ->capture_default_str();
  train
      ->add_flag("--reshard,!--no-reshard", tc.reshard,
                 "free gathered parameters after forward and recompute in backward")
      ->capture_default_str();
  train->add_option("--eval-every", tc.eval_every, "evaluate every N steps (0: only at the end)")
      ->capture_default_str();
  train->add_option("--eval-seqs", tc.eval_seqs, "validation sequences per evaluation")
      ->capture_default_str();
  train->add_option("--log-every", tc.log_every, "log line every N steps (not a terminal)")
      ->capture_default_str();
  train
      ->add_option("--progress", tc.progress,
                   "auto (a live line when stdout is a terminal), bar, or lines (log lines); "
                   "under mpirun the ranks always see a terminal")
      ->check(CLI::IsMember({"auto", "bar", "lines"}))
      ->capture_default_str();
  train->add_option("--out", tc.out, "output folder")->capture_default_str();
  train
      ->add_option("--checkpoint-every", tc.checkpoint_every,
                   "also checkpoint every N steps (0: only at the end)")
      ->capture_default_str();
  train->add_option(
      "--resume", tc.resume,
      "continue from a run folder's newest valid checkpoint, or from one checkpoint folder "
      "(same topology and options)");
  train
      ->add_option("--keep-checkpoints", tc.keep_checkpoints,
                   "checkpoints kept in OUT/checkpoints/ (the newest ones)")
      ->capture_default_str();
  train
      ->add_option("--comm-timeout", tc.comm_timeout,
                   "seconds a collective may take before the job stops with an error (a dead "
                   "or hung rank); 0: wait forever")
      ->capture_default_str();
  train->add_option("--seed", tc.seed, "seed of data order and initialisation")
      ->capture_default_str();
  train->add_option("--threads", tc.threads, "intra-op threads per rank")->capture_default_str();
  train->add_flag("--bf16", tc.bf16, "bf16 autocast of the forward (weights stay float32)");
  train
      ->add_option("--check-replicas", tc.check_replicas,
                   "every N steps, stop if the replicas' parameters differ (0: off)")
      ->capture_default_str();
  train
      ->add_option("--on-nonfinite", tc.on_nonfinite,
                   "a NaN/Inf loss or gradient on any rank: skip the step on all ranks, or stop")
      ->check(CLI::IsMember({"skip", "stop"}))
      ->capture_default_str();

  std::string eval_checkpoint;
  int64_t eval_seqs = 256;
  auto* eval = app.add_subcommand("eval", "validation loss and perplexity of a checkpoint");
  eval->add_option("checkpoint", eval_checkpoint, "a run folder (or its checkpoint/)")
      ->required()
      ->check(CLI::ExistingDirectory);
  eval->add_option("--eval-seqs", eval_seqs, "validation sequences")->capture_default_str();

  std::string gen_checkpoint;
  flexdemo::train::GenerateOptions gen;
  auto* generate = app.add_subcommand("generate", "text from a GPT checkpoint");
  generate->add_option("checkpoint", gen_checkpoint, "a run folder (or its checkpoint/)")
      ->required()
      ->check(CLI::ExistingDirectory);
  generate->add_option("--prompt", gen.prompt, "text to continue")->capture_default_str();
  generate->add_option("--tokens", gen.tokens, "tokens to generate")->capture_default_str();
  generate->add_option("--temperature", gen.temperature, "sampling temperature (0: greedy)")
      ->capture_default_str();
  generate->add_option("--top-k", gen.top_k, "sample among the k likeliest tokens (0: all)")
      ->capture_default_str();
  generate->add_option("--seed", gen.seed, "sampling seed")->capture_default_str();

  std::vector<std::string> report_runs;
  std::string report_out = "report";
  auto* report = app.add_subcommand("report", "compare run folders: Markdown table and PNG plots");
  report
      ->add_option("runs", report_runs,
                   "run folders (each with config.json, metrics.jsonl, "
                   "summary.json)")
      ->required()
      ->check(CLI::ExistingDirectory);
  report->add_option("--out", report_out, "where report.md and the plots go")
      ->capture_default_str();

  try {
    std::vector<std::string> args(argv + 1, argv + argc);
    if (std::find(args.begin(), args.end(), "train") != args.end()) {
      expand_config_file(args, *train);
    }
    std::reverse(args.begin(), args.end());  // CLI11 takes the arguments last first
    app.parse(std::move(args));
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "flexdemo: error: %s\n", e.what());
    return 2;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    // Name what is accepted where a subcommand is missing: those of the deepest one given.
    CLI::App* level = &app;
    for (bool deeper = true; deeper;) {
      deeper = false;
      for (CLI::App* sub : level->get_subcommands({})) {
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
    std::fprintf(stderr, "flexdemo: error: %s%s (see --help)\n", e.what(),
                 accepted.empty() ? "" : ("; accepted: " + accepted).c_str());
    return 2;
  }
  // MPI lives until after an error is printed: every rank reports before any of them exits.
  std::unique_ptr<flexdemo::comm::MpiRuntime> mpi;
  try {
    if (optimizer->parsed()) return flexdemo::bench::run_bench_optimizer(opt);
    if (report->parsed()) {
      std::printf("%s", flexdemo::train::write_report(report_runs, report_out).c_str());
      std::printf("report and plots in %s\n", report_out.c_str());
      return 0;
    }
    if (eval->parsed()) {
      mpi = std::make_unique<flexdemo::comm::MpiRuntime>(&argc, &argv);
      return flexdemo::train::run_eval(eval_checkpoint, eval_seqs, mpi->world());
    }
    if (generate->parsed()) {
      mpi = std::make_unique<flexdemo::comm::MpiRuntime>(&argc, &argv);
      return flexdemo::train::run_generate(gen_checkpoint, gen, mpi->world());
    }
    if (train->parsed()) {
      mpi = std::make_unique<flexdemo::comm::MpiRuntime>(&argc, &argv);
      return flexdemo::train::run_training(tc, mpi->world());
    }
    if (exchange->parsed()) {
      mpi = std::make_unique<flexdemo::comm::MpiRuntime>(&argc, &argv);
      return flexdemo::bench::run_bench_exchange(ex, mpi->world());
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
