// The trainer's pieces on real ranks: GPT shapes and gradients (finite differences), learning a
// batch by heart, the sampler's determinism and independence of the rank count, and a whole
// `run_training` whose outputs follow the documented schema.
#include "test_mpi.h"

#include "flexdemo/data.h"
#include "flexdemo/model.h"
#include "flexdemo/optim.h"
#include "flexdemo/safetensors.h"
#include "flexdemo/text.h"
#include "flexdemo/train.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>

using namespace flexdemo;
namespace fs = std::filesystem;

namespace {

// A communicator of this rank alone: the model is not sharded.
std::shared_ptr<comm::Communicator> alone() {
  auto world = test_world();
  return world->split(world->rank(), 0);
}

model::GptConfig tiny() {
  model::GptConfig c;
  c.vocab = 11, c.context = 6, c.width = 8, c.layers = 2, c.heads = 2;
  return c;
}

// 60 AdamW steps on one fixed batch, alone: the first and the last loss.
std::pair<double, double> overfit(model::LanguageModel& lm,
                                  const std::function<at::Tensor()>& loss_fn) {
  const std::vector<optim::OptimParam> params = shard::optim_params(lm.units());
  optim::OptimizerOptions o;
  o.replicator = optim::ReplicatorKind::Full;
  o.inner = optim::InnerKind::AdamW;
  o.sign = false;
  o.lr = 1e-2;
  o.chunk = 4;
  optim::Optimizer opt(params, o, alone());
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    opt.zero_grad();
    at::Tensor loss = loss_fn();
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  return {first, last};
}

// An int64 [rows, columns] tensor of equally long rows.
at::Tensor long_rows(const std::vector<std::vector<int64_t>>& rows) {
  std::vector<at::Tensor> out;
  for (const auto& r : rows) out.push_back(at::tensor(r, at::kLong));
  return at::stack(out);
}

// The gradient of loss_fn against its directional derivative along a random direction per
// tensor. T5's ReLUs have kinks that a difference step can straddle, and float32 limits small
// steps: the closest of three step sizes must agree (a wrong gradient agrees with none of them).
void expect_gradients_match(model::LanguageModel& lm, const std::function<at::Tensor()>& loss_fn) {
  loss_fn().backward();
  for (const auto& unit : lm.units()) {
    for (const at::Tensor& shard : unit->shards()) {
      const at::Tensor direction = at::randn(shard.sizes());
      const double analytic = (shard.grad() * direction).sum().item<double>();
      double closest = INFINITY;
      for (float eps : {1e-3f, 3e-4f, 1e-4f}) {
        at::NoGradGuard no_grad;
        const at::Tensor orig = shard.clone();
        shard.add_(direction, eps);
        const double up = loss_fn().item<double>();
        shard.copy_(orig).add_(direction, -eps);
        const double down = loss_fn().item<double>();
        shard.copy_(orig);
        const double numeric = (up - down) / (2 * eps);
        if (std::abs(numeric - analytic) < std::abs(closest - analytic)) closest = numeric;
      }
      EXPECT_NEAR(analytic, closest, 3e-3 + 0.1 * std::abs(analytic)) << unit->name();
    }
  }
}

}  // namespace

TEST(Gpt, ParameterCountIsClosedForm) {
  auto lm = model::make_gpt(model::gpt_preset("gpt-nano", 2048), alone(), {}, 1);
  const int64_t d = 128, L = 4, V = 2048, T = 128;
  const int64_t block =
      2 * d + 3 * d * d + 3 * d + d * d + d + 2 * d + 4 * d * d + 4 * d + 4 * d * d + d;
  EXPECT_EQ(lm->num_params(), V * d + T * d + L * block + 2 * d);
  EXPECT_EQ(lm->units().size(), size_t(L + 2));
  EXPECT_EQ(lm->param_names()[1][2], "h0.attn.qkv.weight");
  EXPECT_THROW(model::gpt_preset("gpt-huge", 10), std::invalid_argument);
  model::GptConfig bad = tiny();
  bad.heads = 3;
  EXPECT_THROW(model::make_gpt(bad, alone(), {}, 1), std::invalid_argument);
}

