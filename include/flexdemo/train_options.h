// flexdemo/train_options.h — every `flexdemo train` option, declared once: name, type, default,
// what a resumed run must keep, accepted range and help text. TrainConfig's fields, the command
// line, the TOML config, config.json, validation and the resume check all derive from this list.
#pragma once

#include "flexdemo/compress.h"
#include "flexdemo/names.h"
#include "flexdemo/optim.h"

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace flexdemo::model {
std::vector<std::string> model_presets();
}

namespace flexdemo::train {

// ====== The option types that are words ======
enum class OptimizerKind {
  FlexDemo,       // DeMo between nodes + the adaptive step (or sign-SGD)
  FlexDemoAdamW,  // DeMo between nodes + AdamW
  AdamW,          // dense: full exchange, AdamW (the AdamW-HSDP baseline)
  Sgd,            // dense: full exchange, SGD
};
enum class TokenizerKind { Bpe, Bytes };
enum class ProgressMode { Auto, Bar, Lines };
enum class NonFinitePolicy { Skip, Stop };
enum class DeviceKind { Auto, Cpu, Cuda };
enum class BackendKind { Auto, Mpi, Nccl };
using optim::LinkBudgetMode;

// ====== How an option is checked and kept ======
// What a resumed run (--resume) and a checkpoint's readers do with an option.
enum class OptionRole {
  Model,    // defines the model and its data: eval and generate read it back; a resume must match
  State,    // defines the optimizer state or the data order: a resume must match
  Run,      // may change between a run and its resume
  Unsaved,  // not written to config.json
};

// What an option accepts: a number's range (optim::Range: "--NAME must be >= 1, got 0"), a
// word's list (CLI11's "--NAME: x not in {a,b}"), and an environment variable that sets it too.
struct Accepts {
  optim::Range range;
  std::vector<std::string> (*words)() = nullptr;  // a string option's accepted words
  const char* env = nullptr;

