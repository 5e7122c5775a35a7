// A whole `run_training` on real ranks: checkpoints and exact resumes, the step's collectives,
// replica drift, non-finite steps, the documented outputs, --max-time and T5 runs.
#include "test_mpi.h"

#include "flexdemo/data.h"
#include "flexdemo/model.h"
#include "flexdemo/optim.h"
#include "flexdemo/safetensors.h"
#include "flexdemo/shard.h"
#include "flexdemo/text.h"
#include "flexdemo/train.h"
#include "train/checkpoint_store.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

using namespace flexdemo;
namespace fs = std::filesystem;

namespace {

// A tiny training configuration on a corpus written into dir (by rank 0).
train::TrainConfig tiny_run(const fs::path& dir) {
  auto world = test_world();
  if (world->rank() == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir / "corpus");
    std::ofstream text(dir / "corpus" / "text");
    for (int d = 0; d < 200; ++d) text << "document number " << d << " says hello to all.\n%\n";
  }
  world->barrier();
  train::TrainConfig c;
  c.model = "gpt-nano";
  c.width = 16, c.layers = 1, c.heads = 2, c.context = 16;
  c.data = (dir / "corpus").string();
  c.tokenizer = train::TokenizerKind::Bytes;
  c.steps = 3;
  c.batch = 4;
  c.seq = 16;
  c.eval_seqs = 4;
  c.chunk = 8;
  c.warmup = 1;
  c.out = (dir / "run").string();
  return c;
}

}  // namespace

// The options left unset resolve per optimizer as docs/options.md says: flexdemo takes the
// RMS-capped adaptive step (docs/results/loss-parity.md), the others the reference DeMo's settings;
// what a user sets is kept.
TEST(TrainOptions, DefaultsResolvePerOptimizer) {
  using compress::ValueEncoding;
  auto resolved = [](const std::function<void(train::TrainConfig&)>& set) {
    train::TrainConfig c;
    set(c);
    c.resolve();
    return c;
  };
  const train::TrainConfig flexdemo = resolved([](train::TrainConfig&) {});
  EXPECT_FALSE(flexdemo.sign);
  EXPECT_TRUE(flexdemo.precondition.value());
  EXPECT_FALSE(flexdemo.fold_lr.value());
  EXPECT_EQ(flexdemo.rms_cap.value(), 1.0);
  EXPECT_EQ(flexdemo.topk.value(), 112);
  EXPECT_EQ(flexdemo.values.value(), ValueEncoding::Fp8);

  EXPECT_EQ(resolved([](train::TrainConfig& c) { c.sign = true; }).rms_cap.value(), 0.0);
  EXPECT_EQ(resolved([](train::TrainConfig& c) { c.update_rms = 0.5; }).rms_cap.value(), 0.0);
  EXPECT_EQ(resolved([](train::TrainConfig& c) { c.chunk = 8; }).topk.value(), 64);
  EXPECT_FALSE(resolved([](train::TrainConfig& c) { c.inner_steps = 10; }).precondition.value());

  const train::TrainConfig adamw =
      resolved([](train::TrainConfig& c) { c.optimizer = train::OptimizerKind::FlexDemoAdamW; });
  EXPECT_FALSE(adamw.sign);
  EXPECT_FALSE(adamw.precondition.value());
  EXPECT_TRUE(adamw.fold_lr.value());
  EXPECT_EQ(adamw.rms_cap.value(), 0.0);
  EXPECT_EQ(adamw.topk.value(), 32);
  EXPECT_EQ(adamw.values.value(), ValueEncoding::Bf16);

  const train::TrainConfig chosen = resolved([](train::TrainConfig& c) {
    c.topk = 16, c.values = ValueEncoding::TwoBit, c.precondition = false, c.rms_cap = 0.5;
  });
  EXPECT_EQ(chosen.topk.value(), 16);
  EXPECT_EQ(chosen.values.value(), ValueEncoding::TwoBit);
  EXPECT_FALSE(chosen.precondition.value());
  EXPECT_EQ(chosen.rms_cap.value(), 0.5);
}

