// DeMo across real MPI ranks: replicas with different gradients stay bit-identical, the bytes
// counted equal the closed-form payload size, and the update equals a single-process replay.
#include "closed_form.h"
#include "test_mpi.h"

#include "flexdemo/optim.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>

using namespace flexdemo;

namespace {

const std::vector<std::vector<int64_t>> kShapes = {{96, 64}, {64}, {33, 17}, {4, 6, 5}, {300}};

std::vector<at::Tensor> make_params() {
  at::manual_seed(7);  // same start everywhere
  std::vector<at::Tensor> params;
  for (const auto& s : kShapes) params.push_back(at::randn(s).set_requires_grad(true));
  return params;
}

void set_gradients(std::vector<at::Tensor>& params, int rank, int step) {
  at::Generator gen = at::detail::createCPUGenerator(100 * step + rank);
  for (auto& p : params) p.mutable_grad() = at::randn(p.sizes(), gen);
}

std::vector<dct::ChunkPlan> plans_of(const optim::OptimizerOptions& o) {
  std::vector<dct::ChunkPlan> plans;
  for (const auto& s : kShapes) plans.push_back(dct::make_chunk_plan(s, o.chunk, o.chunk_mode));
  return plans;
}

// Sign-SGD, lr 0.01, top-k 8 of 16 x 16 chunks, bf16 values.
optim::OptimizerOptions bf16_options() {
  optim::OptimizerOptions o = optim::preset(optim::Preset::DeMo);
  o.lr = 0.01;
  o.topk = 8;
  o.chunk = 16;
  o.values = compress::ValueEncoding::Bf16;
  return o;
}

// Trains `steps` steps over `group` (each rank its own gradients) and expects every parameter
// to have moved and to be bit-identical on every rank of `world`. Returns the traffic.
optim::ExchangeTraffic train_and_expect_identical(comm::Communicator& world,
                                                  const optim::OptimizerOptions& o,
                                                  std::shared_ptr<comm::Communicator> group,
                                                  int steps) {
  std::vector<at::Tensor> params = make_params();
  std::vector<at::Tensor> initial;
  for (auto& p : params) initial.push_back(p.detach().clone());
  optim::Optimizer demo(params, o, std::move(group));
  for (int step = 0; step < steps; ++step) {
    set_gradients(params, world.rank(), step);
    demo.step();
  }
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor mine = params[i].detach().clone();
    at::Tensor root = mine.clone();
    world.broadcast(root, 0);
    EXPECT_TRUE(at::equal(mine, root)) << "parameter " << i << " " << name_of(o.values);
    EXPECT_FALSE(at::equal(mine, initial[i])) << "parameter " << i << " never moved";
  }
  return demo.traffic();
}

}  // namespace

TEST(DemoMpi, ReplicasStayBitIdenticalAndBytesMatchClosedForm) {
  auto world = test_world();
  for (auto values : values_of<compress::ValueEncoding>()) {
    optim::OptimizerOptions o = optim::preset(optim::Preset::DeMo);
    o.lr = 0.01;
    o.topk = 8;
    o.chunk = 16;
    o.chunk_mode =
        compress::ValueEncoding::Int8 == values ? dct::ChunkMode::Padded : dct::ChunkMode::Divisor;
    o.values = values;
    auto group = world->split(0, world->rank());
    const int steps = 20;
    const optim::ExchangeTraffic traffic = train_and_expect_identical(*world, o, group, steps);
    const uint64_t payload = closed_form_payload_bytes(plans_of(o), o);
    EXPECT_EQ(traffic.wire_bytes, payload);
    EXPECT_EQ(group->stats().bytes_sent, steps * (world->size() - 1) * payload);
    EXPECT_EQ(group->stats().collectives, uint64_t(steps));  // one bucketed all-gather per step
  }
}

TEST(DemoMpi, UpdateEqualsSingleProcessReplayOfAllReplicas) {
  // One step on P ranks against P optimizers in this process whose payloads are decoded
  // together by hand: the multi-rank update must be the replay's, bit for bit.
  auto world = test_world();
  const int P = world->size();
  optim::OptimizerOptions o = optim::preset(optim::Preset::DeMo);
  o.lr = 0.05;
  o.topk = 4;
  o.chunk = 8;
  o.sign = false;

  std::vector<at::Tensor> params = make_params();
  optim::Optimizer demo(params, o, world->split(0, world->rank()));
  set_gradients(params, world->rank(), 0);
  demo.step();

  // Replay: replica q's residual after its first step is lr * DCT(grad_q) with its top-k
  // removed, so what it sent is lr * DCT(grad_q) minus that residual.
  for (size_t i = 0; i < kShapes.size(); ++i) {
    const dct::ChunkPlan plan = demo.chunk_plan(i);
    at::Tensor sum = at::zeros({plan.padded_rows, plan.padded_cols});
    at::Tensor count = at::zeros_like(sum);
    for (int q = 0; q < P; ++q) {
      std::vector<at::Tensor> replica = make_params();
      set_gradients(replica, q, 0);
      optim::Optimizer local({replica[i]}, o);
      local.step();
      at::Tensor full = dct::chunked_dct(replica[i].grad(), plan) * o.lr;
      at::Tensor sent = full - local.residual(0);
      sum += sent;
      count += (local.residual(0) == 0).to(at::kFloat);
    }
    at::Tensor mean = at::where(count > 0, sum / count.clamp_min(1), at::zeros_like(sum));
    at::Tensor expected =
        make_params()[i].detach() - o.lr * dct::chunked_idct(mean, plan).reshape(kShapes[i]);
    EXPECT_TRUE(at::allclose(params[i].detach(), expected, 1e-5, 1e-6)) << "parameter " << i;
  }
}

TEST(DemoMpi, OverlapStepKeepsReplicasIdenticalAndOneStepBehind) {
  // --overlap-step across real ranks: each step's all-gather stays in flight until the next
  // step, the committed parameters stay bit-identical across replicas, and after step t + 1
  // they are what the blocking exchange gave after step t (same gradients, constant lr).
  auto world = test_world();
  const optim::OptimizerOptions o = bf16_options();
  optim::OptimizerOptions overlapped = o;
  overlapped.overlap_step = true;
  std::vector<at::Tensor> a = make_params(), b = make_params();
  optim::Optimizer blocking(a, o, world->split(0, world->rank()));
  auto group = world->split(0, world->rank());
  optim::Optimizer overlap(b, overlapped, group);
  std::vector<at::Tensor> previous;
  for (auto& p : a) previous.push_back(p.detach().clone());
  const int steps = 8;
  for (int step = 0; step < steps; ++step) {
    set_gradients(a, world->rank(), step);
    set_gradients(b, world->rank(), step);
    blocking.step();
    overlap.step();
    const std::vector<at::Tensor> committed = overlap.replicated_params();
    for (size_t i = 0; i < b.size(); ++i) {
      const at::Tensor mine = committed[i].reshape(b[i].sizes());
      EXPECT_TRUE(at::equal(mine, previous[i])) << "parameter " << i << " step " << step;
      at::Tensor root = mine.clone();
      world->broadcast(root, 0);
      EXPECT_TRUE(at::equal(mine, root)) << "replicas differ, parameter " << i;
      previous[i] = a[i].detach().clone();
    }
  }
  // The last exchange is still in flight; all the earlier ones completed.
  EXPECT_EQ(group->stats().collectives, uint64_t(steps - 1));
}

