// The per-chunk kernels (see chunk_kernels.h), written once with GCC vector extensions (8 float
// lanes) and compiled once per instruction set: FLEXDEMO_KERNEL_ISA names the copy's namespace.
// Everything here has internal linkage but the table, so copies built for different instruction
// sets never share an out-of-line function (no ODR mix-up between AVX2 and baseline code).
//
// Layout inside a chunk: rows of 8-lane vectors. A 1-D transform along the rows of an [n][L]
// block (L lanes, a multiple of 8) is a handful of small matrix products over rows, vectorised
// across the lanes; the 2-D DCT is the column transform, an 8x8-block transpose, the column
// transform again and a transpose back.
#include "demo/cpu/chunk_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__AVX__) || defined(__SSE__)
#include <immintrin.h>
#endif

#ifndef FLEXDEMO_KERNEL_ISA
#error "chunk_kernels.cpp is compiled with -DFLEXDEMO_KERNEL_ISA=<namespace>"
#endif

namespace flexdemo::kernels::FLEXDEMO_KERNEL_ISA {
namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));

// Loads and stores of any float vector type V at any float's alignment.
template <typename V>
struct Unaligned {
  typedef V type __attribute__((aligned(4), may_alias));
};
template <typename V = v8>
inline V load(const float* p) {
  return *reinterpret_cast<const typename Unaligned<V>::type*>(p);
}
template <typename V>
inline void store(float* p, V v) {
  *reinterpret_cast<typename Unaligned<V>::type*>(p) = v;
}
template <typename V = v8>
inline V splat(float s) {
  return -V{} + s;  // -0 + s is s for every s (+0 + s is not, for s = -0): one broadcast
}
template <typename V>
constexpr int lanes_of = int(sizeof(V) / sizeof(float));

// The widest vector this copy's instruction set has: 16 lanes with AVX-512, else 8. A chunk's
// rows stay whole multiples of 8 lanes in every copy (the same layout, the same results per
// lane); the AVX-512 copy walks them 16 at a time and the last 8 alone.
#if defined(__AVX512F__)
typedef v16 vwide;
#else
typedef v8 vwide;
#endif

// Calls body(g, V{}) over lanes [g, g + lanes_of<V>) covering [0, L), L a multiple of 8: the
// widest vectors first, then one of 8.
template <typename Body>
[[gnu::always_inline]] inline void over_lanes(int64_t L, Body body) {
  int64_t g = 0;
  if constexpr (lanes_of < vwide >> 8) {
    for (; g + lanes_of<vwide> <= L; g += lanes_of<vwide>) body(g, vwide{});
  }
  for (; g < L; g += 8) body(g, v8{});
}
// a * b + c: one fused multiply-add where the instruction set has them (a * b, then + c, where
// it does not), whatever the compiler would contract: the same rounding in every loop that
// uses it, vector body and scalar tail alike.
template <typename V>
[[gnu::always_inline]] inline V fused_multiply_add(V a, V b, V c) {
#if defined(__FMA__)
  if constexpr (std::is_same_v<V, float>) {
    return __builtin_fmaf(a, b, c);
  } else if constexpr (std::is_same_v<V, v8>) {
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#if defined(__AVX512F__)
  } else if constexpr (std::is_same_v<V, v16>) {
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#endif
  }
#endif
  return a * b + c;
}
inline v8i splat_i(int32_t s) {
  return v8i{s, s, s, s, s, s, s, s};
}
// Lanes of (a, b) picked by eight constant indices (0-7: a, 8-15: b).
#if defined(__clang__)
#define SHUFFLE8(a, b, i0, i1, i2, i3, i4, i5, i6, i7) \
  __builtin_shufflevector(a, b, i0, i1, i2, i3, i4, i5, i6, i7)
#else
#define SHUFFLE8(a, b, i0, i1, i2, i3, i4, i5, i6, i7) \
  __builtin_shuffle(a, b, v8i{i0, i1, i2, i3, i4, i5, i6, i7})
#endif

// Asks for a row of `cols` floats at p, to be written, into the caches (L2 and nearer) before
// the loop over a chunk's rows reaches it: those rows are a tensor's width apart, a walk the
// hardware prefetchers do not follow. kPrefetchRows ahead: measured best of 2 and 4 (issue 30).
constexpr int kPrefetchRows = 4;
[[gnu::always_inline]] inline void prefetch_row(const float* p, int cols) {
  for (int v = 0; v < cols; v += 64 / int(sizeof(float))) __builtin_prefetch(p + v, 1, 2);
}

// A NextChunk's cache lines, a few at each call of ask(): requests spread over the current
// chunk's work, so that they arrive while it runs. Asked for in one burst before the chunk, its
// 256 lines filled the core's line fill buffers and stalled it until most had arrived (issue 30:
// on an Intel Xeon the burst cost more than it saved; spread, the step took 7% less time).
template <bool kForWrite>
class Ahead {
 public:
  Ahead(const NextChunk& next, int64_t stride)
      : next_(next), stride_(stride), rows_left_(next.valid_h), width_(next.valid_w) {}
  [[gnu::always_inline]] void ask(int lines) {
    for (; lines > 0 && rows_left_ > 0; --lines) {
      for (const float* t : next_.rows) {
        if (t != nullptr) __builtin_prefetch(t + offset_ + v_, kForWrite ? 1 : 0, 2);
      }
      v_ += kLine;
      if (v_ >= width_) {
        v_ = 0;
        offset_ += stride_;
        --rows_left_;
      }
    }
  }

 private:
  static constexpr int kLine = 64 / int(sizeof(float));
  NextChunk next_;
  int64_t stride_, offset_ = 0;
  int rows_left_, width_, v_ = 0;
};

inline int round8(int n) {
  return (n + 7) / 8 * 8;
}

// ====== Small matrix products over rows of lanes ======
// out[i] = sum_j M(i, j) * in[j] for i < rows: in rows at in + j * in_stride, out rows at
// out + i * out_stride, L lanes each; M(i, j) = mat(i, j), a callable. Blocks of R rows x G
// vectors of type V keep their sums in registers.
template <typename V, int R, int G, typename Mat>
[[gnu::always_inline]] inline void matvec_block(const Mat& mat, int cols, const float* in,
                                                int64_t in_stride, float* out, int64_t out_stride,
                                                int i, int64_t g) {
  constexpr int W = lanes_of<V>;
  V acc[R][G];  // in registers once inlined (no memset, no stack round trip)
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < G; ++q) acc[r][q] = V{};
  }
  for (int j = 0; j < cols; ++j) {
    V x[G];
    for (int q = 0; q < G; ++q) x[q] = load<V>(in + j * in_stride + g + W * q);
    for (int r = 0; r < R; ++r) {
      const V m = splat<V>(mat(i + r, j));
      for (int q = 0; q < G; ++q) acc[r][q] += m * x[q];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < G; ++q) store(out + (i + r) * out_stride + g + W * q, acc[r][q]);
  }
}

