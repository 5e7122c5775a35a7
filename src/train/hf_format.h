// --init-from: starting from a Hugging Face transformers model folder (hf_format.cpp, which also
// writes them: `flexdemo export`). Internal to src/train.
#pragma once

#include "session.h"

#include "flexdemo/train_options.h"

namespace flexdemo::train {

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
