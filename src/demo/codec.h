// The body of a DeMo payload, one text for the CPU and the GPU: where each part lies (Layout), each
// value encoding's per-chunk scales, a value's bits and what a receiver decodes from them, and a
// chunk's positions (whole bytes each, or one packed Elias-Fano record a chunk). Compiled by the
// host compiler (wire.cpp, the tests) and by nvcc (the CUDA kernels), so both write and read
// the same bits. The header, its checksum and validation are wire.cpp's.
// Adding a value encoding touches this file, its name (flexdemo/value_encoding.h) and its tests.
#pragma once

#include "demo/chunk_math.h"
#include "flexdemo/value_encoding.h"

#include <cstdint>

namespace flexdemo::demo::codec {

namespace cm = kernels::chunk_math;
using compress::ValueEncoding;

constexpr int64_t kHeaderBytes = 36;  // the header's fields: flexdemo/compress.h

// ====== What each encoding sends ======
FLEXDEMO_HD bool packed_indices(ValueEncoding e) {
  return e == ValueEncoding::TwoBit || e == ValueEncoding::Fp8;
}
// fp32 scales (or levels) per chunk.
FLEXDEMO_HD int scales_per_chunk(ValueEncoding e) {
  switch (e) {
    case ValueEncoding::Int8:
    case ValueEncoding::Sign:
    case ValueEncoding::Fp8:
      return 1;
    case ValueEncoding::TwoBit:
      return 2;
    default:
      return 0;
  }
}
FLEXDEMO_HD int64_t value_bytes(ValueEncoding e, int64_t entries) {
  switch (e) {
    case ValueEncoding::Fp32:
      return 4 * entries;
    case ValueEncoding::Bf16:
      return 2 * entries;
    case ValueEncoding::Int8:
    case ValueEncoding::Fp8:
      return entries;
    case ValueEncoding::Sign:
      return (entries + 7) / 8;
    case ValueEncoding::TwoBit:
      return (entries + 3) / 4;
  }
  return 0;
}

// ====== Packed indices (Elias-Fano) ======
// A chunk's k strictly ascending positions in [0, n) as one fixed-size record: the low `low` bits
// of every position (k * low bits, position j's at bit j * low), then the high parts as a bitmap
// in which position j sets bit (pos_j >> low) + j. low = floor(log2(n / k)): about
// 2 + log2(n / k) bits a position (9 for 32 of 4,096), whatever the positions. Bits LSB first.
FLEXDEMO_HD int packed_low_bits(int64_t n, int64_t k) {
  int low = 0;
  while ((k << (low + 1)) <= n) ++low;
  return low;
}
FLEXDEMO_HD int64_t packed_high_bits(int64_t n, int64_t k) {
  return ((n - 1) >> packed_low_bits(n, k)) + k;
}
FLEXDEMO_HD int64_t packed_record_bytes(int64_t n, int64_t k) {
  return (k * packed_low_bits(n, k) + packed_high_bits(n, k) + 7) / 8;
}

// ====== Layout ======
FLEXDEMO_HD int64_t clamp_k(int64_t k, int64_t chunk_numel) {  // into [1, chunk_numel]
  return k < 1 ? 1 : (k > chunk_numel ? chunk_numel : k);
}
// Bytes a position: 1 if a chunk has at most 256 coefficients, 2 if 65,536, else 4.
FLEXDEMO_HD int index_bytes_for(int64_t chunk_numel) {
  return chunk_numel <= 256 ? 1 : (chunk_numel <= 65536 ? 2 : 4);
}

// Where each part of one tensor's payload body lies: the positions, the per-chunk fp32 scales,
// the values (offsets inside the body, which follows the header).
struct Layout {
  int64_t chunks = 0, chunk_numel = 1;
  int64_t k = 1;        // per chunk, clamped
  int64_t entries = 0;  // chunks * k
  int index_bytes = 0;  // per position; 0: packed, one record of record_bytes a chunk
  int64_t record_bytes = 0;
  int64_t scales_at = 0;
  int64_t values_at = 0;
  int64_t body_bytes = 0;
};
FLEXDEMO_HD Layout layout(int64_t chunks, int64_t chunk_numel, int64_t k, ValueEncoding e) {
  Layout l;
  l.chunks = chunks;
  l.chunk_numel = chunk_numel;
  l.k = clamp_k(k, chunk_numel);
  l.entries = chunks * l.k;
  if (packed_indices(e)) {
    l.index_bytes = 0;
    l.record_bytes = packed_record_bytes(chunk_numel, l.k);
    l.scales_at = chunks * l.record_bytes;
  } else {
    l.index_bytes = index_bytes_for(chunk_numel);
    l.scales_at = l.entries * l.index_bytes;
  }
  l.values_at = l.scales_at + chunks * 4 * scales_per_chunk(e);
  l.body_bytes = l.values_at + value_bytes(e, l.entries);
  return l;
}

// ====== Bytes and bits (little-endian, any alignment) ======
FLEXDEMO_HD void put_u32(uint8_t* p, uint32_t v) {
  for (int b = 0; b < 4; ++b) p[b] = uint8_t(v >> (8 * b));
}
FLEXDEMO_HD uint32_t get_u32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}
FLEXDEMO_HD void put_f32(uint8_t* p, float v) {
  put_u32(p, cm::float_bits(v));
}
FLEXDEMO_HD float get_f32(const uint8_t* p) {
  return cm::bits_float(get_u32(p));
}
FLEXDEMO_HD bool get_bit(const uint8_t* p, int64_t bit) {
  return (p[bit / 8] >> (bit % 8)) & 1;
}
// `width` (< 32) bits from bit `bit` on, LSB first, a byte's share at a time.
FLEXDEMO_HD int64_t get_bits(const uint8_t* p, int64_t bit, int width) {
  int64_t v = 0;
  for (int done = 0; done < width;) {
    const int64_t at = bit + done;
    const int shift = int(at % 8), room = 8 - shift,
              take = room < width - done ? room : width - done;
    v |= int64_t((p[at / 8] >> shift) & ((1u << take) - 1)) << done;
    done += take;
  }
  return v;
}