TEST(DemoMpi, ExchangeStartedInBucketsEqualsOneBucket) {
  // start_exchange (a bucket's exchange started as soon as its gradients are final, as the
  // trainer does in backward) against step() alone: the same parameters, bit for bit, every
  // step, for sign-SGD and AdamW, exchanging every step or every second one, across the real
  // ranks and for one replica; one all-gather per bucket, none between exchanges.
  auto world = test_world();
  for (auto inner : {optim::InnerKind::Sgd, optim::InnerKind::AdamW}) {
    for (int64_t every : {1, 2}) {
      for (bool replicated : {true, false}) {
        optim::OptimizerOptions o = optim::preset(optim::Preset::DeMo);
        o.lr = 0.01;
        o.topk = 8;
        o.chunk = 16;
        o.values = compress::ValueEncoding::Bf16;
        o.inner = inner;
        o.replicate_every = every;
        const std::string what = name_of(inner) + " every " + std::to_string(every) +
                                 (replicated ? " replicated" : " alone");
        auto group_a = replicated ? world->split(0, world->rank()) : nullptr;
        auto group_b = replicated ? world->split(0, world->rank()) : nullptr;
        std::vector<at::Tensor> a = make_params(), b = make_params();
        optim::Optimizer whole(a, o, group_a), buckets(b, o, group_b);
        const int steps = 6;
        for (int step = 0; step < steps; ++step) {
          set_gradients(a, world->rank(), step);
          set_gradients(b, world->rank(), step);
          whole.step();
          buckets.start_exchange({4, 1});  // in a backward's order: the last tensors first
          buckets.start_exchange({2});
          buckets.step();  // 0 and 3 in a third bucket
          for (size_t i = 0; i < a.size(); ++i) {
            EXPECT_TRUE(at::equal(a[i], b[i])) << what << ": parameter " << i << " step " << step;
          }
        }
        if (replicated) {
          const uint64_t exchanges = steps / every;
          EXPECT_EQ(group_a->stats().collectives, exchanges) << what;
          EXPECT_EQ(group_b->stats().collectives, 3 * exchanges) << what;
          EXPECT_EQ(group_b->stats().bytes_sent, group_a->stats().bytes_sent) << what;
        }
      }
    }
  }
  optim::Optimizer demo(make_params(), optim::preset(optim::Preset::DeMo), nullptr);
  EXPECT_THROW(demo.start_exchange({5}), std::out_of_range);
  demo.start_exchange({0});
  EXPECT_THROW(demo.start_exchange({0}), std::logic_error);  // already started
}

namespace {

// --inner-steps' outer loop in float64, from the gradients every replica sees (a function of the
// replica and the step only): local SGD steps (on the gradient's sign or the gradient) from the
// anchor, the replicas' mean pseudo-gradient, Nesterov SGD (on its sign or itself) on the anchor.
// Returns every parameter after `steps` steps as replica `rank` holds it.
std::vector<at::Tensor> outer_loop_reference(const optim::OptimizerOptions& o, int replicas,
                                             int rank, int steps) {
  std::vector<at::Tensor> anchor, momentum, mine;
  for (auto& p : make_params()) {
    anchor.push_back(p.detach().to(at::kDouble));
    momentum.push_back(at::zeros_like(anchor.back()));
  }
  mine = anchor;
  std::vector<std::vector<at::Tensor>> local(replicas, anchor);
  for (int step = 0; step < steps; ++step) {
    for (int q = 0; q < replicas; ++q) {
      std::vector<at::Tensor> grads = make_params();
      set_gradients(grads, q, step);
      for (size_t i = 0; i < anchor.size(); ++i) {
        const at::Tensor g = grads[i].grad().to(at::kDouble);
        local[q][i] = local[q][i] - o.lr * (o.sign ? g.sign() : g);
      }
    }
    if ((step + 1) % o.inner_steps == 0) {
      for (size_t i = 0; i < anchor.size(); ++i) {
        at::Tensor mean = at::zeros_like(anchor[i]);
        for (int q = 0; q < replicas; ++q) mean += (anchor[i] - local[q][i]) / replicas;
        const at::Tensor d = o.outer_sign ? mean.sign() : mean;
        momentum[i] = o.outer_momentum * momentum[i] + d;
        anchor[i] = anchor[i] - o.outer_lr * (d + o.outer_momentum * momentum[i]);
        for (int q = 0; q < replicas; ++q) local[q][i] = anchor[i];
      }
    }
  }
  return local[rank];
}

}  // namespace

TEST(DemoMpi, InnerStepsEqualFloat64OuterLoop) {
  // --inner-steps 3 over 3 rounds and a step into the fourth: local sign-SGD, the pseudo-gradient
  // averaged by the full replicator (exact) or by DeMo keeping every coefficient in fp32 with
  // no residual carried (exact up to the transform's rounding), Nesterov on the anchor; and
  // local plain SGD with the outer step on the mean's sign (--outer-sign: the gradients are
  // continuous, so no mean lies near 0 and rounding flips no sign). One exchange per round;
  // replicas bit-identical after each; mid-round each holds its own steps.
  auto world = test_world();
  for (auto [kind, outer_sign] : {std::pair{optim::ReplicatorKind::Full, false},
                                  {optim::ReplicatorKind::Demo, false},
                                  {optim::ReplicatorKind::Full, true},
                                  {optim::ReplicatorKind::Demo, true}}) {
    optim::OptimizerOptions o = optim::preset(optim::Preset::DeMo);
    o.lr = 0.01;
    o.sign = !outer_sign;
    o.inner_steps = 3;
    o.outer_lr = outer_sign ? 0.02 : 0.7;
    o.outer_momentum = outer_sign ? 0.5 : 0.9;
    o.outer_sign = outer_sign;
    o.replicator = kind;
    o.chunk = 8;
    o.topk = 64;  // every coefficient of an 8 x 8 chunk
    o.decay = 0.0;
    o.values = compress::ValueEncoding::Fp32;
    auto group = world->split(0, world->rank());
    std::vector<at::Tensor> params = make_params();
    optim::Optimizer outer(params, o, group);
    for (int step = 0; step < 10; ++step) {
      set_gradients(params, world->rank(), step);
      outer.step();
      const std::vector<at::Tensor> want =
          outer_loop_reference(o, world->size(), world->rank(), step + 1);
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(at::allclose(params[i].detach().to(at::kDouble), want[i], 1e-5, 1e-6))
            << name_of(kind) << (outer_sign ? " outer sign" : "") << " parameter " << i << " step "
            << step + 1;
      }
      if ((step + 1) % 3 == 0) {
        for (size_t i = 0; i < params.size(); ++i) {
          at::Tensor root = params[i].detach().clone();
          world->broadcast(root, 0);
          EXPECT_TRUE(at::equal(params[i].detach(), root)) << "replicas differ, " << i;
          EXPECT_TRUE(at::equal(outer.replicated_params()[i].reshape(params[i].sizes()), root));
        }
      }
    }
    EXPECT_EQ(group->stats().collectives, 3u) << name_of(kind);
  }
}