TEST(Checkpoint, SafetensorsRoundTripAndRejection) {
  const fs::path path = fs::temp_directory_path() /
                        ("flexdemo-st-" + std::to_string(test_world()->rank()) + ".safetensors");
  const train::NamedTensors tensors = {{"a.weight", at::randn({3, 5})},
                                       {"b", at::arange(7, at::kLong)},
                                       {"c", at::randn({2}).to(at::kBFloat16)},
                                       {"d", at::zeros({0}, at::kByte)}};
  train::write_safetensors(path.string(), tensors, {{"format", "pt"}});
  const train::NamedTensors back = train::read_safetensors(path.string());
  ASSERT_EQ(back.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(back[i].first, tensors[i].first);
    EXPECT_TRUE(at::equal(back[i].second, tensors[i].second)) << tensors[i].first;
  }
  // The layout Python's safetensors reads: u64 header length, JSON, 8-byte aligned data.
  std::ifstream in(path, std::ios::binary);
  uint64_t header = 0;
  in.read(reinterpret_cast<char*>(&header), 8);
  EXPECT_EQ(header % 8, 0u);
  EXPECT_EQ(fs::file_size(path), 8 + header + 15 * 4 + 7 * 8 + 2 * 2);
  fs::resize_file(path, fs::file_size(path) - 3);
  EXPECT_THROW(train::read_safetensors(path.string()), std::invalid_argument);
}

// The per-step training losses of a run, in order (one metrics line per step).
std::vector<double> step_losses(const fs::path& run) {
  std::ifstream metrics(run / "metrics.jsonl");
  std::vector<double> losses;
  for (std::string l; std::getline(metrics, l);) {
    const auto j = nlohmann::json::parse(l);
    EXPECT_EQ(j["step"].get<int64_t>(), int64_t(losses.size()) + 1);
    losses.push_back(j["loss"].get<double>());
  }
  return losses;
}

void expect_same_weights(const fs::path& a, const fs::path& b) {
  const auto wa = train::read_safetensors((a / "model.safetensors").string());
  const auto wb = train::read_safetensors((b / "model.safetensors").string());
  ASSERT_EQ(wa.size(), wb.size());
  for (size_t i = 0; i < wa.size(); ++i) {
    EXPECT_EQ(wa[i].first, wb[i].first);
    EXPECT_TRUE(at::equal(wa[i].second, wb[i].second)) << wa[i].first;
  }
}

// Run b (stopped and resumed) equals run a (uninterrupted), both `steps` steps in dir: every
// step's training loss bit for bit, and the last checkpoint's weights.
void expect_same_run(const fs::path& dir, const std::string& a, const std::string& b,
                     int64_t steps);

// Resumes the run `c` wrote (c.out) to c.steps, then expects it to equal the run dir/whole.
void expect_resumes_to_whole(train::TrainConfig c, const fs::path& dir) {
  auto world = test_world();
  c.resume = c.out;
  ASSERT_EQ(train::run_training(c, world), 0);
  world->barrier();
  expect_same_run(dir, "whole", fs::path(c.out).filename().string(), c.steps);
}

void expect_same_run(const fs::path& dir, const std::string& a, const std::string& b,
                     int64_t steps) {
  const std::vector<double> losses = step_losses(dir / a);
  ASSERT_EQ(losses.size(), size_t(steps));
  EXPECT_EQ(step_losses(dir / b), losses);
  const std::string last = "checkpoints/step-" + std::to_string(steps);
  expect_same_weights(dir / a / last, dir / b / last);
}

void flip_last_byte(const fs::path& file) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-5, std::ios::end);
  const char byte = char(f.get());
  f.seekp(-5, std::ios::end);
  f.put(char(~byte));
}

template <typename Fn>
std::string invalid_argument_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no std::invalid_argument)";
}

