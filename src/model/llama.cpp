// A LLaMA-style decoder as sharded units (a DecoderModel): "embeddings" (the token table; also
// the output head when it is tied), one unit per block (RMSNorm, grouped-query attention with
// rotary positions, SwiGLU), and "norm" (the final RMSNorm, and the output head when it is its
// own). Parameters carry transformers' LlamaForCausalLM names and layouts, so a checkpoint is
// already one.
#include "flexdemo/model.h"

#include "unit_model.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <sstream>
#include <stdexcept>

namespace flexdemo::model {

void LlamaConfig::validate() const {
  require_positive(vocab, "vocab");
  require_positive(context, "context");
  require_positive(width, "width");
  require_positive(layers, "layers");
  require_positive(heads, "heads");
  require_positive(kv_heads, "kv-heads");
  require_positive(ff, "ff");
  require_heads_divide_width(heads, width);
  if (heads % kv_heads != 0) {
    throw std::invalid_argument("--kv-heads " + std::to_string(kv_heads) + " must divide --heads " +
                                std::to_string(heads));
  }
  if ((width / heads) % 2 != 0) {
    throw std::invalid_argument("rotary positions need an even head size, got --width " +
                                std::to_string(width) + " / --heads " + std::to_string(heads));
  }
  if (!(rope_theta > 1.0)) {
    std::ostringstream value;
    value << rope_theta;
    throw std::invalid_argument("--rope-theta must be > 1, got " + value.str());
  }
  if (!(dropout >= 0.0 && dropout < 1.0)) {
    std::ostringstream value;
    value << dropout;
    throw std::invalid_argument("--dropout must be in [0, 1), got " + value.str());
  }
}

std::vector<std::string> llama_presets() {
  return {"llama-nano", "llama-micro", "llama-small", "llama"};
}

LlamaConfig llama_preset(const std::string& name, int64_t vocab) {
  LlamaConfig c;
  c.vocab = vocab;
  if (name == "llama") {  // every dimension given
  } else if (name == "llama-nano") {
    c.width = 128, c.layers = 4, c.heads = 4, c.kv_heads = 2, c.ff = 352, c.context = 128;
  } else if (name == "llama-micro") {
    c.width = 256, c.layers = 4, c.heads = 4, c.kv_heads = 2, c.ff = 704, c.context = 256;
  } else if (name == "llama-small") {  // SmolLM-135M's shapes
    c.width = 576, c.layers = 30, c.heads = 9, c.kv_heads = 3, c.ff = 1536, c.context = 2048;
  } else {
    throw std::invalid_argument("unknown LLaMA preset '" + name +
                                "'; accepted: llama-nano, llama-micro, llama-small, llama");
  }
  return c;
}

namespace {

using Params = std::vector<at::Tensor>;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::Tensor x32 = x.to(at::kFloat);
  return w * (x32 * at::rsqrt(x32.pow(2).mean(-1, true) + eps)).to(x.scalar_type());
}

// Rotary positions on [B, heads, T, D] (transformers' layout: the two halves of a head rotate
// together), positions 0..T-1.
at::Tensor rotate(const at::Tensor& x, double theta) {
  const int64_t T = x.size(2), D = x.size(3);
  const auto f32 = at::dtype(at::kFloat).device(x.device());
  const at::Tensor inv_freq =
      1.0 / at::pow(theta, at::arange(0, D, 2, at::dtype(at::kLong).device(x.device()))
                               .to(at::kFloat)
                               .div(double(D)));
  const at::Tensor freqs = at::outer(at::arange(T, f32), inv_freq);
  const at::Tensor angles = at::cat({freqs, freqs}, -1);
  const at::Tensor cos = angles.cos().to(x.scalar_type()), sin = angles.sin().to(x.scalar_type());
  const at::Tensor x1 = x.narrow(-1, 0, D / 2), x2 = x.narrow(-1, D / 2, D / 2);
  return x * cos + at::cat({-x2, x1}, -1) * sin;
}

// Block parameters, in this order, after "model.layers.N.".
const char* const kBlockParams[] = {
    "input_layernorm.weight",  "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",    "mlp.up_proj.weight",      "mlp.down_proj.weight"};

at::Tensor block_forward(const Params& p, const at::Tensor& x, const LlamaConfig& c) {
  const int64_t B = x.size(0), T = x.size(1), H = c.heads, KV = c.kv_heads, D = c.width / H;
  at::Tensor h = rms_norm(x, p[0], c.norm_eps);
  const at::Tensor q = rotate(at::linear(h, p[1]).view({B, T, H, D}).transpose(1, 2), c.rope_theta);
  // Each key/value head serves H / KV consecutive query heads.
  const at::Tensor k = rotate(at::linear(h, p[2]).view({B, T, KV, D}).transpose(1, 2), c.rope_theta)
                           .repeat_interleave(H / KV, 1);
  const at::Tensor v =
      at::linear(h, p[3]).view({B, T, KV, D}).transpose(1, 2).repeat_interleave(H / KV, 1);
  at::Tensor att = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(D)));
  const at::Tensor future = at::ones({T, T}, x.options().dtype(at::kBool)).triu(1);
  att = at::softmax(att.masked_fill(future, -INFINITY), -1);
  if (c.dropout > 0.0 && at::GradMode::is_enabled()) att = at::dropout(att, c.dropout, true);
  const at::Tensor y = at::matmul(att, v).transpose(1, 2).reshape({B, T, H * D});
  const at::Tensor out = x + at::linear(y, p[4]);
  h = rms_norm(out, p[5], c.norm_eps);
  return out + at::linear(at::silu(at::linear(h, p[6])) * at::linear(h, p[7]), p[8]);
}

