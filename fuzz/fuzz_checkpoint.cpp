// libFuzzer target: the checkpoint reader's parser of safetensors files (model weights and
// optimizer state). Anything but std::invalid_argument, or a read out of bounds, is a finding.
#include "flexdemo/safetensors.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

using namespace flexdemo;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Seeds from the real writer: tensors of every supported dtype, with metadata.
  if (const char* dir = std::getenv("FLEXDEMO_FUZZ_SEEDS")) {
    train::write_safetensors(std::string(dir) + "/seed-model",
                             {{"h0.attn.qkv.weight", at::randn({3, 4})},
                              {"h0.ln.bias", at::randn({4}).to(at::kBFloat16)},
                              {"step", at::arange(3, at::kLong)},
                              {"mask", at::ones({2, 2}, at::kByte)},
                              {"count", at::ones({1}, at::kInt)},
                              {"scale", at::ones({2}, at::kDouble)},
                              {"empty", at::zeros({0})}},
                             {{"format", "pt"}});
    train::write_safetensors(std::string(dir) + "/seed-state", {{"rng_state", at::randn({5})}});
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    train::parse_safetensors(data, size, "fuzz");
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
