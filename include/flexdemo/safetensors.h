// flexdemo/safetensors.h — safetensors files: named tensors in the format Python's safetensors
// reads and writes. Training checkpoints are folders of them (docs/command.md, "Outputs").
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace flexdemo::train {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// float32, float64, bfloat16, float16, int64, int32, uint8 tensors; written atomically (temp +
// rename).
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// Throws std::invalid_argument for a file that is not a complete, consistent safetensors file.
NamedTensors read_safetensors(const std::string& path);
// The names of a file's tensors, read from its header alone (the tensors are neither read nor
// checked: read_safetensors does that). Throws std::invalid_argument where there is no header.
std::vector<std::string> safetensors_names(const std::string& path);
// The same as read_safetensors from memory (`name` names the source in errors); never reads
// outside [data, size).
NamedTensors parse_safetensors(const uint8_t* data, size_t size, const std::string& name);

}  // namespace flexdemo::train