TEST(Checkpoint, OverlapStepResumesExactly) {
  // With --overlap-step a checkpoint holds an exchange still in flight, the committed
  // parameters and the preview in the model: 10 + resume + 10 steps equal 20 straight.
  auto world = test_world();
  const fs::path dir = fs::temp_directory_path() / "flexdemo-resume-overlap-test";
  train::TrainConfig c = tiny_run(dir);
  c.warmup = 0;
  c.min_lr_ratio = 1.0;
  c.overlap_step = true;
  c.check_replicas = 5;
  c.checkpoint_every = 10;
  c.steps = 20;
  c.out = (dir / "whole").string();
  ASSERT_EQ(train::run_training(c, world), 0);
  c.steps = 10;
  c.out = (dir / "halves").string();
  ASSERT_EQ(train::run_training(c, world), 0);
  c.steps = 20;
  expect_resumes_to_whole(c, dir);
}

TEST(Trainer, OneCollectiveOverTheWorldAStep) {
  // A step's non-finite check, stop vote and the step before's metrics travel in one collective
  // over the world, before its optimizer step, so that under --overlap-step nothing follows the
  // exchange onto the link between nodes until the next step's forward and backward are done.
  // Evaluation and checkpoint at the end only: 8 steps take exactly 4 more than 4 steps.
  auto world = test_world();
  const fs::path dir = fs::temp_directory_path() / "flexdemo-world-collectives-test";
  train::TrainConfig c = tiny_run(dir);
  c.overlap_step = true;
  const auto world_collectives = [&](int64_t steps) {
    c.steps = steps;
    c.out = (dir / std::to_string(steps)).string();
    const uint64_t before = world->stats().collectives;
    EXPECT_EQ(train::run_training(c, world), 0);
    return int64_t(world->stats().collectives - before);
  };
  const int64_t four = world_collectives(4);
  EXPECT_EQ(world_collectives(8) - four, 4);
  world->barrier();
  EXPECT_EQ(step_losses(dir / "8").size(), 8u);  // every step's metrics written, the last too
}

TEST(Trainer, ExchangeInBackwardEqualsExchangeAfterIt) {
  // --exchange-in-backward starts each unit's all-gather between nodes in the backward (its
  // bucket: one collective per unit) instead of one after it: on 2 nodes, GPT (the embeddings
  // used twice: the tied head) with two micro-batches per step, the losses of every step and
  // the final weights are the same, bit for bit, for sign-SGD and the AdamW inner optimizer.
  auto world = test_world();
  const fs::path dir = fs::temp_directory_path() / "flexdemo-exchange-in-backward-test";
  train::TrainConfig c = tiny_run(dir);
  c.ranks_per_node = world->size() / 2;
  c.steps = 4;
  c.micro_batch = 4 / world->size();
  if (c.micro_batch > 1) c.micro_batch /= 2;  // 2 ranks: 2 sequences each, as two micro-batches
  c.clip = 0;
  c.on_nonfinite = train::NonFinitePolicy::Stop;
  c.check_replicas = 1;
  const int64_t units = 2 + c.layers;  // embeddings, the blocks, ln_f
  for (const char* optimizer : {"flexdemo", "flexdemo-adamw"}) {
    c.optimizer = parse_name<train::OptimizerKind>(optimizer);
    c.exchange_in_backward = false;
    c.out = (dir / optimizer / "after").string();
    ASSERT_EQ(train::run_training(c, world), 0);
    c.exchange_in_backward = true;
    c.out = (dir / optimizer / "in").string();
    ASSERT_EQ(train::run_training(c, world), 0);
    world->barrier();
    const std::vector<double> after = step_losses(dir / optimizer / "after");
    ASSERT_EQ(after.size(), 4u);
    EXPECT_EQ(step_losses(dir / optimizer / "in"), after) << optimizer;
    expect_same_weights(dir / optimizer / "after/checkpoints/step-4",
                        dir / optimizer / "in/checkpoints/step-4");
    // Plus one per step: --check-replicas' comparison within the replica group.
    for (const auto& [run, collectives] : {std::pair{"after", int64_t(2)}, {"in", units + 1}}) {
      std::ifstream metrics(dir / optimizer / run / "metrics.jsonl");
      for (std::string l; std::getline(metrics, l);) {
        EXPECT_EQ(nlohmann::json::parse(l)["inter_collectives"].get<double>(), collectives)
            << optimizer << " " << run;
      }
    }
  }
  c.clip = 1.0;  // clipping needs the whole gradient before anything is sent
  EXPECT_NE(invalid_argument_of([&] {
              train::run_training(c, world);
            }).find("--exchange-in-backward needs --clip 0"),
            std::string::npos);
  c.clip = 0;
  c.on_nonfinite = train::NonFinitePolicy::Skip;
  EXPECT_NE(invalid_argument_of([&] {
              train::run_training(c, world);
            }).find("--exchange-in-backward needs --on-nonfinite stop"),
            std::string::npos);
}