// Trains one run through `end` steps without stopping and another that stops after `stop`; a
// fresh optimizer continues the second from the state it named and its parameters, and every
// step after must equal the run that never stopped, bit for bit. Returns the state's names and
// the uninterrupted run's parameters.
static std::pair<std::set<std::string>, std::vector<at::Tensor>> expect_exact_resume(
    comm::Communicator& world, const optim::OptimizerOptions& o, int stop, int end,
    const std::string& what) {
  std::vector<at::Tensor> a = make_params(), b = make_params(), c = make_params();
  optim::Optimizer whole(a, o, world.split(0, world.rank()));
  optim::Optimizer first(b, o, world.split(0, world.rank()));
  for (int step = 0; step < stop; ++step) {
    set_gradients(a, world.rank(), step);
    whole.step();
    set_gradients(b, world.rank(), step);
    first.step();
  }
  std::map<std::string, at::Tensor> saved;
  std::set<std::string> names;
  for (auto& [name, t] : first.state_tensors()) saved[name] = t.clone(), names.insert(name);
  optim::Optimizer second(c, o, world.split(0, world.rank()));
  {
    at::NoGradGuard no_grad;  // (with inner_steps, local.i are the parameters themselves)
    for (size_t i = 0; i < c.size(); ++i) c[i].copy_(b[i]);
    for (auto& [name, t] : second.state_tensors()) t.copy_(saved.at(name));
  }
  second.restore_steps(stop);
  for (int step = stop; step < end; ++step) {
    set_gradients(a, world.rank(), step);
    whole.step();
    set_gradients(c, world.rank(), step);
    second.step();
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(at::equal(a[i], c[i])) << what << " parameter " << i << " step " << step + 1;
    }
  }
  return {names, a};
}

TEST(DemoMpi, InnerStepsResumeExactlyFromTheirState) {
  // --inner-steps 4 with DeMo's 2bit exchange (residuals carried): a run stopped after step 5
  // (mid-round) and continued by a fresh optimizer from the state it named equals the run
  // that never stopped, bit for bit, for local sign-SGD and local AdamW.
  auto world = test_world();
  for (auto inner : {optim::InnerKind::Sgd, optim::InnerKind::AdamW}) {
    optim::OptimizerOptions o = optim::preset(optim::Preset::DeMo);
    o.lr = 0.01;
    o.inner = inner;
    o.sign = inner == optim::InnerKind::Sgd;
    o.inner_steps = 4;
    o.chunk = 16;
    o.topk = 8;
    o.values = compress::ValueEncoding::TwoBit;
    const auto names = expect_exact_resume(*world, o, 5, 11, name_of(inner)).first;
    EXPECT_EQ(names.count("local.0") + names.count("anchor.0") + names.count("outer.residual.0") +
                  names.count("outer.momentum.0"),
              4u);
  }
}

TEST(DemoMpi, PreconditionedNormalizedStepResumesExactlyAndKeepsReplicasEqual) {
  // --precondition (each replica's own running mean square) with --no-sign --normalize: a run
  // stopped after step 5 and continued from the state it named (grad_sq.i among it) equals the
  // run that never stopped, bit for bit, and the replicas' parameters stay bit-identical.
  auto world = test_world();
  optim::OptimizerOptions o = optim::preset(optim::Preset::DeMo);
  o.lr = 0.01;
  o.sign = false;
  o.normalize = true;
  o.precondition = true;
  o.second_moment = optim::SecondMoment::Own;  // auto would share it on these 4 replicas
  o.chunk = 16;
  o.topk = 8;
  o.values = compress::ValueEncoding::Bf16;
  const auto [names, params] = expect_exact_resume(*world, o, 5, 9, "preconditioned");
  EXPECT_EQ(names.count("grad_sq.0"), 1u);
  for (const at::Tensor& p : params) {  // every replica holds rank 0's parameters
    at::Tensor root = p.detach().clone();
    world->broadcast(root, 0);
    EXPECT_TRUE(at::equal(root, p.detach()));
  }
}

