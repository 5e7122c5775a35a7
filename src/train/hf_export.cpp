// `flexdemo export --format hf`: a checkpoint as a Hugging Face transformers model folder.
// GPT -> GPT2LMHeadModel (its Conv1D layers keep weights as [in, out]: ours are transposed);
// LLaMA -> LlamaForCausalLM (our names and layouts are already transformers'). The BPE
// tokenizer goes along as the SentencePiece model transformers' LlamaTokenizer reads.
#include "checkpoint_store.h"
#include "options.h"

#include "flexdemo/comm.h"
#include "flexdemo/safetensors.h"
#include "flexdemo/train.h"

#include <ATen/ATen.h>
#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>

namespace flexdemo::train {

namespace fs = std::filesystem;

namespace {

using Weights = std::map<std::string, at::Tensor>;

at::Tensor take(const Weights& w, const std::string& name) {
  const auto it = w.find(name);
  if (it == w.end()) throw std::logic_error("export: the model has no parameter " + name);
  return it->second;
}

// GPT2LMHeadModel: "transformer." names, Conv1D weights [in, out], the head tied to wte.
NamedTensors gpt2_tensors(const Weights& w, const model::GptConfig& c) {
  NamedTensors out = {{"transformer.wte.weight", take(w, "wte")},
                      {"transformer.wpe.weight", take(w, "wpe")}};
  const std::vector<std::pair<std::string, std::string>> same = {
      {"ln_1.weight", "ln_1.weight"}, {"ln_1.bias", "ln_1.bias"},
      {"attn.qkv.bias", "attn.c_attn.bias"}, {"attn.proj.bias", "attn.c_proj.bias"},
      {"ln_2.weight", "ln_2.weight"}, {"ln_2.bias", "ln_2.bias"},
      {"mlp.fc.bias", "mlp.c_fc.bias"}, {"mlp.proj.bias", "mlp.c_proj.bias"}};
  const std::vector<std::pair<std::string, std::string>> transposed = {
      {"attn.qkv.weight", "attn.c_attn.weight"}, {"attn.proj.weight", "attn.c_proj.weight"},
      {"mlp.fc.weight", "mlp.c_fc.weight"}, {"mlp.proj.weight", "mlp.c_proj.weight"}};
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string ours = "h" + std::to_string(l) + ".";
    const std::string theirs = "transformer.h." + std::to_string(l) + ".";
    for (const auto& [a, b] : same) out.push_back({theirs + b, take(w, ours + a)});
    for (const auto& [a, b] : transposed) {
      out.push_back({theirs + b, take(w, ours + a).t().contiguous()});
    }
  }
  out.push_back({"transformer.ln_f.weight", take(w, "ln_f.weight")});
  out.push_back({"transformer.ln_f.bias", take(w, "ln_f.bias")});
  return out;
}

nlohmann::ordered_json gpt2_json(const model::GptConfig& c, int64_t eot) {
  return {{"architectures", {"GPT2LMHeadModel"}},
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
  return {{"architectures", {"LlamaForCausalLM"}},
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

void write_json(const fs::path& path, const nlohmann::ordered_json& j) {
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

}  // namespace

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
  if (is_t5(s->cfg)) {
    throw std::invalid_argument("flexdemo export: T5 models are not exported yet (GPT and LLaMA are)");
  }
  Weights w;
  for (size_t u = 0; u < s->lm->units().size(); ++u) {
    const std::vector<at::Tensor> full = s->lm->units()[u]->gather();
    for (size_t i = 0; i < full.size(); ++i) w[s->lm->param_names()[u][i]] = full[i].cpu();
  }
  if (world->rank() != 0) return 0;

  const int64_t vocab = s->tokens.vocab_size, eot = s->tokens.eot;
  nlohmann::ordered_json config;
  NamedTensors tensors;
  if (is_llama(s->cfg)) {
    const model::LlamaConfig c = llama_config(s->cfg, vocab);
    config = llama_json(c, eot);
    for (const auto& [name, t] : w) tensors.push_back({name, t});
  } else {
    const model::GptConfig c = gpt_config(s->cfg, vocab);
    config = gpt2_json(c, eot);
    tensors = gpt2_tensors(w, c);
  }

  const fs::path tmp = out.string() + ".tmp-" + std::to_string(getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  write_json(tmp / "config.json", config);
  write_safetensors((tmp / "model.safetensors").string(), tensors, {{"format", "pt"}});
  const std::string& spm = s->tokens.tokenizer_model;
  if (!spm.empty()) {
    fs::copy_file(spm, tmp / "tokenizer.model");
    // The SentencePiece model alone: no start token (flexdemo trains without one), its
    // end-of-sentence piece is end-of-text.
    write_json(tmp / "tokenizer_config.json", {{"tokenizer_class", "LlamaTokenizer"},
                                               {"add_bos_token", false},
                                               {"add_eos_token", false},
                                               {"bos_token", nullptr},
                                               {"eos_token", "</s>"},
                                               {"unk_token", "<unk>"},
                                               {"pad_token", nullptr},
                                               {"legacy", true},
                                               {"model_max_length", s->lm->context()}});
  }
  fs::rename(tmp, out);
  fmt::print("exported {} ({}) to {}: config.json, model.safetensors{}\n", checkpoint,
             config["architectures"][0].get<std::string>(), o.out,
             spm.empty() ? " (byte tokenizer: ids are byte values, end-of-text 256; no "
                           "tokenizer files)"
                         : ", tokenizer.model, tokenizer_config.json");
  return 0;
}

}  // namespace flexdemo::train