TEST(Gpt, GradientsMatchFiniteDifferences) {
  auto lm = model::make_gpt(tiny(), alone(), {}, 3);
  at::manual_seed(4);
  const at::Tensor tokens = at::randint(11, {3, 6}, at::kLong);
  lm->loss(tokens).backward();
  for (const auto& unit : lm->units()) {
    for (const at::Tensor& shard : unit->shards()) {
      const at::Tensor grad = shard.grad().clone();
      for (int64_t i : {int64_t(0), shard.numel() / 2, shard.numel() - 1}) {
        const float eps = 1e-3f;
        at::NoGradGuard no_grad;
        const float orig = shard[i].item<float>();
        shard[i] = orig + eps;
        const double up = lm->loss(tokens).item<double>();
        shard[i] = orig - eps;
        const double down = lm->loss(tokens).item<double>();
        shard[i] = orig;
        const double numeric = (up - down) / (2 * eps);
        EXPECT_NEAR(grad[i].item<double>(), numeric, 2e-3 + 2e-2 * std::abs(numeric))
            << unit->name() << " element " << i;
      }
    }
  }
}

TEST(Gpt, LossFallsWhenOverfittingOneBatch) {
  auto lm = model::make_gpt(tiny(), alone(), {}, 5);
  at::manual_seed(6);
  const at::Tensor tokens = at::randint(11, {4, 7}, at::kLong);
  const auto [first, last] = overfit(*lm, [&] { return lm->loss(tokens); });
  EXPECT_LT(last, 0.5 * first);
}

model::LlamaConfig tiny_llama(int64_t kv_heads, bool tied) {
  model::LlamaConfig c;
  c.vocab = 11, c.context = 6, c.width = 8, c.layers = 2, c.heads = 2, c.kv_heads = kv_heads;
  c.ff = 12, c.tied_head = tied;
  return c;
}

TEST(Llama, ParameterCountIsClosedFormAndNamesAreTransformers) {
  const int64_t V = 4096, d = 256, L = 4, kv = 2 * (256 / 4), F = 704;
  auto lm = model::make_llama(model::llama_preset("llama-micro", V), alone(), {}, 1);
  const int64_t block = d + d * d + 2 * kv * d + d * d + d + 3 * F * d;
  EXPECT_EQ(lm->num_params(), V * d + L * block + d);
  EXPECT_EQ(lm->units().size(), size_t(L + 2));
  EXPECT_EQ(lm->param_names()[1][2], "model.layers.0.self_attn.k_proj.weight");
  model::LlamaConfig own = model::llama_preset("llama-micro", V);
  own.tied_head = false;
  EXPECT_EQ(model::make_llama(own, alone(), {}, 1)->num_params(), 2 * V * d + L * block + d);
  EXPECT_EQ(model::make_llama(own, alone(), {}, 1)->param_names().back().back(), "lm_head.weight");
  model::LlamaConfig bad = tiny_llama(2, true);
  bad.kv_heads = 3;  // does not divide the 2 query heads
  EXPECT_THROW(model::make_llama(bad, alone(), {}, 1), std::invalid_argument);
  EXPECT_THROW(model::llama_preset("llama-huge", 10), std::invalid_argument);
}

TEST(Llama, GradientsAndLearningTiedAndOwnHead) {
  for (bool tied : {true, false}) {
    auto lm = model::make_llama(tiny_llama(1, tied), alone(), {}, 3);
    at::manual_seed(4);
    const at::Tensor tokens = at::randint(11, {3, 6}, at::kLong);
    expect_gradients_match(*lm, [&] { return lm->loss(tokens); });
    const auto [first, last] = overfit(*lm, [&] { return lm->loss(tokens); });
    EXPECT_LT(last, 0.5 * first) << (tied ? "tied" : "own head");
  }
}