// Up to 8 bytes from p as a little-endian word, `avail` of them readable (0 beyond): a record's
// bits read a word at a time without reading past it.
FLEXDEMO_HD uint64_t load_le64(const uint8_t* p, int64_t avail) {
  uint64_t v = 0;
  if (avail >= 8) {
    for (int b = 0; b < 8; ++b) v |= uint64_t(p[b]) << (8 * b);  // one load, as compilers see it
    return v;
  }
  for (int b = 0; b < avail; ++b) v |= uint64_t(p[b]) << (8 * b);
  return v;
}
// `width` (<= 56) bits of a record of `bytes` bytes from bit `bit` on, LSB first.
FLEXDEMO_HD uint64_t record_bits(const uint8_t* record, int64_t bytes, int64_t bit, int width) {
  const uint64_t word = load_le64(record + bit / 8, bytes - bit / 8) >> (bit % 8);
  return word & ((uint64_t(1) << width) - 1);
}
FLEXDEMO_HD int lowest_set_bit(uint64_t x) {  // x != 0
#if defined(__CUDA_ARCH__)
  return __ffsll(static_cast<long long>(x)) - 1;
#else
  return __builtin_ctzll(x);
#endif
}

// Fields narrower than a byte (1bit and 2bit values, packed records) share bytes with their
// neighbours, in a chunk and across chunks. They are ORed into zeroed bytes through Bytes::or_byte:
// PlainBytes where one thread writes a payload, AtomicBytes where many do (the GPU's).
struct PlainBytes {
  static FLEXDEMO_HD void or_byte(uint8_t* p, uint8_t mask) { *p |= mask; }
};
struct AtomicBytes {
  static FLEXDEMO_HD void or_byte(uint8_t* p, uint8_t mask) {
#if defined(__CUDA_ARCH__)
    const uintptr_t at = reinterpret_cast<uintptr_t>(p);
    atomicOr(reinterpret_cast<unsigned int*>(at & ~uintptr_t(3)), unsigned(mask) << (8 * (at & 3)));
#else
    __atomic_fetch_or(p, mask, __ATOMIC_RELAXED);
#endif
  }
};
template <class Bytes>
FLEXDEMO_HD void set_bit(uint8_t* p, int64_t bit) {
  Bytes::or_byte(p + bit / 8, uint8_t(1u << (bit % 8)));
}
// ORs the low `width` (< 32) bits of v in from bit `bit` on, a byte's share at a time.
template <class Bytes>
FLEXDEMO_HD void put_bits(uint8_t* p, int64_t bit, int64_t v, int width) {
  for (int done = 0; done < width;) {
    const int64_t at = bit + done;
    const int shift = int(at % 8), room = 8 - shift,
              take = room < width - done ? room : width - done;
    const uint8_t mask = uint8_t(((v >> done) & ((1 << take) - 1)) << shift);
    if (mask != 0) Bytes::or_byte(p + at / 8, mask);
    done += take;
  }
}