TEST(DemoMpi, ScheduleChangesEqualFreshOptimizersWithTheirOptions) {
  // set_schedule between steps (what --link-budget auto does): top-k, values and the interval
  // changed twice during a run equal three optimizers, each made with its segment's options as
  // fixed ones and continuing from the previous one's state (residuals, AdamW's moments), bit
  // for bit every step; the bytes sent are each segment's closed form.
  auto world = test_world();
  struct Segment {
    int64_t steps;
    optim::ExchangeSchedule schedule;
  };
  const std::vector<Segment> segments = {{3, {8, compress::ValueEncoding::Bf16, 1}},
                                         {4, {4, compress::ValueEncoding::TwoBit, 2}},
                                         {3, {12, compress::ValueEncoding::Fp32, 1}}};
  for (auto inner : {optim::InnerKind::Sgd, optim::InnerKind::AdamW}) {
    optim::OptimizerOptions o = optim::preset(optim::Preset::DeMo);
    o.lr = 0.01;
    o.inner = inner;
    o.sign = inner == optim::InnerKind::Sgd;
    o.chunk = 16;
    o.topk = segments[0].schedule.topk;
    o.values = segments[0].schedule.values;
    std::vector<at::Tensor> a = make_params(), b = make_params();
    auto group = world->split(0, world->rank());
    optim::Optimizer changing(a, o, group);
    std::unique_ptr<optim::Optimizer> fixed;
    int step = 0;
    int64_t exchanges = 0;
    uint64_t bytes = 0;
    for (const Segment& segment : segments) {
      changing.set_schedule(segment.schedule);
      optim::OptimizerOptions segment_options = o;
      segment_options.topk = segment.schedule.topk;
      segment_options.values = segment.schedule.values;
      segment_options.replicate_every = segment.schedule.every;
      auto next =
          std::make_unique<optim::Optimizer>(b, segment_options, world->split(0, world->rank()));
      if (fixed) {
        std::map<std::string, at::Tensor> state;
        for (auto& [name, t] : fixed->state_tensors()) state[name] = t;
        for (auto& [name, t] : next->state_tensors()) t.copy_(state.at(name));
        next->restore_steps(step, {exchanges, 0});  // every segment ends with an exchange
      }
      fixed = std::move(next);
      EXPECT_EQ(changing.schedule(), segment.schedule);
      EXPECT_EQ(changing.schedule_in_flight(), segment.schedule);
      EXPECT_EQ(changing.wire_bytes(segment.schedule), fixed->traffic().wire_bytes);
      for (int k = 0; k < segment.steps; ++k, ++step) {
        set_gradients(a, world->rank(), step);
        set_gradients(b, world->rank(), step);
        changing.step();
        fixed->step();
        for (size_t i = 0; i < a.size(); ++i) {
          EXPECT_TRUE(at::equal(a[i], b[i]))
              << name_of(inner) << " parameter " << i << " step " << step + 1;
        }
      }
      const int64_t segment_exchanges = segment.steps / segment.schedule.every;
      exchanges += segment_exchanges;
      optim::OptimizerOptions closed = o;
      closed.topk = segment.schedule.topk;
      closed.values = segment.schedule.values;
      bytes +=
          segment_exchanges * (world->size() - 1) * closed_form_payload_bytes(plans_of(o), closed);
    }
    EXPECT_EQ(changing.counters().exchanges, exchanges);
    EXPECT_EQ(group->stats().bytes_sent, bytes);
    EXPECT_EQ(group->stats().collectives, uint64_t(exchanges));
    for (size_t i = 0; i < a.size(); ++i) {
      at::Tensor root = a[i].detach().clone();
      world->broadcast(root, 0);
      EXPECT_TRUE(at::equal(a[i], root)) << "replicas differ, parameter " << i;
    }
  }
}

TEST(DemoMpi, ScheduleChangesUnderOverlapStepDecodeWhatWasSent) {
  // --overlap-step with the top-k and values changed while an exchange is in flight: that one is
  // decoded as it was sent, the next goes out in the new layout. The committed parameters after
  // step t + 1 stay the blocking run's after step t (both changed before the same steps), and a
  // fresh optimizer given the schedule in use, the state and the counters after such a change
  // continues bit for bit.
  auto world = test_world();
  const optim::OptimizerOptions o = bf16_options();
  optim::OptimizerOptions overlapped = o;
  overlapped.overlap_step = true;
  const std::map<int, optim::ExchangeSchedule> changes = {
      {3, {4, compress::ValueEncoding::TwoBit, 1}}, {6, {16, compress::ValueEncoding::Fp32, 1}}};
  std::vector<at::Tensor> a = make_params(), b = make_params(), c = make_params();
  optim::Optimizer blocking(a, o, world->split(0, world->rank()));
  optim::Optimizer overlap(b, overlapped, world->split(0, world->rank()));
  std::unique_ptr<optim::Optimizer> resumed;
  std::vector<at::Tensor> previous;
  for (auto& p : a) previous.push_back(p.detach().clone());
  const int steps = 9;
  for (int step = 0; step < steps; ++step) {
    if (changes.count(step)) {
      const optim::ExchangeSchedule was = overlap.schedule_in_flight();
      blocking.set_schedule(changes.at(step));
      overlap.set_schedule(changes.at(step));
      if (resumed) resumed->set_schedule(changes.at(step));
      EXPECT_EQ(overlap.schedule_in_flight(), was) << "the exchange in flight keeps its layout";
      EXPECT_EQ(overlap.schedule(), changes.at(step));
    }
    set_gradients(a, world->rank(), step);
    set_gradients(b, world->rank(), step);
    blocking.step();
    overlap.step();
    if (resumed) {
      set_gradients(c, world->rank(), step);
      resumed->step();
      for (size_t i = 0; i < b.size(); ++i) {
        EXPECT_TRUE(at::equal(b[i], c[i])) << "resumed, parameter " << i << " step " << step + 1;
      }
    }
    const std::vector<at::Tensor> committed = overlap.replicated_params();
    for (size_t i = 0; i < b.size(); ++i) {
      const at::Tensor mine = committed[i].reshape(b[i].sizes());
      EXPECT_TRUE(at::equal(mine, previous[i])) << "parameter " << i << " step " << step + 1;
      at::Tensor root = mine.clone();
      world->broadcast(root, 0);
      EXPECT_TRUE(at::equal(mine, root)) << "replicas differ, parameter " << i;
      previous[i] = a[i].detach().clone();
    }
    if (step == 3) {  // right after the first change: the exchange in flight is in the new layout
      EXPECT_EQ(overlap.schedule_in_flight(), changes.at(3));
      resumed = std::make_unique<optim::Optimizer>(c, overlapped, world->split(0, world->rank()));
      resumed->set_schedule(overlap.schedule_in_flight());
      at::NoGradGuard no_grad;
      std::map<std::string, at::Tensor> state;
      for (auto& [name, t] : overlap.state_tensors()) state[name] = t.clone();
      for (auto& [name, t] : resumed->state_tensors()) t.copy_(state.at(name));
      for (size_t i = 0; i < b.size(); ++i) c[i].detach().copy_(b[i].detach());
      resumed->restore_steps(step + 1, overlap.counters());
      resumed->set_schedule(overlap.schedule());
    }
  }
}

