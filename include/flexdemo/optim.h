// flexdemo/optim.h — the DeMo / FlexDeMo optimizer over LibTorch parameters or shards of them.
// A step is: a replicator turns every tensor's gradient into an update direction that is
// identical on every replica (DeMo's compressed exchange by default, all of a step's payloads in
// one bucketed collective, or a few started in backward), then an inner optimizer (sign-SGD or
// AdamW) applies it.
#pragma once

#include "flexdemo/compress.h"
#include "flexdemo/dct.h"

#include "flexdemo/names.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace flexdemo::comm {
class Communicator;
}

namespace flexdemo::optim {

// How replicas exchange what they learnt each step.
enum class ReplicatorKind {
  Demo,    // DeMo: residual momentum, chunked-DCT top-k, all-gather, decode (default)
  Full,    // dense all-reduce average of the gradient: plain (HSDP) data parallelism
  None,    // no exchange: independent local training
  Random,  // a seeded random subset of rows (elements of vectors), dense-averaged, with residual
};

// How DeMo's replicas exchange their payloads.
enum class DemoExchange {
  AllGather,  // every replica gathers every other's payload: R - 1 payloads in, a node, a step
  Owners,     // each replica owns a share of the chunks: one all-to-all sends each owner its
              // chunks' coefficients, the owner keeps the top owner_topk of their mean, one
              // all-gather returns every owner's share (what an owner leaves out: owner_feedback):
              // at most about 2 (R - 1) / R payloads each way a node, whatever R is
};

// Where what an owner leaves out of its replicas' mean goes (DemoExchange::Owners).
enum class OwnerFeedback {
  Owner,    // a residual of the owner's own, over the chunks it owns: decayed as the senders'
            // are, the next mean added to it and its top owner_topk returned (error feedback at
            // the owner, as DoubleSqueeze's; docs/results/many-nodes.md)
  Senders,  // back into the residual of each replica that sent it (the state: residuals alone)
};

// Whose second moment the preconditioner divides a gradient by.
enum class SecondMoment {
  Own,     // each replica's own running mean square, per element (no bytes)
  Shared,  // the replicas' running mean of each tensor's row and column sums of g^2, factored as
           // Adafactor's (rows + cols floats a tensor summed over the replicas every
           // second_moment_every steps; docs/results/many-nodes.md)
  Auto,    // shared from kSharedSecondMomentReplicas replicas on, own below
};

// How the shared second moment's statistics cross between replicas.
enum class StatisticsEncoding {
  Fp32,  // as they are
  Bf16,  // each replica's and their sum rounded to bfloat16: half the bytes
  Log8,  // each replica's and their sum as 8-bit logarithms: a quarter (comm/rank_order_sum.h)
  Auto,  // log8 with the owners' exchange, fp32 with the all-gather
};

// From this many replicas on, second_moment auto shares the second moment: each replica's own
// comes from 1/R of the batch, and the gap to AdamW-HSDP grows with R (gpt-micro, 500 steps: own
// +0.47% at 4 replicas and +2.66% at 8, shared -0.60% and +0.38%; at 2 replicas both within
// 0.3%, where shared would cost about 0.6 payloads a node a step more: docs/results/
// many-nodes.md).
inline constexpr int64_t kSharedSecondMomentReplicas = 4;

// What `chosen` means on `replicas` replicas: auto resolved, the others as they are.
constexpr SecondMoment resolved_second_moment(SecondMoment chosen, int64_t replicas) {
  if (chosen != SecondMoment::Auto) return chosen;
  return replicas >= kSharedSecondMomentReplicas ? SecondMoment::Shared : SecondMoment::Own;
}

// What second_moment_values `chosen` means with `exchange`: auto resolved. The owners' exchange
// takes log8, which keeps it within two payloads a node at 8 nodes (fp32's statistics took it to
// 2.72) at no cost measured in loss; the all-gather fp32, whose bytes the statistics barely add
// to and whose loss log8 raised at 8 nodes (+0.71% against fp32's +0.47%, one run each:
// docs/results/many-nodes.md).
constexpr StatisticsEncoding resolved_statistics_values(StatisticsEncoding chosen,
                                                        DemoExchange exchange) {
  if (chosen != StatisticsEncoding::Auto) return chosen;
  return exchange == DemoExchange::Owners ? StatisticsEncoding::Log8 : StatisticsEncoding::Fp32;
}

// The per-chunk transform DeMo's residual is kept and selected in.
enum class Transform {
  Dct,   // the orthonormal chunked DCT-II (DeMo's)
  None,  // the samples themselves: top-k of the residual's own entries in each chunk (CPUs
         // only; the plain path: the fused kernels are the DCT's)
};

enum class InnerKind {
  Sgd,       // p -= lr * sign(direction) (DeMo's), or lr * direction with sign off
  AdamW,     // AdamW fed with sign(direction) or the direction (FlexDeMo's AdamW variant)
  Nesterov,  // SGD with Nesterov momentum, torch.optim.SGD(nesterov=True)'s formula, on
             // sign(direction) or the direction (CPUs only): the outer optimizer's
};

// What replicas do with a peer's payloads that fail the checks before decoding (a corrupt
// payload, non-finite values, values out of scale): stop the run, or leave that peer out of
// the mean, on every replica alike (each decides from the same gathered bytes).
enum class PeerPolicy { Stop, Drop };

// Whether the exchange's schedule follows the link (LinkBudget, flexdemo/link_budget.h).
enum class LinkBudgetMode {
  Off,   // the fixed topk, values and replicate_every
  Auto,  // top-k, values and interval chosen from the measured link and compute, re-measured
};

// ====== What a number option accepts ======
// Bounds (open or closed) and a note after them, as an error reads them: "{topk} must be >= 1,
// got 0", "{decay} must be in [0, 1), got 1", "{rms_cap} must be >= 0 (0: off), got -1". The
// command's own options use the same (flexdemo/train_options.h).
struct Range {
  std::optional<double> low, high;
  bool low_open = false, high_open = false;  // > instead of >=, < instead of <=
  const char* note = "";                     // after the bound: " (0: off)"
  bool holds(double v) const;
  std::string text() const;  // ">= 1", "> 0", "in [0, 1)", then the note
};
constexpr Range unbounded() {
  return {};
}
constexpr Range at_least(double low, const char* note = "") {
  return {low, std::nullopt, false, false, note};
}
constexpr Range above(double low) {
  return {low, std::nullopt, true, false, ""};
}
constexpr Range closed(double low, double high) {
  return {low, high, false, false, ""};
}
constexpr Range half_open(double low, double high) {  // [low, high)
  return {low, high, false, true, ""};
}
constexpr Range open_closed(double low, double high) {  // (low, high]
  return {low, high, true, false, ""};
}

// ====== The optimizer's options: declared once ======
// X(name, type, default, range, help): the field of OptimizerOptions, its default (the default
// step, FlexDeMo's: see presets below), what a number accepts, and its help, in which {name}
// names another option (each front door spells it its own way: --topk, compression_topk). The
// command's flags of the same names, config.json, the Python keywords and the tables in
// docs/options.md, docs/library.md and docs/python.md all take their range and help from here;
// validate() checks each range and the rules between options.
// Chunk geometry (chunk, chunk_mode) applies to whole parameters (the constructor taking
// tensors); OptimParams (e.g. shards) bring their own plans.
// clang-format off
#define FLEXDEMO_OPTIMIZER_OPTIONS(X)                                                              \
  /* ====== The step rule ====== */                                                              \
  X(inner, InnerKind, InnerKind::Sgd, optim::unbounded(),                                        \
    "the rule that applies the replicas' direction: sgd (by the direction, bounded, or its "     \
    "sign), adamw (AdamW fed with the direction or its sign), nesterov (CPUs only)")             \
  X(lr, double, 1e-3, optim::above(0),                                                           \
    "learning rate (the peak of a schedule); with {fold_lr} also the scale a gradient enters "   \
    "the residual with")                                                                         \
  X(weight_decay, double, 0.0, optim::at_least(0),                                               \
    "decoupled weight decay ({lr} x {weight_decay} < 1)")                                        \
  X(sign, bool, false, optim::unbounded(),                                                       \
    "step by the sign of the direction (DeMo's sign-SGD); off: by the direction itself (for "    \
    "the flexdemo step: the adaptive step, with {precondition}, {rms_cap} and no {fold_lr})")    \
  X(normalize, bool, false, optim::unbounded(),                                                  \
    "{sign} off: each chunk of the direction scaled to unit RMS (sign's step size, the "         \
    "direction's shape within the chunk)")                                                       \
  X(update_rms, double, 0.0, optim::at_least(0, " (0: off)"),                                    \
    "{sign} off: each tensor's update scaled to this RMS (the whole tensor's, over its "         \
    "shards) before the rate")                                                                   \
  X(step_bound, double, 0.0, optim::at_least(0, " (0: off)"),                                    \
    "{sign} off: each element of the update clamped to [-B, B] before the rate")                 \
  X(rms_cap, double, 1.0, optim::at_least(0, " (0: off)"),                                       \
    "{sign} off, the SGD rule (not AdamW's): each tensor's update whose RMS (the whole "         \
    "tensor's, over its shards) is above C scaled down to C before the rate, as Adafactor "      \
    "clips its update (the flexdemo step's default: 1 without {update_rms} or {normalize}, "     \
    "else 0)")                                                                                   \
  X(beta1, double, 0.9, optim::half_open(0, 1),                                                  \
    "AdamW's first-moment decay (0 for flexdemo-adamw: DeMo's residual is its momentum)")        \
  X(beta2, double, 0.999, optim::half_open(0, 1),                                                \
    "AdamW's second-moment decay and the preconditioner's")                                      \
  X(eps, double, 1e-8, optim::above(0), "AdamW's and the preconditioner's epsilon")              \
  X(momentum, double, 0.9, optim::half_open(0, 1), "{inner} nesterov: the momentum")             \
  /* ====== DeMo's compression ====== */                                                         \
  X(decay, double, 0.999, optim::half_open(0, 1), "DeMo's residual decay per step")              \
  X(fold_lr, bool, false, optim::unbounded(),                                                    \
    "scale each gradient by the step's {lr} as it enters DeMo's residual (the reference's); "    \
    "off: add it as it is, so a decaying schedule does not weight old gradients above new ones") \
  X(precondition, bool, true, optim::unbounded(),                                                \
    "divide each gradient by the root of its running mean square (AdamW's second moment: "       \
    "{beta2}, bias-corrected) before it enters DeMo's residual, each replica's own or shared "   \
    "({second_moment}; the flexdemo step's default: on without {inner_steps})")                  \
  X(second_moment, SecondMoment, SecondMoment::Auto, optim::unbounded(),                         \
    "{precondition}: whose second moment divides a gradient: own (each replica's, per element), " \
    "shared (the replicas' mean, factored into each tensor's row and column mean squares as "    \
    "Adafactor's and taken over the whole tensor: rows + cols floats a tensor between replicas)," \
    " or auto (shared from 4 replicas on, own below)")                                          \
  X(second_moment_every, int64_t, 1, optim::at_least(1),                                         \
    "{second_moment} shared (or auto, where it shares): sum the statistics over the replicas "   \
    "every this many steps (each replica adds its own in between)")                              \
  X(second_moment_values, StatisticsEncoding, StatisticsEncoding::Auto, optim::unbounded(),     \
    "{second_moment} shared (or auto, where it shares): the statistics' encoding between "       \
    "replicas: fp32, bf16 (half the bytes: each replica's statistics and their sum rounded to "  \
    "bfloat16), log8 (a quarter: each as a byte, the nearest eighth of an octave below the "     \
    "largest of its slice, within 4.4% each rounding) or auto (log8 with {demo_exchange} "       \
    "owners, fp32 with the all-gather)")                                                         \
  X(topk, int64_t, 112, optim::at_least(1),                                                      \
    "DCT coefficients kept per chunk (at most a chunk's)")                                       \
  X(transform, Transform, Transform::Dct, optim::unbounded(),                                    \
    "the per-chunk transform DeMo selects in: dct (DeMo's chunked DCT-II), or none (the "        \
    "residual's own entries; CPUs only, without the fused kernels)")                             \
  X(chunk, int64_t, 64, optim::at_least(1), "DCT chunk edge (of whole parameters)")              \
  X(chunk_mode, dct::ChunkMode, dct::ChunkMode::Divisor, optim::unbounded(),                     \
    "divisor (per dimension the largest divisor <= {chunk}, the reference's) or padded")         \
  X(values, compress::ValueEncoding, compress::ValueEncoding::Fp8, optim::unbounded(),           \
    "wire encoding of DeMo's kept values: fp32, bf16, int8, fp8, 2bit, 1bit")                    \
  X(fast_path, bool, true, optim::unbounded(),                                                   \
    "the fused kernels; off: the plain whole-tensor transforms (the reference they are tested "  \
    "against)")                                                                                  \
  /* ====== The exchange ====== */                                                               \
  X(replicator, ReplicatorKind, ReplicatorKind::Demo, optim::unbounded(),                        \
    "how replicas exchange: demo (compressed), full (dense all-reduce: HSDP), none, random")     \
  X(demo_exchange, DemoExchange, DemoExchange::AllGather, optim::unbounded(),                    \
    "DeMo's collectives between replicas: all-gather (every replica receives every other's "     \
    "payload) or owners (each replica owns a share of the chunks and keeps the top-k of their "  \
    "mean: about two payloads a node a step whatever the node count)")                           \
  X(owner_topk, int64_t, 0, optim::at_least(0, " (0: as many as fit in a payload's bytes)"),     \
    "{demo_exchange} owners: coefficients a chunk each owner returns (0: as many as fit, at "    \
    "{owner_values}, in the bytes of a replica's payload)")                                      \
  X(owner_values, compress::ValueEncoding, compress::ValueEncoding::TwoBit, optim::unbounded(),  \
    "{demo_exchange} owners: the value encoding of the owners' returned coefficients")           \
  X(owner_feedback, OwnerFeedback, OwnerFeedback::Owner, optim::unbounded(),                     \
    "{demo_exchange} owners: where what an owner leaves out of the replicas' mean goes: owner "  \
    "(a residual of the owner's own, decayed by {decay}, that the next mean adds to) or "       \
    "senders (back into the residuals of the replicas that sent it)")                           \
  X(replicate_every, int64_t, 1, optim::at_least(1),                                             \
    "exchange and update every N steps; the steps between fold their gradients in")              \
  X(overlap_step, bool, false, optim::unbounded(),                                               \
    "run each exchange through the next step and apply it there (one step stale), hiding it "    \
    "behind that step's forward and backward ({replicator} demo; CPUs only)")                    \
  X(random_fraction, double, 1.0 / 32, optim::open_closed(0, 1),                                 \
    "{replicator} random: the fraction of rows exchanged")                                       \
  X(seed, uint64_t, 0, optim::unbounded(),                                                       \
    "{replicator} random: the selection seed, the same on every replica")                        \
  /* ====== Checks of the peers' payloads (demo) ====== */                                       \
  X(peer_policy, PeerPolicy, PeerPolicy::Drop, optim::unbounded(),                               \
    "a peer whose payloads fail the checks (corrupt, non-finite or out of scale): drop (left "   \
    "out of the mean on every replica alike) or stop")                                           \
  X(peer_scale_bound, double, 100.0, optim::at_least(0, " (0: no scale check)"),                 \
    "out of scale: a tensor's values' norm above this many times the replicas' lower median "    \
    "(0 or > 1)")                                                                                \
  /* ====== Many local steps (DiLoCo's outer loop) ====== */                                     \
  X(inner_steps, int64_t, 1, optim::at_least(1),                                                 \
    "take H local steps on each replica, then exchange the parameters' change since the last "   \
    "exchange through {replicator} and apply the mean with the outer step (DiLoCo's outer "      \
    "loop; 1: exchange every step)")                                                             \
  X(outer_lr, double, 1.0, optim::above(0),                                                      \
    "{inner_steps} > 1: the outer step's rate (1 with momentum 0: the replicas' parameters "     \
    "averaged)")                                                                                 \
  X(outer_momentum, double, 0.0, optim::half_open(0, 1),                                         \
    "{inner_steps} > 1: the outer step's Nesterov momentum (DiLoCo's 0.9 with {outer_lr} 0.7)")  \
  X(outer_sign, bool, false, optim::unbounded(),                                                 \
    "{inner_steps} > 1: step by the sign of the replicas' mean change (then {outer_lr} is "      \
    "every parameter's step)")                                                                   \
  /* ====== The link budget (flexdemo/link_budget.h: read by a LinkBudget, not the step) ====== */\
  X(link_budget, LinkBudgetMode, LinkBudgetMode::Off, optim::unbounded(),                        \
    "auto: measure the link between nodes and a step's compute, and choose top-k, values and "   \
    "the exchange interval (within the {link_min_topk}, {link_max_topk}, {link_values} and "     \
    "{link_max_every} bounds) so that the exchange (its payloads, and with the shared "          \
    "{second_moment} the statistics' sums) stays hidden behind compute (under {overlap_step}) "   \
    "or costs at most a tenth of a step; re-measured every {link_probe_every} steps (demo "      \
    "replicator; off: the fixed {topk}, {values}, {replicate_every})")                           \
  X(link_min_topk, int64_t, 8, optim::at_least(1), "{link_budget} auto: the smallest top-k chosen") \
  X(link_max_topk, int64_t, 128, optim::at_least(1), "{link_budget} auto: the largest top-k chosen") \
  X(link_values, std::string, "bf16,2bit", optim::unbounded(),                                   \
    "{link_budget} auto: the value encodings it may choose, comma-separated, preferred first")   \
  X(link_max_every, int64_t, 4, optim::at_least(1),                                              \
    "{link_budget} auto: the longest exchange interval chosen (in steps)")                       \
  X(link_probe_every, int64_t, 100, optim::at_least(1),                                          \
    "{link_budget} auto: steps between two measurements of the link (and choices)")
// clang-format on

// Each option's range and help as compile-time constants (optim::declared::topk.help), so that
// another declaration can take them (the command's flags: flexdemo/train_options.h).
struct Declared {
  const char* name;
  Range range;
  const char* help;
};
namespace declared {
#define FLEXDEMO_OPTIMIZER_DECLARED(name, type, default_value, range, help) \
  inline constexpr Declared name{#name, range, help};
FLEXDEMO_OPTIMIZER_OPTIONS(FLEXDEMO_OPTIMIZER_DECLARED)
#undef FLEXDEMO_OPTIMIZER_DECLARED
}  // namespace declared

struct OptimizerOptions {
#define FLEXDEMO_OPTIMIZER_FIELD(name, type, default_value, range, help) \
  type name = default_value;
  FLEXDEMO_OPTIMIZER_OPTIONS(FLEXDEMO_OPTIMIZER_FIELD)
#undef FLEXDEMO_OPTIMIZER_FIELD