// ====== Positions ======
// Position j of chunk c (ascending within the chunk) into a zeroed body.
template <class Bytes>
FLEXDEMO_HD void put_position(uint8_t* body, const Layout& l, int64_t c, int64_t j, int64_t pos) {
  if (l.index_bytes > 0) {
    uint8_t* p = body + (c * l.k + j) * l.index_bytes;
    for (int b = 0; b < l.index_bytes; ++b) p[b] = uint8_t(pos >> (8 * b));
    return;
  }
  uint8_t* record = body + c * l.record_bytes;
  const int low = packed_low_bits(l.chunk_numel, l.k);
  put_bits<Bytes>(record, j * low, pos, low);
  set_bit<Bytes>(record, l.k * low + (pos >> low) + j);
}
// Chunk c's k ascending positions as its packed record, in one pass (the CPU's): the low bits
// streamed a byte at a time, then the bitmap's bits set. The record's bytes are zero and its own.
FLEXDEMO_HD void put_packed_record(uint8_t* body, const Layout& l, int64_t c, const int64_t* pos) {
  uint8_t* record = body + c * l.record_bytes;
  const int low = packed_low_bits(l.chunk_numel, l.k);
  const uint64_t mask = (uint64_t(1) << low) - 1;
  uint64_t pending = 0;  // bits not yet written, LSB first
  int held = 0;
  uint8_t* out = record;
  for (int64_t j = 0; j < l.k; ++j) {
    pending |= (uint64_t(pos[j]) & mask) << held;
    for (held += low; held >= 8; held -= 8, pending >>= 8) *out++ = uint8_t(pending);
  }
  if (held > 0) *out = uint8_t(pending);
  const int64_t high_at = l.k * low;
  for (int64_t j = 0; j < l.k; ++j) set_bit<PlainBytes>(record, high_at + (pos[j] >> low) + j);
}
// Position j of chunk c, on its own (a GPU thread's share): for a packed record, the place of the
// bitmap's j-th set bit minus j, then its low bits. A valid record holds k set bits.
FLEXDEMO_HD int64_t get_position(const uint8_t* body, const Layout& l, int64_t c, int64_t j) {
  if (l.index_bytes > 0) {
    const uint8_t* p = body + (c * l.k + j) * l.index_bytes;
    int64_t v = 0;
    for (int b = 0; b < l.index_bytes; ++b) v |= int64_t(p[b]) << (8 * b);
    return v;
  }
  const uint8_t* record = body + c * l.record_bytes;
  const int low = packed_low_bits(l.chunk_numel, l.k);
  const int64_t high_at = l.k * low, high_bits = packed_high_bits(l.chunk_numel, l.k);
  int64_t ones = 0, b = 0;
  for (; b < high_bits; ++b) {
    if (get_bit(record, high_at + b) && ones++ == j) break;
  }
  return (b - j) << low | get_bits(record, j * low, low);
}
// Chunk c's packed record, its bitmap read 56 bits at a time and its set bits found by their
// index: visit(j, position) for the j-th set bit (j past k too, the position then from bits past
// the low parts), in order, until visit returns false. Returns whether the record's padding (the
// last byte's bits above the record's) is clear.
template <class Visit>
FLEXDEMO_HD bool walk_packed_record(const uint8_t* body, const Layout& l, int64_t c, Visit visit) {
  const uint8_t* record = body + c * l.record_bytes;
  const int low = packed_low_bits(l.chunk_numel, l.k);
  const int64_t high_at = l.k * low, high_bits = packed_high_bits(l.chunk_numel, l.k);
  int64_t found = 0;
  for (int64_t b = 0; b < high_bits; b += 56) {
    const int width = high_bits - b < 56 ? int(high_bits - b) : 56;
    for (uint64_t w = record_bits(record, l.record_bytes, high_at + b, width); w != 0; w &= w - 1) {
      const int64_t bit = b + lowest_set_bit(w);
      const int64_t low_bits =
          found < l.k ? int64_t(record_bits(record, l.record_bytes, found * low, low)) : 0;
      if (!visit(found, (bit - found) << low | low_bits)) return true;
      ++found;
    }
  }
  const int64_t used = high_at + high_bits;
  return used % 8 == 0 || (record[l.record_bytes - 1] >> (used % 8)) == 0;
}
// Chunk c's positions, in the order sent, into out[0, k). Returns how many the chunk holds: k, or
// for a damaged packed record another count (out then holds the first min(count, k)), or -1 for
// a record with a padding bit set (not one this codec writes).
FLEXDEMO_HD int64_t get_positions(const uint8_t* body, const Layout& l, int64_t c, int64_t* out) {
  if (l.index_bytes > 0) {
    for (int64_t j = 0; j < l.k; ++j) out[j] = get_position(body, l, c, j);
    return l.k;
  }
  int64_t found = 0;
  const bool clear = walk_packed_record(body, l, c, [&](int64_t j, int64_t pos) {
    if (j < l.k) out[j] = pos;
    found = j + 1;
    return true;
  });
  return clear ? found : -1;
}