TEST(Llama, GroupedQueryAttentionEqualsFullAttentionWithRepeatedHeads) {
  // One key/value head serving both query heads computes what two key/value heads holding that
  // same head twice compute (a closed-form equivalence: what grouping means).
  auto grouped = model::make_llama(tiny_llama(1, true), alone(), {}, 5);
  auto full = model::make_llama(tiny_llama(2, true), alone(), {}, 6);
  at::NoGradGuard no_grad;
  for (size_t u = 0; u < grouped->units().size(); ++u) {
    const auto& names = grouped->param_names()[u];
    std::vector<at::Tensor> params = grouped->units()[u]->gather();
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i].find("k_proj") != std::string::npos ||
          names[i].find("v_proj") != std::string::npos) {
        params[i] = at::cat({params[i], params[i]});  // [head, C] -> [head; head, C]
      }
    }
    full->units()[u]->load(params);
  }
  at::manual_seed(7);
  const at::Tensor tokens = at::randint(11, {2, 6}, at::kLong);
  EXPECT_TRUE(at::allclose(grouped->next_token_logits(tokens), full->next_token_logits(tokens),
                           1e-5, 1e-6));
  EXPECT_NEAR(grouped->loss(tokens).item<double>(), full->loss(tokens).item<double>(), 1e-6);
}

TEST(T5, SpanCorruptionGradientsAndLearning) {
  model::T5Config c;
  c.vocab = 11, c.eot = 10, c.width = 8, c.layers = 1, c.heads = 2, c.ff = 16;
  auto lm = model::make_t5(c, alone(), {}, 7);
  // shared; per stack: its position bias, its block, its final norm
  EXPECT_EQ(lm->units().size(), 7u);
  at::manual_seed(8);
  const at::Tensor tokens = at::randint(10, {3, 21}, at::kLong);
  auto loss_at = [&] {
    at::manual_seed(9);  // the same spans every time
    return lm->loss(tokens);
  };
  expect_gradients_match(*lm, loss_at);
  const auto [first, last] = overfit(*lm, loss_at);
  EXPECT_LT(last, 0.5 * first);
}

TEST(T5, TranslationLossIgnoresPadding) {
  // Rows [source (6) | target (5)], -1 padded: the batch's loss, per scored token, equals the
  // token-weighted mean of each pair's loss alone (alone, a pair has no padding), so padding
  // neither reaches the real tokens through attention nor is scored.
  model::T5Config c;
  c.vocab = 11, c.eot = 10, c.width = 8, c.layers = 1, c.heads = 2, c.ff = 16, c.source_len = 6;
  auto lm = model::make_t5(c, alone(), {}, 7);
  const at::Tensor rows = long_rows({{3, 4, 5, 6, 7, 10, 1, 2, 3, 10, -1},
                                     {8, 10, -1, -1, -1, -1, 9, 10, -1, -1, -1},
                                     {2, 2, 10, -1, -1, -1, 4, 5, 6, 7, 10}});
  const std::vector<int64_t> target_tokens = {4, 2, 5};
  double weighted = 0;
  {
    at::NoGradGuard no_grad;
    for (int64_t i = 0; i < 3; ++i) {
      weighted += lm->loss(rows.narrow(0, i, 1)).item<double>() * double(target_tokens[size_t(i)]);
    }
  }
  at::NoGradGuard no_grad;
  EXPECT_NEAR(lm->loss(rows).item<double>(), weighted / 11.0, 1e-5);
}

TEST(T5, TranslationGradientsAndLearning) {
  model::T5Config c;
  c.vocab = 11, c.eot = 10, c.width = 8, c.layers = 1, c.heads = 2, c.ff = 16, c.source_len = 6;
  auto lm = model::make_t5(c, alone(), {}, 7);
  const at::Tensor rows =
      long_rows({{3, 4, 5, 6, 7, 10, 1, 2, 3, 10, -1}, {8, 10, -1, -1, -1, -1, 9, 10, -1, -1, -1}});
  at::manual_seed(8);
  expect_gradients_match(*lm, [&] { return lm->loss(rows); });
  const auto [first, last] = overfit(*lm, [&] { return lm->loss(rows); });
  EXPECT_LT(last, 0.5 * first);
}