  Accepts(optim::Range r = {}) : range(r) {}  // NOLINT: a range is what most options accept
  Accepts from_env(const char* variable) const {
    Accepts a = *this;
    a.env = variable;
    return a;
  }
};
inline Accepts anything() {
  return {};
}
using optim::above;
using optim::at_least;
using optim::closed;
using optim::half_open;
inline Accepts one_of(std::vector<std::string> (*words)()) {
  Accepts a;
  a.words = words;
  return a;
}

struct OptionSpec {
  const char* name;  // snake_case: the config.json key; the flag (and TOML key) is --kebab-case
  OptionRole role;
  Accepts accepts;
  const char* help;       // other options named {name} (the optimizer's help: see below)
  bool chosen = false;    // std::optional: unset, the --optimizer's choice
  std::string flag() const;         // "--" + name with '_' -> '-'
  std::string help_text() const;    // help with {names} as flags, and the choice when unset
};

// clang-format off
// X(name, type, default, role, accepts, help). std::optional: unset means "the optimizer's".
// An option that is the optimizer's (include/flexdemo/optim.h) takes its range and help from
// there (optim::declared::NAME), so the command and the library accept and say the same.
#define FLEXDEMO_TRAIN_OPTIONS(X)                                                                  \
  /* ====== Model ====== */                                                                        \
  X(model, std::string, "gpt-micro", Model, one_of(model::model_presets),                          \
    "the model preset (llama-*: a LLaMA-style decoder; t5-*: a T5-style encoder-decoder, trained " \
    "by span corruption on text or on translation pairs); gpt, llama, t5: the family alone, "      \
    "every dimension given (what --init-from sets)")                                               \
  X(width, int64_t, 0, Model, at_least(0, " (0: the preset's)"), "d_model (0: the preset's)")      \
  X(layers, int64_t, 0, Model, at_least(0, " (0: the preset's)"), "blocks (0: the preset's)")      \
  X(heads, int64_t, 0, Model, at_least(0, " (0: the preset's)"),                                   \
    "attention heads (0: the preset's)")                                                           \
  X(context, int64_t, 0, Model, at_least(0, " (0: the preset's)"),                                 \
    "longest sequence (0: the preset's)")                                                          \
  X(ff, int64_t, 0, Model, at_least(0, " (0: the preset's)"),                                      \
    "llama-* and t5-*: the feed-forward's inner size (0: the preset's)")                           \
  X(kv_heads, int64_t, 0, Model, at_least(0, " (0: the preset's)"),                                \
    "llama-*: key/value heads, dividing --heads (grouped-query attention; 0: the preset's)")       \
  X(rope_theta, double, 10000.0, Model, above(1), "llama-*: the rotary positions' base")           \
  X(tied_head, bool, true, Model, anything(),                                                      \
    "llama-*: the output head is the token table (--no-tied-head: a head of its own)")             \
  X(dropout, double, 0.0, Run, anything(), "dropout probability")                                  \
  /* ====== Data ====== */                                                                         \
  X(data, std::string, "/usr/share/games/fortunes", Model, anything(),                             \
    "text file or folder, an llm.c token shard (.bin), or translation pairs for t5-*: "            \
    "gettext:LANG (English -> LANG from the installed message catalogues), *.tsv or *.jsonl")      \
  X(tokenizer, TokenizerKind, TokenizerKind::Bpe, Model, anything(),                               \
    "bpe (SentencePiece, trained on --data) or bytes")                                             \
  X(vocab, int32_t, 4096, Model, anything(), "BPE vocabulary size")                                \
  X(tokenizer_model, std::string, "", Model, anything(),                                           \
    "a SentencePiece model file to tokenize --data with instead of training a BPE on it "          \
    "(--init-from sets the model folder's tokenizer.model)")                                       \
  X(init_from, std::string, "", State, anything(),                                                 \
    "start from a transformers model folder (GPT2LMHeadModel or LlamaForCausalLM: its "            \
    "config.json, model.safetensors and tokenizer.model): its shape, weights and tokenizer")       \
  /* ====== Schedule ====== */                                                                     \
  X(steps, int64_t, 200, Run, at_least(1), "optimizer steps")                                      \
  X(batch, int64_t, 16, State, at_least(1), "global batch in sequences, divided across ranks")     \
  X(micro_batch, int64_t, 0, State, at_least(0),                                                   \
    "sequences per forward on a rank; accumulates (0: the rank's share)")                          \
  X(seq, int64_t, 64, Model, at_least(1),                                                          \
    "tokens per sequence (translation pairs: the longest source; longer ones are cut)")            \
  X(target_seq, int64_t, 0, Model, at_least(0, " (0: --seq)"),                                     \
    "translation pairs: the longest target in tokens (0: --seq)")                                  \
  X(lr, std::optional<double>, std::nullopt, Run,                                                  \
    optim::declared::lr.range, optim::declared::lr.help)                                           \
  X(warmup, int64_t, 20, Run, at_least(0), "linear warmup steps, then cosine decay")               \
  X(min_lr_ratio, double, 0.1, Run, closed(0, 1), "final lr as a fraction of --lr")                \
  X(clip, double, 1.0, Run, at_least(0),                                                           \
    "clip each replica's gradient to this global norm (0: off)")                                   \
  X(weight_decay, double, 0.0, State,                                                              \
    optim::declared::weight_decay.range, optim::declared::weight_decay.help)                       \
  X(beta1, std::optional<double>, std::nullopt, State,                                             \
    optim::declared::beta1.range, optim::declared::beta1.help)                                     \
  X(beta2, double, 0.999, State, optim::declared::beta2.range, optim::declared::beta2.help)        \
  X(max_time, double, 0.0, Run, at_least(0, " seconds (0: no limit)"),                             \
    "stop after the step that reaches this many seconds of training, with a checkpoint "           \
    "(0: no limit)")                                                                               \
  /* ====== Optimizer ====== */                                                                    \
  X(optimizer, OptimizerKind, OptimizerKind::FlexDemo, State, anything(),                          \
    "flexdemo (DeMo between nodes + the adaptive step, or sign-SGD with --sign), flexdemo-adamw "  \
    "(+ AdamW), adamw or sgd (dense, full exchange)")                                              \
  X(replicator, std::optional<optim::ReplicatorKind>, std::nullopt, State,                         \
    optim::declared::replicator.range, optim::declared::replicator.help)                           \
  X(demo_exchange, optim::DemoExchange, optim::DemoExchange::AllGather, Run,                       \
    optim::declared::demo_exchange.range, optim::declared::demo_exchange.help)                     \
  X(owner_topk, int64_t, 0, Run,                                                                   \
    optim::declared::owner_topk.range, optim::declared::owner_topk.help)                           \
  X(owner_values, compress::ValueEncoding, compress::ValueEncoding::TwoBit, Run,                   \
    optim::declared::owner_values.range, optim::declared::owner_values.help)                       \
  X(owner_feedback, optim::OwnerFeedback, optim::OwnerFeedback::Owner, Run,                        \
    optim::declared::owner_feedback.range, optim::declared::owner_feedback.help)                   \
  X(sign, bool, false, State, optim::declared::sign.range, optim::declared::sign.help)             \
  X(normalize, bool, false, State,                                                                 \
    optim::declared::normalize.range, optim::declared::normalize.help)                             \
  X(update_rms, double, 0.0, State,                                                                \
    optim::declared::update_rms.range, optim::declared::update_rms.help)                           \
  X(step_bound, double, 0.0, State,                                                                \
    optim::declared::step_bound.range, optim::declared::step_bound.help)                           \
  X(rms_cap, std::optional<double>, std::nullopt, State,                                           \
    optim::declared::rms_cap.range, optim::declared::rms_cap.help)                                 \
  X(topk, std::optional<int64_t>, std::nullopt, State,                                             \
    optim::declared::topk.range, optim::declared::topk.help)                                       \
  X(chunk, int64_t, 64, Model, optim::declared::chunk.range, optim::declared::chunk.help)          \
  X(transform, optim::Transform, optim::Transform::Dct, State,                                     \
    optim::declared::transform.range, optim::declared::transform.help)                             \
  X(decay, double, 0.999, State, optim::declared::decay.range, optim::declared::decay.help)        \
  X(fold_lr, std::optional<bool>, std::nullopt, State,                                             \
    optim::declared::fold_lr.range, optim::declared::fold_lr.help)                                 \
  X(precondition, std::optional<bool>, std::nullopt, State,                                        \
    optim::declared::precondition.range, optim::declared::precondition.help)                       \
  X(second_moment, optim::SecondMoment, optim::SecondMoment::Auto, Run,                           \
    optim::declared::second_moment.range, optim::declared::second_moment.help)                     \
  X(second_moment_every, int64_t, 1, State,                                                        \
    optim::declared::second_moment_every.range, optim::declared::second_moment_every.help)         \
  X(second_moment_values, optim::StatisticsEncoding, optim::StatisticsEncoding::Auto, Run,         \
    optim::declared::second_moment_values.range, optim::declared::second_moment_values.help)       \
  X(values, std::optional<compress::ValueEncoding>, std::nullopt, State,                           \
    optim::declared::values.range, optim::declared::values.help)                                   \
  X(replicate_every, int64_t, 1, State,                                                            \
    optim::declared::replicate_every.range, optim::declared::replicate_every.help)                 \
  X(inner_steps, int64_t, 1, State,                                                                \
    optim::declared::inner_steps.range, optim::declared::inner_steps.help)                         \
  X(outer_lr, double, 1.0, State, optim::declared::outer_lr.range, optim::declared::outer_lr.help) \
  X(outer_momentum, double, 0.0, State,                                                            \
    optim::declared::outer_momentum.range, optim::declared::outer_momentum.help)                   \
  X(outer_sign, bool, false, State,                                                                \
    optim::declared::outer_sign.range, optim::declared::outer_sign.help)                           \
  X(overlap_step, bool, false, State,                                                              \
    optim::declared::overlap_step.range, optim::declared::overlap_step.help)                       \
  X(link_budget, LinkBudgetMode, LinkBudgetMode::Off, State,                                     \
    optim::declared::link_budget.range, optim::declared::link_budget.help)                         \
  X(link_min_topk, int64_t, 8, Run,                                                                \
    optim::declared::link_min_topk.range, optim::declared::link_min_topk.help)                     \
  X(link_max_topk, int64_t, 128, Run,                                                              \
    optim::declared::link_max_topk.range, optim::declared::link_max_topk.help)                     \
  X(link_values, std::string, "bf16,2bit", Run,                                                    \
    optim::declared::link_values.range, optim::declared::link_values.help)                         \
  X(link_max_every, int64_t, 4, Run,                                                               \
    optim::declared::link_max_every.range, optim::declared::link_max_every.help)                   \
  X(link_probe_every, int64_t, 100, Run,                                                           \
    optim::declared::link_probe_every.range, optim::declared::link_probe_every.help)               \
  X(exchange_in_backward, bool, false, Run, anything(),                                            \
    "start each unit's exchange between nodes during the backward, as soon as its gradients are "  \
    "final (the same result as without; needs --clip 0 and --on-nonfinite stop; none starts on a " \
    "step that sums the shared --second-moment: by default from 4 replicas, every step)")          \
  /* ====== Topology ====== */                                                                     \
  X(ranks_per_node, int, 0, Run,                                                                   \
    Accepts(at_least(0, " (0: from MPI)")).from_env("FLEXDEMO_RANKS_PER_NODE"),                             \
    "ranks per node (0: from MPI)")                                                                \
  X(shard_size, int, 0, Run, at_least(0, " (0: the whole island)"),                                \
    "ranks per shard group, dividing the island's ranks (0: the island: the node unless "          \
    "--island-nodes)")                                                                             \
  X(island_nodes, int, 1, Run, at_least(1),                                                        \
    "nodes an island holds (consecutive nodes on a fast fabric): shard groups may span an "        \
    "island's nodes and the exchange between replicas runs between islands")                       \
  X(reshard, bool, true, Run, anything(),                                                          \
    "free gathered parameters after forward and recompute in backward")                            \
  /* ====== Devices ====== */                                                                      \
  X(device, DeviceKind, DeviceKind::Auto, Run, anything(),                                         \
    "cpu or cuda; each rank takes GPU local_rank % GPUs (auto: cuda when flexdemo is built with "  \
    "CUDA and a GPU is visible)")                                                                  \
  X(intra_backend, BackendKind, BackendKind::Auto, Run, anything(),                                \
    "collectives inside a node: mpi or nccl (auto: nccl on GPUs when no two ranks of the node "    \
    "share one, else mpi)")                                                                        \
  X(inter_backend, BackendKind, BackendKind::Auto, Run, anything(),                                \
    "collectives between nodes: mpi (through pinned host memory) or nccl (auto: mpi)")             \
  /* ====== Run ====== */                                                                          \
  X(eval_every, int64_t, 0, Run, at_least(0), "evaluate every N steps (0: only at the end)")       \
  X(eval_seqs, int64_t, 64, Run, at_least(1), "validation sequences per evaluation")               \
  X(log_every, int64_t, 10, Run, at_least(1), "log line every N steps (not a terminal)")           \
  X(progress, ProgressMode, ProgressMode::Auto, Run, anything(),                                   \
    "auto (a live line when stdout is a terminal), bar, or lines (log lines); under mpirun the "   \
    "ranks always see a terminal")                                                                 \
  X(out, std::string, "runs/latest", Run, anything(), "output folder")                             \
  X(seed, uint64_t, 1337, Model, anything(),                                                       \
    "seed of data order and initialisation, and with the rank of span corruption and dropout")     \
  X(threads, int, 1, Run, at_least(1), "intra-op threads per rank")                                \
  X(bf16, bool, false, Run, anything(), "bf16 autocast of the forward (weights stay float32)")     \
  X(check_replicas, int64_t, 0, Run, at_least(0),                                                  \
    "every N steps, stop if the replicas' parameters differ (0: off)")                             \
  X(on_nonfinite, NonFinitePolicy, NonFinitePolicy::Skip, Run, anything(),                         \
    "a NaN/Inf loss or gradient on any rank: skip the step on all ranks, or stop")                 \
  X(on_bad_peer, optim::PeerPolicy, optim::PeerPolicy::Drop, Run,                                  \
    optim::declared::peer_policy.range, optim::declared::peer_policy.help)                         \
  X(peer_scale_bound, double, 100.0, Run,                                                          \
    optim::declared::peer_scale_bound.range, optim::declared::peer_scale_bound.help)               \
  X(checkpoint_every, int64_t, 0, Run, at_least(0),                                                \
    "also checkpoint every N steps (0: only at the end)")                                          \
  X(keep_checkpoints, int64_t, 2, Run, at_least(1),                                                \
    "checkpoints kept in OUT/checkpoints/ (the newest ones)")                                      \
  X(resume, std::string, "", Unsaved, anything(),                                                  \
    "continue from a run folder's newest valid checkpoint, or from one checkpoint folder (same "   \
    "options; another topology: elastic); auto: --out's newest valid checkpoint when it has "     \
    "checkpoints, else a fresh start (one command line for the first start and every restart: "   \
    "flexdemo supervise, Slurm's requeue)")                                                        \
  X(comm_timeout, double, 60.0, Run, at_least(0, " seconds (0: wait forever)"),                    \
    "seconds a collective may take before the job stops with an error (a dead or hung rank); 0: "  \
    "wait forever")
// clang-format on

struct TrainConfig {
#define FLEXDEMO_FIELD(name, type, default_value, role, accepts, help) type name = default_value;
  FLEXDEMO_TRAIN_OPTIONS(FLEXDEMO_FIELD)
#undef FLEXDEMO_FIELD

