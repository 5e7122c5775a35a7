// FlexDeMo on 4 real ranks as 2 nodes x 2: topology checks, shard-size invariance, HSDP against a
// single-process AdamW, bit-identical replicas, and state and traffic against closed forms.
#include "closed_form.h"
#include "test_mpi.h"

#include "flexdemo/shard.h"
#include "flexdemo/topology.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <cstdio>
#include <tuple>

using namespace flexdemo;

namespace {

constexpr int64_t kIn = 16, kHidden = 32, kWide = 64, kOut = 8, kBatch = 16;

// A small residual MLP as four units. The sharded model and the single-process reference run
// these same functions on full parameters.
at::Tensor embed(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& in) {
  return at::tanh(at::linear(in[0], p[0], p[1]));
}
at::Tensor block(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& in) {
  return in[0] + at::linear(at::tanh(at::linear(in[0], p[0], p[1])), p[2], p[3]);
}
at::Tensor head(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& in) {
  return at::linear(in[0], p[0], p[1]);
}
const std::vector<shard::UnitFn> kUnitFns = {embed, block, block, head};

std::vector<std::vector<at::Tensor>> initial_params() {
  at::manual_seed(5);
  auto w = [](int64_t o, int64_t i) { return at::randn({o, i}) / std::sqrt(double(i)); };
  auto b = [](int64_t o) { return at::randn({o}) * 0.1; };
  return {{w(kHidden, kIn), b(kHidden)},
          {w(kWide, kHidden), b(kWide), w(kHidden, kWide), b(kHidden)},
          {w(kWide, kHidden), b(kWide), w(kHidden, kWide), b(kHidden)},
          {w(kOut, kHidden), b(kOut)}};
}

// The global batch of a step: the same on every rank.
std::pair<at::Tensor, at::Tensor> global_batch(int step) {
  at::Generator gen = at::detail::createCPUGenerator(1000 + step);
  at::Tensor x = at::randn({kBatch, kIn}, gen);
  at::Tensor y = at::randn({kBatch, kOut}, gen);
  return {x, y};
}

// This rank's rows: its replica's part of the global batch, then its shard rank's part of that.
at::Tensor rank_rows(const at::Tensor& t, const comm::Topology& topo) {
  const int64_t per_replica = t.size(0) / topo.replicas;
  const int64_t per_rank = per_replica / topo.shard_size;
  return t.narrow(0, topo.replica_rank * per_replica + topo.shard_rank * per_rank, per_rank);
}

struct ShardedMlp {
  std::vector<std::unique_ptr<shard::ShardedUnit>> units;

  ShardedMlp(const comm::Topology& topo, const optim::OptimizerOptions& o, bool reshard = true) {
    shard::ShardOptions so;
    so.chunk = o.chunk;
    so.chunk_mode = o.chunk_mode;
    so.reshard_after_forward = reshard;
    const auto init = initial_params();
    for (size_t u = 0; u < init.size(); ++u) {
      units.push_back(std::make_unique<shard::ShardedUnit>("unit" + std::to_string(u), init[u],
                                                           topo.shard_group, so));
    }
  }
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y) {
    at::Tensor h = x;
    for (size_t u = 0; u < units.size(); ++u) h = units[u]->forward(kUnitFns[u], {h});
    return at::mse_loss(h, y);
  }
  std::vector<optim::OptimParam> optim_params() const { return shard::optim_params(units); }
  std::vector<at::Tensor> full_params() const {
    std::vector<at::Tensor> all;
    for (const auto& u : units) {
      for (auto& p : u->gather()) all.push_back(p);
    }
    return all;
  }
  int64_t param_and_grad_bytes() const {
    int64_t bytes = 0;
    for (const auto& u : units) bytes += u->param_bytes() + u->grad_bytes();
    return bytes;
  }
};

// 2 nodes x 2 ranks, shard groups of 2.
comm::Topology two_nodes_of_two() {
  return comm::make_topology(test_world(), {2, 2});
}
// 2 nodes x 1 rank, shard groups of 1: ranks {0, 2} and {1, 3} each form such a world.
comm::Topology two_nodes_of_one() {
  auto world = test_world();
  return comm::make_topology(world->split(world->rank() % 2, world->rank() / 2), {1, 1});
}

optim::OptimizerOptions demo_options() {
  optim::OptimizerOptions o = optim::preset(optim::Preset::DeMo);
  o.lr = 0.01;
  o.decay = 0.9;
  o.topk = 4;
  o.chunk = 8;
  return o;
}

