// A T5-style encoder-decoder (T5 v1.0 layout: RMS norms, no biases, ReLU feed-forward, tied
// embeddings; one relative position bias table per stack, shared by its self-attentions) as
// sharded units, trained with T5's span corruption (spans of the text become sentinels in the
// input and are predicted in the output) or on translation pairs. Parameters carry transformers'
// T5ForConditionalGeneration names, so a checkpoint is already one.
#include "flexdemo/model.h"

#include "unit_model.h"

#include <ATen/ATen.h>

#include <cmath>
#include <stdexcept>

namespace flexdemo::model {

void T5Config::validate() const {
  require_positive(vocab, "vocab");
  require_positive(width, "width");
  require_positive(layers, "layers");
  require_positive(heads, "heads");
  require_positive(ff, "ff");
  require_heads_divide_width(heads, width);
}

std::vector<std::string> t5_presets() {
  return {"t5-nano", "t5-small", "t5"};
}

T5Config t5_preset(const std::string& name, int64_t vocab) {
  T5Config c;
  c.vocab = vocab;
  if (name == "t5") {  // every dimension given
  } else if (name == "t5-small") {
    c.width = 512, c.layers = 6, c.heads = 8, c.ff = 2048;
  } else if (name == "t5-nano") {
    c.width = 64, c.layers = 2, c.heads = 4, c.ff = 256;
  } else {
    throw std::invalid_argument("unknown T5 preset '" + name +
                                "'; accepted: t5-nano, t5-small, t5");
  }
  return c;
}

namespace {

using Params = std::vector<at::Tensor>;
constexpr int64_t kBuckets = 32, kMaxDistance = 128, kSentinels = kT5Sentinels;
constexpr int64_t kPad = -1;  // data::PairSampler's padding

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w) {
  return x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-6) * w;
}

// T5's relative position buckets: half exact small distances, half log-spaced up to
// kMaxDistance; bidirectional attention also tells left from right.
at::Tensor position_buckets(int64_t q_len, int64_t k_len, bool bidirectional, at::Device device) {
  const auto options = at::dtype(at::kLong).device(device);
  const at::Tensor rel = at::arange(k_len, options).view({1, -1}) -
                         at::arange(q_len, options).view({-1, 1});  // key - query
  int64_t buckets = kBuckets;
  at::Tensor out = at::zeros_like(rel);
  at::Tensor n = -rel;
  if (bidirectional) {
    buckets /= 2;
    out = out + (n < 0).to(at::kLong) * buckets;
    n = n.abs();
  } else {
    n = n.clamp_min(0);
  }
  const int64_t exact = buckets / 2;
  const at::Tensor large = (exact + (at::log(n.to(at::kFloat) / exact + 1e-9) /
                                     std::log(double(kMaxDistance) / exact) * (buckets - exact))
                                        .to(at::kLong))
                               .clamp_max(buckets - 1);
  return out + at::where(n < exact, n, large);
}

// The position bias [1, heads, q_len, k_len] of a relative position bias table [kBuckets,
// heads].
at::Tensor position_bias(const at::Tensor& table, int64_t q_len, int64_t k_len,
                         bool bidirectional) {
  return at::embedding(table, position_buckets(q_len, k_len, bidirectional, table.device()))
      .permute({2, 0, 1})
      .unsqueeze(0);
}

// Multi-head attention, plus a position bias [1, heads, T, S] when given; keys where key_pad
// ([B, S] bool) is true are not attended to.
at::Tensor attention(const at::Tensor& x, const at::Tensor& kv, const at::Tensor& wq,
                     const at::Tensor& wk, const at::Tensor& wv, const at::Tensor& wo,
                     const at::Tensor* bias, bool causal, int64_t H,
                     const at::Tensor* key_pad = nullptr) {
  const int64_t B = x.size(0), T = x.size(1), S = kv.size(1), C = x.size(2), D = C / H;
  const at::Tensor q = at::linear(x, wq).view({B, T, H, D}).transpose(1, 2);
  const at::Tensor k = at::linear(kv, wk).view({B, S, H, D}).transpose(1, 2);
  const at::Tensor v = at::linear(kv, wv).view({B, S, H, D}).transpose(1, 2);
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1));  // T5 folds the scaling into init
  if (bias) scores = scores + *bias;
  if (causal)
    scores =
        scores.masked_fill(at::ones({T, S}, scores.options().dtype(at::kBool)).triu(1), -INFINITY);
  if (key_pad) scores = scores.masked_fill(key_pad->view({B, 1, 1, S}), -INFINITY);
  const at::Tensor y = at::matmul(at::softmax(scores, -1), v).transpose(1, 2).reshape({B, T, C});
  return at::linear(y, wo);
}