  // Throws std::invalid_argument naming the bad option: every check that needs no data and no
  // other rank, so that bad input fails at once.
  void validate() const;
  // Fills in what defaults to the optimizer's choice (replicator, lr, beta1, the DeMo step's).
  void resolve();
};


// Whether an option's type is std::optional (unset: the optimizer's choice, until resolve()).
template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

// Calls visit(field, spec) for every option in declaration order (field typed as declared).
template <class Config, class Visitor>
void for_each_option(Config& config, Visitor&& visit) {
#define FLEXDEMO_VISIT(name, type, default_value, role, accepts, help) \
  visit(config.name, OptionSpec{#name, OptionRole::role, accepts, help, is_optional<type>::value});
  FLEXDEMO_TRAIN_OPTIONS(FLEXDEMO_VISIT)
#undef FLEXDEMO_VISIT
}

}  // namespace flexdemo::train

// ====== Name tables ======
namespace flexdemo {
template <>
struct NameTable<train::OptimizerKind> {
  static constexpr const char* what = "--optimizer";
  static constexpr std::pair<train::OptimizerKind, const char*> entries[] = {
      {train::OptimizerKind::FlexDemo, "flexdemo"},
      {train::OptimizerKind::FlexDemoAdamW, "flexdemo-adamw"},
      {train::OptimizerKind::AdamW, "adamw"},
      {train::OptimizerKind::Sgd, "sgd"}};
};
template <>
struct NameTable<train::TokenizerKind> {
  static constexpr const char* what = "--tokenizer";
  static constexpr std::pair<train::TokenizerKind, const char*> entries[] = {
      {train::TokenizerKind::Bpe, "bpe"}, {train::TokenizerKind::Bytes, "bytes"}};
};
template <>
struct NameTable<train::ProgressMode> {
  static constexpr const char* what = "--progress";
  static constexpr std::pair<train::ProgressMode, const char*> entries[] = {
      {train::ProgressMode::Auto, "auto"},
      {train::ProgressMode::Bar, "bar"},
      {train::ProgressMode::Lines, "lines"}};
};
template <>
struct NameTable<train::NonFinitePolicy> {
  static constexpr const char* what = "--on-nonfinite";
  static constexpr std::pair<train::NonFinitePolicy, const char*> entries[] = {
      {train::NonFinitePolicy::Skip, "skip"}, {train::NonFinitePolicy::Stop, "stop"}};
};
template <>
struct NameTable<train::DeviceKind> {
  static constexpr const char* what = "--device";
  static constexpr std::pair<train::DeviceKind, const char*> entries[] = {
      {train::DeviceKind::Auto, "auto"},
      {train::DeviceKind::Cpu, "cpu"},
      {train::DeviceKind::Cuda, "cuda"}};
};
template <>
struct NameTable<train::BackendKind> {
  static constexpr const char* what = "collective backend";
  static constexpr std::pair<train::BackendKind, const char*> entries[] = {
      {train::BackendKind::Auto, "auto"},
      {train::BackendKind::Mpi, "mpi"},
      {train::BackendKind::Nccl, "nccl"}};
};
}  // namespace flexdemo