// Trains for `steps` on the global batches; returns the model. With micro_batches M, each rank
// takes its rows in M equal parts, each loss scaled by 1 / M. For M = 2 a shard group of 1 then
// computes the gradient of a group of 2 ranks bit for bit: the same matmuls on the same rows, a
// sum of two terms is the same in either order, and scaling by 1/2 is exact (the group's Avg
// divides by 2 after its sum). Other M need not sum in MPI's order.
// The optimizer takes the shard group, as the trainer's does, unless shard_group is false.
std::unique_ptr<ShardedMlp> train(const comm::Topology& topo, const optim::OptimizerOptions& o,
                                  int steps, optim::Optimizer** optimizer_out = nullptr,
                                  int micro_batches = 1, bool shard_group = true) {
  auto model = std::make_unique<ShardedMlp>(topo, o);
  static std::unique_ptr<optim::Optimizer> optimizer;  // outlives the call for the caller
  optimizer = std::make_unique<optim::Optimizer>(model->optim_params(), o, topo.replica_group,
                                                 shard_group ? topo.shard_group : nullptr);
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = global_batch(step);
    optimizer->zero_grad();
    const at::Tensor xs = rank_rows(x, topo), ys = rank_rows(y, topo);
    const int64_t rows = xs.size(0) / micro_batches;
    for (int m = 0; m < micro_batches; ++m) {
      (model->loss(xs.narrow(0, m * rows, rows), ys.narrow(0, m * rows, rows)) /
       double(micro_batches)).backward();
    }
    optimizer->step();
  }
  if (optimizer_out) *optimizer_out = optimizer.get();
  return model;
}

double max_relative_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = b[i].abs().max().item<double>();
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

void report(const char* what, double value) {
  if (test_world()->rank() == 0) std::printf("  [measured] %s: %g\n", what, value);
}

}  // namespace

TEST(Topology, BuildsShardAndReplicaGroups) {
  comm::Topology t = two_nodes_of_two();
  const int r = test_world()->rank();
  EXPECT_EQ(t.nodes, 2);
  EXPECT_EQ(t.shard_size, 2);
  EXPECT_EQ(t.replicas, 2);
  EXPECT_EQ(t.node, r / 2);
  EXPECT_EQ(t.shard_rank, r % 2);
  EXPECT_EQ(t.shard_group->size(), 2);
  EXPECT_EQ(t.replica_group->size(), 2);
  EXPECT_EQ(t.replica_group->rank(), r / 2);

  comm::Topology groups = comm::make_topology(test_world(), {2, 1});  // 2 shard groups per node
  EXPECT_EQ(groups.replicas, 4);
  EXPECT_EQ(groups.replica_group->size(), 4);
  EXPECT_EQ(groups.shard_group->size(), 1);

  // Islands: 4 nodes of 1 rank in 2 islands of 2, shard groups spanning each island's nodes:
  // ranks {0,1} and {2,3} shard, {0,2} and {1,3} replicate (a replica: an island).
  comm::Topology islands = comm::make_topology(test_world(), {1, 0, 2});
  EXPECT_EQ(islands.nodes, 4);
  EXPECT_EQ(islands.islands, 2);
  EXPECT_EQ(islands.island, r / 2);
  EXPECT_EQ(islands.shard_size, 2);  // the whole island
  EXPECT_EQ(islands.shard_rank, r % 2);
  EXPECT_EQ(islands.replica_rank, r / 2);
  EXPECT_EQ(islands.shard_group->size(), 2);
  EXPECT_EQ(islands.replica_group->rank(), r / 2);
  EXPECT_EQ(islands.describe(), "2 islands x 2 nodes x 1 rank, shard size 2, 2 replicas");
  // One island of all 4 nodes, shard size 2: 2 shard groups inside it, replicating.
  comm::Topology one = comm::make_topology(test_world(), {1, 2, 4});
  EXPECT_EQ(one.islands, 1);
  EXPECT_EQ(one.replicas, 2);
  EXPECT_EQ(one.shard_rank, r % 2);
  EXPECT_EQ(one.replica_rank, r / 2);

  comm::Topology host = comm::make_topology(test_world(), {});  // MPI: one host here
  EXPECT_EQ(host.nodes, 1);
  EXPECT_EQ(host.shard_size, 4);
  EXPECT_EQ(host.describe(), "1 node x 4 ranks, shard size 4, 1 replica");
}