// The source's padding mask ([B, S] bool), where a block's inputs carry one after the others.
const at::Tensor* pad_mask(const Params& in, size_t at) {
  return in.size() > at ? &in[at] : nullptr;
}

// Encoder block [ln, q, k, v, o, ln, wi, wo] on inputs {x, position bias[, pad]}.
at::Tensor encoder_block(const Params& p, const Params& in, int64_t H) {
  const at::Tensor& x = in[0];
  const at::Tensor h = rms_norm(x, p[0]);
  at::Tensor out = x + attention(h, h, p[1], p[2], p[3], p[4], &in[1], false, H, pad_mask(in, 2));
  return out + at::linear(at::relu(at::linear(rms_norm(out, p[5]), p[6])), p[7]);
}

// Decoder block [ln, q, k, v, o, ln, cq, ck, cv, co, ln, wi, wo] on inputs {y, encoder output,
// position bias[, source pad]}.
at::Tensor decoder_block(const Params& p, const Params& in, int64_t H) {
  const at::Tensor& x = in[0];
  const at::Tensor h = rms_norm(x, p[0]);
  at::Tensor out = x + attention(h, h, p[1], p[2], p[3], p[4], &in[2], true, H);
  out = out + attention(rms_norm(out, p[5]), in[1], p[6], p[7], p[8], p[9], nullptr, false, H,
                        pad_mask(in, 3));
  return out + at::linear(at::relu(at::linear(rms_norm(out, p[10]), p[11])), p[12]);
}

