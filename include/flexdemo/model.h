// flexdemo/model.h — language models built from sharded units (the blocks and the embeddings):
// a GPT decoder (pre-norm, causal self-attention, GELU MLP, learned positions, tied embeddings),
// a LLaMA-style decoder (RMSNorm, rotary positions, SwiGLU, grouped-query attention) and a
// T5-style encoder-decoder with relative position bias.
#pragma once

#include "flexdemo/names.h"
#include "flexdemo/shard.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace flexdemo::comm {
class Communicator;
}

namespace flexdemo::model {

// ====== Families and presets ======
enum class ModelFamily { Gpt, Llama, T5 };
// Every preset, family by family: gpt-nano, gpt-micro, gpt2-small, gpt; llama-nano, llama-micro,
// llama-small, llama; t5-nano, t5-small, t5. The bare family names have no dimensions of their
// own: every one is given (what --init-from does, from a transformers folder).
std::vector<std::string> model_presets();
// A preset's family; throws std::invalid_argument for a name model_presets() lacks.
ModelFamily model_family(const std::string& preset);

struct GptConfig {
  int64_t vocab = 0;    // tokenizer's vocabulary
  int64_t context = 0;  // longest sequence (learned positions)
  int64_t width = 0;    // d_model
  int64_t layers = 0;
  int64_t heads = 0;      // divides width
  double dropout = 0.0;   // on embeddings, attention weights and residual branches
  void validate() const;  // throws std::invalid_argument naming the bad dimension
};

// Presets (vocabulary from the tokenizer): gpt-nano (width 128, 4 layers, 4 heads, context 128;
// ~1M parameters with a 2048 vocabulary), gpt-micro (256, 4, 4, 256; ~4M with 4096),
// gpt2-small (768, 12, 12, 1024; GPT-2's 124M with its 50257 vocabulary).
GptConfig gpt_preset(const std::string& name, int64_t vocab);

struct LlamaConfig {
  int64_t vocab = 0;
  int64_t context = 0;  // longest sequence
  int64_t width = 0;    // hidden size
  int64_t layers = 0;
  int64_t heads = 0;     // query heads; divides width, the head size even (rotary positions)
  int64_t kv_heads = 0;  // key/value heads (grouped-query attention); divides heads
  int64_t ff = 0;        // SwiGLU's intermediate size
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  bool tied_head = true;  // the output head is the token table
  double dropout = 0.0;   // on attention weights
  void validate() const;
};
// llama-nano (width 128, 4 layers, 4 heads, 2 key/value heads, ff 352, context 128),
// llama-micro (256, 4, 4, 2, 704, 256; 4.0M parameters with a 4096 vocabulary) and llama-small
// (SmolLM-135M's shapes: 576, 30, 9, 3, 1536, 2048; 108.6M parameters with a 4096 vocabulary,
// 134.5M with 49152).
LlamaConfig llama_preset(const std::string& name, int64_t vocab);

// T5's sentinel ids (span corruption's <extra_id_N>): vocab + N, N < kT5Sentinels.
constexpr int64_t kT5Sentinels = 100;

struct T5Config {
  int64_t vocab = 0;   // tokenizer's vocabulary; kT5Sentinels ids are added after it
  int64_t eot = 0;     // the tokenizer's end-of-text id: decoder start and end of targets
  int64_t width = 0;   // d_model
  int64_t layers = 0;  // encoder layers, and as many decoder layers
  int64_t heads = 0;
  int64_t ff = 0;  // d_ff
  // 0: trained on running text by span corruption (rows [B, T + 1]); > 0: on translation pairs,
  // rows [B, source_len + target_len] as data::PairSampler makes them (padded with -1).
  int64_t source_len = 0;
  void validate() const;
};
// t5-small (d_model 512, 6+6 layers, 8 heads, d_ff 2048: the FlexDeMo paper's model) and
// t5-nano (64, 2+2, 4, 256) for tests.
T5Config t5_preset(const std::string& name, int64_t vocab);

class LanguageModel {
 public:
  virtual ~LanguageModel() = default;
  // Mean next-token cross-entropy of tokens int64 [B, T + 1] (inputs, targets shifted by one).
  // Collective over the shard group (the units gather their parameters).
  virtual at::Tensor loss(const at::Tensor& tokens) = 0;
  // Logits of the last position, float32 [B, vocab], for tokens int64 [B, T] (generation).
  virtual at::Tensor next_token_logits(const at::Tensor& tokens) = 0;
  // Encoder-decoders (translation): whether this is one; the encoder's output for sources int64
  // [B, S] (padded with -1 at their ends); and the logits of the next target token, float32
  // [B, vocab], given that output, the sources and target prefixes int64 [B, T] (each starting
  // with end-of-text, the decoder's start). Collective over the shard group, like loss().
  virtual bool seq2seq() const { return false; }
  virtual at::Tensor encode(const at::Tensor& source);
  virtual at::Tensor next_target_logits(const at::Tensor& encoded, const at::Tensor& source,
                                        const at::Tensor& prefix);
  virtual const std::vector<std::unique_ptr<shard::ShardedUnit>>& units() const = 0;
  // Per unit, the descriptive names of its parameters ("wte", "h0.attn.qkv.weight", ...).
  virtual const std::vector<std::vector<std::string>>& param_names() const = 0;
  virtual int64_t num_params() const = 0;
  virtual int64_t context() const = 0;
  virtual std::string describe() const = 0;
};

// T5-style encoder-decoder trained with span corruption (loss takes the same [B, T+1] windows).
std::unique_ptr<LanguageModel> make_t5(const T5Config& config,
                                       std::shared_ptr<comm::Communicator> shard_group,
                                       const shard::ShardOptions& options, uint64_t seed);

// The same initial parameters on every rank (drawn from `seed`), sharded over shard_group.
std::unique_ptr<LanguageModel> make_gpt(const GptConfig& config,
                                        std::shared_ptr<comm::Communicator> shard_group,
                                        const shard::ShardOptions& options, uint64_t seed);
// Its parameters carry transformers' LlamaForCausalLM names ("model.layers.0.mlp.up_proj.weight").
std::unique_ptr<LanguageModel> make_llama(const LlamaConfig& config,
                                          std::shared_ptr<comm::Communicator> shard_group,
                                          const shard::ShardOptions& options, uint64_t seed);

}  // namespace flexdemo::model

namespace flexdemo {
template <>
struct NameTable<model::ModelFamily> {
  static constexpr const char* what = "model family";
  static constexpr std::pair<model::ModelFamily, const char*> entries[] = {
      {model::ModelFamily::Gpt, "gpt"},
      {model::ModelFamily::Llama, "llama"},
      {model::ModelFamily::T5, "t5"}};
};
}  // namespace flexdemo
