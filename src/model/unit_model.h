// The part every model shares: its sharded units, their parameters' names and the count; and
// the forward of a decoder-only model. Internal to src/model; models add units in order and run
// them in their forward.
#pragma once

#include "flexdemo/model.h"

#include <ATen/ATen.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace flexdemo::model {

// Each family's presets, in its own file (model_presets() lists them all: presets.cpp).
std::vector<std::string> gpt_presets();
std::vector<std::string> llama_presets();
std::vector<std::string> t5_presets();

// Config checks shared by the models: one line naming the option and what is accepted.
inline void require_positive(int64_t value, const char* option) {
  if (value <= 0) {
    throw std::invalid_argument(std::string("--") + option + " must be > 0, got " +
                                std::to_string(value));
  }
}
inline void require_heads_divide_width(int64_t heads, int64_t width) {
  if (width % heads != 0) {
    throw std::invalid_argument("--heads " + std::to_string(heads) + " must divide --width " +
                                std::to_string(width));
  }
}

class UnitModel : public LanguageModel {
 public:
  const std::vector<std::unique_ptr<shard::ShardedUnit>>& units() const override { return units_; }
  const std::vector<std::vector<std::string>>& param_names() const override { return names_; }
  int64_t num_params() const override { return num_params_; }

 protected:
  // A unit of named initial parameters, sharded over group.
  void add_unit(const std::string& name,
                const std::vector<std::pair<std::string, at::Tensor>>& params,
                std::shared_ptr<comm::Communicator> group, const shard::ShardOptions& options) {
    std::vector<at::Tensor> tensors;
    std::vector<std::string> names;
    for (const auto& [n, t] : params) {
      names.push_back(n);
      tensors.push_back(t);
      num_params_ += t.numel();
    }
    units_.push_back(
        std::make_unique<shard::ShardedUnit>(name, tensors, std::move(group), options));
    names_.push_back(names);
  }

  std::vector<std::unique_ptr<shard::ShardedUnit>> units_;

 private:
  std::vector<std::vector<std::string>> names_;
  int64_t num_params_ = 0;
};

// A decoder-only language model of units 0 (the embeddings; also the output head when it is
// tied: logits = x E^T), 1..L (the blocks) and L+1 (the final norm; with a head of its own, the
// logits too). A model adds its units in that order and says what each computes.
class DecoderModel : public UnitModel {
 public:
  at::Tensor loss(const at::Tensor& tokens) override {
    const int64_t T = tokens.size(1) - 1;
    const at::Tensor logits = forward(tokens.narrow(1, 0, T));
    return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}),
                                  tokens.narrow(1, 1, T).reshape({-1}));
  }
  at::Tensor next_token_logits(const at::Tensor& tokens) override {
    return forward(tokens).select(1, tokens.size(1) - 1);
  }
  int64_t context() const override { return context_; }

 protected:
  struct Pieces {
    shard::UnitFn embed;  // unit 0: token ids [B, T] -> states [B, T, C]
    shard::UnitFn block;  // each block: states -> states
    shard::UnitFn last;   // unit L+1: states -> normed states, or logits with a head of its own
    bool own_head = false;
  };
  explicit DecoderModel(int64_t context) : context_(context) {}
  virtual Pieces pieces() const = 0;

 private:
  // Logits [B, T, vocab] for inputs [B, T]. Each unit names the one that runs after it (its
  // gather is prefetched) and the one whose output it takes (prefetched in the backward).
  at::Tensor forward(const at::Tensor& inputs) {
    const int64_t T = inputs.size(1);
    if (T > context_) {
      throw std::invalid_argument("sequence of " + std::to_string(T) +
                                  " tokens is longer than the model's context " +
                                  std::to_string(context_));
    }
    const Pieces p = pieces();
    const int64_t L = int64_t(units_.size()) - 2;
    auto u = [this](int64_t i) { return units_[size_t(i)].get(); };
    at::Tensor x = u(0)->forward(p.embed, {inputs}, {u(1), nullptr});
    for (int64_t l = 0; l < L; ++l) x = u(1 + l)->forward(p.block, {x}, {u(2 + l), u(l)});
    if (p.own_head) return u(L + 1)->forward(p.last, {x}, {nullptr, u(L)});
    x = u(L + 1)->forward(p.last, {x}, {u(0), u(L)});
    return u(0)->forward(  // the tied head: the token table, transposed
        [](const std::vector<at::Tensor>& w, const std::vector<at::Tensor>& in) {
          return at::matmul(in[0], w[0].t());
        },
        {x}, {nullptr, u(L + 1)});
  }

  int64_t context_;
};

}  // namespace flexdemo::model
