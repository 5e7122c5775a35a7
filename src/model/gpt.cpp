// The GPT decoder as sharded units: "embeddings" (token and position tables; also the tied
// output head), one unit per block, and "ln_f". Blocks are written with functional ops on
// their full parameters, so a unit can gather, run and recompute them.
#include "flexdemo/model.h"

#include "unit_model.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <sstream>
#include <stdexcept>

namespace flexdemo::model {

void GptConfig::validate() const {
  require_positive(vocab, "vocab");
  require_positive(context, "context");
  require_positive(width, "width");
  require_positive(layers, "layers");
  require_positive(heads, "heads");
  require_heads_divide_width(heads, width);
  if (!(dropout >= 0.0 && dropout < 1.0)) {
    std::ostringstream value;
    value << dropout;
    throw std::invalid_argument("--dropout must be in [0, 1), got " + value.str());
  }
}

at::Tensor LanguageModel::encode(const at::Tensor&) {
  throw std::invalid_argument("only an encoder-decoder (t5-*) translates");
}
at::Tensor LanguageModel::next_target_logits(const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&) {
  throw std::invalid_argument("only an encoder-decoder (t5-*) translates");
}

std::vector<std::string> gpt_presets() {
  return {"gpt-nano", "gpt-micro", "gpt2-small", "gpt"};
}

GptConfig gpt_preset(const std::string& name, int64_t vocab) {
  GptConfig c;
  c.vocab = vocab;
  if (name == "gpt") {  // every dimension given
  } else if (name == "gpt-nano") {
    c.width = 128, c.layers = 4, c.heads = 4, c.context = 128;
  } else if (name == "gpt-micro") {
    c.width = 256, c.layers = 4, c.heads = 4, c.context = 256;
  } else if (name == "gpt2-small") {
    c.width = 768, c.layers = 12, c.heads = 12, c.context = 1024;
  } else {
    throw std::invalid_argument("unknown GPT preset '" + name +
                                "'; accepted: gpt-nano, gpt-micro, gpt2-small, gpt");
  }
  return c;
}

namespace {

using Params = std::vector<at::Tensor>;

at::Tensor dropout(const at::Tensor& x, double p) {
  return p > 0.0 && at::GradMode::is_enabled() ? at::dropout(x, p, /*train=*/true) : x;
}

// Block parameters, in this order.
const char* const kBlockParams[] = {"ln_1.weight",   "ln_1.bias",        "attn.qkv.weight",
                                    "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
                                    "ln_2.weight",   "ln_2.bias",        "mlp.fc.weight",
                                    "mlp.fc.bias",   "mlp.proj.weight",  "mlp.proj.bias"};

at::Tensor block_forward(const Params& p, const at::Tensor& x, const GptConfig& c) {
  const int64_t B = x.size(0), T = x.size(1), C = c.width, H = c.heads, D = C / H;
  at::Tensor h = at::layer_norm(x, {C}, p[0], p[1]);
  const auto qkv = at::linear(h, p[2], p[3]).split(C, 2);
  const at::Tensor q = qkv[0].view({B, T, H, D}).transpose(1, 2);
  const at::Tensor k = qkv[1].view({B, T, H, D}).transpose(1, 2);
  const at::Tensor v = qkv[2].view({B, T, H, D}).transpose(1, 2);
  at::Tensor att = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(D)));
  const at::Tensor future = at::ones({T, T}, x.options().dtype(at::kBool)).triu(1);
  att = dropout(at::softmax(att.masked_fill(future, -INFINITY), -1), c.dropout);
  at::Tensor y = at::matmul(att, v).transpose(1, 2).reshape({B, T, C});
  at::Tensor out = x + dropout(at::linear(y, p[4], p[5]), c.dropout);
  h = at::layer_norm(out, {C}, p[6], p[7]);
  h = at::linear(at::gelu(at::linear(h, p[8], p[9]), "tanh"), p[10], p[11]);
  return out + dropout(h, c.dropout);
}

class Gpt final : public DecoderModel {
 public:
  Gpt(const GptConfig& c, std::shared_ptr<comm::Communicator> group,
      const shard::ShardOptions& options, uint64_t seed)
      : DecoderModel(c.context), c_(c) {
    c.validate();
    at::Generator gen = at::detail::createCPUGenerator(seed);
    auto normal = [&](std::vector<int64_t> shape, double std) {
      return at::normal(0.0, std, shape, gen);
    };
    const double std = 0.02, proj_std = 0.02 / std::sqrt(2.0 * double(c.layers));
    const int64_t C = c.width;
    add_unit("embeddings",
             {{"wte", normal({c.vocab, C}, std)}, {"wpe", normal({c.context, C}, std)}}, group,
             options);
    for (int64_t l = 0; l < c.layers; ++l) {
      const std::vector<at::Tensor> p = {at::ones({C}),
                                         at::zeros({C}),
                                         normal({3 * C, C}, std),
                                         at::zeros({3 * C}),
                                         normal({C, C}, proj_std),
                                         at::zeros({C}),
                                         at::ones({C}),
                                         at::zeros({C}),
                                         normal({4 * C, C}, std),
                                         at::zeros({4 * C}),
                                         normal({C, 4 * C}, proj_std),
                                         at::zeros({C})};
      std::vector<std::pair<std::string, at::Tensor>> named;
      for (size_t i = 0; i < p.size(); ++i) {
        named.push_back({"h" + std::to_string(l) + "." + kBlockParams[i], p[i]});
      }
      add_unit("h" + std::to_string(l), named, group, options);
    }
    add_unit("ln_f", {{"ln_f.weight", at::ones({C})}, {"ln_f.bias", at::zeros({C})}}, group,
             options);
  }

  std::string describe() const override {
    return "GPT width " + std::to_string(c_.width) + ", " + std::to_string(c_.layers) +
           " layers, " + std::to_string(c_.heads) + " heads, context " +
           std::to_string(c_.context) + ", vocab " + std::to_string(c_.vocab) + " (" +
           std::to_string(num_params()) + " parameters)";
  }

 private:
  Pieces pieces() const override {
    const GptConfig c = c_;
    Pieces p;
    p.embed = [c](const Params& w, const Params& in) {
      const int64_t t = in[0].size(1);
      return dropout(at::embedding(w[0], in[0]) + w[1].narrow(0, 0, t), c.dropout);
    };
    p.block = [c](const Params& w, const Params& in) { return block_forward(w, in[0], c); };
    p.last = [c](const Params& w, const Params& in) {
      return at::layer_norm(in[0], {c.width}, w[0], w[1]);
    };
    return p;
  }

  GptConfig c_;
};

}  // namespace

std::unique_ptr<LanguageModel> make_gpt(const GptConfig& config,
                                        std::shared_ptr<comm::Communicator> shard_group,
                                        const shard::ShardOptions& options, uint64_t seed) {
  return std::make_unique<Gpt>(config, std::move(shard_group), options, seed);
}

}  // namespace flexdemo::model