TEST(DemoMpi, TransformNoneSelectsTheResidualsOwnEntries) {
  // transform none: each replica keeps the top-k of lr * grad's own entries in every chunk, and
  // the update is, per entry, the mean over the replicas that kept it. Two steps (the second
  // carries the first's residual, less what it sent) against a float64 replay of every replica.
  auto world = test_world();
  const int P = world->size();
  optim::OptimizerOptions o = optim::preset(optim::Preset::DeMo);
  o.lr = 0.05;
  o.topk = 5;
  o.chunk = 8;
  o.sign = false;
  o.decay = 0.9;
  o.transform = optim::Transform::None;
  std::vector<at::Tensor> params = make_params();
  optim::Optimizer demo(params, o, world->split(0, world->rank()));
  const int steps = 2;
  for (int step = 0; step < steps; ++step) {
    set_gradients(params, world->rank(), step);
    demo.step();
  }
  for (size_t i = 0; i < kShapes.size(); ++i) {
    const dct::ChunkPlan plan = demo.chunk_plan(i);
    const int64_t R = plan.row_chunks(), C = plan.col_chunks(), h = plan.chunk_rows,
                  w = plan.chunk_cols;
    // [rows, cols] float64 <-> [chunks, h * w], chunks row-major (divisor plans: no padding).
    auto to_chunks = [&](const at::Tensor& t) {
      return t.reshape({R, h, C, w}).permute({0, 2, 1, 3}).reshape({R * C, h * w});
    };
    auto from_chunks = [&](const at::Tensor& t) {
      return t.reshape({R, C, h, w}).permute({0, 2, 1, 3}).reshape({plan.rows, plan.cols});
    };
    at::Tensor expected = make_params()[i].detach().to(at::kDouble).reshape({plan.rows, plan.cols});
    std::vector<at::Tensor> residuals(P);
    for (int q = 0; q < P; ++q) residuals[q] = at::zeros({R * C, h * w}, at::kDouble);
    for (int step = 0; step < steps; ++step) {
      at::Tensor sum = at::zeros({R * C, h * w}, at::kDouble), count = at::zeros_like(sum);
      for (int q = 0; q < P; ++q) {
        std::vector<at::Tensor> replica = make_params();
        set_gradients(replica, q, step);
        at::Tensor& r = residuals[q];
        r = o.decay * r + o.lr * to_chunks(replica[i].grad().to(at::kDouble));
        const at::Tensor kept = std::get<1>(r.abs().topk(std::min(o.topk, h * w), 1));
        const at::Tensor mask = at::zeros_like(r).scatter_(1, kept, 1.0);
        sum += r * mask;
        count += mask;
        r = r * (1 - mask);
      }
      expected -= o.lr * from_chunks(at::where(count > 0, sum / count.clamp_min(1), sum));
    }
    EXPECT_TRUE(at::allclose(params[i].detach().to(at::kDouble).reshape({plan.rows, plan.cols}),
                             expected, 1e-5, 1e-6))
        << "parameter " << i;
  }
}

namespace {

struct PeerFaultCase {
  const char* name;
  compress::Tamper how;
  double factor;
  optim::PeerFault::Kind kind;
};
const PeerFaultCase kPeerFaults[] = {
    {"nan", compress::Tamper::Scale, NAN, optim::PeerFault::Kind::NonFinite},
    {"scale=1000", compress::Tamper::Scale, 1000.0, optim::PeerFault::Kind::OutOfScale},
    {"corrupt", compress::Tamper::Corrupt, 1.0, optim::PeerFault::Kind::Corrupt}};

}  // namespace

TEST(DemoMpi, FaultyPeerIsLeftOutAlikeEverywhereAsIfItWereAbsent) {
  // The last rank sends tampered payloads every step: under the drop policy every replica (the
  // faulty one too) names it for every tensor and applies the mean of the others alone, bit for
  // bit what the healthy ranks compute as a replica group of their own.
  auto world = test_world();
  const int faulty = world->size() - 1;
  const bool healthy = world->rank() != faulty;
  const auto others = world->split(healthy ? 0 : 1, world->rank());
  for (const PeerFaultCase& c : kPeerFaults) {
    for (auto values : values_of<compress::ValueEncoding>()) {
      const std::string what = std::string(c.name) + " " + name_of(values);
      optim::OptimizerOptions o = bf16_options();
      o.values = values;
      o.sign = false;  // the mean's size counts too
      std::vector<at::Tensor> params = make_params(), alone = make_params();
      optim::Optimizer demo(params, o, world->split(0, world->rank()));
      optim::Optimizer reference(alone, o, others);
      const int steps = 2;
      for (int step = 0; step < steps; ++step) {
        set_gradients(params, world->rank(), step);
        set_gradients(alone, world->rank(), step);
        if (!healthy) demo.tamper_next_exchange(c.how, c.factor);
        demo.step();
        reference.step();
      }
      const std::vector<optim::PeerFault> faults = demo.take_peer_faults();
      ASSERT_EQ(faults.size(), steps * kShapes.size()) << what;
      for (size_t f = 0; f < faults.size(); ++f) {
        EXPECT_EQ(faults[f].replica, faulty) << what;
        EXPECT_EQ(faults[f].tensor, f % kShapes.size()) << what;
        EXPECT_EQ(int(faults[f].kind), int(c.kind)) << what << ": " << faults[f].describe();
        if (c.kind == optim::PeerFault::Kind::OutOfScale) {
          EXPECT_GT(faults[f].ratio, 100.0) << what;
        }
      }
      EXPECT_TRUE(demo.take_peer_faults().empty()) << "taken once";
      for (size_t i = 0; i < params.size(); ++i) {
        at::Tensor mine = params[i].detach().clone(), root = mine.clone();
        world->broadcast(root, 0);
        EXPECT_TRUE(at::equal(mine, root)) << what << ": parameter " << i << " differs";
        if (healthy) {
          EXPECT_TRUE(at::equal(mine, alone[i].detach())) << what << ": parameter " << i;
        }
      }
    }
  }
}

TEST(DemoMpi, AReplicasOwnCorruptPayloadIsNotPreviewedUnderOverlap) {
  // --overlap-step previews each replica's own payloads, which nobody screens: a corrupt one (the
  // test aid) is skipped there (the faulty replica keeps its committed parameters) and left out
  // of everyone's mean one step later, every replica alike.
  auto world = test_world();
  const int faulty = world->size() - 1;
  optim::OptimizerOptions o = bf16_options();
  o.overlap_step = true;
  std::vector<at::Tensor> params = make_params();
  optim::Optimizer demo(params, o, world->split(0, world->rank()));
  for (int step = 0; step < 3; ++step) {
    set_gradients(params, world->rank(), step);
    const bool corrupt = world->rank() == faulty && step == 1;
    if (corrupt) demo.tamper_next_exchange(compress::Tamper::Corrupt, 1.0);
    demo.step();
    const std::vector<at::Tensor> committed = demo.replicated_params();
    for (size_t i = 0; i < params.size(); ++i) {  // previewed: the parameters moved past them
      const at::Tensor p = params[i].detach().reshape(committed[i].sizes());
      EXPECT_EQ(at::equal(p, committed[i]), corrupt)
          << "step " << step << " rank " << world->rank() << " tensor " << i;
    }
  }
  const std::vector<optim::PeerFault> faults = demo.take_peer_faults();
  ASSERT_EQ(faults.size(), kShapes.size());  // step 1's payloads, decoded at step 2
  for (const optim::PeerFault& f : faults) EXPECT_EQ(f.replica, faulty);
  for (const at::Tensor& p : demo.replicated_params()) {
    at::Tensor root = p.clone();
    world->broadcast(root, 0);
    EXPECT_TRUE(at::equal(p, root));
  }
}