class T5 final : public UnitModel {
 public:
  T5(const T5Config& c, std::shared_ptr<comm::Communicator> group,
     const shard::ShardOptions& options, uint64_t seed)
      : c_(c) {
    c.validate();
    at::Generator gen = at::detail::createCPUGenerator(seed);
    const int64_t d = c.width, f = c.ff, V = c.vocab + kSentinels;
    auto normal = [&](std::vector<int64_t> shape, double std) {
      return at::normal(0.0, std, shape, gen);
    };
    const double dk = 1.0 / std::sqrt(double(d / c.heads));  // T5: q init folds 1/sqrt(d_kv)
    add_unit("shared", {{"shared.weight", normal({V, d}, 1.0)}}, group, options);
    auto attn = [&](const std::string& prefix) {
      return std::vector<std::pair<std::string, at::Tensor>>{
          {prefix + ".q.weight", normal({d, d}, dk / std::sqrt(double(d)))},
          {prefix + ".k.weight", normal({d, d}, 1.0 / std::sqrt(double(d)))},
          {prefix + ".v.weight", normal({d, d}, 1.0 / std::sqrt(double(d)))},
          {prefix + ".o.weight", normal({d, d}, 1.0 / std::sqrt(double(d)))}};
    };
    auto ff = [&](const std::string& prefix) {
      return std::vector<std::pair<std::string, at::Tensor>>{
          {prefix + ".wi.weight", normal({f, d}, 1.0 / std::sqrt(double(d)))},
          {prefix + ".wo.weight", normal({d, f}, 1.0 / std::sqrt(double(f)))}};
    };
    auto append = [](std::vector<std::pair<std::string, at::Tensor>>& to,
                     std::vector<std::pair<std::string, at::Tensor>> more) {
      for (auto& t : more) to.push_back(std::move(t));
    };
    // Each stack's position bias table is a unit of its own, used by all its self-attentions
    // (transformers keeps it in the stack's first block).
    for (const std::string stack : {"encoder", "decoder"}) {
      add_unit(stack + ".relative_attention_bias",
               {{stack + ".block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                 normal({kBuckets, c.heads}, 0.1)}},
               group, options);
      for (int64_t l = 0; l < c.layers; ++l) {
        const std::string n = stack + ".block." + std::to_string(l) + ".layer.";
        std::vector<std::pair<std::string, at::Tensor>> p = {
            {n + "0.layer_norm.weight", at::ones({d})}};
        append(p, attn(n + "0.SelfAttention"));
        const std::string last = stack == "encoder" ? "1" : "2";
        if (stack == "decoder") {
          p.push_back({n + "1.layer_norm.weight", at::ones({d})});
          append(p, attn(n + "1.EncDecAttention"));
        }
        p.push_back({n + last + ".layer_norm.weight", at::ones({d})});
        append(p, ff(n + last + ".DenseReluDense"));
        add_unit(stack + "." + std::to_string(l), p, group, options);
      }
      add_unit(stack + ".final_layer_norm", {{stack + ".final_layer_norm.weight", at::ones({d})}},
               group, options);
    }
  }

  // Text windows [B, T + 1] are corrupted into (inputs, targets); pairs [B, source_len +
  // target_len] are (inputs, targets) as they are. Then teacher-forced; padding is not scored.
  at::Tensor loss(const at::Tensor& tokens) override {
    if (c_.source_len > 0) {
      const at::Tensor source = trim_padding(tokens.narrow(1, 0, c_.source_len));
      const at::Tensor target =
          trim_padding(tokens.narrow(1, c_.source_len, tokens.size(1) - c_.source_len));
      const at::Tensor logits = decode(encode(source), source, decoder_inputs(target));
      return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}), {},
                                    at::Reduction::Mean, kPad);
    }
    // Corrupted on the CPU (the spans are drawn from its generator), trained where tokens are.
    const auto [text_inputs, text_targets] =
        corrupt_spans(tokens.narrow(1, 0, tokens.size(1) - 1).cpu());
    const at::Tensor inputs = text_inputs.to(tokens.device());
    const at::Tensor targets = text_targets.to(tokens.device());
    const at::Tensor logits = decode(encode(inputs), inputs, decoder_inputs(targets));
    return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
  }

  at::Tensor next_token_logits(const at::Tensor&) override {
    throw std::invalid_argument(
        "this T5 was trained on span corruption, which continues no text; a T5 trained on "
        "translation pairs translates --prompt");
  }

  bool seq2seq() const override { return true; }
  at::Tensor encode(const at::Tensor& source) override {
    return encoder_states(source.clamp_min(0), padding(source));
  }
  at::Tensor next_target_logits(const at::Tensor& encoded, const at::Tensor& source,
                                const at::Tensor& prefix) override {
    const at::Tensor logits = decode(encoded, source, prefix);
    return logits.select(1, logits.size(1) - 1).to(at::kFloat);
  }

  int64_t context() const override { return 1 << 20; }  // relative positions: no limit
  std::string describe() const override {
    return "T5 width " + std::to_string(c_.width) + ", " + std::to_string(c_.layers) + "+" +
           std::to_string(c_.layers) + " layers, " + std::to_string(c_.heads) + " heads, ff " +
           std::to_string(c_.ff) + ", vocab " + std::to_string(c_.vocab) + " + " +
           std::to_string(kSentinels) + " sentinels (" + std::to_string(num_params()) +
           " parameters)";
  }

  // Teacher forcing: the decoder sees the end-of-text id (its start), then the target but its
  // last token; padding is fed as end-of-text (its positions are never scored).
  at::Tensor decoder_inputs(const at::Tensor& targets) const {
    const at::Tensor start = at::full({targets.size(0), 1}, c_.eot, targets.options());
    const at::Tensor in = at::cat({start, targets.narrow(1, 0, targets.size(1) - 1)}, 1);
    return in.masked_fill(in == kPad, c_.eot);
  }

  // Where a side is padding, [B, n] bool; undefined for rows without any (no mask needed).
  static at::Tensor padding(const at::Tensor& side) {
    const at::Tensor pad = side == kPad;
    return pad.any().item<bool>() ? pad : at::Tensor();
  }

  // The columns up to the longest row's end (rows are padded at their ends only).
  static at::Tensor trim_padding(const at::Tensor& side) {
    const int64_t longest = (side != kPad).sum(1).max().item<int64_t>();
    return side.narrow(1, 0, longest);
  }

  // Span corruption with noise density 0.15 and mean span 3 (T5's defaults): a fixed number of
  // spans per row at random places; each span becomes one sentinel in the inputs, and the
  // targets list every sentinel followed by its span, then end-of-text.
  std::pair<at::Tensor, at::Tensor> corrupt_spans(const at::Tensor& text) {
    const int64_t B = text.size(0), n = text.size(1);
    const int64_t noise = std::max<int64_t>(1, std::llround(0.15 * double(n)));
    const int64_t spans = std::max<int64_t>(1, std::min<int64_t>(kSentinels, noise / 3));
    const int64_t span = noise / spans;  // every span the same length: fixed output shapes
    const int64_t used = span * spans;
    at::Tensor inputs = at::empty({B, n - used + spans}, at::kLong);
    at::Tensor targets = at::empty({B, used + spans + 1}, at::kLong);
    auto t = text.accessor<int64_t, 2>();
    auto in = inputs.accessor<int64_t, 2>();
    auto out = targets.accessor<int64_t, 2>();
    for (int64_t b = 0; b < B; ++b) {
      // Span starts: distinct slots among the n - used + spans "gaps", in order.
      // The default generator: its state is in every checkpoint, so a resumed run corrupts
      // the same spans.
      const at::Tensor order = at::randperm(n - used + spans, at::kLong);
      std::vector<int64_t> starts(order.data_ptr<int64_t>(), order.data_ptr<int64_t>() + spans);
      std::sort(starts.begin(), starts.end());
      int64_t src = 0, i = 0, o = 0, s = 0;
      for (int64_t slot = 0; slot < n - used + spans; ++slot) {
        if (s < spans && starts[s] == slot) {
          const int64_t sentinel = c_.vocab + s;
          in[b][i++] = sentinel;
          out[b][o++] = sentinel;
          for (int64_t k = 0; k < span; ++k) out[b][o++] = t[b][src++];
          ++s;
        } else {
          in[b][i++] = t[b][src++];
        }
      }
      out[b][o++] = c_.eot;
    }
    return {inputs, targets};
  }

 private:
  // Units: 0 the shared embeddings (and head); 1 the encoder's position bias, 2..L+1 its
  // blocks, L+2 its final norm; L+3 the decoder's position bias, L+4..2L+3 its blocks, 2L+4 its
  // final norm. Each names the unit that runs after it (its gather is prefetched) and the one
  // that ran before it (prefetched in the backward).
  shard::ShardedUnit* u(int64_t i) const { return units_[size_t(i)].get(); }

  // The encoder's output for inputs [B, S] (valid ids), pad: undefined or [B, S] bool.
  at::Tensor encoder_states(const at::Tensor& inputs, const at::Tensor& pad) {
    const int64_t H = c_.heads, L = c_.layers, S = inputs.size(1);
    auto embed = [](const Params& p, const Params& in) { return at::embedding(p[0], in[0]); };
    at::Tensor x = u(0)->forward(embed, {inputs}, {u(1), nullptr});
    const at::Tensor bias = u(1)->forward(
        [S](const Params& p, const Params&) { return position_bias(p[0], S, S, true); }, {},
        {u(2), u(0)});
    for (int64_t l = 0; l < L; ++l) {
      x = u(2 + l)->forward(
          [H](const Params& p, const Params& in) { return encoder_block(p, in, H); },
          pad.defined() ? Params{x, bias, pad} : Params{x, bias}, {u(3 + l), u(1 + l)});
    }
    return u(2 + L)->forward(
        [](const Params& p, const Params& in) { return rms_norm(in[0], p[0]); }, {x},
        {u(0), u(1 + L)});
  }

  // Logits [B, T, vocab + sentinels] of the decoder on decoder_in [B, T], attending to the
  // encoder's output of source (padded with kPad where it is).
  at::Tensor decode(const at::Tensor& enc, const at::Tensor& source, const at::Tensor& decoder_in) {
    const int64_t H = c_.heads, L = c_.layers, d = c_.width, T = decoder_in.size(1);
    const int64_t first = L + 3;  // the decoder's position bias unit
    const at::Tensor pad = padding(source);
    auto embed = [](const Params& p, const Params& in) { return at::embedding(p[0], in[0]); };
    at::Tensor y = u(0)->forward(embed, {decoder_in}, {u(first), nullptr});
    const at::Tensor bias = u(first)->forward(
        [T](const Params& p, const Params&) { return position_bias(p[0], T, T, false); }, {},
        {u(first + 1), u(0)});
    for (int64_t l = 0; l < L; ++l) {
      y = u(first + 1 + l)
              ->forward([H](const Params& p, const Params& in) { return decoder_block(p, in, H); },
                        pad.defined() ? Params{y, enc, bias, pad} : Params{y, enc, bias},
                        {u(first + 2 + l), u(first + l)});
    }
    y = u(first + 1 + L)
            ->forward(
                [d](const Params& p, const Params& in) {
                  return rms_norm(in[0], p[0]) *
                         (1.0 / std::sqrt(double(d)));  // T5's tied-head scale
                },
                {y}, {u(0), u(first + L)});
    return u(0)->forward(
        [](const Params& p, const Params& in) { return at::matmul(in[0], p[0].t()); }, {y},
        {nullptr, u(first + 1 + L)});
  }

  T5Config c_;
};

}  // namespace

std::unique_ptr<LanguageModel> make_t5(const T5Config& config,
                                       std::shared_ptr<comm::Communicator> shard_group,
                                       const shard::ShardOptions& options, uint64_t seed) {
  return std::make_unique<T5>(config, std::move(shard_group), options, seed);
}

}  // namespace flexdemo::model
