// --init-from: a Hugging Face transformers model folder read into a training run — its config.json
// into the model's family and shape (what flexdemo's models cannot express refused with one
// line), its weights into the model's shards, its SentencePiece tokenizer.
#include "hf_format.h"

#include "flexdemo/safetensors.h"

#include <ATen/ATen.h>
#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>

namespace flexdemo::train {

namespace fs = std::filesystem;

namespace {

// ====== Reading a transformers folder ======
[[noreturn]] void bad(const std::string& dir, const std::string& what) {
  throw std::invalid_argument("--init-from " + dir + ": " + what);
}

nlohmann::json read_hf_config(const std::string& dir) {
  const fs::path path = fs::path(dir) / "config.json";
  if (!fs::is_regular_file(path)) bad(dir, "no config.json (not a transformers model folder)");
  try {
    return nlohmann::json::parse(std::ifstream(path));
  } catch (const nlohmann::json::exception&) {
    bad(dir, "config.json is not valid JSON");
  }
}

std::string architecture(const nlohmann::json& hf, const std::string& dir) {
  if (!hf.contains("architectures") || !hf["architectures"].is_array() ||
      hf["architectures"].empty() || !hf["architectures"][0].is_string()) {
    bad(dir, "config.json names no architecture (\"architectures\")");
  }
  const std::string arch = hf["architectures"][0].get<std::string>();
  if (arch != kGpt2 && arch != kLlama && arch != kT5) {
    bad(dir, fmt::format("architecture {} is not supported; accepted: {}, {}, {}", arch, kGpt2,
                         kLlama, kT5));
  }
  return arch;
}

// A number from config.json (fallback when absent; a required key without one is an error).
double number(const nlohmann::json& hf, const std::string& key, const std::string& dir,
              std::optional<double> fallback = std::nullopt) {
  if (!hf.contains(key) || hf[key].is_null()) {
    if (fallback) return *fallback;
    bad(dir, "config.json has no " + key);
  }
  if (!hf[key].is_number()) bad(dir, "config.json's " + key + " is not a number");
  return hf[key].get<double>();
}

// What flexdemo's model cannot express: a one-line error naming the setting.
void require(bool ok, const std::string& dir, const std::string& what) {
  if (!ok) bad(dir, what + " is not supported by flexdemo's model");
}

// The weights of a folder: model.safetensors, or the files model.safetensors.index.json lists.
std::map<std::string, at::Tensor> read_hf_weights(const std::string& dir) {
  std::vector<fs::path> files;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::is_regular_file(fs::path(dir) / "model.safetensors")) {
    files.push_back(fs::path(dir) / "model.safetensors");
  } else if (fs::is_regular_file(index)) {
    std::set<std::string> names;
    for (const auto& [tensor, file] :
         nlohmann::json::parse(std::ifstream(index)).at("weight_map").items()) {
      names.insert(file.get<std::string>());
    }
    for (const std::string& name : names) files.push_back(fs::path(dir) / name);
  } else {
    bad(dir, "no model.safetensors (nor model.safetensors.index.json)");
  }
  std::map<std::string, at::Tensor> weights;
  for (const fs::path& file : files) {
    for (auto& [name, t] : read_safetensors(file.string())) weights[name] = t;
  }
  return weights;
}

std::string shape_of(at::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

// ====== --init-from ======
namespace {

// A dimension from the folder; a shape option given as well must agree with it.
void take(const std::string& dir, int64_t& option, const char* flag, const std::string& key,
          int64_t value) {
  if (option != 0 && option != value) {
    bad(dir, fmt::format("its {} is {}, but {} {} was given", key, value, flag, option));
  }
  option = value;
}

void shape_from_t5(const nlohmann::json& hf, const std::string& dir, TrainConfig& c) {
  require(hf.value("feed_forward_proj", "relu") == "relu", dir,
          "feed_forward_proj other than relu (T5 v1.0)");
  require(hf.value("tie_word_embeddings", true), dir, "an untied head");
  require(int64_t(number(hf, "relative_attention_num_buckets", dir, 32)) == 32 &&
              int64_t(number(hf, "relative_attention_max_distance", dir, 128)) == 128,
          dir, "relative attention other than 32 buckets up to 128");
  require(std::abs(number(hf, "layer_norm_epsilon", dir, 1e-6) - 1e-6) < 1e-12, dir,
          "layer_norm_epsilon other than 1e-6");
  const int64_t width = int64_t(number(hf, "d_model", dir));
  const int64_t heads = int64_t(number(hf, "num_heads", dir));
  const int64_t layers = int64_t(number(hf, "num_layers", dir));
  require(int64_t(number(hf, "d_kv", dir)) * heads == width, dir,
          "d_kv x num_heads other than d_model");
  require(int64_t(number(hf, "num_decoder_layers", dir, double(layers))) == layers, dir,
          "num_decoder_layers other than num_layers");
  c.model = "t5";  // the family: every dimension is the folder's
  take(dir, c.width, "--width", "d_model", width);
  take(dir, c.layers, "--layers", "num_layers", layers);
  take(dir, c.heads, "--heads", "num_heads", heads);
  take(dir, c.ff, "--ff", "d_ff", int64_t(number(hf, "d_ff", dir)));
}

void shape_from_llama(const nlohmann::json& hf, const std::string& dir, TrainConfig& c) {
  require(hf.value("hidden_act", "silu") == "silu", dir, "hidden_act other than silu");
  require(!hf.value("attention_bias", false), dir, "attention_bias");
  require(!hf.value("mlp_bias", false), dir, "mlp_bias");
  const bool scaled = hf.contains("rope_scaling") && !hf["rope_scaling"].is_null();
  const bool other_rope = hf.contains("rope_parameters") && hf["rope_parameters"].is_object() &&
                          hf["rope_parameters"].value("rope_type", "default") != "default";
  require(!scaled && !other_rope, dir, "rope scaling");
  require(std::abs(number(hf, "rms_norm_eps", dir, 1e-6) - 1e-5) < 1e-12, dir,
          "rms_norm_eps other than 1e-5");
  const int64_t width = int64_t(number(hf, "hidden_size", dir));
  const int64_t heads = int64_t(number(hf, "num_attention_heads", dir));
  require(int64_t(number(hf, "head_dim", dir, double(width / heads))) == width / heads, dir,
          "head_dim other than hidden_size / num_attention_heads");
  c.model = "llama";  // the family: every dimension is the folder's
  take(dir, c.width, "--width", "hidden_size", width);
  take(dir, c.layers, "--layers", "num_hidden_layers",
       int64_t(number(hf, "num_hidden_layers", dir)));
  take(dir, c.heads, "--heads", "num_attention_heads", heads);
  take(dir, c.kv_heads, "--kv-heads", "num_key_value_heads",
       int64_t(number(hf, "num_key_value_heads", dir, double(heads))));
  take(dir, c.ff, "--ff", "intermediate_size", int64_t(number(hf, "intermediate_size", dir)));
  take(dir, c.context, "--context", "max_position_embeddings",
       int64_t(number(hf, "max_position_embeddings", dir)));
  double theta = number(hf, "rope_theta", dir, 10000.0);
  if (hf.contains("rope_parameters") && hf["rope_parameters"].is_object() &&
      hf["rope_parameters"].contains("rope_theta")) {
    theta = hf["rope_parameters"]["rope_theta"].get<double>();
  }
  c.rope_theta = theta;
  c.tied_head = hf.value("tie_word_embeddings", false);  // LlamaConfig's default
}

void shape_from_gpt2(const nlohmann::json& hf, const std::string& dir, TrainConfig& c) {
  require(hf.value("activation_function", "gelu_new") == "gelu_new", dir,
          "activation_function other than gelu_new");
  require(hf.value("tie_word_embeddings", true), dir, "an untied head");
  require(hf.value("scale_attn_weights", true) &&
              !hf.value("scale_attn_by_inverse_layer_idx", false) &&
              !hf.value("reorder_and_upcast_attn", false),
          dir, "attention scaling other than 1/sqrt(head size)");
  require(std::abs(number(hf, "layer_norm_epsilon", dir, 1e-5) - 1e-5) < 1e-12, dir,
          "layer_norm_epsilon other than 1e-5");
  const int64_t width = int64_t(number(hf, "n_embd", dir));
  require(int64_t(number(hf, "n_inner", dir, double(4 * width))) == 4 * width, dir,
          "n_inner other than 4 x n_embd");
  c.model = "gpt";  // the family: every dimension is the folder's
  take(dir, c.width, "--width", "n_embd", width);
  take(dir, c.layers, "--layers", "n_layer", int64_t(number(hf, "n_layer", dir)));
  take(dir, c.heads, "--heads", "n_head", int64_t(number(hf, "n_head", dir)));
  take(dir, c.context, "--context", "n_positions", int64_t(number(hf, "n_positions", dir)));
}

}  // namespace

void apply_init_from(TrainConfig& c) {
  if (c.init_from.empty()) return;
  const std::string& dir = c.init_from;
  const nlohmann::json hf = read_hf_config(dir);
  const std::string arch = architecture(hf, dir);
  if (arch == kT5) {
    shape_from_t5(hf, dir, c);
  } else if (arch == kLlama) {
    shape_from_llama(hf, dir, c);
  } else {
    shape_from_gpt2(hf, dir, c);
  }
  // LLaMA's and GPT's SentencePiece file is tokenizer.model, T5's spiece.model.
  fs::path spm = fs::path(dir) / "tokenizer.model";
  if (!fs::is_regular_file(spm)) spm = fs::path(dir) / "spiece.model";
  if (fs::is_regular_file(spm)) {
    c.tokenizer = TokenizerKind::Bpe;
    c.tokenizer_model = fs::absolute(spm).string();
  } else if (c.tokenizer != TokenizerKind::Bytes) {
    bad(dir,
        "no tokenizer.model or spiece.model (flexdemo reads SentencePiece tokenizers; a "
        "model of 257 ids trained on bytes takes --tokenizer bytes)");
  }
}

void load_init_from(Session& s) {
  const std::string& dir = s.cfg.init_from;
  if (dir.empty()) return;
  const nlohmann::json hf = read_hf_config(dir);
  const std::string arch = architecture(hf, dir);
  const bool llama = arch == kLlama, t5 = arch == kT5;
  const int64_t vocab = int64_t(number(hf, "vocab_size", dir));
  const int64_t ids = s.tokens.vocab_size + (t5 ? model::kT5Sentinels : 0);
  if (vocab != ids) {
    bad(dir, fmt::format("its vocab_size is {}, but its tokenizer has {} ids{}", vocab, ids,
                         t5 ? " (with T5's 100 sentinels)" : ""));
  }
  std::map<std::string, at::Tensor> weights = read_hf_weights(dir);
  std::set<std::string> used;
  for (size_t u = 0; u < s.lm->units().size(); ++u) {
    const auto& names = s.lm->param_names()[u];
    const std::vector<shard::ShardSpec>& specs = s.lm->units()[u]->specs();  // full shapes
    std::vector<at::Tensor> full;
    for (size_t i = 0; i < names.size(); ++i) {
      const HfName theirs = hf_name(names[i], llama || t5);
      auto it = weights.find(theirs.name);
      if (it == weights.end() && !llama && !t5) {  // GPT-2's original files lack "transformer."
        it = weights.find(theirs.name.substr(std::string("transformer.").size()));
      }
      if (it == weights.end()) bad(dir, "model.safetensors has no tensor " + theirs.name);
      used.insert(it->first);
      const at::Tensor& t = it->second;
      const at::ScalarType type = t.scalar_type();
      if (type != at::kFloat && type != at::kBFloat16 && type != at::kHalf) {
        bad(dir, fmt::format("tensor {} is {}; accepted: float32, bfloat16, float16", it->first,
                             c10::toString(type)));
      }
      const at::Tensor value = theirs.transposed ? t.t() : t;
      if (!value.sizes().equals(specs[i].shape)) {
        std::vector<int64_t> expected = specs[i].shape;  // in the file's layout
        if (theirs.transposed) std::reverse(expected.begin(), expected.end());
        bad(dir, fmt::format("tensor {} has shape {}, the model needs {}", it->first,
                             shape_of(t.sizes()), shape_of(expected)));
      }
      full.push_back(value.to(at::kFloat).contiguous());  // load() copies into the shards
    }
    s.lm->units()[u]->load(full);
  }
  for (const auto& [name, t] : weights) {
    if (used.count(name)) continue;
    // Tied copies saved anyway (a head, T5's per-stack embeddings), and GPT-2's attention
    // masks (buffers, not weights).
    const bool tied =
        (name == "lm_head.weight" && (!llama || s.cfg.tied_head)) ||
        (t5 && (name == "encoder.embed_tokens.weight" || name == "decoder.embed_tokens.weight"));
    const bool mask =
        arch == kGpt2 && (name.size() > 9 && (name.substr(name.size() - 9) == "attn.bias" ||
                                              name.find("masked_bias") != std::string::npos));
    if (!tied && !mask) bad(dir, "model.safetensors has a tensor this model has not: " + name);
  }
}

}  // namespace flexdemo::train
