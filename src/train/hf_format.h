// Hugging Face transformers' model folders: the names they give our parameters (hf_format.cpp,
// which also writes such folders: `flexdemo export`), and --init-from, starting from one
// (hf_import.cpp). Internal to src/train.
#pragma once

#include "session.h"

#include "flexdemo/train_options.h"

#include <string>

namespace flexdemo::train {

// transformers' architectures flexdemo reads and writes.
constexpr const char* kGpt2 = "GPT2LMHeadModel";
constexpr const char* kLlama = "LlamaForCausalLM";
constexpr const char* kT5 = "T5ForConditionalGeneration";

// transformers' name of one of our parameters, and whether its layout is our layout transposed.
struct HfName {
  std::string name;
  bool transposed = false;
};
// `same`: LLaMA and T5, whose names and layouts are already transformers'.
HfName hf_name(const std::string& ours, bool same);

// Sets the model family and shape (and the tokenizer model, when the folder has one) of
// config.init_from's config.json into config; nothing when init_from is empty. Throws
// std::invalid_argument, one line naming the folder, for what flexdemo cannot load (an unknown
// architecture, a setting its models lack, a shape option that disagrees).
void apply_init_from(TrainConfig& config);

// Loads config.init_from's weights into the session's model (every rank its shards): each of
// the model's parameters must be there with its shape, in float32, bfloat16 or float16, and
// nothing else may be. Throws std::invalid_argument naming the tensor otherwise.
void load_init_from(Session& s);

}  // namespace flexdemo::train