  void validate() const;  // throws OptionsError naming the bad option
};

// The steps a front door offers by name, each the defaults with a few options changed:
//   flexdemo        the default step: each gradient preconditioned, entering the residual
//                   unscaled, top-k 112 at fp8, the decoded direction applied with its RMS capped
//                   at 1 (docs/results/loss-parity.md)
//   flexdemo-adamw  AdamW on the direction (beta1 0: DeMo's residual is the momentum), top-k 32
//                   at bf16, lr folded in, no preconditioning
//   demo            the reference DeMo: sign-SGD, top-k 32 at fp32, lr folded in, no
//                   preconditioning
enum class Preset { FlexDemo, FlexDemoAdamW, DeMo };
OptimizerOptions preset(Preset p);
// The step an inner rule brings its defaults from, where no step is named: flexdemo-adamw for
// adamw, flexdemo otherwise.
Preset preset_for(InnerKind inner);

// The options a front door asks for: preset p's, then each given (name, value) set, then the
// options that follow from others resolved where not given: rms_cap 1 only for the flexdemo step
// with sign off, no update_rms and no normalize (else 0); precondition only with inner_steps 1;
// topk at most chunk x chunk. Validated (OptionsError; also a topk given above chunk x chunk,
// which the library alone would clamp). The command's flags and Python's keywords both come
// here, so the three doors default to the same step.
OptimizerOptions options_for(Preset p,
                             const std::vector<std::pair<std::string, std::string>>& given);

// Every option by name, as declared above.
struct OptionInfo {
  std::string name;
  std::string type;  // double, int, bool, or the accepted words ("sgd|adamw|nesterov")
  Range range;
  std::string help;  // other options named {name}: see spell()
};
std::vector<OptionInfo> option_infos();
// text with each {name} replaced by spelling(name): how a front door writes an option's name in
// its help and errors (--weight-decay, compression_topk).
std::string spell(const std::string& text,
                  const std::function<std::string(const std::string&)>& spelling);
// An option's value as a word ("0.001", "true", "fp8") and back; set_option throws OptionsError
// naming an unknown option or a value of the wrong kind (the ranges are validate()'s).
std::string option_value(const OptimizerOptions& o, const std::string& name);
void set_option(OptimizerOptions& o, const std::string& name, const std::string& value);

// A bad OptimizerOptions. The message names the options as {name} (their field and config.json
// names); what() spells them as they are, after "optimizer: ". A command spells them in its own
// words instead (flexdemo: --weight-decay), so every rule has one place and one message.
class OptionsError : public std::invalid_argument {
 public:
  explicit OptionsError(std::string text);
  std::string spelled(const std::function<std::string(const std::string&)>& name) const;