class Llama final : public DecoderModel {
 public:
  Llama(const LlamaConfig& c, std::shared_ptr<comm::Communicator> group,
        const shard::ShardOptions& options, uint64_t seed)
      : DecoderModel(c.context), c_(c) {
    c.validate();
    at::Generator gen = at::detail::createCPUGenerator(seed);
    auto normal = [&](std::vector<int64_t> shape) { return at::normal(0.0, 0.02, shape, gen); };
    const int64_t C = c.width, D = c.width / c.heads, F = c.ff;
    add_unit("embeddings", {{"model.embed_tokens.weight", normal({c.vocab, C})}}, group, options);
    for (int64_t l = 0; l < c.layers; ++l) {
      const std::vector<at::Tensor> p = {at::ones({C}),
                                         normal({c.heads * D, C}),
                                         normal({c.kv_heads * D, C}),
                                         normal({c.kv_heads * D, C}),
                                         normal({C, c.heads * D}),
                                         at::ones({C}),
                                         normal({F, C}),
                                         normal({F, C}),
                                         normal({C, F})};
      std::vector<std::pair<std::string, at::Tensor>> named;
      for (size_t i = 0; i < p.size(); ++i) {
        named.push_back({"model.layers." + std::to_string(l) + "." + kBlockParams[i], p[i]});
      }
      add_unit("layers." + std::to_string(l), named, group, options);
    }
    std::vector<std::pair<std::string, at::Tensor>> last = {{"model.norm.weight", at::ones({C})}};
    if (!c.tied_head) last.push_back({"lm_head.weight", normal({c.vocab, C})});
    add_unit("norm", last, group, options);
  }

  std::string describe() const override {
    std::ostringstream theta;
    theta << c_.rope_theta;
    return "LLaMA width " + std::to_string(c_.width) + ", " + std::to_string(c_.layers) +
           " layers, " + std::to_string(c_.heads) + " heads (" + std::to_string(c_.kv_heads) +
           " key/value), ff " + std::to_string(c_.ff) + ", rope theta " + theta.str() +
           ", context " + std::to_string(c_.context) + ", vocab " + std::to_string(c_.vocab) +
           (c_.tied_head ? ", tied head" : ", own head") + " (" + std::to_string(num_params()) +
           " parameters)";
  }

 private:
  Pieces pieces() const override {
    const LlamaConfig c = c_;
    Pieces p;
    p.embed = [](const Params& w, const Params& in) { return at::embedding(w[0], in[0]); };
    p.block = [c](const Params& w, const Params& in) { return block_forward(w, in[0], c); };
    p.last = [c](const Params& w, const Params& in) {
      const at::Tensor normed = rms_norm(in[0], w[0], c.norm_eps);
      return c.tied_head ? normed : at::linear(normed, w[1]);
    };
    p.own_head = !c.tied_head;
    return p;
  }

  LlamaConfig c_;
};

}  // namespace

std::unique_ptr<LanguageModel> make_llama(const LlamaConfig& config,
                                          std::shared_ptr<comm::Communicator> shard_group,
                                          const shard::ShardOptions& options, uint64_t seed) {
  return std::make_unique<Llama>(config, std::move(shard_group), options, seed);
}

}  // namespace flexdemo::model
