// The DeMo step's CUDA kernels themselves (device code; launched by cuda_kernels.cu): one block per
// chunk of the bucket, the chunk in shared memory, every element computed by chunk_math.h's
// functions in their fixed order; all reductions whose order could change a bit (sums of floats)
// run in one fixed order, the others (counts, maxima, ORs) are order-free. Also compiled for the
// host by tests/test_cuda_emulation.cpp, whose emulation of blocks and threads runs them on a CPU.
// Include once per translation unit.
#pragma once

#include "demo/cuda/cuda_kernels.h"

#include <cstdint>

// A kernel's dynamic shared memory, as an array of T named `name`.
#ifndef FLEXDEMO_DYNAMIC_SHARED
#define FLEXDEMO_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

namespace flexdemo::kernels::cuda {
namespace {

namespace cm = chunk_math;
namespace codec = demo::codec;

constexpr int kThreads = 256;

// Where chunk `c` of tensor t lies: its rows and columns inside the tensor (the rest is padding).
struct Place {
  int64_t ci, cj;  // chunk row and column
  int valid_h, valid_w;
};
__device__ Place place_of(const TensorDesc& t, int64_t c) {
  Place p;
  p.ci = c / t.col_chunks;
  p.cj = c % t.col_chunks;
  p.valid_h = int(min(int64_t(t.chunk_h), t.rows - p.ci * t.chunk_h));
  p.valid_w = int(min(int64_t(t.chunk_w), t.cols - p.cj * t.chunk_w));
  return p;
}

// This thread's share [begin, end) of n positions, in position order across the block.
__device__ void my_range(int n, int& begin, int& end) {
  const int per = (n + blockDim.x - 1) / blockDim.x;
  begin = min(n, int(threadIdx.x) * per);
  end = min(n, begin + per);
}

// Exclusive prefix sum of one int per thread, in thread order; *total gets the sum.
__device__ int exclusive_scan(int v, int* scan, int* total) {
  scan[threadIdx.x] = v;
  __syncthreads();
  for (unsigned offset = 1; offset < blockDim.x; offset <<= 1) {
    const int add = threadIdx.x >= offset ? scan[threadIdx.x - offset] : 0;
    __syncthreads();
    scan[threadIdx.x] += add;
    __syncthreads();
  }
  const int exclusive = scan[threadIdx.x] - v;
  *total = scan[blockDim.x - 1];
  __syncthreads();
  return exclusive;
}

// ====== Encode ======
// The k-th largest magnitude of x[0, n) by radix selection (8 bits a pass, from the top), and how
// many entries equal to it belong to the top-k (those of lowest position).
__device__ void kth_magnitude(const float* x, int n, int k, uint32_t* hist, uint32_t* threshold,
                              int* take_equal) {
  __shared__ uint32_t prefix;
  __shared__ int remaining;
  if (threadIdx.x == 0) prefix = 0, remaining = k;
  uint32_t mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
      const uint32_t m = cm::magnitude_bits(x[e]);
      if ((m & mask) == prefix) atomicAdd(&hist[(m >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // the bin holding the remaining-th largest, from the top
      int above = 0, bin = 255;
      for (; bin > 0 && above + int(hist[bin]) < remaining; --bin) above += int(hist[bin]);
      remaining -= above;
      prefix |= uint32_t(bin) << shift;
    }
    mask |= 255u << shift;
    __syncthreads();
  }
  *threshold = prefix;
  *take_equal = remaining;
}

// The chunk's top-k positions into selected[0, k), ascending: the entries above the k-th
// magnitude and, of those equal to it, the lowest positions. Ends with a barrier.
__device__ void chunk_topk(const float* x, int n, int k, uint32_t* hist, int* scan,
                           int32_t* selected) {
  uint32_t threshold;
  int take_equal;
  kth_magnitude(x, n, k, hist, &threshold, &take_equal);
  int begin, end;
  my_range(n, begin, end);
  int equal = 0;
  for (int e = begin; e < end; ++e) equal += cm::magnitude_bits(x[e]) == threshold;
  int total;
  int equal_before = exclusive_scan(equal, scan, &total);
  int mine = 0;
  for (int e = begin; e < end; ++e) {
    const uint32_t m = cm::magnitude_bits(x[e]);
    mine += m > threshold || (m == threshold && equal_before++ < take_equal);
  }
  int slot = exclusive_scan(mine, scan, &total);
  equal_before = exclusive_scan(equal, scan, &total);
  for (int e = begin; e < end; ++e) {
    const uint32_t m = cm::magnitude_bits(x[e]);
    if (m > threshold || (m == threshold && equal_before++ < take_equal)) selected[slot++] = e;
  }
  __syncthreads();
}

__global__ void encode_kernel(TensorTable table, float beta, float alpha, uint8_t* payloads) {
  FLEXDEMO_DYNAMIC_SHARED(float, shared);
  __shared__ uint32_t hist[256];
  __shared__ int scan[kThreads];
  __shared__ codec::ChunkScales scales;
  const int64_t chunk = blockIdx.x;
  const TensorDesc& t = table.tensors[table.chunk_tensor[chunk]];
  const int64_t c = chunk - t.first_chunk;
  const int h = t.chunk_h, w = t.chunk_w, n = h * w, k = int(t.body.k);
  const Place place = place_of(t, c);
  float* x = shared;                                  // the chunk, then its new residual
  float* y = shared + n;                              // the transform along the columns
  int32_t* selected = reinterpret_cast<int32_t*>(y);  // then the top-k's positions, ascending
  float* residual = t.residual + place.ci * h * t.padded_cols + place.cj * w;

  // 1. The chunk (zeros outside the tensor), transformed along each axis, folded into the residual.
  if (t.grad != nullptr) {
    const float* src = t.grad + place.ci * h * t.cols + place.cj * w;
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
      const int i = e / w, j = e % w;
      x[e] = i < place.valid_h && j < place.valid_w ? src[i * t.cols + j] : 0.0f;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
      const int u = e / w, j = e % w;
      y[e] = cm::forward_dot(t.basis_rows, t.basis_rows_stride, u, x + j, w, h);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
      const int u = e / w, v = e % w;
      const float coeff = cm::forward_dot(t.basis_cols, t.basis_cols_stride, v, y + u * w, 1, w);
      float& r = residual[u * t.padded_cols + v];
      r = cm::accumulate(beta, r, alpha, coeff);
      x[e] = r;
    }
  } else {  // a zero gradient scales the residual only (the CPU path's residual.mul_(beta))
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
      float& r = residual[(e / w) * t.padded_cols + e % w];
      r = beta * r;
      x[e] = r;
    }
  }
  __syncthreads();