TEST(Topology, BadTopologyFailsOnEveryRank) {
  auto world = test_world();
  auto expect_error = [&](comm::TopologyOptions o, const std::string& what) {
    try {
      comm::make_topology(world, o);
      ADD_FAILURE() << "accepted a bad topology: " << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_error({3, 0}, "does not divide into nodes of 3");
  expect_error({2, 3}, "--shard-size 3 does not divide the 2 ranks per node");
  expect_error({2, -1}, "--shard-size must be >= 1");
  expect_error({0, world->rank() == 0 ? 1 : 2}, "ranks disagree on --shard-size");
  expect_error({1, 0, 3}, "--island-nodes 3 does not divide the 4 nodes");
  expect_error({1, 3, 2}, "--shard-size 3 does not divide the island's 2 ranks (2 nodes x 1)");
  expect_error({1, 0, 0}, "--island-nodes must be >= 1");
  expect_error({1, 0, world->rank() == 0 ? 1 : 2}, "ranks disagree on --island-nodes");
  world->barrier();  // every rank got here: nobody hung
}

TEST(ShardSpec, ShardsAreWholeChunkRowsCoveringTheTensor) {
  for (int S : {1, 2, 3, 5}) {
    int64_t covered = 0;
    for (int r = 0; r < S; ++r) {
      shard::ShardSpec s = shard::make_shard_spec({50, 12}, 8, dct::ChunkMode::Padded, r, S);
      EXPECT_EQ(s.begin, covered);
      if (s.begin < 50 * 12) {
        EXPECT_EQ(s.begin % (8 * 12), 0);  // starts on a chunk-row
      }
      EXPECT_EQ(s.shard_plan.numel(), s.end - s.begin);
      EXPECT_EQ(s.shard_plan.chunk_rows, 8);
      covered = s.end;
    }
    EXPECT_EQ(covered, 50 * 12);
  }
}

// Exact by design: with the same gradients (the unsharded run takes the shard ranks' rows as
// two micro-batches), every chunk's DCT, top-k and step is the same computation whichever rank
// holds it. A bound instead would have to cover a sign or top-k near-tie flipped by rounding
// (2 x lr in one element: 2e-2 relative), which depends on the CPU's kernels.
TEST(FlexDemo, ResultDoesNotDependOnShardSize) {
  const optim::OptimizerOptions o = demo_options();
  const auto sharded = train(two_nodes_of_two(), o, 10)->full_params();
  const auto whole = train(two_nodes_of_one(), o, 10, nullptr, /*micro_batches=*/2)->full_params();
  const auto start = initial_params();
  const double difference = max_relative_difference(sharded, whole);
  report("S=2 against S=1 after 10 steps: max relative difference", difference);
  EXPECT_EQ(difference, 0.0);
  EXPECT_GT(max_relative_difference({sharded[0]}, {start[0][0]}), 1e-3);  // it did train
}

// The adaptive step with its RMS capped (the default step, the cap low enough to act on every
// tensor every step) on shards: each tensor's RMS is the whole tensor's, so the step is that of
// the unsharded run. The same gradients as above; both the fused kernels (which measure a
// direction by its coefficients, and wait with them for the other shards' sums) and the plain
// backend (the decoded direction itself). What may differ is the order of the float64 sum of
// squares (one pass, or two shards' sums added), about 1e-16 relative; the float32 factor the
// direction is scaled by changes only where that moves it across a float32 rounding boundary
// (2^-23 apart), a chance of about 2^-52 / 2^-23 = 2e-9 per tensor and step, 2e-7 over these 10
// steps of 8 tensors. So the runs are held equal; with each shard's own RMS (no shard group)
// they are not.
TEST(FlexDemo, RmsCappedStepDoesNotDependOnShardSize) {
  for (const bool fast_path : {true, false}) {
    optim::OptimizerOptions o = optim::options_for(optim::Preset::FlexDemo, {});
    o.lr = 0.01;
    o.topk = 4;
    o.chunk = 8;
    o.rms_cap = 1e-3;
    o.fast_path = fast_path;
    const auto sharded = train(two_nodes_of_two(), o, 10)->full_params();
    const auto whole =
        train(two_nodes_of_one(), o, 10, nullptr, /*micro_batches=*/2)->full_params();
    const auto per_shard =
        train(two_nodes_of_two(), o, 10, nullptr, 1, /*shard_group=*/false)->full_params();
    const double difference = max_relative_difference(sharded, whole);
    const double per_shard_difference = max_relative_difference(per_shard, whole);
    report(fast_path ? "capped step (fused), S=2 against S=1 after 10 steps"
                     : "capped step (plain), S=2 against S=1 after 10 steps",
           difference);
    report("... each shard's own RMS instead", per_shard_difference);
    EXPECT_EQ(difference, 0.0) << "fast_path " << fast_path;
    EXPECT_GT(per_shard_difference, 1e-6) << "fast_path " << fast_path;
    EXPECT_GT(max_relative_difference({sharded[0]}, {initial_params()[0][0]}), 1e-4);  // trained
  }
}

// --second-moment shared (src/optim/second_moment.h) written out in float64 on whole tensors:
// per tensor the replicas' running mean of its row and column sums of g^2 (a vector: of its
// elements' g^2), summed every `every` steps (that step's included), each replica's own g^2 in
// between.
struct NaiveSharedMoment {
  double beta2, eps;
  int64_t every;
  std::vector<at::Tensor> rows, cols;        // shared: [rows] and [cols] (a vector: cols only)
  std::vector<std::vector<at::Tensor>> own;  // per replica, per tensor: g^2 since the last sum

  // Each replica's gradients of step t (1-based) divided by the root of its second moment.
  std::vector<std::vector<at::Tensor>> precondition(
      const std::vector<std::vector<at::Tensor>>& grads, int64_t t) {
    const size_t replicas = grads.size(), tensors = grads[0].size();
    if (own.empty()) {
      own.assign(replicas, std::vector<at::Tensor>(tensors));
      for (size_t i = 0; i < tensors; ++i) {
        const at::Tensor g = grads[0][i];
        for (auto& o : own) o[i] = at::zeros_like(g);
        rows.push_back(g.dim() > 1 ? at::zeros({g.size(0)}, g.options()) : at::Tensor());
        cols.push_back(at::zeros({g.dim() > 1 ? g.size(1) : g.size(0)}, g.options()));
      }
    }
    int64_t n = (t - 1) % every + 1;  // steps in own, this one included
    for (size_t r = 0; r < replicas; ++r) {
      for (size_t i = 0; i < tensors; ++i) {
        own[r][i] = beta2 * own[r][i] + (1 - beta2) * grads[r][i] * grads[r][i];
      }
    }
    if (t % every == 0) {  // the sum over the replicas
      for (size_t i = 0; i < tensors; ++i) {
        at::Tensor row_sums = rows[i].defined() ? at::zeros_like(rows[i]) : at::Tensor();
        at::Tensor col_sums = at::zeros_like(cols[i]);
        for (size_t r = 0; r < replicas; ++r) {
          if (rows[i].defined()) row_sums += own[r][i].sum(1);
          col_sums += rows[i].defined() ? own[r][i].sum(0) : own[r][i];
          own[r][i].zero_();
        }
        const double decay = std::pow(beta2, double(n));
        if (rows[i].defined()) rows[i] = decay * rows[i] + row_sums / double(replicas);
        cols[i] = decay * cols[i] + col_sums / double(replicas);
      }
      n = 0;
    }
    std::vector<std::vector<at::Tensor>> out(replicas);
    for (size_t r = 0; r < replicas; ++r) {
      for (size_t i = 0; i < tensors; ++i) {
        const at::Tensor g = grads[r][i];
        const at::Tensor shared =
            g.dim() > 1 ? at::outer(rows[i], cols[i]) / cols[i].sum().clamp_min(1e-300) : cols[i];
        const at::Tensor v = std::pow(beta2, double(n)) * shared + own[r][i];
        out[r].push_back(g / ((v / (1 - std::pow(beta2, double(t)))).sqrt() + eps));
      }
    }
    return out;
  }
};

// The shared second moment on 2 replicas x 2 shards and on 4 replicas of one rank, summed every
// step and every 3, against NaiveSharedMoment with HSDP's dense mean (p -= lr x the replicas'
// mean preconditioned gradient) on the same batches in float64. Bound: float32's forward and
// backward put about 1e-6 relative error into a gradient (a few dozen roundings of 2^-24); the
// division by the root of v keeps it that size, and 7 steps of lr 0.01 move each parameter by
// at most 0.07 x its update's error: far below 1e-5 of the parameter's scale. Each replica's own
// second moment instead (the default) differs by more than 1e-4, so the test can fail.
TEST(FlexDemo, SharedSecondMomentMatchesNaiveFloat64) {
  const int steps = 7;
  for (const int64_t every : {1, 3}) {
    optim::OptimizerOptions o = demo_options();
    o.replicator = optim::ReplicatorKind::Full;
    o.sign = false;
    o.fold_lr = false;
    o.precondition = true;
    o.beta2 = 0.95;
    o.second_moment = optim::SecondMoment::Shared;
    o.second_moment_every = every;
    const comm::Topology four = comm::make_topology(test_world(), {1, 1});
    for (const comm::Topology& topo : {two_nodes_of_two(), four}) {
      const auto trained = train(topo, o, steps)->full_params();
      // The reference: every replica's gradient on its rows of the batch, in float64.
      std::vector<at::Tensor> params;
      for (auto& unit : initial_params()) {
        for (auto& p : unit) params.push_back(p.to(at::kDouble).requires_grad_(true));
      }
      NaiveSharedMoment naive{o.beta2, o.eps, every};
      for (int step = 0; step < steps; ++step) {
        auto [x, y] = global_batch(step);
        const int64_t rows = kBatch / topo.replicas;
        std::vector<std::vector<at::Tensor>> grads;
        for (int r = 0; r < topo.replicas; ++r) {
          at::Tensor h = x.narrow(0, r * rows, rows).to(at::kDouble);
          size_t k = 0;
          for (size_t u = 0; u < kUnitFns.size(); ++u) {
            const size_t n = initial_params()[u].size();
            h = kUnitFns[u]({params.begin() + k, params.begin() + k + n}, {h});
            k += n;
          }
          grads.push_back(torch::autograd::grad(
              {at::mse_loss(h, y.narrow(0, r * rows, rows).to(at::kDouble))}, params));
        }
        const auto scaled = naive.precondition(grads, step + 1);
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < params.size(); ++i) {
          at::Tensor mean = at::zeros_like(params[i]);
          for (const auto& replica : scaled) mean += replica[i] / double(topo.replicas);
          params[i].sub_(mean, o.lr);
        }
      }
      std::vector<at::Tensor> reference;
      for (auto& p : params) reference.push_back(p.detach().to(at::kFloat));
      const double difference = max_relative_difference(trained, reference);
      report(("shared second moment, every " + std::to_string(every) + ", " +
              std::to_string(topo.replicas) + " replicas, against float64")
                 .c_str(),
             difference);
      EXPECT_LT(difference, 1e-5) << "every " << every << ", " << topo.replicas << " replicas";
      optim::OptimizerOptions own = o;
      own.second_moment = optim::SecondMoment::Own;
      own.second_moment_every = 1;
      EXPECT_GT(max_relative_difference(train(topo, own, steps)->full_params(), reference), 1e-4);
    }
  }
}

// The shared second moment summed every 3 steps, on 2 replicas x 2 shards with the DeMo step:
// (1) each tensor's exchange started as soon as the backward is done (start_exchange, as
// --exchange-in-backward does: preconditioned then on a step that does not sum, left to step()
// on one that does) gives step() alone's parameters bit for bit; (2) a run whose optimizer
// state is copied after step 4 (mid-interval: one step of each replica's own statistics) into a
// new optimizer over the same parameters continues bit for bit. Exact by design: the same
// arithmetic in the same order either way.
TEST(FlexDemo, SharedSecondMomentStartsEarlyAndResumesMidInterval) {
  optim::OptimizerOptions o = optim::options_for(optim::Preset::FlexDemo, {});
  o.lr = 0.01;
  o.topk = 4;
  o.chunk = 8;
  o.second_moment = optim::SecondMoment::Shared;
  o.second_moment_every = 3;
  const comm::Topology topo = two_nodes_of_two();
  const int steps = 8;
  const auto reference = train(topo, o, steps)->full_params();
  auto run = [&](bool early, int restart_after) {
    ShardedMlp model(topo, o);
    auto optimizer = std::make_unique<optim::Optimizer>(model.optim_params(), o,
                                                        topo.replica_group, topo.shard_group);
    for (int step = 0; step < steps; ++step) {
      if (step == restart_after) {  // the state into a new optimizer, as a checkpoint would
        std::vector<at::Tensor> saved;
        for (const auto& [name, t] : optimizer->state_tensors()) saved.push_back(t.clone());
        optimizer = std::make_unique<optim::Optimizer>(model.optim_params(), o,
                                                       topo.replica_group, topo.shard_group);
        auto state = optimizer->state_tensors();
        for (size_t i = 0; i < state.size(); ++i) state[i].second.copy_(saved[i]);
        optimizer->restore_steps(step);
      }
      auto [x, y] = global_batch(step);
      optimizer->zero_grad();
      model.loss(rank_rows(x, topo), rank_rows(y, topo)).backward();
      if (early) {
        const size_t tensors = model.optim_params().size();
        for (size_t t = 0; t < tensors; ++t) optimizer->start_exchange({t});
      }
      optimizer->step();
    }
    return model.full_params();
  };
  const double started = max_relative_difference(run(true, -1), reference);
  const double resumed = max_relative_difference(run(false, 4), reference);
  report("shared second moment every 3: started early against step() alone", started);
  report("shared second moment every 3: resumed after step 4 against uninterrupted", resumed);
  EXPECT_EQ(started, 0.0);
  EXPECT_EQ(resumed, 0.0);
  EXPECT_GT(max_relative_difference({reference[0]}, {initial_params()[0][0]}), 1e-4);  // trained
}

// What the link budget weighs (Optimizer::link_bytes) against what crossed the replicas' link:
// 4 replicas of one rank, the default step with the shared second moment summed every step. The
// bytes the replica group's communicator counted over one step are (R - 1) x link_bytes: the
// all-gather's payloads plus the statistics' rank-order sum (8n / R bytes as an all-gather's),
// within its uneven slices (at most 4 bytes a slice when the n floats do not divide by R: two
// collectives of R - 1 slices each); at bf16 half the statistics' bytes. With each replica's
// own second moment, link_bytes is the payloads' alone.
TEST(FlexDemo, LinkBytesCountTheSharedSecondMomentsSum) {
  const comm::Topology four = comm::make_topology(test_world(), {1, 1});
  for (const auto kind : {optim::SecondMoment::Shared, optim::SecondMoment::Own}) {
    optim::OptimizerOptions o = optim::options_for(optim::Preset::FlexDemo, {});
    o.topk = 4;
    o.chunk = 8;
    o.second_moment = kind;
    ShardedMlp model(four, o);
    optim::Optimizer optimizer(model.optim_params(), o, four.replica_group, four.shard_group);
    four.replica_group->reset_stats();
    auto [x, y] = global_batch(0);
    optimizer.zero_grad();
    model.loss(rank_rows(x, four), rank_rows(y, four)).backward();
    optimizer.step();
    const double sent = double(four.replica_group->stats().bytes_sent);
    const optim::ExchangeSchedule schedule{o.topk, o.values, 1};
    const double wire = double(optimizer.wire_bytes(schedule));
    const double link = optimizer.link_bytes(schedule);
    const int R = four.replicas;
    if (kind == optim::SecondMoment::Own) {
      EXPECT_EQ(link, wire);
      EXPECT_EQ(sent, (R - 1) * wire);
      continue;
    }
    EXPECT_GT(link - wire, 0.0);
    EXPECT_NEAR(sent, (R - 1) * link, 2.0 * (R - 1) * 4.0);
    // Summed every 2 steps, a schedule of 3 steps carries one and a half sums.
    o.second_moment_every = 2;
    optim::Optimizer every_two(model.optim_params(), o, four.replica_group, four.shard_group);
    const optim::ExchangeSchedule three{o.topk, o.values, 3};
    EXPECT_DOUBLE_EQ(every_two.link_bytes(three) - double(every_two.wire_bytes(three)),
                     1.5 * (link - wire));
    // The statistics at bf16 (half their bytes) and at log8 (a quarter, and a 4-byte header a
    // slice each way): counted, and sent within a value a slice (the slices are uneven).
    o.second_moment_every = 1;
    for (const auto& [values, share, header, value_bytes] :
         {std::tuple{optim::StatisticsEncoding::Bf16, 0.5, 0.0, 2.0},
          std::tuple{optim::StatisticsEncoding::Log8, 0.25, 4.0, 1.0}}) {
      o.second_moment_values = values;
      optim::Optimizer narrowed(model.optim_params(), o, four.replica_group, four.shard_group);
      four.replica_group->reset_stats();
      narrowed.zero_grad();
      model.loss(rank_rows(x, four), rank_rows(y, four)).backward();
      narrowed.step();
      const double counted = narrowed.link_bytes(schedule);
      EXPECT_DOUBLE_EQ(counted - wire, share * (link - wire) + 2.0 * header);
      EXPECT_NEAR(double(four.replica_group->stats().bytes_sent), (R - 1) * counted,
                  2.0 * (R - 1) * value_bytes);
    }
  }
}

TEST(FlexDemo, FullWithAdamWEqualsSingleProcessAdamW) {
  optim::OptimizerOptions o = demo_options();
  o.replicator = optim::ReplicatorKind::Full;
  o.inner = optim::InnerKind::AdamW;
  o.sign = false;
  o.weight_decay = 0.1;
  const int steps = 5;
  const auto sharded = train(two_nodes_of_two(), o, steps)->full_params();

  // The reference: one process, the whole global batch, torch's AdamW.
  std::vector<std::vector<at::Tensor>> params = initial_params();
  std::vector<at::Tensor> flat;
  for (auto& unit : params) {
    for (auto& p : unit) flat.push_back(p.requires_grad_(true));
  }
  torch::optim::AdamW adamw(flat, torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = global_batch(step);
    adamw.zero_grad();
    at::Tensor h = x;
    for (size_t u = 0; u < params.size(); ++u) h = kUnitFns[u](params[u], {h});
    at::mse_loss(h, y).backward();
    adamw.step();
  }
  std::vector<at::Tensor> reference;
  for (auto& p : flat) reference.push_back(p.detach());
  const double difference = max_relative_difference(sharded, reference);
  report("full+AdamW against single-process AdamW: max relative difference", difference);
  EXPECT_LT(difference, 1e-5);
}

TEST(FlexDemo, ReplicasAreBitIdenticalAcrossNodes) {
  for (auto kind :
       {optim::ReplicatorKind::Demo, optim::ReplicatorKind::Full, optim::ReplicatorKind::Random}) {
    optim::OptimizerOptions o = demo_options();
    o.replicator = kind;
    o.random_fraction = 0.25;
    const comm::Topology topo = two_nodes_of_two();
    auto model = train(topo, o, 20);
    for (const auto& unit : model->units) {
      for (const at::Tensor& shard : unit->shards()) {
        at::Tensor mine = shard.detach().clone();
        at::Tensor first = mine.clone();
        topo.replica_group->broadcast(first, 0);
        EXPECT_TRUE(at::equal(mine, first)) << name_of(kind) << " " << unit->name();
      }
    }
  }
}

TEST(FlexDemo, StateBytesScaleWithOneOverShardSize) {
  optim::OptimizerOptions o = demo_options();
  o.inner = optim::InnerKind::AdamW;
  optim::Optimizer* opt = nullptr;
  auto sharded = train(two_nodes_of_two(), o, 1, &opt);
  const double sharded_bytes = double(sharded->param_and_grad_bytes() + opt->state_bytes());
  auto whole = train(two_nodes_of_one(), o, 1, &opt);
  const double whole_bytes = double(whole->param_and_grad_bytes() + opt->state_bytes());
  report("state bytes S=2 / S=1", sharded_bytes / whole_bytes);
  EXPECT_NEAR(sharded_bytes / whole_bytes, 0.5, 0.05);
}

TEST(FlexDemo, BytesBetweenNodesMatchClosedForm) {
  const comm::Topology topo = two_nodes_of_two();
  for (auto kind :
       {optim::ReplicatorKind::Demo, optim::ReplicatorKind::Full, optim::ReplicatorKind::None}) {
    optim::OptimizerOptions o = demo_options();
    o.replicator = kind;
    o.values = compress::ValueEncoding::Bf16;
    ShardedMlp model(topo, o);
    optim::Optimizer optimizer(model.optim_params(), o, topo.replica_group);
    std::vector<dct::ChunkPlan> plans;
    int64_t shard_numel = 0;
    for (const auto& p : model.optim_params()) {
      plans.push_back(p.plan);
      shard_numel += p.plan.numel();
    }
    const uint64_t R = topo.replicas;
    const uint64_t expected =
        kind == optim::ReplicatorKind::Demo   ? (R - 1) * closed_form_payload_bytes(plans, o)
        : kind == optim::ReplicatorKind::Full ? 2 * (R - 1) * 4 * uint64_t(shard_numel) / R
                                              : 0;
    comm::TrafficMeter meter(topo);
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = global_batch(step);
      const uint64_t collectives = topo.replica_group->stats().collectives;
      optimizer.zero_grad();
      model.loss(rank_rows(x, topo), rank_rows(y, topo)).backward();
      optimizer.step();
      const comm::StepTraffic t = meter.lap();
      EXPECT_EQ(t.inter_sent, expected) << name_of(kind) << " step " << step;
      EXPECT_GT(t.intra_sent, 0u);
      const uint64_t bucketed = kind == optim::ReplicatorKind::None ? 0 : 1;  // one per step
      EXPECT_EQ(topo.replica_group->stats().collectives - collectives, bucketed);
    }
  }
}

