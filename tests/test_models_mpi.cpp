// The models on real ranks: GPT, LLaMA and T5 shapes and parameter counts against closed forms,
// gradients against finite differences, and learning a batch by heart.
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
  optim::OptimizerOptions o = optim::preset(optim::Preset::DeMo);
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
