// flexdemo/train.h — the commands behind `flexdemo train`, `eval` and `generate`: a sharded model
// trained with FlexDeMo (or a dense baseline) on a corpus, with schedule, clipping, evaluation,
// checkpoints, metrics and progress. The options are declared in train_options.h.
#pragma once

#include "flexdemo/train_options.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace flexdemo::comm {
class Communicator;
}

namespace flexdemo::train {

// The exit code of a run stopped early by a preemption signal (SIGTERM, SIGINT or SIGUSR1 to any
// rank): it wrote a checkpoint at the step boundary where the ranks agreed to stop; --resume
// continues it. (sysexits' EX_TEMPFAIL: try again later.)
inline constexpr int kExitStopped = 75;

// Collective over world. Writes config.json, metrics.jsonl, summary.json and checkpoints into
// cfg.out (rank 0 writes the shared files). Returns the process exit code: 0 when done (or
// stopped by --max-time), kExitStopped when a signal stopped it.
int run_training(const TrainConfig& cfg, std::shared_ptr<comm::Communicator> world);

// The option reference as Markdown (docs/options.md is this text, checked by a test): per
// option its flag, default, what a resume keeps, what it accepts and its help, in declaration
// order. `flexdemo train --help-markdown` prints it.
std::string options_markdown();

// Collective over world: every rank's CRC-32 of its shards is compared with those of its
// replica group; on any mismatch anywhere every rank throws std::runtime_error naming the step
// and the replicas that differ (replica drift: the replicas must be bit-identical).
void check_replicas(const std::vector<at::Tensor>& shards,
                    const std::shared_ptr<comm::Communicator>& replica_group,
                    const std::shared_ptr<comm::Communicator>& world, int64_t step);

struct EvalOptions {
  int64_t eval_seqs = 256;  // validation sequences (pairs) for the loss
  int64_t translate = 200;  // translation: the first N validation pairs translated for chrF
  int64_t beam = 1;         // translation: beams (1: greedy)
  // Decoders: a JSON file of token id rows of one length ([[...], ...]) scored instead of the
  // validation data: their mean next-token loss, and with `logits` (a safetensors path) their
  // next-token logits written there as "next_token_logits", float32 [rows, vocab].
  std::string tokens;
  std::string logits;
};
// Validation loss and perplexity of a run's checkpoint (any number of ranks), printed as JSON;
// for a T5 trained on translation pairs also chrF (sacreBLEU's) of its translations. Collective.
int run_eval(const std::string& checkpoint, const EvalOptions& options,
             std::shared_ptr<comm::Communicator> world);

struct GenerateOptions {
  std::string prompt;
  int64_t tokens = 100;      // to generate
  double temperature = 0.8;  // GPT: 0: greedy
  int64_t top_k = 40;        // GPT: sample among the k likeliest (0: all)
  uint64_t seed = 0;
  int64_t beam = 4;  // translation: beams of the beam search (1: greedy)
};
struct ExportOptions {
  std::string format = "hf";  // the only one: Hugging Face transformers'
  std::string out;            // a folder that must not exist yet
};
// A checkpoint as a transformers model folder: config.json, model.safetensors (transformers'
// names and layouts: GPT2LMHeadModel or LlamaForCausalLM) and, for a BPE tokenizer, its
// SentencePiece model as tokenizer.model with tokenizer_config.json. Written into a temporary
// folder renamed to `out` at the end. Collective (run it on one rank).
int run_export(const std::string& checkpoint, const ExportOptions& options,
               std::shared_ptr<comm::Communicator> world);

// Text from a GPT checkpoint (the prompt and its continuation), or a T5's translation of the
// prompt, printed to stdout. Collective (run it on one rank).
int run_generate(const std::string& checkpoint, const GenerateOptions& options,
                 std::shared_ptr<comm::Communicator> world);

}  // namespace flexdemo::train