TEST(Sampler, PairRowsArePaddedCutAndDrawnLikeWindows) {
  // Pairs (source, eot, target, eot): 3 pairs; lengths 2+3, 5+1, 1+2 (end-of-text 0).
  const std::vector<int32_t> tokens = {5, 0, 6, 7, 0, 1, 2, 3, 4, 0, 0, 9, 0, 8, 8, 0};
  const data::PairSampler a(tokens, 0, 3, 3, 42), b(tokens, 0, 3, 3, 42);
  const at::Tensor val = a.windows(0, 4);
  const at::Tensor expected = long_rows({{5, 0, -1, 6, 7, 0},
                                         {1, 2, 0, 0, -1, -1},  // source cut, eot kept
                                         {9, 0, -1, 8, 8, 0},
                                         {5, 0, -1, 6, 7, 0}});  // wraps around
  EXPECT_TRUE(at::equal(val, expected)) << val;
  EXPECT_EQ(a.num_windows(), 3);
  EXPECT_EQ(a.scored_tokens(val), 3 + 1 + 3 + 3);
  const at::Tensor whole = a.rows(7, 0, 8);
  EXPECT_TRUE(at::equal(whole, b.rows(7, 0, 8)));
  for (int r = 0; r < 8; r += 2) EXPECT_TRUE(at::equal(a.rows(7, r, 2), whole.narrow(0, r, 2)));
  for (int64_t r = 0; r < 8; ++r) {  // every row is one of the pairs
    EXPECT_TRUE(at::equal(whole[r], expected[0]) || at::equal(whole[r], expected[1]) ||
                at::equal(whole[r], expected[2]));
  }
  EXPECT_THROW(data::PairSampler({5, 0, 6}, 0, 3, 3, 1), std::invalid_argument);  // no target end
}