// tiny_run's configuration `base` for `steps` steps at a constant learning rate (a shorter run
// must not end its schedule early), a checkpoint every 10 steps, written to dir/name.
train::TrainConfig checkpointed(train::TrainConfig c, const fs::path& dir, const std::string& name,
                                int64_t steps) {
  c.warmup = 0;
  c.min_lr_ratio = 1.0;
  c.checkpoint_every = 10;
  c.steps = steps;
  c.out = (dir / name).string();
  return c;
}

// In dir (made afresh): the run "whole" of `steps` steps uninterrupted, and the run `name` of its
// first `first` steps, whose configuration (for `steps` steps) is returned for a resume.
train::TrainConfig whole_and_first_part(const fs::path& dir, const std::string& name, int64_t steps,
                                        int64_t first) {
  auto world = test_world();
  const train::TrainConfig base = tiny_run(dir);
  EXPECT_EQ(train::run_training(checkpointed(base, dir, "whole", steps), world), 0);
  train::TrainConfig c = checkpointed(base, dir, name, first);
  EXPECT_EQ(train::run_training(c, world), 0);
  world->barrier();
  c.steps = steps;
  return c;
}

TEST(Checkpoint, ResumedRunEqualsUninterruptedRun) {
  const fs::path dir = fs::temp_directory_path() / "flexdemo-resume-test";
  const train::TrainConfig c = whole_and_first_part(dir, "halves", 40, 20);
  expect_resumes_to_whole(c, dir);
  EXPECT_FALSE(fs::exists(dir / "whole/checkpoints/step-20"));  // the newest 2 are kept
  EXPECT_TRUE(fs::exists(dir / "whole/checkpoints/step-30"));
}

TEST(Checkpoint, ResumeSkipsADamagedNewestCheckpoint) {
  auto world = test_world();
  const fs::path dir = fs::temp_directory_path() / "flexdemo-resume-damaged-test";
  const train::TrainConfig c = whole_and_first_part(dir, "damaged", 30, 20);
  if (world->rank() == 0) flip_last_byte(dir / "damaged/checkpoints/step-20/model.safetensors");
  world->barrier();
  expect_resumes_to_whole(c, dir);  // from step-10, skipping step-20
}

// Refused before any work, and nothing written: a damaged checkpoint named directly, a run with
// no valid one, another topology without the checkpoint's table of ranks, another model.
TEST(Checkpoint, ResumeRefusesWhatItCannotContinue) {
  auto world = test_world();
  const bool root = world->rank() == 0;
  const fs::path dir = fs::temp_directory_path() / "flexdemo-resume-refused-test";
  const train::TrainConfig base = tiny_run(dir);
  ASSERT_EQ(train::run_training(checkpointed(base, dir, "run", 20), world), 0);
  world->barrier();
  if (root) {
    fs::copy(dir / "run", dir / "damaged", fs::copy_options::recursive);
    flip_last_byte(dir / "damaged/checkpoints/step-20/optimizer-rank0.safetensors");
    fs::copy(dir / "run", dir / "old", fs::copy_options::recursive);
    const fs::path manifest = dir / "old/checkpoints/step-20/manifest.json";
    nlohmann::json m = nlohmann::json::parse(std::ifstream(manifest));
    m.erase("ranks");  // written by a version before elastic resume
    std::ofstream(manifest) << m.dump(2);
  }
  world->barrier();
  train::TrainConfig c = checkpointed(base, dir, "refused", 30);
  auto refusal = [&] { return invalid_argument_of([&] { train::run_training(c, world); }); };
  c.resume = (dir / "damaged/checkpoints/step-20").string();
  EXPECT_NE(
      refusal().find("is damaged: optimizer-rank0.safetensors is missing or fails its CRC-32"),
      std::string::npos);
  if (root) flip_last_byte(dir / "damaged/checkpoints/step-10/model.safetensors");
  world->barrier();
  c.resume = (dir / "damaged").string();
  EXPECT_NE(refusal().find("no valid checkpoint in " + c.resume), std::string::npos);
  c.resume = (dir / "old").string();
  c.ranks_per_node = 1;
  EXPECT_NE(refusal().find("without the table of ranks that resuming on another topology needs"),
            std::string::npos);
  c.ranks_per_node = 0;
  c.resume = (dir / "run").string();
  c.width = 32;
  EXPECT_NE(refusal().find("was written with --width 16, this run has 32"), std::string::npos);
  world->barrier();
  EXPECT_FALSE(fs::exists(dir / "refused"));
}