// ====== Value arithmetic ======
// bfloat16 by round to nearest even; NaN stays a (quiet) NaN. c10::BFloat16's rule.
FLEXDEMO_HD uint16_t bf16_bits(float x) {
  if (x != x) return 0x7fc0;
  const uint32_t u = cm::float_bits(x);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
FLEXDEMO_HD float bf16_value(uint16_t bits) {
  return cm::bits_float(uint32_t(bits) << 16);
}
// Round to nearest even, as both sides' default rounding mode does.
FLEXDEMO_HD float round_even(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}
// int8: value / scale rounded to nearest even, within +-127 (NaN: 127).
FLEXDEMO_HD int8_t int8_quantize(float value, float scale) {
  if (!(scale > 0.0f)) return 0;
  const float q = round_even(value / scale);
  return int8_t(!(q <= 127.0f) ? 127.0f : (q < -127.0f ? -127.0f : q));
}
// fp8 e4m3 (OCP E4M3FN: bias 7, no infinities, S.1111.111 NaN, largest 448) by round to nearest
// even, saturating to +-448; NaN stays NaN. Integer arithmetic on the float's bits, so that both
// sides round alike; every case computed and one selected, so that a loop of them vectorises.
FLEXDEMO_HD uint8_t fp8_bits(float x) {
  const uint32_t u = cm::float_bits(x), a = u & 0x7fffffffu;
  const uint32_t sign = (u >> 24) & 0x80u;
  // Below 2^-6: subnormal, in steps of 2^-9, x * 512 < 8 rounded to nearest even by adding and
  // taking away 2^23 (exact: the float's own rounding does it).
  const float small = cm::bits_float(a < 0x3c800000u ? a : 0u);  // the others: not this case
  const uint32_t subnormal = uint32_t((small * 512.0f + 8388608.0f) - 8388608.0f);
  const uint32_t normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - ((127 - 7) << 3);
  const uint32_t code = a > 0x7f800000u   ? 0x7fu   // NaN
                        : a >= 0x43e00000u ? 0x7eu  // 448 and above, infinity too: the largest
                        : a < 0x3c800000u  ? subnormal
                                           : normal;
  return uint8_t(sign | code);
}
FLEXDEMO_HD float fp8_value(uint8_t bits) {
  const uint32_t e = (bits >> 3) & 15u, m = bits & 7u;
  const uint32_t magnitude = e == 15 && m == 7 ? 0x7fc00000u
                             : e == 0 ? cm::float_bits(float(m) * 0.001953125f)  // m * 2^-9
                                      : (e + 127 - 7) << 23 | m << 20;
  return cm::bits_float(magnitude | uint32_t(bits & 0x80u) << 24);
}
#if !defined(__CUDA_ARCH__)
// fp8_value of every code, for the CPU's loops over a chunk: one load where the bit arithmetic
// took several operations a value (the same floats: the table is made by fp8_value).
inline const float* fp8_values() {
  struct Table {
    float value[256];
    Table() {
      for (int q = 0; q < 256; ++q) value[q] = fp8_value(uint8_t(q));
    }
  };
  static const Table table;
  return table.value;
}
#endif
FLEXDEMO_HD double abs64(float x) {  // |x| in double, as std::fabs gives it
  return double(cm::bits_float(cm::magnitude_bits(x)));
}
FLEXDEMO_HD bool negative(float x) {  // the sign bit, as std::signbit reads it
  return cm::float_bits(x) >> 31;
}
// 2bit: an entry is large when |v| exceeds the chunk's mean |v|.
FLEXDEMO_HD bool two_bit_large(float value, float mean_abs) {
  return cm::bits_float(cm::magnitude_bits(value)) > mean_abs;
}

// ====== Per-chunk scales ======
// A chunk's scales, from its k values in entry order: values[order[j]] (order null: values[j]).
//   int8: scale = max |v| / 127 (NaN ignored); fp8: max |v| / 448
//   1bit: scale = mean |v|: values decode to +-scale
//   2bit: scale = mean |v|; level[0], level[1] the mean |v| of the entries at most / above it (an
//         empty group's: scale). One step of 1-D k-means seeded by the 1bit scale.
// Sums in double, in entry order. Trivial (no initialisers), so that a GPU block can share one.
struct ChunkScales {
  float scale;
  float level[2];
};
FLEXDEMO_HD ChunkScales chunk_scales(ValueEncoding e, const float* values, const int32_t* order,
                                     int64_t k) {
  ChunkScales s = {0.0f, {0.0f, 0.0f}};
  if (e == ValueEncoding::Int8 || e == ValueEncoding::Fp8) {
    uint32_t max_bits = 0;
    for (int64_t j = 0; j < k; ++j) {
      const uint32_t m = cm::magnitude_bits(values[order != nullptr ? order[j] : j]);
      if (m <= 0x7f800000u && m > max_bits) max_bits = m;
    }
    s.scale = cm::bits_float(max_bits) / (e == ValueEncoding::Int8 ? 127.0f : 448.0f);
  } else if (e == ValueEncoding::Sign || e == ValueEncoding::TwoBit) {
    double sum_abs = 0.0, sum_group[2] = {0.0, 0.0};
    for (int64_t j = 0; j < k; ++j) sum_abs += abs64(values[order != nullptr ? order[j] : j]);
    s.scale = float(sum_abs / double(k));
    int64_t large = 0;
    for (int g = 1; g >= 0; --g) {  // the large group summed first, then the small, as before
      for (int64_t j = 0; j < k; ++j) {
        const float v = values[order != nullptr ? order[j] : j];
        if (two_bit_large(v, s.scale) == (g == 1)) sum_group[g] += abs64(v), large += g;
      }
    }
    const int64_t count[2] = {k - large, large};
    for (int g = 0; g < 2; ++g) {
      s.level[g] = count[g] > 0 ? float(sum_group[g] / double(count[g])) : s.scale;
    }
  }
  return s;
}
FLEXDEMO_HD void put_scales(uint8_t* body, const Layout& l, ValueEncoding e, int64_t c,
                            const ChunkScales& s) {
  uint8_t* at = body + l.scales_at + 4 * scales_per_chunk(e) * c;
  if (scales_per_chunk(e) == 1) put_f32(at, s.scale);
  if (e == ValueEncoding::TwoBit) put_f32(at, s.level[0]), put_f32(at + 4, s.level[1]);
}

// ====== Values ======
// Writes entry `entry`'s value v (the payload's entry number, c * k + j) into a zeroed body and
// returns what a receiver decodes from it: error feedback takes exactly that from the residual.
template <class Bytes>
FLEXDEMO_HD float put_value(uint8_t* body, const Layout& l, ValueEncoding e, int64_t entry, float v,
                            const ChunkScales& s) {
  uint8_t* values = body + l.values_at;
  switch (e) {
    case ValueEncoding::Fp32:
      put_f32(values + 4 * entry, v);
      return v;
    case ValueEncoding::Bf16: {
      const uint16_t bits = bf16_bits(v);
      values[2 * entry] = uint8_t(bits);
      values[2 * entry + 1] = uint8_t(bits >> 8);
      return bf16_value(bits);
    }
    case ValueEncoding::Int8: {
      const int8_t q = int8_quantize(v, s.scale);
      values[entry] = uint8_t(q);
      return float(q) * s.scale;
    }
    case ValueEncoding::Sign:
      if (negative(v)) set_bit<Bytes>(values, entry);
      return negative(v) ? -s.scale : s.scale;
    case ValueEncoding::TwoBit: {
      const bool large = two_bit_large(v, s.scale);
      if (negative(v)) set_bit<Bytes>(values, 2 * entry);
      if (large) set_bit<Bytes>(values, 2 * entry + 1);
      return negative(v) ? -s.level[large] : s.level[large];
    }
    case ValueEncoding::Fp8: {
      const uint8_t q = s.scale > 0.0f ? fp8_bits(v / s.scale) : 0;
      values[entry] = q;
      return fp8_value(q) * s.scale;
    }
  }
  return 0.0f;
}

// Chunk c's k entries (ascending positions pos, values val) into a zeroed body: positions,
// scales, values; val[j] replaced by what a receiver decodes, so that error feedback removes
// exactly what was sent. The CPU encoders' per-chunk step (one payload at a time: PlainBytes;
// chunks written by several tasks: AtomicBytes, for the values narrower than a byte: a chunk's
// positions are whole bytes of its own, written plainly).
template <class Bytes>
FLEXDEMO_HD void put_chunk(uint8_t* body, const Layout& l, ValueEncoding e, int64_t c,
                           const int64_t* pos, float* val) {
  if (l.index_bytes == 0) {
    put_packed_record(body, l, c, pos);
  } else {
    for (int64_t j = 0; j < l.k; ++j) put_position<PlainBytes>(body, l, c, j, pos[j]);
  }
  const ChunkScales scales = chunk_scales(e, val, nullptr, l.k);
  put_scales(body, l, e, c, scales);
  if (e == ValueEncoding::Fp8) {  // put_value's, in loops of their own (the first vectorises)
    uint8_t* values = body + l.values_at + c * l.k;
    for (int64_t j = 0; j < l.k; ++j)
      values[j] = scales.scale > 0.0f ? fp8_bits(val[j] / scales.scale) : 0;
#if defined(__CUDA_ARCH__)
    for (int64_t j = 0; j < l.k; ++j) val[j] = fp8_value(values[j]) * scales.scale;
#else
    const float* decoded = fp8_values();
    for (int64_t j = 0; j < l.k; ++j) val[j] = decoded[values[j]] * scales.scale;
#endif
    return;
  }
  for (int64_t j = 0; j < l.k; ++j)
    val[j] = put_value<Bytes>(body, l, e, c * l.k + j, val[j], scales);
}
// What a receiver decodes for entry `entry` of a validated body.
FLEXDEMO_HD float get_value(const uint8_t* body, const Layout& l, ValueEncoding e, int64_t entry) {
  const uint8_t* values = body + l.values_at;
  const uint8_t* scales = body + l.scales_at + 4 * scales_per_chunk(e) * (entry / l.k);
  switch (e) {
    case ValueEncoding::Fp32:
      return get_f32(values + 4 * entry);
    case ValueEncoding::Bf16:
      return bf16_value(uint16_t(values[2 * entry] | values[2 * entry + 1] << 8));
    case ValueEncoding::Int8:
      return float(int8_t(values[entry])) * get_f32(scales);
    case ValueEncoding::Sign:
      return get_bit(values, entry) ? -get_f32(scales) : get_f32(scales);
    case ValueEncoding::TwoBit: {
      const float level = get_f32(scales + (get_bit(values, 2 * entry + 1) ? 4 : 0));
      return get_bit(values, 2 * entry) ? -level : level;
    }
    case ValueEncoding::Fp8:
      return fp8_value(values[entry]) * get_f32(scales);
  }
  return 0.0f;
}
// Chunk c's k values, get_value's for each, into out[0, k): the encoding looked at once, the
// common ones unpacked in a loop of their own (the CPU decode's per-chunk step).
FLEXDEMO_HD void get_values(const uint8_t* body, const Layout& l, ValueEncoding e, int64_t c,
                            float* out) {
  const uint8_t* values = body + l.values_at;
  const int64_t first = c * l.k;
  switch (e) {
    case ValueEncoding::Fp32:
      for (int64_t j = 0; j < l.k; ++j) out[j] = get_f32(values + 4 * (first + j));
      return;
    case ValueEncoding::Bf16:
      for (int64_t j = 0; j < l.k; ++j) {
        const uint8_t* v = values + 2 * (first + j);
        out[j] = bf16_value(uint16_t(v[0] | v[1] << 8));
      }
      return;
    case ValueEncoding::Fp8: {
      const float scale = get_f32(body + l.scales_at + 4 * c);
#if defined(__CUDA_ARCH__)
      for (int64_t j = 0; j < l.k; ++j) out[j] = fp8_value(values[first + j]) * scale;
#else
      const float* decoded = fp8_values();
      for (int64_t j = 0; j < l.k; ++j) out[j] = decoded[values[first + j]] * scale;
#endif
      return;
    }
    default:
      for (int64_t j = 0; j < l.k; ++j) out[j] = get_value(body, l, e, first + j);
  }
}


// ====== CRC-32 arithmetic (the GPU's checksums in segments) ======
constexpr uint32_t kCrcPoly = 0xedb88320u;  // zlib's polynomial, reflected
// a * b modulo the polynomial (zlib's multmodp).
FLEXDEMO_HD uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  while (a != 0) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = b & 1u ? (b >> 1) ^ kCrcPoly : b >> 1;
  }
  return p;
}
// x2n[k] = x^(2^k) modulo the polynomial, k < 32 (zlib's x2n_table): computed once on the host.
FLEXDEMO_HD void crc_x2n_table(uint32_t* x2n) {
  x2n[0] = 1u << 30;  // x
  for (int k = 1; k < 32; ++k) x2n[k] = multmodp(x2n[k - 1], x2n[k - 1]);
}