TEST(DemoMpi, FaultyPeerStopsEveryReplicaUnderTheStopPolicy) {
  auto world = test_world();
  const int faulty = world->size() - 1;
  for (const PeerFaultCase& c : kPeerFaults) {
    optim::OptimizerOptions o = bf16_options();
    o.peer_policy = optim::PeerPolicy::Stop;
    std::vector<at::Tensor> params = make_params();
    optim::Optimizer demo(params, o, world->split(0, world->rank()));
    set_gradients(params, world->rank(), 0);
    if (world->rank() == faulty) demo.tamper_next_exchange(c.how, c.factor);
    try {
      demo.step();
      ADD_FAILURE() << c.name << ": no error";
    } catch (const optim::PeerFaultError& e) {
      EXPECT_EQ(e.fault().replica, faulty) << c.name;
      EXPECT_EQ(e.fault().tensor, 0u) << c.name;  // the first found
      EXPECT_EQ(int(e.fault().kind), int(c.kind)) << c.name << ": " << e.what();
    }
  }
}

TEST(DemoMpi, HealthyPeersWithinTheScaleBoundAreKept) {
  // Replicas of different gradients, 20 steps: nothing is left out at the default bound, and a
  // bound of 1.0001 flags every payload above the lower median (so the check is live).
  auto world = test_world();
  optim::OptimizerOptions o = bf16_options();
  std::vector<at::Tensor> params = make_params();
  optim::Optimizer demo(params, o, world->split(0, world->rank()));
  for (int step = 0; step < 20; ++step) {
    set_gradients(params, world->rank(), step);
    demo.step();
  }
  EXPECT_TRUE(demo.take_peer_faults().empty());
  o.peer_scale_bound = 1.0001;
  std::vector<at::Tensor> tight_params = make_params();
  optim::Optimizer tight(tight_params, o, world->split(0, world->rank()));
  set_gradients(tight_params, world->rank(), 0);
  tight.step();
  EXPECT_FALSE(tight.take_peer_faults().empty());
}

// ====== The owners' exchange (--demo-exchange owners) ======
namespace {

optim::OptimizerOptions owners_options(compress::ValueEncoding values) {
  optim::OptimizerOptions o = bf16_options();
  o.values = values;
  o.demo_exchange = optim::DemoExchange::Owners;
  return o;
}

// The owners' exchange in float64, written from its description (docs/algorithm.md): every
// replica's residual in the DCT domain (per chunk, direct-formula bases), the tensors' chunk
// rows cut into R runs of about equal payload bytes (run r: replica r's), each replica's top-k
// per chunk out of its residual, the owner's mean of the replicas that chose a coefficient, its
// own top owner_topk of that mean (owner_feedback senders: what it leaves out back into its
// senders' residuals) or of the mean added to the owner's decayed residual (owner: what it
// leaves out kept there), and the step by the inverse DCT of what it kept (sign off, no weight
// decay, fp32 values both ways). Divisor chunks only (no padding).
struct NaiveOwners {
  std::vector<dct::ChunkPlan> plans;
  optim::OptimizerOptions o = optim::preset(optim::Preset::DeMo);
  int R;
  std::vector<std::vector<at::Tensor>> residual;  // [replica][tensor] float64 coefficients
  std::vector<std::vector<int>> owner;            // [tensor][chunk row]
  std::vector<at::Tensor> params;                 // float64 [rows, cols]
  std::vector<at::Tensor> owner_residual;         // [tensor]: every owner's rows together

  NaiveOwners(const std::vector<dct::ChunkPlan>& p, const optim::OptimizerOptions& options,
              int replicas, const std::vector<at::Tensor>& init)
      : plans(p), o(options), R(replicas), residual(size_t(replicas)), owner(p.size()) {
    double total = 0.0;
    for (const auto& plan : plans) total += double(closed_form_payload_bytes({plan}, o));
    double before = 0.0;
    for (size_t t = 0; t < plans.size(); ++t) {
      const double row = double(closed_form_payload_bytes({plans[t]}, o)) / plans[t].row_chunks();
      for (int64_t i = 0; i < plans[t].row_chunks(); ++i) {
        owner[t].push_back(std::min(R - 1, int((before + row / 2) * R / total)));
        before += row;
      }
      params.push_back(init[t].detach().to(at::kDouble).reshape({plans[t].rows, plans[t].cols}));
      for (int q = 0; q < R; ++q) residual[q].push_back(at::zeros_like(params.back()));
      owner_residual.push_back(at::zeros_like(params.back()));
    }
  }

  // The per-chunk transform (inverse: the transposes) of a [rows, cols] float64 tensor.
  at::Tensor transform(const at::Tensor& x, const dct::ChunkPlan& plan, bool inverse) const {
    const at::Tensor bh = naive_dct_basis(plan.chunk_rows), bw = naive_dct_basis(plan.chunk_cols);
    at::Tensor out = at::empty_like(x);
    for (int64_t i = 0; i < plan.row_chunks(); ++i) {
      for (int64_t j = 0; j < plan.col_chunks(); ++j) {
        const at::Tensor c = x.narrow(0, i * plan.chunk_rows, plan.chunk_rows)
                                 .narrow(1, j * plan.chunk_cols, plan.chunk_cols);
        out.narrow(0, i * plan.chunk_rows, plan.chunk_rows)
            .narrow(1, j * plan.chunk_cols, plan.chunk_cols)
            .copy_(inverse ? at::mm(at::mm(bh.t(), c), bw) : at::mm(at::mm(bh, c), bw.t()));
      }
    }
    return out;
  }

  // Each chunk's `count` largest magnitudes of x (the rest zero), and where they are.
  std::pair<at::Tensor, at::Tensor> topk(const at::Tensor& x, const dct::ChunkPlan& plan,
                                         int64_t count) const {
    at::Tensor kept = at::zeros_like(x), where = at::zeros_like(x);
    const int64_t k = std::min(count, plan.chunk_numel());
    for (int64_t i = 0; i < plan.row_chunks(); ++i) {
      for (int64_t j = 0; j < plan.col_chunks(); ++j) {
        auto chunk = [&](const at::Tensor& t) {
          return t.narrow(0, i * plan.chunk_rows, plan.chunk_rows)
              .narrow(1, j * plan.chunk_cols, plan.chunk_cols);
        };
        const at::Tensor c = chunk(x).reshape(-1);
        std::vector<int64_t> order(size_t(c.numel()));
        for (size_t q = 0; q < order.size(); ++q) order[q] = int64_t(q);
        auto v = c.accessor<double, 1>();
        std::stable_sort(order.begin(), order.end(),
                         [&](int64_t a, int64_t b) { return std::fabs(v[a]) > std::fabs(v[b]); });
        at::Tensor kc = at::zeros_like(c), wc = at::zeros_like(c);
        for (int64_t q = 0; q < k; ++q) kc[order[q]] = v[order[q]], wc[order[q]] = 1.0;
        chunk(kept).copy_(kc.view({plan.chunk_rows, plan.chunk_cols}));
        chunk(where).copy_(wc.view({plan.chunk_rows, plan.chunk_cols}));
      }
    }
    return {kept, where};
  }