// Lanes in blocks of 2 x G and then G of the widest vectors, then what is left one vector at a
// time.
template <int R, int G, typename Mat>
[[gnu::always_inline]] inline void matvec_rows(const Mat& mat, int cols, const float* in,
                                               int64_t in_stride, float* out, int64_t out_stride,
                                               int i, int64_t L) {
  constexpr int W = lanes_of<vwide>;
  int64_t g = 0;
  for (; g + 2 * G * W <= L; g += 2 * G * W) {
    matvec_block<vwide, R, 2 * G>(mat, cols, in, in_stride, out, out_stride, i, g);
  }
  if (g + G * W <= L) {
    matvec_block<vwide, R, G>(mat, cols, in, in_stride, out, out_stride, i, g);
    g += G * W;
  }
  over_lanes(L - g, [&](int64_t h, auto v) {
    matvec_block<decltype(v), R, 1>(mat, cols, in, in_stride, out, out_stride, i, g + h);
  });
}

template <typename Mat>
void matvec_of(const Mat& mat, int rows, int cols, const float* in, int64_t in_stride, float* out,
               int64_t out_stride, int L) {
  // Blocks of 4 rows x 2 G vectors: 4 x 4 sums of 16 lanes (a whole row of a 64-wide chunk) fit
  // AVX-512's 32 registers, 4 x 2 of 8 lanes AVX2's 16.
  constexpr int G = lanes_of < vwide >> 8 ? 2 : 1;
  int i = 0;
  for (; i + 4 <= rows; i += 4) matvec_rows<4, G>(mat, cols, in, in_stride, out, out_stride, i, L);
  if (i + 2 <= rows) {
    matvec_rows<2, G>(mat, cols, in, in_stride, out, out_stride, i, L);
    i += 2;
  }
  if (i < rows) matvec_rows<1, G>(mat, cols, in, in_stride, out, out_stride, i, L);
}

// With M a row-major rows x cols matrix.
void matvec(const float* mat, int rows, int cols, const float* in, int64_t in_stride, float* out,
            int64_t out_stride, int L) {
  matvec_of([mat, cols](int i, int j) { return mat[i * cols + j]; }, rows, cols, in, in_stride, out,
            out_stride, L);
}

// ====== 1-D transforms along rows ======
const float kHalfSqrt2 = 0.70710678118654752f;
const float kSqrt2 = 1.41421356237309505f;

// The m rows at z + i * stride hold the orthonormal DCT-II Z of scaled differences; replaced by
// the DCT-IV they give: Z'[i] + Z'[i+1], with Z'[0] = sqrt(2) Z[0] and Z'[m] = 0.
void odd_from_dct2(float* z, int64_t stride, int m, int L) {
  for (int i = 0; i < m; ++i) {
    float* row = z + i * stride;
    const float* next = i + 1 < m ? row + stride : nullptr;
    over_lanes(L, [&](int64_t g, auto v) {
      using V = decltype(v);
      v = load<V>(row + g);
      if (i == 0) v *= kSqrt2;
      if (next != nullptr) v += load<V>(next + g);
      store(row + g, v);
    });
  }
}

// The DCT-II of n = 2M rows split once into a dense DCT-IV of the differences and a dense DCT-II
// of size M of the sums, for the lanes [g, g + lanes of V): forward()'s arithmetic in its order,
// with the rows, their sums and differences in registers (AVX-512's 32 hold them for M <= 8):
// 2M stores a vector of lanes where forward()'s passes make 4M. With lee_odd, the outputs Z
// become the DCT-IV odd_from_dct2 makes of them (Z'[i] + Z'[i+1]) before they are stored.
template <typename V, int M, bool lee_odd>
[[gnu::always_inline]] inline void forward_split_lanes(const float* odd, const float* base,
                                                       const float* src, int64_t src_stride,
                                                       float* out, int64_t out_stride, int64_t g) {
  constexpr int N = 2 * M;
  V sum[M], diff[M], z[N];
  for (int i = 0; i < M; ++i) {
    const V x = load<V>(src + i * src_stride + g), y = load<V>(src + (N - 1 - i) * src_stride + g);
    sum[i] = (x + y) * kHalfSqrt2;
    diff[i] = (x - y) * kHalfSqrt2;
  }
  for (int i = 0; i < M; ++i) {  // forward_odd's input order is reversed: diff[M - 1 - j]
    V acc = V{};
    for (int j = 0; j < M; ++j) acc += splat<V>(odd[i * M + j]) * diff[M - 1 - j];
    z[2 * i + 1] = acc;
  }
  for (int k = 0; k < M; ++k) {
    V acc = V{};
    for (int j = 0; j < M; ++j) acc += splat<V>(base[k * M + j]) * sum[j];
    z[2 * k] = acc;
  }
  for (int i = 0; i < N; ++i) {
    V v = z[i];
    if constexpr (lee_odd) {
      if (i == 0) v *= kSqrt2;
      if (i + 1 < N) v += z[i + 1];
    }
    store(out + i * out_stride + g, v);
  }
}

// forward_split_lanes over L lanes where it applies (AVX-512; level `level`'s 16 or 12 rows split
// once into the dense base of 8 or 6); false where forward()'s passes do the work.
template <bool lee_odd>
bool forward_split(const Dct1d& p, int level, const float* src, int64_t src_stride, float* out,
                   int64_t out_stride, int64_t L) {
  if constexpr (lanes_of<vwide> == 16) {
    const int n = p.n >> level;
    if (p.splits != level + 1 || p.lee[level] || (n != 16 && n != 12)) return false;
    over_lanes(L, [&](int64_t g, auto v) {
      using V = decltype(v);
      if (n == 16) {
        forward_split_lanes<V, 8, lee_odd>(p.forward_odd[level], p.base, src, src_stride, out,
                                           out_stride, g);
      } else {
        forward_split_lanes<V, 6, lee_odd>(p.forward_odd[level], p.base, src, src_stride, out,
                                           out_stride, g);
      }
    });
    return true;
  }
  return false;
}