TEST(Checkpoint, OwnersResidualGoesWhereTheResumeKeepsIt) {
  // --demo-exchange owners keeps what an owner leaves out in a residual of its own
  // (owner_residual.i, with owner_replicas: --owner-feedback owner, the default), one replica a
  // rank here: R = the ranks. Its checkpoint loaded (a) by the owners' exchange: as it is;
  // (b) by the all-gather, which keeps none: each residual takes R times the owner's (the
  // replicas' mean then holds it whole); (c) by the owners' exchange on one node of every rank
  // (one replica, elastic; the engine's rule): replica 0's residual takes replica 0's owner's
  // once (1 replica continuing it, of 1); (d) by the all-gather on one node: the same, by the
  // trainer's loader. (e) An all-gather's checkpoint: the owners' residual starts at zero.
  auto world = test_world();
  const int R = world->size();
  const fs::path dir = fs::temp_directory_path() / "flexdemo-owner-residual-test";
  train::TrainConfig c = checkpointed(tiny_run(dir), dir, "owners", 10);
  c.ranks_per_node = 1;
  c.demo_exchange = optim::DemoExchange::Owners;
  c.second_moment = optim::SecondMoment::Own;  // (auto's kind would change with the replicas)
  train::TrainConfig plain = checkpointed(c, dir, "plain", 10);
  plain.demo_exchange = optim::DemoExchange::AllGather;
  ASSERT_EQ(train::run_training(c, world), 0);
  ASSERT_EQ(train::run_training(plain, world), 0);
  world->barrier();
  const auto saved_by = [&](const std::string& run) {
    std::map<std::string, at::Tensor> saved;
    const fs::path file = dir / run / "checkpoints/step-10" /
                          ("optimizer-rank" + std::to_string(world->rank()) + ".safetensors");
    for (auto& [name, t] : train::read_safetensors(file.string())) saved[name] = t;
    return saved;
  };
  // The state loaded, by name; with `where`, each tensor's [dim, offset] in the whole (a matrix
  // is sharded in whole chunk-rows, a vector held as [1, n] in chunks).
  std::map<size_t, std::pair<int, int64_t>> where;
  const auto loaded = [&](const train::TrainConfig& config, const std::string& run) {
    const std::unique_ptr<train::Session> s = train::open_session(config, world);
    train::load_checkpoint(*s, dir / run / "checkpoints/step-10", true);
    std::map<std::string, at::Tensor> state;
    for (const auto& [name, t] : s->optimizer->state_tensors()) state[name] = t.clone();
    where.clear();
    for (const auto& unit : s->lm->units()) {
      for (const shard::ShardSpec& spec : unit->specs()) {
        const int dim = spec.plan.rows > 1 ? 0 : 1;
        where[where.size()] = {dim, dim == 0 ? spec.begin / spec.plan.cols : spec.begin};
      }
    }
    return state;
  };
  const auto tensors = saved_by("owners");
  ASSERT_EQ(tensors.count("owner_replicas"), 1u);
  EXPECT_EQ(tensors.at("owner_replicas").item<double>(), double(R));
  size_t T = 0;  // the optimizer's tensors
  while (tensors.count("residual." + std::to_string(T))) ++T;
  ASSERT_GT(T, 0u);
  // (a)
  at::Tensor held = at::zeros({1}, at::kDouble);
  for (const auto& [name, t] : loaded(c, "owners")) {
    ASSERT_EQ(tensors.count(name), 1u) << name;
    EXPECT_TRUE(at::equal(t, tensors.at(name))) << name;
    if (name.rfind("owner_residual.", 0) == 0) held += t.abs().sum().to(at::kDouble);
  }
  world->all_reduce(held, comm::ReduceOp::Sum);
  EXPECT_GT(held.item<double>(), 0.0) << "the owners left some out";
  // (b)
  train::TrainConfig gather = c;
  gather.demo_exchange = optim::DemoExchange::AllGather;
  const auto gathered = loaded(gather, "owners");
  for (size_t i = 0; i < T; ++i) {
    const std::string n = std::to_string(i);
    EXPECT_EQ(gathered.count("owner_residual." + n), 0u);
    EXPECT_TRUE(at::allclose(gathered.at("residual." + n),
                             tensors.at("residual." + n) + R * tensors.at("owner_residual." + n),
                             1e-6, 1e-7))
        << "residual." << n;
  }
  // (c), (d) Each tensor's residual, its shards put together: rank 0's (replica 0's), folded.
  train::TrainConfig one = c;
  one.ranks_per_node = R;
  train::TrainConfig one_gather = gather;
  one_gather.ranks_per_node = R;
  for (const train::TrainConfig* config : {&one, &one_gather}) {
    const auto state = loaded(*config, "owners");
    for (size_t i = 0; i < T; ++i) {
      const std::string n = std::to_string(i);
      at::Tensor whole = at::zeros_like(tensors.at("residual." + n));  // each rank's shard
      const auto it = state.find("residual." + n);
      if (it != state.end()) {
        const auto [dim, offset] = where.at(i);
        whole.narrow(dim, offset, it->second.size(dim)).copy_(it->second);
      }
      world->all_reduce(whole, comm::ReduceOp::Sum);
      at::Tensor want = at::zeros_like(whole);  // rank 0's, folded once
      if (world->rank() == 0) want += tensors.at("residual." + n) + tensors.at("owner_residual." + n);
      world->all_reduce(want, comm::ReduceOp::Sum);
      EXPECT_TRUE(at::allclose(whole, want, 1e-6, 1e-7))
          << "residual." << n << (config == &one ? " (owners)" : " (all-gather)") << " on one node";
    }
    for (const auto& [name, t] : state) {
      if (name.rfind("owner_residual.", 0) == 0) {
        EXPECT_EQ(t.abs().max().item<double>(), 0.0) << name << ": folded";
      }
    }
  }
  // (e)
  const auto plain_saved = saved_by("plain");
  for (const auto& [name, t] : loaded(c, "plain")) {
    if (name == "owner_replicas") {
      EXPECT_EQ(t.item<double>(), double(R));
    } else if (name.rfind("owner_residual.", 0) == 0) {
      EXPECT_EQ(t.abs().max().item<double>(), 0.0) << name;
    } else {
      EXPECT_TRUE(at::equal(t, plain_saved.at(name))) << name;
    }
  }
}