TEST(FlexDemo, ReplicateEveryExchangesOnlyEveryNthStep) {
  const comm::Topology topo = two_nodes_of_two();
  for (auto kind : {optim::ReplicatorKind::Demo, optim::ReplicatorKind::Full}) {
    optim::OptimizerOptions o = demo_options();
    o.replicator = kind;
    o.replicate_every = 3;
    ShardedMlp model(topo, o);
    optim::Optimizer optimizer(model.optim_params(), o, topo.replica_group);
    const std::vector<at::Tensor> start = model.full_params();
    comm::TrafficMeter meter(topo);
    for (int step = 0; step < 6; ++step) {
      auto [x, y] = global_batch(step);
      optimizer.zero_grad();
      model.loss(rank_rows(x, topo), rank_rows(y, topo)).backward();
      optimizer.step();
      const bool exchanged = (step + 1) % 3 == 0;
      EXPECT_EQ(meter.lap().inter_sent > 0, exchanged) << name_of(kind) << " " << step;
      const std::vector<at::Tensor> now = model.full_params();
      meter.lap();  // the gather above is not the optimizer's traffic
      if (step == 1) {
        EXPECT_EQ(max_relative_difference(now, start), 0.0);  // nothing applied yet
      } else if (step == 2) {
        EXPECT_GT(max_relative_difference(now, start), 0.0);
      }
    }
    for (const auto& unit : model.units) {  // and the replicas still agree
      for (const at::Tensor& shard : unit->shards()) {
        at::Tensor first = shard.detach().clone();
        topo.replica_group->broadcast(first, 0);
        EXPECT_TRUE(at::equal(first, shard.detach()));
      }
    }
  }
}