  void step(const std::vector<std::vector<at::Tensor>>& grads) {  // [replica][tensor]
    for (size_t t = 0; t < plans.size(); ++t) {
      const dct::ChunkPlan& plan = plans[t];
      at::Tensor sum = at::zeros_like(params[t]), count = at::zeros_like(params[t]);
      std::vector<at::Tensor> sent(static_cast<size_t>(R));
      for (int q = 0; q < R; ++q) {
        at::Tensor& d = residual[q][t];
        d = o.decay * d +
            o.lr * transform(grads[q][t].reshape({plan.rows, plan.cols}), plan, false);
        at::Tensor where;
        std::tie(sent[q], where) = topk(d, plan, o.topk);
        d -= sent[q];
        sum += sent[q];
        count += where;
      }
      const at::Tensor mean = at::where(count > 0, sum / count.clamp_min(1), at::zeros_like(sum));
      if (o.owner_feedback == optim::OwnerFeedback::Owner) {
        owner_residual[t] = o.decay * owner_residual[t] + mean;
        const at::Tensor kept = topk(owner_residual[t], plan, o.owner_topk).first;
        owner_residual[t] -= kept;
        params[t] -= o.lr * transform(kept, plan, true);
        continue;
      }
      const auto [kept, taken] = topk(mean, plan, o.owner_topk);
      for (int q = 0; q < R; ++q) residual[q][t] += sent[q] * (1 - taken);
      params[t] -= o.lr * transform(kept, plan, true);
    }
  }

  // Replica q's share of the owners' residual: its rows of owner_residual[t], zero elsewhere.
  at::Tensor owned_by(int q, size_t t) const {
    at::Tensor out = at::zeros_like(owner_residual[t]);
    const int64_t rows = plans[t].chunk_rows;
    for (int64_t i = 0; i < plans[t].row_chunks(); ++i) {
      if (owner[t][i] == q) {
        out.narrow(0, i * rows, rows).copy_(owner_residual[t].narrow(0, i * rows, rows));
      }
    }
    return out;
  }
};

at::Tensor state_named(const optim::Optimizer& demo, const std::string& name) {
  for (const auto& [n, t] : demo.state_tensors()) {
    if (n == name) return t;
  }
  ADD_FAILURE() << "no optimizer state " << name;
  return {};
}

}  // namespace

TEST(DemoMpi, OwnersEqualFloat64Reference) {
  // Every rank replays every replica in float64 and compares its own parameters, residuals and
  // share of the owners' residual with the reference's after each step: the owners' mean, their
  // top-6 (more than a replica's top-4, fewer than the replicas send together) and what they
  // leave out included, for either feedback.
  for (auto feedback : values_of<optim::OwnerFeedback>()) {
    SCOPED_TRACE(name_of(feedback));
    auto world = test_world();
    const int R = world->size(), me = world->rank();
    optim::OptimizerOptions o = owners_options(compress::ValueEncoding::Fp32);
    o.sign = false;
    o.decay = 0.9;
    o.lr = 0.05;
    o.topk = 4;
    o.owner_topk = 6;
    o.owner_values = compress::ValueEncoding::Fp32;
    o.owner_feedback = feedback;
    o.chunk = 8;
    std::vector<at::Tensor> params = make_params();
    optim::Optimizer demo(params, o, world->split(0, me));
    NaiveOwners naive(plans_of(o), o, R, make_params());
    std::set<int> owners;
    for (const auto& rows : naive.owner) owners.insert(rows.begin(), rows.end());
    EXPECT_EQ(int(owners.size()), R) << "every replica owns some chunk rows";
    for (int step = 0; step < 5; ++step) {
      std::vector<std::vector<at::Tensor>> grads;
      for (int q = 0; q < R; ++q) {
        std::vector<at::Tensor> replica = make_params();
        set_gradients(replica, q, step);
        grads.emplace_back();
        for (auto& p : replica) grads.back().push_back(p.grad().to(at::kDouble));
      }
      set_gradients(params, me, step);
      demo.step();
      naive.step(grads);
      for (size_t t = 0; t < params.size(); ++t) {
        const dct::ChunkPlan& plan = naive.plans[t];
        const at::Tensor got = params[t].detach().to(at::kDouble).reshape({plan.rows, plan.cols});
        EXPECT_LT((got - naive.params[t]).abs().max().item<double>(), 1e-5)
            << "parameter " << t << " step " << step + 1;
        const at::Tensor residual = demo.residual(t).to(at::kDouble);
        EXPECT_LT((residual - naive.residual[me][t]).abs().max().item<double>(), 1e-5)
            << "residual " << t << " step " << step + 1;
        if (feedback == optim::OwnerFeedback::Owner) {
          const at::Tensor held =
              state_named(demo, "owner_residual." + std::to_string(t)).to(at::kDouble);
          EXPECT_LT((held - naive.owned_by(me, t)).abs().max().item<double>(), 1e-5)
              << "owner residual " << t << " step " << step + 1;
        }
      }
    }
    // (The chunks of 8 x 8 hold more than the owners' 6; the smaller ones may not.)
    if (feedback == optim::OwnerFeedback::Owner) {
      EXPECT_GT(naive.owner_residual[0].abs().max().item<double>(), 0.0)
          << "an owner left some out";
    }
  }
}

TEST(DemoMpi, OwnersKeepReplicasBitIdenticalWithinTwoPayloads) {
  // Every encoding: replicas stay bit-identical, and each moves at most two all-gather payloads
  // a step each way (2 (R - 1) / R of one: the owners return no more bytes than they receive,
  // plus the pieces' own headers), where the all-gather moves R - 1.
  auto world = test_world();
  for (auto values : values_of<compress::ValueEncoding>()) {
    const optim::OptimizerOptions o = owners_options(values);
    auto group = world->split(0, world->rank());
    const int steps = 10;
    train_and_expect_identical(*world, o, group, steps);
    const uint64_t payload = closed_form_payload_bytes(plans_of(o), o);
    EXPECT_LE(group->stats().bytes_sent, uint64_t(steps) * 2 * payload) << name_of(values);
    EXPECT_LE(group->stats().bytes_received, uint64_t(steps) * 2 * payload) << name_of(values);
    EXPECT_GT(group->stats().bytes_received, 0u);
    EXPECT_EQ(group->stats().collectives, uint64_t(2 * steps));  // an all-to-all, an all-gather
  }
}