TEST(Trainer, ReplicaDriftStopsEveryRank) {
  auto world = test_world();
  auto replicas = world;  // every rank a replica of the others
  at::manual_seed(3);
  std::vector<at::Tensor> shards = {at::randn({5, 4}), at::randn({7})};
  EXPECT_NO_THROW(train::check_replicas(shards, replicas, world, 10));
  if (world->rank() == world->size() - 1) shards[1][3] += 1e-6f;  // one replica drifts
  try {
    train::check_replicas(shards, replicas, world, 11);
    ADD_FAILURE() << "drift went unnoticed";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("replica drift at step 11"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(world->size() - 1) + " differ"),
              std::string::npos)
        << e.what();
  }
}

TEST(Trainer, NonFiniteStepIsSkippedEverywhereOrStops) {
  auto world = test_world();
  const fs::path dir = fs::temp_directory_path() / "flexdemo-nonfinite-test";
  train::TrainConfig c = tiny_run(dir);
  c.steps = 4;
  c.check_replicas = 1;  // the skip must leave the replicas bit-identical
  const std::string inject = "2:" + std::to_string(world->size() - 1);
  setenv("FLEXDEMO_INJECT_NONFINITE", inject.c_str(), 1);
  EXPECT_EQ(train::run_training(c, world), 0);
  world->barrier();
  std::ifstream metrics(dir / "run" / "metrics.jsonl");
  std::vector<nlohmann::json> lines;
  for (std::string l; std::getline(metrics, l);) lines.push_back(nlohmann::json::parse(l));
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0]["skipped_steps"].get<int64_t>(), 0);
  EXPECT_EQ(lines[1]["skipped_steps"].get<int64_t>(), 1);
  EXPECT_EQ(lines[3]["skipped_steps"].get<int64_t>(), 1);
  c.on_nonfinite = train::NonFinitePolicy::Stop;
  try {
    train::run_training(c, world);
    ADD_FAILURE() << "a NaN did not stop the run";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("non-finite loss or gradient at step 2 on "),
              std::string::npos)
        << e.what();
  }
  unsetenv("FLEXDEMO_INJECT_NONFINITE");
}

