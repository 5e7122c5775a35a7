// flexdemo/train.h — the training loop behind `flexdemo train`: data, a sharded GPT, FlexDeMo
// (or a dense baseline), schedule, clipping, evaluation, metrics and progress.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include <vector>

namespace flexdemo::comm {
class Communicator;
}

namespace flexdemo::train {

struct TrainConfig {
  // ====== Model ======
  std::string model = "gpt-micro";  // preset; the dimensions below override it when > 0
  int64_t width = 0, layers = 0, heads = 0, context = 0;
  double dropout = 0.0;
  // ====== Data ======
  std::string data = "/usr/share/games/fortunes";  // text file or folder, or an llm.c shard
  std::string tokenizer = "bpe";                   // bpe | bytes
  int32_t vocab = 4096;                            // BPE vocabulary
  // ====== Schedule ======
  int64_t steps = 200;
  int64_t batch = 16;       // global batch in sequences, divided across all ranks
  int64_t micro_batch = 0;  // sequences per forward on a rank (0: the rank's whole share)
  int64_t seq = 64;         // tokens per sequence
  double lr = 1e-3;
  int64_t warmup = 20;        // linear warmup steps, then cosine decay
  double min_lr_ratio = 0.1;  // the cosine ends at lr * this
  double clip = 1.0;          // clip each replica's gradient to this global norm (0: off)
  double weight_decay = 0.0;
  // ====== Optimizer ======
  std::string optimizer = "flexdemo";  // flexdemo | flexdemo-adamw | adamw | sgd
  std::string replicator;              // "" = the optimizer's: demo, or full for adamw / sgd
  int sign = -1;                       // -1: the optimizer's (on for flexdemo), 0 off, 1 on
  int64_t topk = 32, chunk = 64;
  double decay = 0.999;
  std::string values = "bf16";
  int64_t replicate_every = 1;
  bool overlap_step = false;  // apply each exchange one step later, hidden behind that step
  // Start each unit's exchange between nodes in the backward, as soon as its gradients are
  // final (same result; needs clip 0 and on_nonfinite "stop", no overlap_step).
  bool exchange_in_backward = false;
  // ====== Topology ======
  int ranks_per_node = 0;  // 0: from MPI
  int shard_size = 0;      // 0: the whole node
  bool reshard = true;     // free gathered parameters after forward (recompute in backward)
  // ====== Run ======
  int64_t eval_every = 0;         // 0: only at the end
  int64_t eval_seqs = 64;         // validation sequences per evaluation
  int64_t log_every = 10;         // plain log lines when stdout is not a terminal
  std::string progress = "auto";  // auto (a live line on a terminal), bar, lines
  int64_t checkpoint_every = 0;   // also checkpoint every N steps (always at the end)
  int64_t keep_checkpoints = 2;   // the newest N checkpoints stay in out/checkpoints/
  std::string resume;             // a run folder (its newest valid checkpoint) or a checkpoint
  double comm_timeout = 60.0;     // seconds before a stuck collective stops the job (0: never)
  std::string out = "runs/latest";
  uint64_t seed = 1337;
  int threads = 1;                    // intra-op threads per rank
  bool bf16 = false;                  // bf16 autocast of the forward (weights stay float32)
  std::string on_nonfinite = "skip";  // a NaN/Inf loss or gradient: skip the step, or stop
  int64_t check_replicas = 0;         // every N steps compare the replicas' parameters (0: off)

  void validate() const;  // throws std::invalid_argument naming the bad option
};

// Collective over world. Writes config.json, metrics.jsonl and summary.json into cfg.out
// (rank 0). Returns the process exit code.
int run_training(const TrainConfig& cfg, std::shared_ptr<comm::Communicator> world);

// Collective over world: every rank's CRC-32 of its shards is compared with those of its
// replica group; on any mismatch anywhere every rank throws std::runtime_error naming the step
// and the replicas that differ (replica drift: the replicas must be bit-identical).
void check_replicas(const std::vector<at::Tensor>& shards,
                    const std::shared_ptr<comm::Communicator>& replica_group,
                    const std::shared_ptr<comm::Communicator>& world, int64_t step);

// Validation loss and perplexity of a run's checkpoint (any number of ranks). Collective.
int run_eval(const std::string& checkpoint, int64_t eval_seqs,
             std::shared_ptr<comm::Communicator> world);

struct GenerateOptions {
  std::string prompt;
  int64_t tokens = 100;      // to generate
  double temperature = 0.8;  // 0: greedy
  int64_t top_k = 40;        // sample among the k likeliest (0: all)
  uint64_t seed = 0;
};
// Text from a GPT checkpoint, printed to stdout. Collective (run it on one rank).
int run_generate(const std::string& checkpoint, const GenerateOptions& options,
                 std::shared_ptr<comm::Communicator> world);

}  // namespace flexdemo::train