// ====== Screening a received payload (the CPU's and the GPU's, one order) ======
// Whether chunk c holds k strictly ascending positions inside the chunk (a packed record: k set
// bits and no padding bit): what a decode needs of it. One pass and no storage, so that a GPU
// thread checks a chunk on its own; validate_payload makes the same checks with messages.
FLEXDEMO_HD bool positions_valid(const uint8_t* body, const Layout& l, int64_t c) {
  int64_t previous = -1, found = 0;
  bool ordered = true;
  const auto check = [&](int64_t j, int64_t pos) {
    ordered = j < l.k && pos > previous && pos < l.chunk_numel;
    previous = pos;
    found = j + 1;
    return ordered;
  };
  if (l.index_bytes > 0) {
    for (int64_t j = 0; j < l.k && ordered; ++j) check(j, get_position(body, l, c, j));
    return ordered;
  }
  const bool clear = walk_packed_record(body, l, c, check);
  return ordered && clear && found == l.k;
}
// A payload's values are judged by their sum of squares in float64 (the scale check), summed in
// one order wherever it is computed, so that a CPU and a GPU judge the same bytes alike: each
// chunk's over its entries in order (chunk_squares), then runs of kScreenRun chunks in order,
// then the runs in order. A float's square is exact in float64, so a fused multiply-add or a
// multiply then an add give the same sums.
constexpr int64_t kScreenRun = 64;
FLEXDEMO_HD bool finite_value(float v) {
  return (cm::float_bits(v) & 0x7f800000u) != 0x7f800000u;
}
// Chunk c's values: their sum of squares; *finite cleared if one is not finite.
FLEXDEMO_HD double chunk_squares(const uint8_t* body, const Layout& l, ValueEncoding e, int64_t c,
                                 bool* finite) {
  double sum = 0.0;
  for (int64_t j = 0; j < l.k; ++j) {
    const float v = get_value(body, l, e, c * l.k + j);
    if (!finite_value(v)) *finite = false;
    sum += double(v) * double(v);
  }
  return sum;
}

}  // namespace flexdemo::demo::codec