TEST(DemoMpi, OwnersResumeExactlyFromTheirState) {
  // The owners' state: the residuals, and with owner_feedback owner the owner's residual and the
  // replicas it was kept among. A run stopped after step 4 and continued by a fresh optimizer
  // from it equals the run that never stopped, bit for bit.
  auto world = test_world();
  for (auto feedback : values_of<optim::OwnerFeedback>()) {
    optim::OptimizerOptions o = owners_options(compress::ValueEncoding::TwoBit);
    o.owner_feedback = feedback;
    const auto names = expect_exact_resume(*world, o, 4, 8, name_of(feedback)).first;
    EXPECT_EQ(names.count("residual.0"), 1u);
    const bool owner = feedback == optim::OwnerFeedback::Owner;
    EXPECT_EQ(names.count("owner_residual.0") + names.count("owner_replicas"), owner ? 2u : 0u);
    EXPECT_EQ(names.size(), owner ? 2 * kShapes.size() + 1 : kShapes.size());
  }
}

TEST(DemoMpi, OwnersWithInnerStepsResumeExactly) {
  // --inner-steps 3 through the owners' exchange (the owner's residual and its count named
  // "outer.owner_residual.i" and "outer.owner_replicas"): stopped mid-round after step 4 and
  // continued from the state it named, bit for bit.
  auto world = test_world();
  optim::OptimizerOptions o = optim::preset(optim::Preset::DeMo);
  o.lr = 0.01;
  o.inner_steps = 3;
  o.chunk = 16;
  o.demo_exchange = optim::DemoExchange::Owners;
  const auto names = expect_exact_resume(*world, o, 4, 9, "owners, inner steps").first;
  EXPECT_EQ(names.count("outer.owner_residual.0") + names.count("outer.owner_replicas"), 2u);
}

TEST(DemoMpi, OwnersResidualGoesToTheSendersWhereOwnersChange) {
  // What an owner holds in rows it does not own goes into its own residual: the rows another
  // replica owns when the top-k re-cuts the pieces (the link budget), R times over, so that the
  // replicas' mean of their residuals plus the owners' residuals (one quantity, in the mean's
  // units) is kept, and afterwards every owner holds only its own rows; and all of it when a
  // load says it was kept among another number of replicas (an elastic checkpoint's): here 1,
  // continued by all R, each taking it once (R / R).
  auto world = test_world();
  const int R = world->size(), me = world->rank();
  optim::OptimizerOptions o = owners_options(compress::ValueEncoding::Fp32);
  o.owner_values = compress::ValueEncoding::Fp32;
  o.chunk = 8;
  o.topk = 4;
  std::vector<at::Tensor> params = make_params();
  optim::Optimizer demo(params, o, world->split(0, me));
  for (int step = 0; step < 4; ++step) {
    set_gradients(params, me, step);
    demo.step();
  }
  const size_t T = kShapes.size();
  auto residual = [&](size_t t) { return state_named(demo, "residual." + std::to_string(t)); };
  auto held = [&](size_t t) { return state_named(demo, "owner_residual." + std::to_string(t)); };
  // The mean's quantity, summed over every replica (float64: the folds add in float32).
  auto total = [&](size_t t) {
    at::Tensor mine = (residual(t).to(at::kDouble) / R + held(t).to(at::kDouble)).contiguous();
    world->all_reduce(mine, comm::ReduceOp::Sum);
    return mine;
  };
  auto expect_kept = [&](const std::vector<at::Tensor>& before, const std::string& what) {
    for (size_t t = 0; t < T; ++t) {
      const at::Tensor after = total(t);
      const double scale = before[t].abs().max().item<double>();
      EXPECT_LE((after - before[t]).abs().max().item<double>(), 4 * R * 1.2e-7 * scale)
          << what << ": tensor " << t;
    }
  };
  // 1. The top-k re-cuts the pieces: rows whose owner changed go to their senders.
  std::vector<at::Tensor> before;
  for (size_t t = 0; t < T; ++t) before.push_back(total(t));
  optim::OptimizerOptions recut = o;
  recut.topk = 40;
  const NaiveOwners was(plans_of(o), o, R, make_params()),
      now(plans_of(recut), recut, R, make_params());
  ASSERT_NE(was.owner, now.owner) << "top-k 40 must move some rows to another owner";
  at::Tensor moving = at::zeros({1}, at::kDouble);  // what the moved rows hold, every replica's
  for (size_t t = 0; t < T; ++t) {
    const dct::ChunkPlan& plan = now.plans[t];
    for (int64_t i = 0; i < plan.row_chunks(); ++i) {
      if (was.owner[t][i] == me && now.owner[t][i] != me) {
        moving +=
            held(t).narrow(0, i * plan.chunk_rows, plan.chunk_rows).abs().sum().to(at::kDouble);
      }
    }
  }
  world->all_reduce(moving, comm::ReduceOp::Sum);
  EXPECT_GT(moving.item<double>(), 0.0) << "the rows that move hold something";
  demo.set_schedule({recut.topk, recut.values, 1});
  expect_kept(before, "re-cut");
  for (size_t t = 0; t < T; ++t) {
    const dct::ChunkPlan& plan = now.plans[t];
    for (int64_t i = 0; i < plan.row_chunks(); ++i) {
      if (now.owner[t][i] == me) continue;
      EXPECT_EQ(held(t).narrow(0, i * plan.chunk_rows, plan.chunk_rows).abs().max().item<double>(),
                0.0)
          << "tensor " << t << " chunk row " << i << " (another's) after the re-cut";
    }
  }
  // 2. State kept among 1 replica, which all R continue: all of it, once (R / R).
  for (int step = 4; step < 6; ++step) {
    set_gradients(params, me, step);
    demo.step();
  }
  std::vector<at::Tensor> residuals, helds;
  for (size_t t = 0; t < T; ++t) {
    residuals.push_back(residual(t).clone());
    helds.push_back(held(t).clone());
  }
  at::Tensor most = at::zeros({1}, at::kDouble);  // over every replica
  for (const at::Tensor& h : helds) most += h.abs().max().to(at::kDouble);
  world->all_reduce(most, comm::ReduceOp::Sum);
  EXPECT_GT(most.item<double>(), 0.0) << "some owner left some out";
  state_named(demo, "owner_replicas").fill_(1);
  demo.restore_steps(6);
  for (size_t t = 0; t < T; ++t) {
    EXPECT_TRUE(at::allclose(residual(t), residuals[t] + helds[t], 1e-6, 1e-7)) << "tensor " << t;
    EXPECT_EQ(held(t).abs().max().item<double>(), 0.0) << "tensor " << t;
  }
  EXPECT_EQ(state_named(demo, "owner_replicas").item<double>(), double(R));
}