TEST(FlexDemo, KeepingGatheredParametersGivesTheSameGradients) {
  const comm::Topology topo = two_nodes_of_two();
  const optim::OptimizerOptions o = demo_options();
  ShardedMlp resharded(topo, o, true), kept(topo, o, false);
  auto [x, y] = global_batch(0);
  resharded.loss(rank_rows(x, topo), rank_rows(y, topo)).backward();
  kept.loss(rank_rows(x, topo), rank_rows(y, topo)).backward();
  for (size_t u = 0; u < kept.units.size(); ++u) {
    for (size_t i = 0; i < kept.units[u]->shards().size(); ++i) {
      EXPECT_TRUE(at::allclose(resharded.units[u]->shards()[i].grad(),
                               kept.units[u]->shards()[i].grad(), 1e-6, 1e-7));
    }
  }
}

TEST(FlexDemo, UnitSignalsItsGradientsCompleteOncePerBackward) {
  // A unit used twice in a forward (tied, like GPT's embeddings) and two more: each unit's
  // on_gradients_ready runs once per backward, in backward order, after its last use's backward,
  // when its shards' gradients are already the final ones, which equal a model without the
  // callbacks; across two accumulated backwards too, with and without resharding.
  const comm::Topology topo = two_nodes_of_two();
  const optim::OptimizerOptions o = demo_options();
  for (bool reshard : {true, false}) {
    ShardedMlp model(topo, o, reshard), reference(topo, o, reshard);
    auto tied_loss = [](ShardedMlp& m, const at::Tensor& x, const at::Tensor& y) {
      at::Tensor h = m.units[0]->forward(kUnitFns[0], {x});
      h = m.units[1]->forward(kUnitFns[1], {h});
      h = m.units[1]->forward(kUnitFns[1], {h});  // the same parameters again
      return at::mse_loss(m.units[3]->forward(kUnitFns[3], {h}), y);
    };
    std::vector<size_t> order;
    std::vector<std::vector<at::Tensor>> seen(model.units.size());
    for (size_t u = 0; u < model.units.size(); ++u) {
      model.units[u]->on_gradients_ready([&, u] {
        order.push_back(u);
        seen[u].clear();
        for (const at::Tensor& s : model.units[u]->shards()) seen[u].push_back(s.grad().clone());
      });
    }
    for (int micro = 0; micro < 2; ++micro) {
      auto [x, y] = global_batch(micro);
      order.clear();
      tied_loss(model, rank_rows(x, topo), rank_rows(y, topo)).backward();
      tied_loss(reference, rank_rows(x, topo), rank_rows(y, topo)).backward();
      EXPECT_EQ(order, (std::vector<size_t>{3, 1, 0})) << "reshard " << reshard;  // 2: unused
      for (size_t u : {0, 1, 3}) {
        for (size_t i = 0; i < model.units[u]->shards().size(); ++i) {
          const at::Tensor& grad = model.units[u]->shards()[i].grad();
          EXPECT_TRUE(at::equal(seen[u].at(i), grad)) << "unit " << u << " micro " << micro;
          EXPECT_TRUE(at::equal(grad, reference.units[u]->shards()[i].grad()));
        }
      }
    }
  }
}