 private:
  std::string text_;
};

// A peer's payload for one tensor that failed the checks (PeerPolicy).
struct PeerFault {
  enum class Kind { Corrupt, NonFinite, OutOfScale };
  Kind kind = Kind::Corrupt;
  int replica = 0;     // the sender's rank in the replica group
  size_t tensor = 0;   // its index among the tensors given to the optimizer
  double ratio = 0.0;  // OutOfScale: its values' norm over the lower median of the replicas'
  std::string detail;  // Corrupt: what the wire format's validation found
  std::string describe() const;  // e.g. "values 935x the replicas' lower median norm"
};
// Raised by Optimizer::step() under PeerPolicy::Stop, on every replica alike.
class PeerFaultError : public std::runtime_error {
 public:
  explicit PeerFaultError(PeerFault fault);
  const PeerFault& fault() const { return fault_; }

 private:
  PeerFault fault_;
};

// A tensor the optimizer updates: the first plan.numel() elements of `leaf` (row-major), whose
// gradient autograd leaves in leaf.grad(). For a whole parameter, leaf is the parameter and plan
// its chunk plan; for a shard, leaf is the shard's storage and plan the shard's part of the
// parameter's chunk grid (see shard.h).
struct OptimParam {
  at::Tensor leaf;
  dct::ChunkPlan plan;
};

// What each exchange sends and how often: the options' topk, values and replicate_every until
// Optimizer::set_schedule changes them between steps (--link-budget auto).
struct ExchangeSchedule {
  int64_t topk = 32;
  compress::ValueEncoding values = compress::ValueEncoding::Fp32;
  int64_t every = 1;  // exchange every `every` steps, the steps between folding into the state
  bool operator==(const ExchangeSchedule& o) const {
    return topk == o.topk && values == o.values && every == o.every;
  }
  bool operator!=(const ExchangeSchedule& o) const { return !(*this == o); }
};

// Exchanges so far, and the steps folded into the state since the last one.
struct ExchangeCounters {
  int64_t exchanges = 0;
  int64_t folded = 0;
};

// What one exchange puts on the wire from this replica (the same every exchange, until the
// schedule changes).
struct ExchangeTraffic {
  uint64_t wire_bytes = 0;        // payload of one exchange: all tensors, headers included
  int64_t kept_coefficients = 0;  // Demo: sum over tensors of chunks * k
  int64_t params = 0;             // elements covered
};

class Optimizer {
 public:
  // Whole parameters (chunk plans from their shapes). replica_group: the ranks holding the same
  // parameters; nullptr means one replica (nothing is sent, but DeMo's payload is still encoded
  // and decoded, so the numbers match a multi-replica run). shard_group: where the parameters
  // are shards of larger tensors, the ranks holding the other shards (every rank of it gives the
  // same number of tensors, an empty shard included), over which a tensor's RMS is taken for
  // update_rms and rms_cap (an all-gather of two doubles a tensor each applied step, two with
  // overlap_step), so the step does not depend on where the shards are cut; nullptr or a group
  // of one: each tensor is whole here.
  Optimizer(std::vector<at::Tensor> params, OptimizerOptions options,
            std::shared_ptr<comm::Communicator> replica_group = nullptr,
            std::shared_ptr<comm::Communicator> shard_group = nullptr);
  // Explicit plans, e.g. this rank's shards.
  Optimizer(std::vector<OptimParam> params, OptimizerOptions options,
            std::shared_ptr<comm::Communicator> replica_group,
            std::shared_ptr<comm::Communicator> shard_group = nullptr);
  ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One step from the gradients (a missing gradient counts as zero). Collective over the
  // replica group on exchange steps: every replica calls it with the same shapes and options.
  void step();
  // Optional, after the backward has made these tensors' gradients final and before step():
  // their exchange may start now, non-blocking, while the rest of the backward runs (indices
  // as given to the constructor; each call is one collective). step() starts the tensors not
  // started, completes every exchange and applies it: the result is the same as step() alone.
  // A hint, acted on only by the demo replicator without overlap_step, on exchange steps.
  // Every replica makes the same calls in the same order; the gradients must not change after
  // this call until step().
  void start_exchange(const std::vector<size_t>& tensors);
  // The same two with the gradients given instead of read from the leaves (a binding's, e.g.
  // FSDP2's local shards): grads[i] is tensor i's (indices as given to the constructor; at least
  // plan.numel() elements, row-major; undefined = zero); start_exchange's grads[k] is
  // tensors[k]'s.
  void step(const std::vector<at::Tensor>& grads);
  void start_exchange(const std::vector<size_t>& tensors, const std::vector<at::Tensor>& grads);
  void zero_grad();  // zeroes the gradients (keeps their storage)