// DCT-II of the n = p.n >> level rows at in + i * in_stride (destroyed), results to the rows at
// out + k * out_stride. Even outputs are the DCT-II of the sums x[i] + x[n-1-i]; odd ones the
// DCT-IV of the differences: a dense product, or where p.lee[level] (Lee) the DCT-II of the
// differences scaled by 1 / (2 cos(pi (2i+1) / (2n))), whose neighbouring outputs are added.
// The input rows come from src (row stride src_stride), which may be `in` itself; the first
// level's butterflies move them into `in`, so a chunk can be read straight from the tensor.
void forward(const Dct1d& p, int level, const float* src, int64_t src_stride, float* in,
             int64_t in_stride, float* out, int64_t out_stride, int L) {
  const int n = p.n >> level;
  if (level == p.splits) {
    matvec(p.base, n, n, src, src_stride, out, out_stride, L);
    return;
  }
  if (forward_split<false>(p, level, src, src_stride, out, out_stride, L)) return;
  const int m = n / 2;
  const float* f = p.lee[level] ? p.lee_scale[level] : nullptr;
  for (int i = 0; i < m; ++i) {
    const float* sa = src + i * src_stride;
    const float* sb = src + (n - 1 - i) * src_stride;
    float* a = in + i * in_stride;
    float* b = in + (n - 1 - i) * in_stride;
    const float fi = f != nullptr ? f[i] : kHalfSqrt2;
    over_lanes(L, [&](int64_t g, auto v) {
      using V = decltype(v);
      const V x = load<V>(sa + g), y = load<V>(sb + g);
      store(a + g, (x + y) * kHalfSqrt2);
      store(b + g, (x - y) * fi);
    });
  }
  // The differences sit in rows n-1, n-2, ..., m.
  if (p.lee[level]) {
    float* odd = in + (n - 1) * in_stride;
    if (!forward_split<true>(p, level + 1, odd, -in_stride, out + out_stride, 2 * out_stride, L)) {
      forward(p, level + 1, odd, -in_stride, odd, -in_stride, out + out_stride, 2 * out_stride, L);
      odd_from_dct2(out + out_stride, 2 * out_stride, m, L);
    }
  } else {
    matvec(p.forward_odd[level], m, m, in + m * in_stride, in_stride, out + out_stride,
           2 * out_stride, L);
  }
  forward(p, level + 1, in, in_stride, in, in_stride, out, 2 * out_stride, L);
}

void inverse(const Dct1d& p, int level, float* X, int64_t x_stride, float* out, int64_t out_stride,
             int L);

// Level `level`'s last pass, lanes of x[i] and x[n-1-i] from those of the even half's inverse e
// and the odd half's o: (e + o) / sqrt(2) and (e - o) / sqrt(2), or, where the odd half took
// Lee's form (lee_scale not null), e / sqrt(2) + f o and e / sqrt(2) - f o, f = lee_scale[i].
template <typename V>
[[gnu::always_inline]] inline std::pair<V, V> unsplit(V e, V o, const float* lee_scale, int i) {
  if (lee_scale == nullptr) return {(e + o) * kHalfSqrt2, (e - o) * kHalfSqrt2};
  const V half = e * kHalfSqrt2, f = splat<V>(lee_scale[i]);
  return {fused_multiply_add(f, o, half), fused_multiply_add(-f, o, half)};
}

// The two halves of a DCT-III of the n = p.n >> level rows at X + k * x_stride (destroyed): the
// even coefficients' inverse of size n / 2 to the rows out + i * out_stride, the odd ones' to the
// rows out + (n - 1 - i) * out_stride, as unsplit() takes them. The odd half is a dense DCT-IV
// (its own inverse), or where p.lee[level] the transpose of the forward's Lee form: the
// coefficients' neighbours added (X'[j] = X[j] + X[j-1], X'[0] = sqrt(2) X[0], the transpose of
// odd_from_dct2), their DCT-III of size n / 2, and the scale, which unsplit() applies.
void inverse_halves(const Dct1d& p, int level, float* X, int64_t x_stride, float* out,
                    int64_t out_stride, int L) {
  const int n = p.n >> level, m = n / 2;
  float* odd = X + x_stride;
  const int64_t odd_stride = 2 * x_stride;
  if (p.lee[level]) {
    for (int j = m - 1; j >= 0; --j) {
      float* row = odd + j * odd_stride;
      const float* before = j > 0 ? row - odd_stride : nullptr;
      over_lanes(L, [&](int64_t g, auto v) {
        using V = decltype(v);
        v = load<V>(row + g);
        store(row + g, before != nullptr ? v + load<V>(before + g) : v * kSqrt2);
      });
    }
    inverse(p, level + 1, odd, odd_stride, out + (n - 1) * out_stride, -out_stride, L);
  } else {
    matvec(p.inverse_odd[level], m, m, odd, odd_stride, out + m * out_stride, out_stride, L);
  }
  inverse(p, level + 1, X, odd_stride, out, out_stride, L);
}

// DCT-III (the inverse) of the n = p.n >> level rows at X + k * x_stride (destroyed), results to
// the rows at out + i * out_stride.
void inverse(const Dct1d& p, int level, float* X, int64_t x_stride, float* out, int64_t out_stride,
             int L) {
  const int n = p.n >> level;
  if (level == p.splits) {
    matvec(p.base_t, n, n, X, x_stride, out, out_stride, L);
    return;
  }
  inverse_halves(p, level, X, x_stride, out, out_stride, L);
  const int m = n / 2;
  const float* lee_scale = p.lee[level] ? p.lee_scale[level] : nullptr;
  for (int i = 0; i < m; ++i) {
    float* a = out + i * out_stride;
    float* b = out + (n - 1 - i) * out_stride;
    over_lanes(L, [&](int64_t g, auto v) {
      using V = decltype(v);
      const auto [top, bottom] = unsplit(load<V>(a + g), load<V>(b + g), lee_scale, i);
      store(a + g, top);
      store(b + g, bottom);
    });
  }
}