  // 2. Top-k: entries above the k-th magnitude, and of those equal to it the lowest positions.
  chunk_topk(x, n, k, hist, scan, selected);

  // 3. The payload's entries; what a receiver decodes leaves the residual (error feedback).
  uint8_t* body = payloads + t.payload_offset + codec::kHeaderBytes;
  const compress::ValueEncoding encoding = table.encoding;
  if (threadIdx.x == 0) {
    scales = codec::chunk_scales(encoding, x, selected, k);
    codec::put_scales(body, t.body, encoding, c, scales);
  }
  __syncthreads();
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    const int pos = selected[j];
    codec::put_position<codec::AtomicBytes>(body, t.body, c, j, pos);
    const float sent =
        codec::put_value<codec::AtomicBytes>(body, t.body, encoding, c * k + j, x[pos], scales);
    float& r = residual[(pos / w) * t.padded_cols + pos % w];
    r = r + -1.0f * sent;  // compress::add_selected with alpha -1
  }
}

// ====== Decode and step ======
__global__ void decode_step_kernel(TensorTable table, const uint8_t* gathered, int64_t bucket_bytes,
                                   int replicas, float lr, float keep, cm::AdamWConstants adamw,
                                   bool use_adamw) {
  FLEXDEMO_DYNAMIC_SHARED(float, shared);
  const int64_t chunk = blockIdx.x;
  const TensorDesc& t = table.tensors[table.chunk_tensor[chunk]];
  const int64_t c = chunk - t.first_chunk;
  const int h = t.chunk_h, w = t.chunk_w, n = h * w, k = int(t.body.k);
  const Place place = place_of(t, c);
  float* X = shared;                                          // sums, then the mean coefficients
  uint32_t* count = reinterpret_cast<uint32_t*>(shared + n);  // then the inverse along the rows
  float* rows_done = shared + n;

  // 1. Per coefficient, the sum over the replicas that sent it, rank by rank, and their count.
  for (int e = threadIdx.x; e < n; e += blockDim.x) X[e] = 0.0f, count[e] = 0;
  __syncthreads();
  for (int r = 0; r < replicas; ++r) {  // positions are distinct within one replica's chunk
    const uint8_t* body = gathered + r * bucket_bytes + t.payload_offset + codec::kHeaderBytes;
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
      const int pos = int(codec::get_position(body, t.body, c, j));
      X[pos] += codec::get_value(body, t.body, table.encoding, c * k + j);
      count[pos] += 1;
    }
    __syncthreads();
  }
  for (int e = threadIdx.x; e < n; e += blockDim.x) X[e] = cm::mean_of(X[e], count[e]);
  __syncthreads();

  // 2. The inverse DCT along each axis, then the step on the parameters inside the tensor.
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    const int u = e / w, j = e % w;
    rows_done[e] = cm::inverse_dot(t.basis_cols, t.basis_cols_stride, j, X + u * w, 1, w);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    const int i = e / w, j = e % w;
    if (i >= place.valid_h || j >= place.valid_w) continue;
    const float x = cm::inverse_dot(t.basis_rows, t.basis_rows_stride, i, rows_done + j, w, h);
    const int64_t at = (place.ci * h + i) * t.cols + place.cj * w + j;
    if (use_adamw) {
      cm::adamw_step(t.param[at], t.exp_avg[at], t.exp_avg_sq[at], x, adamw);
    } else {
      t.param[at] = cm::sign_step(t.param[at], x, keep, lr);
    }
  }
}

}  // namespace
}  // namespace flexdemo::kernels::cuda
