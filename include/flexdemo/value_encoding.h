// flexdemo/value_encoding.h — how the values of DeMo's payloads travel, and their names. No other
// dependency, so that the codec (src/demo/codec.h, compiled by nvcc too) can include it. What each
// encoding writes is the codec's; adding one adds its value and name here and its code there.
#pragma once

#include "flexdemo/names.h"

#include <cstdint>

namespace flexdemo::compress {

enum class ValueEncoding : uint8_t {
  Fp32 = 0,  // 4 bytes per value, exact
  Bf16 = 1,  // 2 bytes per value, round to nearest even
  Int8 = 2,  // 1 byte per value + one fp32 scale per chunk (max |v| / 127)
  Sign = 3,  // 1 bit per value + one fp32 scale per chunk (mean |v|): decodes to +-scale
  // 2 bits per value (sign, size) + two fp32 levels per chunk, the indices packed (Elias-Fano):
  // 1.5 bytes per value at top-k 32 of 4,096.
  TwoBit = 4,
  // fp8 e4m3 (OCP E4M3FN: max 448, no infinities) of value / scale, one fp32 scale per chunk
  // (max |v| / 448), the indices packed: 2.25 bytes per value at top-k 32 of 4,096.
  Fp8 = 5,
};

}  // namespace flexdemo::compress

namespace flexdemo {
template <>
struct NameTable<compress::ValueEncoding> {
  static constexpr const char* what = "value encoding";
  static constexpr std::pair<compress::ValueEncoding, const char*> entries[] = {
      {compress::ValueEncoding::Fp32, "fp32"},   {compress::ValueEncoding::Bf16, "bf16"},
      {compress::ValueEncoding::Int8, "int8"},   {compress::ValueEncoding::Sign, "1bit"},
      {compress::ValueEncoding::TwoBit, "2bit"}, {compress::ValueEncoding::Fp8, "fp8"}};
};
}  // namespace flexdemo