  const OptimizerOptions& options() const;
  void set_lr(double lr);  // the learning rate of this and later steps (a schedule)
  ExchangeTraffic traffic() const;
  int64_t steps() const;  // step() calls so far
  // The schedule the exchanges follow, as last set. set_schedule, between steps and alike on
  // every replica: `every` counts at once (the next step exchanges if as many steps have been
  // folded in); top-k and values from the next payload encoded (an exchange in flight under
  // overlap_step is decoded as it was sent). Demo replicator and inner_steps 1 only.
  ExchangeSchedule schedule() const;
  void set_schedule(const ExchangeSchedule& schedule);
  // The top-k and values of the payloads last encoded (under overlap_step: the exchange in
  // flight), with the interval set. A checkpoint restores this schedule before its state (the
  // payloads in flight are sized by it), then schedule().
  ExchangeSchedule schedule_in_flight() const;
  ExchangeCounters counters() const;
  // Waits until the exchange in flight (overlap_step) has arrived; it is still applied at the
  // next step, as always. A no-op when nothing is in flight.
  void wait_in_flight();
  // The peers' payloads that failed the checks since the last call (PeerPolicy::Drop: each
  // was left out of its exchange's mean), in the order found: the same on every replica.
  std::vector<PeerFault> take_peer_faults();
  // A test aid (FLEXDEMO_INJECT_PAYLOAD): this replica's payloads of the next exchange are
  // tampered as compress::tamper_payload does after they are encoded (Demo only).
  void tamper_next_exchange(compress::Tamper how, double factor = 1.0);
  // What one exchange of `schedule` would put on the wire from this rank (headers included).
  uint64_t wire_bytes(const ExchangeSchedule& schedule) const;
  // What the link between replicas carries for one exchange of `schedule`, as the bytes a rank
  // of an all-gather sends each other rank: wire_bytes, plus the shared second moment's sums
  // over the schedule's steps (SecondMoment::Shared). What the link budget weighs.
  double link_bytes(const ExchangeSchedule& schedule) const;
  // This rank's optimizer state (residuals, accumulators, AdamW moments) by name; the tensors
  // share storage with the optimizer, so a checkpoint loads by copying into them, then calls
  // restore_steps with the number of steps taken. A tensor's state is named "what.i", i the
  // tensor's index among those given (an empty shard has none; the exchange's own state, such
  // as "owner_replicas", has no index), shaped as its chunk plan
  // [rows, cols] (DeMo's residuals: [padded_rows, padded_cols]).
  std::vector<std::pair<std::string, at::Tensor>> state_tensors() const;
  // The fixed schedule's counters follow from the steps; a schedule that changed (set_schedule)
  // needs them given.
  void restore_steps(int64_t steps);
  void restore_steps(int64_t steps, ExchangeCounters counters);
  int64_t state_bytes() const;  // of state_tensors()
  const dct::ChunkPlan& chunk_plan(size_t i) const;
  // Demo: parameter i's residual momentum in the DCT domain (block layout, see dct.h).
  const at::Tensor& residual(size_t i) const;
  // What is identical on every replica after a step: the parameters ([rows, cols] views), or
  // with --overlap-step and the SGD rule the committed parameters (the ones in the model also carry
  // this replica's preview of the update in flight), or with inner_steps > 1 the parameters of
  // the last exchange.
  std::vector<at::Tensor> replicated_params() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ====== Gradient utilities ======
// Whether every defined gradient of `params` is finite; whether every defined tensor is (a pass
// of the CPU kernels over float32 ones: what the trainer and Python's FlexDeMo check before a
// step).
bool all_finite(const std::vector<OptimParam>& params);
bool all_finite(const std::vector<at::Tensor>& tensors);
// Scales the gradients so that their norm is at most max_norm, the norm taken over the
// gradients of `params` on every rank of `group` (e.g. the shard group: together one replica's
// whole gradient); sums in float64. Collective over group. Returns the norm before scaling.
double clip_grad_norm(const std::vector<OptimParam>& params, double max_norm,
                      comm::Communicator& group);

}  // namespace flexdemo::optim

namespace flexdemo {
template <>
struct NameTable<optim::ReplicatorKind> {
  static constexpr const char* what = "replicator";
  static constexpr std::pair<optim::ReplicatorKind, const char*> entries[] = {
      {optim::ReplicatorKind::Demo, "demo"},
      {optim::ReplicatorKind::Full, "full"},
      {optim::ReplicatorKind::None, "none"},
      {optim::ReplicatorKind::Random, "random"}};
};

template <>
struct NameTable<optim::DemoExchange> {
  static constexpr const char* what = "DeMo exchange";
  static constexpr std::pair<optim::DemoExchange, const char*> entries[] = {
      {optim::DemoExchange::AllGather, "all-gather"}, {optim::DemoExchange::Owners, "owners"}};
};

template <>
struct NameTable<optim::OwnerFeedback> {
  static constexpr const char* what = "owner feedback";
  static constexpr std::pair<optim::OwnerFeedback, const char*> entries[] = {
      {optim::OwnerFeedback::Owner, "owner"}, {optim::OwnerFeedback::Senders, "senders"}};
};

template <>
struct NameTable<optim::SecondMoment> {
  static constexpr const char* what = "second moment";
  static constexpr std::pair<optim::SecondMoment, const char*> entries[] = {
      {optim::SecondMoment::Own, "own"},
      {optim::SecondMoment::Shared, "shared"},
      {optim::SecondMoment::Auto, "auto"}};
};

template <>
struct NameTable<optim::StatisticsEncoding> {
  static constexpr const char* what = "statistics encoding";
  static constexpr std::pair<optim::StatisticsEncoding, const char*> entries[] = {
      {optim::StatisticsEncoding::Fp32, "fp32"},
      {optim::StatisticsEncoding::Bf16, "bf16"},
      {optim::StatisticsEncoding::Log8, "log8"},
      {optim::StatisticsEncoding::Auto, "auto"}};
};

template <>
struct NameTable<optim::PeerPolicy> {
  static constexpr const char* what = "peer policy";
  static constexpr std::pair<optim::PeerPolicy, const char*> entries[] = {
      {optim::PeerPolicy::Drop, "drop"}, {optim::PeerPolicy::Stop, "stop"}};
};

template <>
struct NameTable<optim::LinkBudgetMode> {
  static constexpr const char* what = "link budget";
  static constexpr std::pair<optim::LinkBudgetMode, const char*> entries[] = {
      {optim::LinkBudgetMode::Off, "off"}, {optim::LinkBudgetMode::Auto, "auto"}};
};

template <>
struct NameTable<optim::Transform> {
  static constexpr const char* what = "transform";
  static constexpr std::pair<optim::Transform, const char*> entries[] = {
      {optim::Transform::Dct, "dct"}, {optim::Transform::None, "none"}};
};

template <>
struct NameTable<optim::Preset> {
  static constexpr const char* what = "step";
  static constexpr std::pair<optim::Preset, const char*> entries[] = {
      {optim::Preset::FlexDemo, "flexdemo"},
      {optim::Preset::FlexDemoAdamW, "flexdemo-adamw"},
      {optim::Preset::DeMo, "demo"}};
};

template <>
struct NameTable<optim::InnerKind> {
  static constexpr const char* what = "inner optimizer";
  static constexpr std::pair<optim::InnerKind, const char*> entries[] = {
      {optim::InnerKind::Sgd, "sgd"},
      {optim::InnerKind::AdamW, "adamw"},
      {optim::InnerKind::Nesterov, "nesterov"}};
};
}  // namespace flexdemo