TEST(Trainer, WritesDocumentedOutputs) {
  auto world = test_world();
  const fs::path dir = fs::temp_directory_path() / "flexdemo-train-test";
  train::TrainConfig c = tiny_run(dir);
  EXPECT_EQ(train::run_training(c, world), 0);
  world->barrier();
  std::ifstream metrics(dir / "run" / "metrics.jsonl");
  std::vector<nlohmann::json> lines;
  for (std::string l; std::getline(metrics, l);) lines.push_back(nlohmann::json::parse(l));
  ASSERT_EQ(lines.size(), 3u);
  for (const char* key :
       {"step", "loss", "lr", "tokens", "step_ms", "compute_ms", "comm_ms", "intra_bytes_sent",
        "intra_bytes_recv", "inter_bytes_sent", "inter_bytes_recv"}) {
    EXPECT_TRUE(lines[0].contains(key)) << key;
  }
  EXPECT_FALSE(lines[0].contains("val_loss"));
  EXPECT_TRUE(lines[2].contains("val_loss"));  // evaluated at the end
  EXPECT_EQ(lines[2]["tokens"].get<int64_t>(), 3 * 4 * 16);
  const auto summary = nlohmann::json::parse(std::ifstream(dir / "run" / "summary.json"));
  for (const char* key :
       {"final_val_loss", "tokens_per_s", "inter_bytes_per_step", "peak_rss_mb"}) {
    EXPECT_TRUE(summary.contains(key)) << key;
  }
  EXPECT_TRUE(fs::exists(dir / "run" / "config.json"));

  c.batch = 3;  // does not divide across the ranks (2 or 4)
  EXPECT_THROW(train::run_training(c, world), std::invalid_argument);
  c.batch = 4;
  c.seq = 17;  // longer than the context
  EXPECT_THROW(train::run_training(c, world), std::invalid_argument);
}

TEST(Trainer, MaxTimeStopsAtAStepBoundaryWithACheckpoint) {
  // --max-time ends the run after the step that reaches it, evaluated and checkpointed, and a
  // resume from there continues as if nothing had stopped it.
  auto world = test_world();
  const fs::path dir = fs::temp_directory_path() / "flexdemo-max-time-test";
  train::TrainConfig c = tiny_run(dir);
  c.max_time = 1e9;  // never reached: the whole run
  c.out = (dir / "whole").string();
  ASSERT_EQ(train::run_training(c, world), 0);
  c.max_time = 1e-9;  // reached by the first step
  c.out = (dir / "stopped").string();
  ASSERT_EQ(train::run_training(c, world), 0);
  world->barrier();
  const auto summary = nlohmann::json::parse(std::ifstream(dir / "stopped" / "summary.json"));
  EXPECT_EQ(summary["steps"].get<int64_t>(), 1);
  EXPECT_TRUE(std::isfinite(summary["final_val_loss"].get<double>()));
  ASSERT_EQ(step_losses(dir / "stopped").size(), 1u);
  EXPECT_TRUE(fs::exists(dir / "stopped" / "checkpoints" / "step-1" / "manifest.json"));
  EXPECT_FALSE(fs::exists(dir / "stopped" / "checkpoints" / "step-3"));
  c.max_time = 0;  // no limit
  expect_resumes_to_whole(c, dir);
}

