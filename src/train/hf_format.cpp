// Hugging Face transformers' model folders, both ways: `flexdemo export --format hf` writes a
// checkpoint as one, `--init-from` starts training from one. GPT <-> GPT2LMHeadModel (its Conv1D
// layers keep weights as [in, out]: ours are transposed); LLaMA <-> LlamaForCausalLM and T5 <->
// T5ForConditionalGeneration (our names and layouts are already transformers'). The BPE
// tokenizer travels as the SentencePiece model transformers' LlamaTokenizer (T5Tokenizer) reads.
#include "hf_format.h"

#include "checkpoint_store.h"
#include "options.h"

#include "flexdemo/comm.h"
#include "flexdemo/safetensors.h"
#include "flexdemo/train.h"

#include <ATen/ATen.h>
#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>

namespace flexdemo::train {

namespace fs = std::filesystem;

namespace {

nlohmann::ordered_json gpt2_json(const model::GptConfig& c, int64_t eot) {
  return {{"architectures", {kGpt2}},
          {"model_type", "gpt2"},
          {"vocab_size", c.vocab},
          {"n_positions", c.context},
          {"n_embd", c.width},
          {"n_layer", c.layers},
          {"n_head", c.heads},
          {"n_inner", nullptr},  // 4 x n_embd
          {"activation_function", "gelu_new"},
          {"layer_norm_epsilon", 1e-5},
          {"initializer_range", 0.02},
          {"embd_pdrop", c.dropout},
          {"attn_pdrop", c.dropout},
          {"resid_pdrop", c.dropout},
          {"scale_attn_weights", true},
          {"tie_word_embeddings", true},
          {"bos_token_id", eot},
          {"eos_token_id", eot},
          {"dtype", "float32"}};
}

nlohmann::ordered_json llama_json(const model::LlamaConfig& c, int64_t eot) {
  return {{"architectures", {kLlama}},
          {"model_type", "llama"},
          {"vocab_size", c.vocab},
          {"hidden_size", c.width},
          {"intermediate_size", c.ff},
          {"num_hidden_layers", c.layers},
          {"num_attention_heads", c.heads},
          {"num_key_value_heads", c.kv_heads},
          {"head_dim", c.width / c.heads},
          {"hidden_act", "silu"},
          {"max_position_embeddings", c.context},
          {"rms_norm_eps", c.norm_eps},
          {"rope_theta", c.rope_theta},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", c.rope_theta}}},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"attention_dropout", c.dropout},
          {"tie_word_embeddings", c.tied_head},
          {"initializer_range", 0.02},
          {"bos_token_id", eot},
          {"eos_token_id", eot},
          {"dtype", "float32"}};
}

nlohmann::ordered_json t5_json(const model::T5Config& c, int64_t eot) {
  return {{"architectures", {kT5}},
          {"model_type", "t5"},
          {"vocab_size", c.vocab + model::kT5Sentinels},
          {"d_model", c.width},
          {"d_kv", c.width / c.heads},
          {"d_ff", c.ff},
          {"num_layers", c.layers},
          {"num_decoder_layers", c.layers},
          {"num_heads", c.heads},
          {"relative_attention_num_buckets", 32},
          {"relative_attention_max_distance", 128},
          {"dropout_rate", 0.0},
          {"layer_norm_epsilon", 1e-6},
          {"feed_forward_proj", "relu"},
          {"is_encoder_decoder", true},
          {"tie_word_embeddings", true},
          {"decoder_start_token_id", eot},  // flexdemo's decoder starts with end-of-text
          {"eos_token_id", eot},
          {"pad_token_id", eot},
          {"dtype", "float32"}};
}

void write_json(const fs::path& path, const nlohmann::ordered_json& j) {
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

}  // namespace

HfName hf_name(const std::string& ours, bool same) {
  if (same) return {ours, false};
  if (ours == "wte" || ours == "wpe") return {"transformer." + ours + ".weight", false};
  if (ours.rfind("ln_f.", 0) == 0) return {"transformer." + ours, false};
  // "h<L>.<rest>"
  const size_t dot = ours.find('.');
  const std::string layer = ours.substr(1, dot - 1), rest = ours.substr(dot + 1);
  static const std::map<std::string, HfName> kBlock = {
      {"ln_1.weight", {"ln_1.weight"}},
      {"ln_1.bias", {"ln_1.bias"}},
      {"attn.qkv.weight", {"attn.c_attn.weight", true}},
      {"attn.qkv.bias", {"attn.c_attn.bias"}},
      {"attn.proj.weight", {"attn.c_proj.weight", true}},
      {"attn.proj.bias", {"attn.c_proj.bias"}},
      {"ln_2.weight", {"ln_2.weight"}},
      {"ln_2.bias", {"ln_2.bias"}},
      {"mlp.fc.weight", {"mlp.c_fc.weight", true}},
      {"mlp.fc.bias", {"mlp.c_fc.bias"}},
      {"mlp.proj.weight", {"mlp.c_proj.weight", true}},
      {"mlp.proj.bias", {"mlp.c_proj.bias"}}};
  const HfName& block = kBlock.at(rest);
  return {"transformer.h." + layer + "." + block.name, block.transposed};
}

// ====== export ======
int run_export(const std::string& checkpoint, const ExportOptions& o,
               std::shared_ptr<comm::Communicator> world) {
  if (o.format != "hf") {
    throw std::invalid_argument("--format must be hf (Hugging Face transformers), got " + o.format);
  }
  if (o.out.empty()) throw std::invalid_argument("--out must name a new folder");
  const fs::path out(o.out);
  if (fs::exists(out)) {
    throw std::invalid_argument("--out " + o.out + " exists; give a folder that does not");
  }
  auto s = open_checkpoint(checkpoint, 1, world);
  const model::ModelFamily f = family(s->cfg);
  const bool llama = f == model::ModelFamily::Llama, t5 = f == model::ModelFamily::T5;
  NamedTensors tensors;
  for (size_t u = 0; u < s->lm->units().size(); ++u) {
    const std::vector<at::Tensor> full = s->lm->units()[u]->gather();
    for (size_t i = 0; i < full.size(); ++i) {
      const HfName theirs = hf_name(s->lm->param_names()[u][i], llama || t5);
      const at::Tensor t = full[i].cpu();
      tensors.push_back({theirs.name, theirs.transposed ? t.t().contiguous() : t});
    }
  }
  if (world->rank() != 0) return 0;

  const int64_t vocab = s->tokens.vocab_size, eot = s->tokens.eot;
  const nlohmann::ordered_json config = llama ? llama_json(llama_config(s->cfg, vocab), eot)
                                        : t5  ? t5_json(t5_config(s->cfg, vocab), eot)
                                              : gpt2_json(gpt_config(s->cfg, vocab), eot);
  const fs::path tmp = out.string() + ".tmp-" + std::to_string(getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  write_json(tmp / "config.json", config);
  write_safetensors((tmp / "model.safetensors").string(), tensors, {{"format", "pt"}});
  const std::string& spm = s->tokens.tokenizer_model;
  if (!spm.empty()) {
    fs::copy_file(spm, tmp / (t5 ? "spiece.model" : "tokenizer.model"));
    // The SentencePiece model alone: no start token (flexdemo trains without one), its
    // end-of-sentence piece is end-of-text. T5's sources end with it: T5Tokenizer appends it.
    nlohmann::ordered_json tokenizer = {{"tokenizer_class", t5 ? "T5Tokenizer" : "LlamaTokenizer"},
                                        {"add_bos_token", false},
                                        {"add_eos_token", false},
                                        {"bos_token", nullptr},
                                        {"eos_token", "</s>"},
                                        {"unk_token", "<unk>"},
                                        {"pad_token", nullptr},
                                        {"legacy", true},
                                        {"model_max_length", t5 ? s->cfg.seq : s->lm->context()}};
    if (t5) {
      tokenizer.erase("add_bos_token");
      tokenizer.erase("add_eos_token");
      tokenizer["pad_token"] = "</s>";
      tokenizer["extra_ids"] = model::kT5Sentinels;
    }
    write_json(tmp / "tokenizer_config.json", tokenizer);
  }
  fs::rename(tmp, out);
  fmt::print("exported {} ({}) to {}: config.json, model.safetensors{}\n", checkpoint,
             config["architectures"][0].get<std::string>(), o.out,
             spm.empty() ? " (byte tokenizer: ids are byte values, end-of-text 256; no "
                           "tokenizer files)"
             : t5        ? ", spiece.model, tokenizer_config.json"
                         : ", tokenizer.model, tokenizer_config.json");
  return 0;
}

}  // namespace flexdemo::train