// ====== Transposes ======
// The 8 x 8 block in rows r, transposed into out.
inline void transpose8_registers(const v8 r[8], v8 out[8]) {
  v8 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {  // pairs of rows interleaved
    t[i] = SHUFFLE8(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = SHUFFLE8(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 8; i += 4) {  // then pairs of pairs
    u[i] = SHUFFLE8(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 1] = SHUFFLE8(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    u[i + 2] = SHUFFLE8(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 3] = SHUFFLE8(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int i = 0; i < 4; ++i) {  // then the 128-bit halves
    out[i] = SHUFFLE8(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    out[i + 4] = SHUFFLE8(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

inline void transpose8(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  v8 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = load(src + i * src_stride);
  transpose8_registers(r, t);
  for (int i = 0; i < 8; ++i) store(dst + i * dst_stride, t[i]);
}

// src: rows x cols (both multiples of 8, row stride cols) -> dst: cols x rows; the next chunk's
// lines asked for, `lines` an 8 x 8 block.
void transpose(const float* src, int rows, int cols, float* dst, Ahead<false>& ahead, int lines) {
  for (int i = 0; i < rows; i += 8) {
    for (int j = 0; j < cols; j += 8) {
      ahead.ask(lines);
      transpose8(src + int64_t(i) * cols + j, cols, dst + int64_t(j) * rows + i, rows);
    }
  }
}

// ====== The fused forward kernel ======
// One pass, vectorised by the compiler (no errno to keep: the square root is a vector op).
void precondition(const float* __restrict g, float* __restrict v, float* __restrict out, int64_t n,
                  float beta2, float one_minus_beta2, float bias, float eps) {
  for (int64_t j = 0; j < n; ++j) {
    out[j] = precondition_element(g[j], v[j], beta2, one_minus_beta2, bias, eps);
  }
}

void dct_accumulate(const ChunkShape& shape, const float* src, int64_t src_stride, int valid_h,
                    int valid_w, float* out, int64_t out_stride, float beta, float alpha,
                    float* fresh, float* scratch, const NextChunk& next,
                    const ChunkPrecondition* pre) {
  const int h = shape.h, w = shape.w, H8 = round8(h), W8 = round8(w);
  // The next chunk's samples, two lines an 8 x 8 block in each of two passes over the chunk's
  // blocks: (h / 8) (w / 8) blocks, h w / 16 lines.
  Ahead<false> ahead(next, src_stride);
  constexpr int kAheadLines = 2;
  const int64_t block = int64_t(H8) * W8;
  float* a = scratch;
  float* b = scratch + block;
  // The column transform reads a whole chunk of whole vectors straight from the tensor; other
  // chunks, and preconditioned ones, are copied into a first (h rows of W8 lanes), zeros outside
  // the tensor and in the padding lanes.
  const bool direct = pre == nullptr && h > 1 && valid_h == h && valid_w == w && w % 8 == 0;
  for (int u = 0; u < H8 && !direct; ++u) {
    float* row = a + int64_t(u) * W8;
    const int have = u < valid_h && u < h ? valid_w : 0;
    if (have > 0 && pre != nullptr) {
      precondition(src + u * src_stride, pre->v + u * src_stride, row, have, pre->beta2,
                   pre->one_minus_beta2, pre->bias, pre->eps);
    } else if (have > 0) {
      std::memcpy(row, src + u * src_stride, sizeof(float) * size_t(have));
    }
    std::memset(row + have, 0, sizeof(float) * size_t(W8 - have));
  }
  float* y = a;  // the column transform (h rows, W8 lanes), then transposed into the other buffer
  if (h > 1) {
    forward(*shape.along_rows, 0, direct ? src : a, direct ? src_stride : W8, a, W8, b, W8, W8);
    std::memset(b + int64_t(h) * W8, 0, sizeof(float) * size_t((H8 - h) * W8));
    y = b;
  }
  float* yt = y == a ? b : a;
  transpose(y, H8, W8, yt, ahead, kAheadLines);              // yt: W8 rows x H8 lanes
  forward(*shape.along_cols, 0, yt, H8, yt, H8, y, H8, H8);  // y: the row transform, transposed
  // beta * o + alpha * z as one explicit multiply-add onto beta * o (the contraction the compiler
  // had chosen for the vector loop: the same bits as before). Left to the compiler, the loops
  // with and without fresh were contracted differently and rounded differently.
  const auto update = [beta, alpha](auto o, auto z) {
    using V = decltype(z);
    return beta == 0.0f ? alpha * z : fused_multiply_add(splat<V>(alpha), z, beta * o);
  };
  if (h % 8 == 0 && w % 8 == 0) {
    // Whole 8 x 8 blocks: each transposed in registers straight into the residual's update.
    for (int u0 = 0; u0 < h; u0 += 8) {
      for (int u = u0 + 8; u < std::min(u0 + 16, h); ++u) prefetch_row(out + u * out_stride, w);
      for (int v0 = 0; v0 < w; v0 += 8) {
        ahead.ask(kAheadLines);
        v8 r[8], z[8];
        for (int i = 0; i < 8; ++i) r[i] = load(y + int64_t(v0 + i) * H8 + u0);
        transpose8_registers(r, z);
        for (int i = 0; i < 8; ++i) {
          float* o = out + (u0 + i) * out_stride + v0;
          const v8 x = update(load(o), z[i]);
          store(o, x);
          if (fresh != nullptr) store(fresh + int64_t(u0 + i) * w + v0, x);
        }
      }
    }
    return;
  }
  transpose(y, W8, H8, yt, ahead, kAheadLines);  // yt: H8 rows x W8 lanes, the chunk's DCT
  for (int u = 0; u < std::min(kPrefetchRows, h); ++u) prefetch_row(out + u * out_stride, w);
  for (int u = 0; u < h; ++u) {
    if (u + kPrefetchRows < h) prefetch_row(out + (u + kPrefetchRows) * out_stride, w);
    float* o = out + u * out_stride;
    const float* z = yt + int64_t(u) * W8;
    float* f = fresh != nullptr ? fresh + int64_t(u) * w : nullptr;
    const int whole = w / 8 * 8;
    over_lanes(whole, [&](int64_t v, auto lanes) {
      using V = decltype(lanes);
      const V r = update(load<V>(o + v), load<V>(z + v));
      store(o + v, r);
      if (f != nullptr) store(f + v, r);
    });
    for (int v = whole; v < w; ++v) {
      const float r = update(o[v], z[v]);
      o[v] = r;
      if (f != nullptr) f[v] = r;
    }
  }
}

// ====== Top-k by partial selection ======
inline uint32_t magnitude(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return bits & 0x7fffffffu;  // IEEE bits of |x|: they compare like |x| (NaN above infinity)
}
inline v8i magnitudes(const float* p) {
  return (v8i)load(p) & splat_i(0x7fffffff);
}
// Bit q set where lane q of a comparison result is true.
inline unsigned lane_mask(v8i m) {
#if defined(__AVX__)
  return unsigned(_mm256_movemask_ps(reinterpret_cast<__m256>(m)));
#elif defined(__SSE__)
  __m128 half[2];
  std::memcpy(half, &m, sizeof m);
  return unsigned(_mm_movemask_ps(half[0]) | _mm_movemask_ps(half[1]) << 4);
#else
  unsigned bits = 0;
  for (int q = 0; q < 8; ++q) bits |= unsigned(m[q] != 0) << q;
  return bits;
#endif
}

#if defined(__AVX2__)
// For each 8-bit mask, the lanes whose bit is set, packed to the front.
struct PackedLanes {
  int32_t lanes[256][8] = {};
  constexpr PackedLanes() {
    for (int mask = 0; mask < 256; ++mask) {
      int used = 0;
      for (int lane = 0; lane < 8; ++lane) {
        if (mask & (1 << lane)) lanes[mask][used++] = lane;
      }
    }
  }
};
constexpr PackedLanes kPackedLanes{};
#endif

// Positions of the entries whose magnitude is >= t, ascending; returns how many. positions
// needs room for n (whole vectors are stored, but never past the entries read so far).
int64_t collect_at_least(const float* x, int64_t n, uint32_t t, int32_t* positions) {
  const v8i vt = splat_i(int32_t(t));
  int64_t count = 0, i = 0;
#if defined(__AVX512F__)  // 16 at a time: the hits' positions packed by one compress
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; i + 16 <= n; i += 16) {
    const __m512i mag = _mm512_and_si512(_mm512_loadu_si512(x + i), _mm512_set1_epi32(0x7fffffff));
    const __mmask16 hits = _mm512_cmpge_epi32_mask(mag, _mm512_set1_epi32(int32_t(t)));
    _mm512_storeu_si512(
        positions + count,
        _mm512_maskz_compress_epi32(hits, _mm512_add_epi32(iota, _mm512_set1_epi32(int32_t(i)))));
    count += __builtin_popcount(hits);
  }
#endif
  for (; i + 8 <= n; i += 8) {
    const unsigned bits = lane_mask(magnitudes(x + i) >= vt);
#if defined(__AVX2__)  // without a branch per hit: store the packed lanes, count them
    const __m256i lanes =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kPackedLanes.lanes[bits]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(positions + count),
                        _mm256_add_epi32(lanes, _mm256_set1_epi32(int32_t(i))));
    count += __builtin_popcount(bits);
#else
    for (unsigned b = bits; b != 0; b &= b - 1) positions[count++] = int32_t(i + __builtin_ctz(b));
#endif
  }
  for (; i < n; ++i) {
    if (magnitude(x[i]) >= t) positions[count++] = int32_t(i);
  }
  return count;
}

// How many of mags[0, count) are >= t; mags is padded with -1 to whole vectors.
int64_t count_at_least(const int32_t* mags, int64_t count, int32_t t) {
  typedef int32_t vi __attribute__((vector_size(sizeof(vwide))));
  typedef int32_t viu __attribute__((vector_size(sizeof(vwide)), aligned(4), may_alias));
  constexpr int L = lanes_of<vwide>;
  vi hits = {};
  for (int64_t j = 0; j < count; j += L) {
    hits += *reinterpret_cast<const viu*>(mags + j) >= (vi{} + t);  // true: -1
  }
  int64_t sum = 0;
  for (int q = 0; q < L; ++q) sum -= hits[q];
  return sum;
}

// A threshold t >= lo over mags[0, count) (magnitudes' bits, >= 0) that at least `fewest` and
// at most `most` of them reach, or else the largest t that at least `fewest` reach (with fewest
// = most = k: the k-th largest magnitude, or a t that exactly k reach). Needs count(>= lo) >=
// fewest. Found by bisection on the bits, each probe a vectorised count (no branch per entry,
// no partition), stopping at the first probe inside the range. Pads mags with -1 to whole
// vectors: it needs room for count + 16.
int32_t threshold_between(int32_t* mags, int64_t count, int32_t lo, int64_t fewest, int64_t most) {
  int32_t largest = lo;
  for (int64_t j = 0; j < count; ++j) largest = std::max(largest, mags[j]);
  for (int64_t j = count; j < count + lanes_of<vwide>; ++j) mags[j] = -1;
  int64_t low = lo, high = int64_t(largest) + 1;  // count(>= low) >= fewest > count(>= high)
  while (high - low > 1) {
    const int64_t mid = low + (high - low) / 2, reach = count_at_least(mags, count, int32_t(mid));
    if (reach < fewest) {
      high = mid;
    } else {
      low = mid;
      if (reach <= most) break;
    }
  }
  return int32_t(low);
}

// The sample a threshold is taken from: 8 consecutive entries out of every 136, the start moving
// 8 entries along each time, so that a chunk's rows of 64 are sampled in every column and not
// only in their first 8 (a DCT's low frequencies lie there). Writes their magnitudes to out
// (room for n / 17 + 8 + 16) and returns how many.
int64_t sample_magnitudes(const float* x, int64_t n, int32_t* out) {
  int64_t count = 0;
  for (int64_t i = 0; i + 8 <= n; i += 136, count += 8) {
    const v8i m = magnitudes(x + i);
    std::memcpy(out + count, &m, sizeof m);
  }
  return count;
}

// The k largest magnitudes are found among the entries >= a threshold t: one the sample ranks
// where about 1.5k to 3k of the chunk would pass, lowered until at least k pass (first by half
// an exponent, about a third, each step twice the last). Among those, a threshold kth exactly k
// reach (or the k-th largest magnitude, where ties leave none) comes by bisection; the chosen
// are every candidate above kth and the first of those equal to it (ties go to the lower
// position), taken in one pass in ascending position order.
constexpr uint64_t kLowerStep = 1u << 22;  // in a magnitude's bits: half an exponent step
void select_topk(const float* values, int64_t n, int64_t k, int64_t* positions, float* selected,
                 uint64_t* scratch) {
  int32_t* mags = reinterpret_cast<int32_t*>(scratch);                // n + 16
  int32_t* candidates = reinterpret_cast<int32_t*>(scratch + n + 8);  // n + 8
  uint32_t t = 0;
  if (n >= 256 && k * 8 <= n) {
    const int64_t sampled = sample_magnitudes(values, n, mags);
    const int64_t rank = std::min(sampled, (3 * k * sampled) / (2 * n) + 2);
    t = uint32_t(threshold_between(mags, sampled, 0, rank, 2 * rank));
  }
  int64_t count = collect_at_least(values, n, t, candidates);
  for (uint64_t step = kLowerStep; count < k; step *= 2) {  // a sample far off: a few passes
    t = t > step ? uint32_t(t - step) : 0;
    count = collect_at_least(values, n, t, candidates);
  }
  for (int64_t j = 0; j < count; ++j) mags[j] = int32_t(magnitude(values[candidates[j]]));
  const int32_t kth = threshold_between(mags, count, int32_t(t), k, k);
  const int64_t above = kth == INT32_MAX ? 0 : count_at_least(mags, count, kth + 1);
  int64_t ties = k - above, taken = 0;  // how many equal to kth are chosen
  if (count_at_least(mags, count, kth) == k) {
    // Every candidate equal to kth is chosen (the usual case): a filter, without the chain of
    // the count of ties left from one candidate to the next.
    for (int64_t j = 0; j < count; ++j) {  // kept in place: taken <= j
      candidates[taken] = candidates[j];
      taken += mags[j] >= kth;
    }
  } else {  // more ties than are chosen: the first ones
    for (int64_t j = 0; j < count; ++j) {
      const bool tie = mags[j] == kth, take = mags[j] > kth || (tie && ties > 0);
      ties -= tie && take;
      candidates[taken] = candidates[j];
      taken += take;
    }
  }
  for (int64_t j = 0; j < k; ++j) {
    positions[j] = candidates[j];
    selected[j] = values[candidates[j]];
  }
}

// ====== The sparse inverse ======
// Sign-SGD on a vector of parameters p with directions d: keep * p - lr * sign(d) (sign(0) =
// sign(NaN) = 0).
template <typename V>
[[gnu::always_inline]] inline V sign_sgd(V p, V d, const chunk_math::SgdConstants& c) {
  typedef int32_t Vi __attribute__((vector_size(sizeof(V))));
  const Vi lr = (Vi)splat<V>(c.lr);
  const V up = (V)((d > 0.0f) & lr), down = (V)((d < 0.0f) & lr);
  return c.keep * p - up + down;
}

// The SGD rule with sign off on a vector: chunk_math::sgd_step's keep * p - lr * x, x clamped to
// the bound (NaN stays NaN), rounded once by a fused multiply-add. Only where the instruction set
// has one (kFusedPlainSgd): elsewhere sgd_step's scalar loop calls the exact std::fma.
#if defined(__FMA__)
constexpr bool kFusedPlainSgd = true;
#else
constexpr bool kFusedPlainSgd = false;
#endif
template <typename V>
[[gnu::always_inline]] inline V plain_sgd(V p, V x, const chunk_math::SgdConstants& c) {
  if (c.bound > 0.0f) {
    const V bound = splat<V>(c.bound);
    x = x > bound ? bound : x < -bound ? -bound : x;
  }
  return fused_multiply_add(splat<V>(c.keep), p, -(splat<V>(c.lr) * x));
}

// The step a chunk's direction x takes on its parameters p, lane by lane, where it can be fused
// into the inverse's last pass: sign-SGD, or the plain rule where kFusedPlainSgd.
struct SgdLanes {
  const chunk_math::SgdConstants& c;
  template <typename V>
  [[gnu::always_inline]] V operator()(V p, V x) const {
    return c.sign ? sign_sgd(p, x, c) : plain_sgd(p, x, c);
  }
};

// SGD over the update's rows and columns: p = keep * p - lr * sign(x) (sign(0) = sign(NaN) =
// 0), or with sign off p = keep * p - lr * x, x clamped to the bound.
void sgd_step(const float* x, int64_t x_stride, const StepUpdate& update, float* p,
              int64_t p_stride, Ahead<true>& ahead) {
  const chunk_math::SgdConstants& c = update.sgd;
  const int rows = update.valid_h, cols = update.valid_w;
  const int lines_per_row = (cols + 15) / 16;
  if (!c.sign) {
    for (int u = 0; u < rows; ++u) {
      ahead.ask(lines_per_row);
      const float* xr = x + u * x_stride;
      float* pr = p + u * p_stride;
      for (int v = 0; v < cols; ++v) pr[v] = chunk_math::sgd_step(pr[v], xr[v], c);
    }
    return;
  }
  for (int u = 0; u < std::min(kPrefetchRows, rows); ++u) prefetch_row(p + u * p_stride, cols);
  for (int u = 0; u < rows; ++u) {
    if (u + kPrefetchRows < rows) prefetch_row(p + (u + kPrefetchRows) * p_stride, cols);
    ahead.ask(lines_per_row);
    const float* xr = x + u * x_stride;
    float* pr = p + u * p_stride;
    const int whole = update.valid_w / 8 * 8;
    over_lanes(whole, [&](int64_t v, auto lanes) {
      using V = decltype(lanes);
      store(pr + v, sign_sgd(load<V>(pr + v), load<V>(xr + v), c));
    });
    for (int v = whole; v < update.valid_w; ++v) {
      const float step = c.lr * float((xr[v] > 0.0f) - (xr[v] < 0.0f));
      pr[v] = c.keep * pr[v] - step;
    }
  }
}

// AdamW over the update's rows and columns (see StepUpdate), element by element in
// torch.optim.AdamW's order of operations.
void adamw_step(const float* x, int64_t x_stride, const StepUpdate& update, float* p,
                int64_t p_stride, Ahead<true>& ahead) {
  const chunk_math::AdamWConstants& c = update.adamw;
  for (int u = 0; u < update.valid_h; ++u) {
    ahead.ask((update.valid_w + 15) / 16);
    const float* xr = x + u * x_stride;
    float* pr = p + u * p_stride;
    float* mr = update.m + u * p_stride;
    float* vr = update.v + u * p_stride;
    for (int j = 0; j < update.valid_w; ++j) {
      const float g = c.sign ? float((xr[j] > 0.0f) - (xr[j] < 0.0f)) : xr[j];
      const float m = mr[j] * c.beta1 + g * c.one_minus_beta1;
      const float v = vr[j] * c.beta2 + c.one_minus_beta2 * g * g;
      mr[j] = m;
      vr[j] = v;
      pr[j] = c.keep * pr[j] - c.lr * m / (__builtin_sqrtf(v) / c.sqrt_bc2 + c.eps);
    }
  }
}

// The direct column pass's halves applied as the SGD step, for output rows i..i+R-1 and lanes
// [g, g + G * W): E = the even rows' sums (matrix me over the ne rows at te), O = the odd rows'
// (mo over the no rows at to, going up), then x[i] = E + O and x[h-1-i] = E - O step the
// parameters' rows i and h-1-i. The sums stay in registers: x never goes through memory.
template <typename V, int R, int G, typename MatE, typename MatO>
[[gnu::always_inline]] inline void halves_sgd_block(const MatE& me, int ne, const float* te,
                                                    const MatO& mo, int no, const float* to,
                                                    int64_t t_stride, int h, int i, int64_t g,
                                                    const SgdLanes& step, float* p,
                                                    int64_t p_stride) {
  constexpr int W = lanes_of<V>;
  V e[R][G], o[R][G];
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < G; ++q) e[r][q] = o[r][q] = V{};
  }
  for (int j = 0; j < ne; ++j) {
    V x[G];
    for (int q = 0; q < G; ++q) x[q] = load<V>(te + j * t_stride + g + W * q);
    for (int r = 0; r < R; ++r) {
      const V m = splat<V>(me(i + r, j));
      for (int q = 0; q < G; ++q) e[r][q] += m * x[q];
    }
  }
  for (int j = 0; j < no; ++j) {
    V x[G];
    for (int q = 0; q < G; ++q) x[q] = load<V>(to - j * t_stride + g + W * q);
    for (int r = 0; r < R; ++r) {
      const V m = splat<V>(mo(i + r, j));
      for (int q = 0; q < G; ++q) o[r][q] += m * x[q];
    }
  }
  for (int r = 0; r < R; ++r) {
    float* top = p + (i + r) * p_stride + g;
    float* bottom = p + (h - 1 - i - r) * p_stride + g;
    for (int q = 0; q < G; ++q) {
      store(top + W * q, step(load<V>(top + W * q), e[r][q] + o[r][q]));
      store(bottom + W * q, step(load<V>(bottom + W * q), e[r][q] - o[r][q]));
    }
  }
}

// Every row and lane of a chunk through halves_sgd_block: rows in pairs, lanes in blocks of
// 4 (AVX-512) or 2 vectors of the widest, then what is left one vector at a time.
template <typename MatE, typename MatO>
void halves_sgd(const MatE& me, int ne, const float* te, const MatO& mo, int no, const float* to,
                int64_t t_stride, int h, int64_t L, const SgdLanes& step, float* p,
                int64_t p_stride, Ahead<true>& ahead) {
  constexpr int G = lanes_of < vwide >> 8 ? 4 : 2;
  constexpr int W = lanes_of<vwide>;
  const int m = h / 2;
  const int lines_per_row = int((L + 15) / 16);
  auto rows = [&](auto pair, int i) {
    constexpr int R = decltype(pair)::value;
    int64_t g = 0;
    for (; g + G * W <= L; g += G * W) {
      halves_sgd_block<vwide, R, G>(me, ne, te, mo, no, to, t_stride, h, i, g, step, p, p_stride);
    }
    over_lanes(L - g, [&](int64_t k, auto v) {
      halves_sgd_block<decltype(v), R, 1>(me, ne, te, mo, no, to, t_stride, h, i, g + k, step, p,
                                          p_stride);
    });
  };
  int i = 0;
  for (; i + 2 <= m; i += 2) {
    ahead.ask(4 * lines_per_row);  // as many as the four rows this pair steps
    rows(std::integral_constant<int, 2>{}, i);
  }
  if (i < m) rows(std::integral_constant<int, 1>{}, i);
}

// inverse() of a whole chunk's n = p.n rows (p.splits > 0) whose last pass, level 0's
// butterflies, steps the parameters' rows i and n-1-i by the rows it makes instead of writing
// them: the direction never goes through memory. out: the rows the lower levels write.
void inverse_step(const Dct1d& p, float* X, int64_t x_stride, float* out, int64_t out_stride, int L,
                  const SgdLanes& step, float* param, int64_t p_stride, Ahead<true>& ahead) {
  const int n = p.n, m = n / 2;
  inverse_halves(p, 0, X, x_stride, out, out_stride, L);
  const float* lee_scale = p.lee[0] ? p.lee_scale[0] : nullptr;
  const int lines_per_row = (L + 15) / 16, ahead_pairs = kPrefetchRows / 2;
  const auto prefetch_pair = [&](int i) {
    prefetch_row(param + i * p_stride, L);
    prefetch_row(param + (n - 1 - i) * p_stride, L);
  };
  for (int i = 0; i < std::min(ahead_pairs, m); ++i) prefetch_pair(i);
  for (int i = 0; i < m; ++i) {
    if (i + ahead_pairs < m) prefetch_pair(i + ahead_pairs);
    ahead.ask(2 * lines_per_row);  // as many as the two rows this pair steps
    const float* a = out + i * out_stride;
    const float* b = out + (n - 1 - i) * out_stride;
    float* top = param + i * p_stride;
    float* bottom = param + (n - 1 - i) * p_stride;
    over_lanes(L, [&](int64_t g, auto v) {
      using V = decltype(v);
      const auto [x_top, x_bottom] = unsplit(load<V>(a + g), load<V>(b + g), lee_scale, i);
      store(top + g, step(load<V>(top + g), x_top));
      store(bottom + g, step(load<V>(bottom + g), x_bottom));
    });
  }
}

// x = B_h^T X B_w: first t[u] = sum_v X[u][v] B_w[v] for the rows u holding a coefficient (one
// multiply-add per coefficient and lane), then along the columns either directly over those
// rows or, when they are many, by the factorised inverse (whichever costs less: the number of
// multiply-adds against Dct1d::inverse_cost).
// An SGD step on a whole chunk is fused into the column pass's last writes.
void idct_sparse(const ChunkShape& shape, const int32_t* positions, const float* values,
                 int64_t nnz, float* out, int64_t out_stride, const StepUpdate* update,
                 float* scratch) {
  const int h = shape.h, w = shape.w, W8 = round8(w);
  const int64_t block = int64_t(round8(h)) * W8;
  const Dct1d& cols = *shape.along_cols;
  const Dct1d& rows = *shape.along_rows;
  // t: one row per row u holding a coefficient, X[u] B_w. For even h the rows of even u fill t
  // from the top and those of odd u from the bottom, so that the direct column pass can use
  // B[u][h-1-i] = (-1)^u B[u][i]: half the multiply-adds. The factorised inverse takes every
  // row in place instead (row u at u), the rows without a coefficient zeroed.
  const bool halves = h % 2 == 0;
  float* x = scratch + block;        // the result (h rows of W8 lanes) unless it goes to out
  float* mat = scratch + 2 * block;  // every row of X B_w, for the factorised inverse
  int32_t* slot_of = reinterpret_cast<int32_t*>(mat + int64_t(h) * std::max(h, W8));
  int32_t* row_of = slot_of + h;    // by slot
  int32_t* unwritten = row_of + h;  // per row: 1 until the row pass first writes it
  // A position's row: a shift where w is a power of two (64, the default chunk), whose division
  // per entry cost a tenth of this kernel.
  const int shift = (w & (w - 1)) == 0 ? __builtin_ctz(unsigned(w)) : -1;
  const auto row_of_position = [w, shift](int32_t pos) {
    return shift >= 0 ? pos >> shift : pos / w;
  };
  // The slots in the order the rows first appear, which the direct passes sum in.
  int even = 0, odd = 0;
  std::fill(slot_of, slot_of + h, -1);
  for (int64_t e = 0; e < nnz; ++e) {
    const int u = row_of_position(positions[e]);
    if (slot_of[u] >= 0) continue;
    slot_of[u] = halves && u % 2 == 1 ? h - 1 - odd++ : even++;
    row_of[slot_of[u]] = u;
  }
  const int used = even + odd;
  enum class Columns { None, Copy, Halves, Direct, Factorised };
  const Columns pass = used == 0                                              ? Columns::None
                       : h == 1                                               ? Columns::Copy
                       : halves && int64_t(used) * h / 2 <= rows.inverse_cost ? Columns::Halves
                       : !halves && int64_t(used) * h <= rows.inverse_cost    ? Columns::Direct
                                                                              : Columns::Factorised;
  float* t = scratch;
  if (pass == Columns::Factorised) {
    t = mat;
    for (int u = 0; u < h; ++u) {
      if (slot_of[u] < 0) std::memset(mat + int64_t(u) * W8, 0, sizeof(float) * size_t(W8));
      slot_of[u] = u;
    }
  }
  for (int u = 0; u < h; ++u) unwritten[u] = 1;
  Ahead<true> ahead(update != nullptr ? update->next : NextChunk{}, out_stride);
  // Entries come in runs of one row (a payload's positions ascend): a run's sums stay in
  // registers, lane by lane, in the entries' order; a row's first run starts them at zero.
  for (int64_t e = 0, end; e < nnz; e = end) {
    const int u = row_of_position(positions[e]);
    const int32_t first = u * w, past = first + w;  // the row's positions
    for (end = e + 1; end < nnz && positions[end] >= first && positions[end] < past;) ++end;
    float* row = t + int64_t(slot_of[u]) * W8;
    const bool fresh = std::exchange(unwritten[u], 0) != 0;
    // G vectors at a time: G independent sums, each a chain of multiply-adds.
    const auto run = [&](int64_t g, auto lanes) {
      using V = typename decltype(lanes)::first_type;
      constexpr int G = decltype(lanes)::second_type::value, W = lanes_of<V>;
      V sum[G];
      for (int q = 0; q < G; ++q) sum[q] = fresh ? V{} : load<V>(row + g + W * q);
      for (int64_t f = e; f < end; ++f) {
        const float* basis = cols.full + int64_t(positions[f] - first) * cols.full_stride + g;
        const V c = splat<V>(values[f]);
        for (int q = 0; q < G; ++q) sum[q] += c * load<V>(basis + W * q);
      }
      for (int q = 0; q < G; ++q) store(row + g + W * q, sum[q]);
    };
    constexpr int W = lanes_of<vwide>;
    int64_t g = 0;
    for (; g + 4 * W <= W8; g += 4 * W) {
      run(g, std::pair<vwide, std::integral_constant<int, 4>>{});
    }
    over_lanes(W8 - g, [&](int64_t k, auto v) {
      run(g + k, std::pair<decltype(v), std::integral_constant<int, 1>>{});
    });
  }
  // An SGD step on a whole chunk is fused (sign-SGD, or the plain rule where kFusedPlainSgd).
  const bool fused = update != nullptr && update->m == nullptr &&
                     (update->sgd.sign || kFusedPlainSgd) && update->valid_h == h &&
                     update->valid_w == w && w == W8;
  // Straight into out when whole vectors fit its rows; otherwise (or for a step) through x.
  const bool direct = w % 8 == 0 && update == nullptr;
  float* dst = direct ? out : x;
  const int64_t dst_stride = direct ? out_stride : W8;
  const float* basis = rows.full;
  const int bs = rows.full_stride;
  switch (pass) {
    case Columns::None:
      for (int i = 0; i < h; ++i) std::memset(dst + i * dst_stride, 0, sizeof(float) * size_t(W8));
      break;
    case Columns::Copy:
      std::memcpy(dst, t, sizeof(float) * size_t(W8));
      break;
    case Columns::Halves: {
      // x[i] = E[i] + O[i], x[h-1-i] = E[i] - O[i] (i < h/2), E and O the even and odd rows'
      // sums. The matrices read straight from the basis: entry (i, r) is row u's basis function
      // at i.
      const int m = h / 2;
      const int32_t* odd_rows = row_of + h - 1;  // by slot, from the bottom
      const auto even_mat = [=](int i, int r) { return basis[row_of[r] * bs + i]; };
      const auto odd_mat = [=](int i, int r) { return basis[odd_rows[-r] * bs + i]; };
      if (fused) {  // x stays in registers
        halves_sgd(even_mat, even, t, odd_mat, odd, t + int64_t(h - 1) * W8, W8, h, W8,
                   SgdLanes{update->sgd}, out, out_stride, ahead);
        return;
      }
      matvec_of(even_mat, m, even, t, W8, dst, dst_stride, W8);
      float* last = dst + (h - 1) * dst_stride;
      matvec_of(odd_mat, m, odd, t + int64_t(h - 1) * W8, -W8, last, -dst_stride, W8);
      for (int i = 0; i < m; ++i) {
        float* a = dst + i * dst_stride;
        float* b = dst + (h - 1 - i) * dst_stride;
        over_lanes(W8, [&](int64_t g, auto v) {
          using V = decltype(v);
          const V e = load<V>(a + g), o = load<V>(b + g);
          store(a + g, e + o);
          store(b + g, e - o);
        });
      }
      break;
    }
    case Columns::Direct:
      matvec_of([=](int i, int r) { return basis[row_of[r] * bs + i]; }, h, used, t, W8, dst,
                dst_stride, W8);
      break;
    case Columns::Factorised:
      if (fused && rows.splits > 0) {
        inverse_step(rows, mat, W8, x, W8, W8, SgdLanes{update->sgd}, out, out_stride, ahead);
        return;
      }
      inverse(rows, 0, mat, W8, dst, dst_stride, W8);
      break;
  }
  if (update != nullptr && update->m != nullptr) {
    adamw_step(x, W8, *update, out, out_stride, ahead);
  } else if (update != nullptr) {
    sgd_step(x, W8, *update, out, out_stride, ahead);
  } else if (dst == x) {
    for (int i = 0; i < h; ++i) std::memcpy(out + i * out_stride, x + i * W8, sizeof(float) * w);
  }
}

// Whether no x[j] is infinite or NaN (an exponent of all ones): blocks of 128 read before each
// test, so that the scan runs at the speed of memory.
bool all_finite(const float* x, int64_t n) {
  const v8i exponent = splat_i(0x7f800000);
  int64_t j = 0;
  for (; j + 128 <= n; j += 128) {
    v8i special = {};
    for (int i = 0; i < 128; i += 8) special |= ((v8i)load(x + j + i) & exponent) == exponent;
    if (lane_mask(special) != 0) return false;
  }
  for (; j < n; ++j) {
    if ((magnitude(x[j]) & 0x7f800000u) == 0x7f800000u) return false;
  }
  return true;
}

}  // namespace

extern const KernelTable table;
const KernelTable table = {
#define FLEXDEMO_STR2(x) #x
#define FLEXDEMO_STR(x) FLEXDEMO_STR2(x)
    FLEXDEMO_STR(FLEXDEMO_KERNEL_ISA),
    dct_accumulate,
    select_topk,
    idct_sparse,
    precondition,
    all_finite,
};

}  // namespace flexdemo::kernels::FLEXDEMO_KERNEL_ISA
