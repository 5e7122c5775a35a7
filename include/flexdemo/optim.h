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
              // all-gather returns every owner's share (what an owner leaves out goes back into
              // its senders' residuals): at most about 2 (R - 1) / R payloads each way a node,
              // whatever R is
};

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

struct OptimizerOptions {
  // ====== Inner optimizer ======
  double lr = 1e-3;           // learning rate (> 0); DeMo also folds it into the residual
  double weight_decay = 0.0;  // decoupled, >= 0 and lr * weight_decay < 1
  bool sign = true;           // apply sign(direction) instead of the direction
  bool normalize = false;     // sign off: each chunk of the direction scaled to unit RMS (the
                              // size of sign's step, the direction's shape within the chunk)
  double update_rms = 0.0;    // sign off, > 0: each tensor's update (this rank's share of it)
                              // scaled to this RMS before the rate (0: off)
  double step_bound = 0.0;    // sign off, > 0: each element of the update clamped to
                              // [-step_bound, step_bound] before the rate (0: off)
  double rms_cap = 0.0;       // sign off, > 0: each tensor's update (this rank's share) whose
                              // RMS is above rms_cap scaled down to it before the rate
                              // (Adafactor's update clipping; 0: off)
  InnerKind inner = InnerKind::Sgd;
  double beta1 = 0.9;     // AdamW, in [0, 1)
  double beta2 = 0.999;   // AdamW, in [0, 1)
  double eps = 1e-8;      // AdamW, > 0
  double momentum = 0.9;  // Nesterov, in [0, 1)
  // ====== DeMo compression ======
  double decay = 0.999;       // residual decay, in [0, 1)
  bool fold_lr = true;        // residual += lr * gradient (the reference's); false: += gradient, so
                              // a decaying schedule does not weight old gradients above new ones
  bool precondition = false;  // each gradient divided by the root of its running mean square
                              // (AdamW's: beta2, bias-corrected, eps) before it enters the
                              // replicator; the mean square is this replica's own (inner_steps 1)
  int64_t topk = 32;          // coefficients kept per chunk (> 0; clamped to the chunk)
  Transform transform = Transform::Dct;
  // The chunk geometry of whole parameters (the constructor taking tensors); given OptimParams
  // (e.g. shards) bring their own plans and these two are not used.
  int64_t chunk = 64;  // target chunk edge (> 0)
  dct::ChunkMode chunk_mode = dct::ChunkMode::Divisor;
  compress::ValueEncoding values = compress::ValueEncoding::Fp32;  // wire value encoding
  bool fast_path = true;  // sparse-aware decode; false: the plain whole-tensor transforms (the
                          // reference the fast path is tested against)
  // ====== Exchange ======
  ReplicatorKind replicator = ReplicatorKind::Demo;
  DemoExchange demo_exchange = DemoExchange::AllGather;  // Demo: the collectives
  // Owners: what an owner returns a chunk. owner_topk 0: as many coefficients as fit, at
  // owner_values, in the bytes of a replica's payload (top-k 32 at bf16: 104 at 2-bit values).
  int64_t owner_topk = 0;  // >= 0
  compress::ValueEncoding owner_values = compress::ValueEncoding::TwoBit;
  int64_t replicate_every = 1;        // exchange and update every N steps (>= 1); the steps in
                                      // between only fold their gradients into the state
  bool overlap_step = false;          // Demo: the exchange runs non-blocking through the next
                                      // step and its update is applied there (one step stale);
                                      // with sign-SGD the replica's own part of it is applied
                                      // at once as a preview, replaced when the update arrives
  double random_fraction = 1.0 / 32;  // Random: fraction of rows exchanged, in (0, 1]
  uint64_t seed = 0;                  // Random: selection seed, the same on every replica
  // ====== Checks of the peers' payloads (Demo) ======
  PeerPolicy peer_policy = PeerPolicy::Drop;
  // A tensor's payload whose values' norm exceeds this many times the lower median of the
  // replicas' norms for that tensor is out of scale (> 1; 0: no scale check). With two
  // replicas the lower median is the smaller norm. Healthy replicas' ratios reached 17.6 on a
  // LayerNorm vector early in training (docs/reliability.md), so the default leaves room.
  double peer_scale_bound = 100.0;
  // ====== Many local steps (DiLoCo's outer loop) ======
  // inner_steps > 1: every step is a local step of the inner optimizer on this replica's own
  // gradient (nothing crosses the replica group); every inner_steps steps, the parameters'
  // change since the last exchange (the pseudo-gradient, last minus now) goes through the
  // replicator as a gradient would (with lr 1: DeMo's residual, transform, top-k and encoding),
  // and the outer optimizer applies the replicas' mean to the parameters of the last exchange,
  // identically on every replica; every replica then continues from them.
  int64_t inner_steps = 1;  // >= 1; > 1 excludes replicate_every > 1 and overlap_step
  // The defaults average the replicas' parameters (lr 1, momentum 0); DiLoCo's 0.7 and 0.9
  // trained worse at H = 10 on gpt-micro (docs/results/fewer-bits.md).
  double outer_lr = 1.0;        // > 0
  double outer_momentum = 0.0;  // Nesterov's, in [0, 1) (0: plain SGD)
  bool outer_sign = false;      // step by sign(mean) instead of the mean: outer_lr is then the
                                // step of every parameter (e.g. inner_steps * lr)

  void validate() const;  // throws OptionsError naming the bad option
};

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
  // and decoded, so the numbers match a multi-replica run).
  Optimizer(std::vector<at::Tensor> params, OptimizerOptions options,
            std::shared_ptr<comm::Communicator> replica_group = nullptr);
  // Explicit plans, e.g. this rank's shards.
  Optimizer(std::vector<OptimParam> params, OptimizerOptions options,
            std::shared_ptr<comm::Communicator> replica_group);
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
  // This rank's optimizer state (residuals, accumulators, AdamW moments) by name; the tensors
  // share storage with the optimizer, so a checkpoint loads by copying into them, then calls
  // restore_steps with the number of steps taken. A tensor's state is named "what.i", i the
  // tensor's index among those given (an empty shard has none), shaped as its chunk plan
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
// Whether every defined gradient of `params` is finite.
bool all_finite(const std::vector<OptimParam>& params);
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
struct NameTable<optim::PeerPolicy> {
  static constexpr const char* what = "peer policy";
  static constexpr std::pair<optim::PeerPolicy, const char*> entries[] = {
      {optim::PeerPolicy::Drop, "drop"}, {optim::PeerPolicy::Stop, "stop"}};
};

template <>
struct NameTable<optim::Transform> {
  static constexpr const char* what = "transform";
  static constexpr std::pair<optim::Transform, const char*> entries[] = {
      {optim::Transform::Dct, "dct"}, {optim::Transform::None, "none"}};
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