TEST(Trainer, IdenticalT5RunsAreBitIdentical) {
  // T5's span corruption and dropout draw from LibTorch's default generators: seeded by --seed
  // (per rank), two identical runs in one process give the same losses bit for bit, as GPT's
  // do; another seed gives others.
  auto world = test_world();
  const fs::path dir = fs::temp_directory_path() / "flexdemo-t5-seed-test";
  train::TrainConfig c = tiny_run(dir);
  c.model = "t5-nano";
  c.width = 16, c.layers = 1, c.heads = 2, c.context = 0;
  c.dropout = 0.1;
  std::vector<std::vector<double>> losses;
  for (uint64_t seed : {7, 7, 8}) {
    c.seed = seed;
    c.out = (dir / ("run" + std::to_string(losses.size()))).string();
    ASSERT_EQ(train::run_training(c, world), 0);
    world->barrier();
    losses.push_back(step_losses(c.out));
    ASSERT_EQ(losses.back().size(), size_t(c.steps));
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_NE(losses[0], losses[2]);
}

TEST(Trainer, T5TranslatesPairsItLearned) {
  // A T5 trained on a few TSV pairs until it knows them: `generate` translates a training source
  // into its target, greedy and by beam search; `eval` scores translations with chrF.
  auto world = test_world();
  const fs::path dir = fs::temp_directory_path() / "flexdemo-t5-pairs-test";
  train::TrainConfig c = tiny_run(dir);
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"one", "un"},     {"two", "deux"},   {"three", "trois"}, {"four", "quatre"},
      {"five", "cinq"},  {"six", "six!"},   {"seven", "sept"},  {"eight", "huit"},
      {"nine", "neuf"},  {"ten", "dix"},    {"red", "rouge"},   {"blue", "bleu"},
      {"green", "vert"}, {"black", "noir"}, {"white", "blanc"}, {"cat", "chat"}};
  if (world->rank() == 0) {
    std::ofstream tsv(dir / "pairs.tsv");
    for (const auto& [source, target] : pairs) tsv << source << "\t" << target << "\n";
  }
  world->barrier();
  c.data = (dir / "pairs.tsv").string();
  c.model = "t5-nano";
  c.width = 32, c.layers = 1, c.heads = 2, c.context = 0;
  c.seq = 8, c.target_seq = 8;
  c.optimizer = train::OptimizerKind::AdamW;
  c.lr = 1e-2;
  c.steps = 100;
  c.batch = 16;
  c.eval_every = 0;
  c.progress = train::ProgressMode::Lines;
  c.log_every = 50;
  ASSERT_EQ(train::run_training(c, world), 0);
  world->barrier();
  for (int64_t beam : {1, 4}) {
    train::GenerateOptions o;
    o.prompt = "three";
    o.beam = beam;
    testing::internal::CaptureStdout();
    ASSERT_EQ(train::run_generate(c.out, o, world), 0);
    const std::string printed = testing::internal::GetCapturedStdout();
    if (world->rank() == 0) {
      EXPECT_EQ(printed, "trois\n") << "beam " << beam;
    }
  }
  train::EvalOptions e;
  e.translate = 5;
  testing::internal::CaptureStdout();
  ASSERT_EQ(train::run_eval(c.out, e, world), 0);
  const std::string printed = testing::internal::GetCapturedStdout();
  if (world->rank() == 0) {
    const auto j = nlohmann::json::parse(printed);
    EXPECT_GE(j.at("chrf").get<double>(), 0.0);
    EXPECT_LE(j.at("chrf").get<double>(), 100.0);
    EXPECT_GE(j.at("translated").get<int64_t>(), 1);
  }
}
