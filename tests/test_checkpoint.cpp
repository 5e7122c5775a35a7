// The safetensors parser on hostile input (one process): what the fuzzer found stays fixed.
#include "flexdemo/safetensors.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>

using namespace flexdemo;

namespace {

// A safetensors file whose JSON header is `header`, followed by `data_bytes` zero bytes.
std::string file_with_header(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  for (int b = 0; b < 8; ++b) out[b] = char(uint64_t(header.size()) >> (8 * b));
  return out + header + std::string(data_bytes, '\0');
}

void expect_rejected(const std::string& header, size_t data_bytes, const std::string& why) {
  const std::string f = file_with_header(header, data_bytes);
  try {
    train::parse_safetensors(reinterpret_cast<const uint8_t*>(f.data()), f.size(), "t");
    ADD_FAILURE() << "accepted " << header;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Safetensors, RejectsHostileHeadersBeforeAllocating) {
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string f = file_with_header(ok, 8);
  EXPECT_EQ(
      train::parse_safetensors(reinterpret_cast<const uint8_t*>(f.data()), f.size(), "t").size(),
      1u);
  // Found by fuzz_checkpoint: a float where an integer belongs was undefined behaviour.
  expect_rejected(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,1.1e118]}})", 8,
                  "non-integer");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8, "non-integer");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[4000000000,4000000000],"data_offsets":[0,8]}})",
                  8, "impossible shape");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8,
                  "impossible shape");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", 8,
                  "negative offset");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8,
                  "inconsistent byte range");
  expect_rejected(R"({"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", 8, "dtype");
  expect_rejected(R"([1,2,3])", 0, "not a JSON object");
  expect_rejected(R"({"a":3})", 0, "corrupt safetensors header");
  expect_rejected(R"({"a":{"dtype":"F32")", 0, "corrupt safetensors header");
}