TEST(FlexDemo, PrefetchedGathersGiveTheSameTrainingAndNeverStaleParameters) {
  // Each unit prefetching the next one's gather (and the one before it in the backward) trains
  // bit-identically to gathering on demand, through DeMo's fused steps; a prefetched gather of
  // parameters changed since it started is not used.
  const comm::Topology topo = two_nodes_of_two();
  const optim::OptimizerOptions o = demo_options();
  for (bool reshard : {true, false}) {
    ShardedMlp plain(topo, o, reshard), prefetching(topo, o, reshard);
    optim::Optimizer a(plain.optim_params(), o, topo.replica_group);
    optim::Optimizer b(prefetching.optim_params(), o, topo.replica_group);
    auto chained_loss = [](ShardedMlp& m, const at::Tensor& x, const at::Tensor& y) {
      const size_t n = m.units.size();
      at::Tensor h = x;
      for (size_t u = 0; u < n; ++u) {
        h = m.units[u]->forward(
            kUnitFns[u], {h},
            {u + 1 < n ? m.units[u + 1].get() : nullptr, u > 0 ? m.units[u - 1].get() : nullptr});
      }
      return at::mse_loss(h, y);
    };
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = global_batch(step);
      a.zero_grad();
      b.zero_grad();
      plain.loss(rank_rows(x, topo), rank_rows(y, topo)).backward();
      chained_loss(prefetching, rank_rows(x, topo), rank_rows(y, topo)).backward();
      a.step();
      b.step();
      const auto pa = plain.full_params(), pb = prefetching.full_params();
      for (size_t i = 0; i < pa.size(); ++i) {
        EXPECT_TRUE(at::equal(pa[i], pb[i])) << "tensor " << i << " step " << step;
      }
    }
  }
  ShardedMlp model(topo, o);
  const std::vector<at::Tensor> before = model.units[0]->gather();
  model.units[0]->prefetch();
  EXPECT_TRUE(at::equal(model.units[0]->gather()[0], before[0]));  // unchanged: used
  model.units[0]->prefetch();
  {
    at::NoGradGuard no_grad;
    model.units[0]->shards()[0].add_(1.0);  // changed after the prefetch started
  }
  EXPECT_TRUE(at::equal(model.units[0]->gather()[0], before[0] + 1.0));
}