TEST(Sampler, DeterministicAndIndependentOfRankCount) {
  std::vector<int32_t> tokens(1000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t(i % 97);
  const data::BatchSampler a(tokens, 16, 42), b(tokens, 16, 42), other(tokens, 16, 43);
  const at::Tensor whole = a.rows(7, 0, 8);
  EXPECT_TRUE(at::equal(whole, b.rows(7, 0, 8)));       // the same seed: the same batch
  EXPECT_FALSE(at::equal(whole, other.rows(7, 0, 8)));  // another seed: another batch
  EXPECT_FALSE(at::equal(whole, a.rows(8, 0, 8)));      // another step: another batch
  for (int ranks : {1, 2, 4, 8}) {                      // any split gives the same rows
    for (int r = 0; r < ranks; ++r) {
      const int64_t n = 8 / ranks;
      EXPECT_TRUE(at::equal(a.rows(7, r * n, n), whole.narrow(0, r * n, n)));
    }
  }
  // A resumed run at step 7 draws exactly the batch the uninterrupted run drew.
  const data::BatchSampler resumed(tokens, 16, 42);
  EXPECT_TRUE(at::equal(resumed.rows(7, 0, 8), whole));
  // Each row is a contiguous window: targets are the inputs shifted by one.
  const at::Tensor row = whole[0];
  EXPECT_EQ(
      (row.narrow(0, 1, 16) - row.narrow(0, 0, 16)).remainder(97).eq(1).sum().item<int64_t>() +
          (row.narrow(0, 1, 16) == 0).sum().item<int64_t>(),
      16);
}

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
  c.resume = c.out;
  ASSERT_EQ(train::run_training(c, world), 0);
  world->barrier();
  const std::vector<double> whole = step_losses(dir / "whole");
  ASSERT_EQ(whole.size(), 20u);
  EXPECT_EQ(step_losses(dir / "halves"), whole);
  expect_same_weights(dir / "whole/checkpoints/step-20", dir / "halves/checkpoints/step-20");
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

TEST(Checkpoint, ResumedRunEqualsUninterruptedRun) {
  auto world = test_world();
  const bool root = world->rank() == 0;
  const fs::path dir = fs::temp_directory_path() / "flexdemo-resume-test";
  train::TrainConfig c = tiny_run(dir);
  c.warmup = 0;  // a constant learning rate: the 20-step run must not end its schedule early
  c.min_lr_ratio = 1.0;
  c.checkpoint_every = 10;
  c.steps = 40;
  c.out = (dir / "whole").string();
  ASSERT_EQ(train::run_training(c, world), 0);
  c.steps = 20;
  c.out = (dir / "halves").string();
  ASSERT_EQ(train::run_training(c, world), 0);
  world->barrier();
  // The newest 2 checkpoints are kept; a copy of the run gets a corrupted newest one.
  EXPECT_FALSE(fs::exists(dir / "whole/checkpoints/step-20"));
  EXPECT_TRUE(fs::exists(dir / "whole/checkpoints/step-30"));
  if (root) {
    fs::copy(dir / "halves", dir / "damaged", fs::copy_options::recursive);
    flip_last_byte(dir / "damaged/checkpoints/step-20/model.safetensors");
  }
  world->barrier();

  c.steps = 40;
  c.resume = c.out;
  ASSERT_EQ(train::run_training(c, world), 0);
  c.resume = c.out = (dir / "damaged").string();  // resumes from step-10, skipping step-20
  ASSERT_EQ(train::run_training(c, world), 0);
  world->barrier();
  const std::vector<double> whole = step_losses(dir / "whole");
  ASSERT_EQ(whole.size(), 40u);
  EXPECT_EQ(step_losses(dir / "halves"), whole);  // bit-identical losses, step by step
  EXPECT_EQ(step_losses(dir / "damaged"), whole);
  expect_same_weights(dir / "whole/checkpoints/step-40", dir / "halves/checkpoints/step-40");
  expect_same_weights(dir / "whole/checkpoints/step-40", dir / "damaged/checkpoints/step-40");

  // Refused before any work: a damaged checkpoint named directly, a run with no valid one,
  // another topology without the checkpoint's table of ranks, another model.
  c.out = (dir / "refused").string();
  c.resume = (dir / "damaged/checkpoints/step-30").string();
  world->barrier();
  if (root) flip_last_byte(dir / "damaged/checkpoints/step-30/optimizer-rank0.safetensors");
  world->barrier();
  EXPECT_NE(invalid_argument_of([&] {
              train::run_training(c, world);
            }).find("is damaged: optimizer-rank0.safetensors is missing or fails its CRC-32"),
            std::string::npos);
  if (root) flip_last_byte(dir / "damaged/checkpoints/step-40/model.safetensors");
  world->barrier();
  c.resume = (dir / "damaged").string();
  EXPECT_NE(invalid_argument_of([&] {
              train::run_training(c, world);
            }).find("no valid checkpoint in " + c.resume),
            std::string::npos);
  // Another topology needs the checkpoint's table of ranks, which older ones lack.
  if (root) {
    fs::copy(dir / "halves", dir / "old", fs::copy_options::recursive);
    const fs::path manifest = dir / "old/checkpoints/step-40/manifest.json";
    nlohmann::json m = nlohmann::json::parse(std::ifstream(manifest));
    m.erase("ranks");
    std::ofstream(manifest) << m.dump(2);
  }
  world->barrier();
  c.resume = (dir / "old").string();
  c.ranks_per_node = 1;
  EXPECT_NE(invalid_argument_of([&] {
              train::run_training(c, world);
            }).find("without the table of ranks that resuming on another topology needs"),
            std::string::npos);
  c.ranks_per_node = 0;
  c.resume = (dir / "halves").string();
  c.width = 32;
  EXPECT_NE(invalid_argument_of([&] {
              train::run_training(c, world);
            }).find("was written with --width 16, this run has 32"),
            std::string::npos);
  world->barrier();
  EXPECT_FALSE(fs::exists(dir / "refused"));  // nothing written by a refused run
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
  c.resume = c.out;
  ASSERT_EQ(train::run_training(c, world), 0);
  world->barrier();
  const std::vector<double> whole = step_losses(dir / "whole");
  ASSERT_EQ(whole.size(), 3u);
  EXPECT_EQ(step_losses(dir / "stopped"), whole);
  expect_same_weights(dir / "whole/checkpoints/step-3", dir / "stopped/checkpoints/step-3");
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
