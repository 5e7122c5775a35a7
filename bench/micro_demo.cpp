// Google Benchmark microbenchmarks of a DeMo step's parts, each fast path against its plain-path
// equivalent, on GPT-2's MLP weight (768 x 3072, 576 chunks of 64 x 64, k = 32):
//   encode         the gradient's DCT folded into the residual: the per-chunk factorised kernel
//                  against the banded GEMMs
//   select         per-chunk top-k: partial selection against a bounded heap
//   encode_select  both in one pass over the chunks (the optimizer's fast path) against the two
//                  plain ones after each other
//   pack           the top-k into the wire payload (bf16 values), then error feedback
//   decode         two replicas' payloads to per-chunk coefficient lists and the sparse inverse,
//                  against dense mean coefficients and the GEMM inverse
// Threads: --threads=N (default 1).
// After the table it prints, per part, plain / fast measured in this run.
#include "flexdemo/compress.h"
#include "flexdemo/dct.h"
#include "demo/kernels.h"
#include "flexdemo/runtime.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

using namespace flexdemo;

namespace {

struct Fixture {
  dct::ChunkPlan plan = dct::make_chunk_plan({768, 3072}, 64, dct::ChunkMode::Divisor);
  int64_t k = 32;
  at::Tensor grad = at::randn({768, 3072});
  at::Tensor residual = at::randn({768, 3072});
  at::Tensor scratch = at::empty({768 * 3072});
  at::Tensor samples = at::empty({768 * 3072});
  std::vector<uint8_t> payloads[2];
  static Fixture& get() {
    static Fixture f;
    return f;
  }
  Fixture() {
    const size_t bytes = compress::wire_payload_bytes(plan, k, compress::ValueEncoding::Bf16);
    for (auto& p : payloads) {
      compress::TopK topk = kernels::select_topk(at::randn({768, 3072}), plan, k);
      p.resize(bytes);
      compress::encode_payload(plan, topk, compress::ValueEncoding::Bf16, p.data());
    }
  }
};

void BM_encode_fast(benchmark::State& state) {
  Fixture& f = Fixture::get();
  for (auto _ : state) kernels::dct_accumulate(f.grad, f.plan, 0.999, 1e-3, f.residual);
}
void BM_encode_plain(benchmark::State& state) {
  Fixture& f = Fixture::get();
  for (auto _ : state)
    dct::chunked_dct_accumulate(f.grad, f.plan, 0.999, 1e-3, f.residual, &f.scratch);
}
// The fast path's encode and select in one pass, against the two plain ones after each other.
void BM_encode_select_fast(benchmark::State& state) {
  Fixture& f = Fixture::get();
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        kernels::dct_accumulate_topk(f.grad, f.plan, 0.999, 1e-3, f.residual, f.k));
  }
}
void BM_encode_select_plain(benchmark::State& state) {
  Fixture& f = Fixture::get();
  for (auto _ : state) {
    dct::chunked_dct_accumulate(f.grad, f.plan, 0.999, 1e-3, f.residual, &f.scratch);
    benchmark::DoNotOptimize(compress::select_topk_plain(f.residual, f.plan, f.k));
  }
}
void BM_select_fast(benchmark::State& state) {
  Fixture& f = Fixture::get();
  for (auto _ : state) benchmark::DoNotOptimize(kernels::select_topk(f.residual, f.plan, f.k));
}
void BM_select_plain(benchmark::State& state) {
  Fixture& f = Fixture::get();
  for (auto _ : state)
    benchmark::DoNotOptimize(compress::select_topk_plain(f.residual, f.plan, f.k));
}
void BM_pack(benchmark::State& state) {
  Fixture& f = Fixture::get();
  compress::TopK topk = kernels::select_topk(f.residual, f.plan, f.k);
  std::vector<uint8_t> wire(
      compress::wire_payload_bytes(f.plan, f.k, compress::ValueEncoding::Bf16));
  for (auto _ : state) {
    compress::encode_payload(f.plan, topk, compress::ValueEncoding::Bf16, wire.data());
    compress::add_selected(f.residual, f.plan, topk, -1.0f);
    compress::add_selected(f.residual, f.plan, topk, 1.0f);  // leave the residual as it was
  }
}
void decode(benchmark::State& state, bool fast) {
  Fixture& f = Fixture::get();
  const at::Tensor decoded = at::empty({768 * 3072});
  const std::vector<const uint8_t*> payloads = {f.payloads[0].data(), f.payloads[1].data()};
  const size_t size = f.payloads[0].size();
  for (auto _ : state) {
    if (fast) {
      kernels::idct_sparse(
          compress::decode_mean_sparse(payloads, size, f.plan, f.k, compress::ValueEncoding::Bf16),
          f.plan, f.samples);
    } else {
      compress::decode_mean(payloads, size, f.plan, f.k, compress::ValueEncoding::Bf16, decoded);
      dct::chunked_idct_into(decoded, f.plan, f.samples, &f.scratch);
    }
  }
}
void BM_decode_fast(benchmark::State& state) {
  decode(state, true);
}
void BM_decode_plain(benchmark::State& state) {
  decode(state, false);
}

BENCHMARK(BM_encode_plain)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_encode_fast)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_select_plain)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_encode_select_plain)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_encode_select_fast)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_select_fast)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_pack)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decode_plain)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decode_fast)->Unit(benchmark::kMicrosecond);

// The console table, and every run's time kept for the ratios.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) us[r.benchmark_name()] = r.GetAdjustedRealTime();
  }
  std::map<std::string, double> us;
};

}  // namespace

int main(int argc, char** argv) {
  flexdemo::use_native_blas(argv);  // the plain step's matmuls on the kernels the command runs
  int threads = 1;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--threads=", 0) == 0) {
      threads = std::stoi(a.substr(10));
    } else {
      rest.push_back(argv[i]);
    }
  }
  set_num_threads(threads);
  int n = int(rest.size());
  benchmark::Initialize(&n, rest.data());
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  std::printf("\nthreads %d; plain / fast, measured in this run:\n", threads);
  std::printf("(fast path kernels: %s; blas: %s)\n",
              kernels::to_string(kernels::active_isa()).c_str(), flexdemo::blas_description().c_str());
  for (const char* part : {"encode", "select", "encode_select", "decode"}) {
    const std::string fast = std::string("BM_") + part + "_fast",
                      plain = std::string("BM_") + part + "_plain";
    if (reporter.us.count(fast) && reporter.us.count(plain)) {
      std::printf("  %-14s %9.1f us / %9.1f us = %.2fx\n", part, reporter.us[plain],
                  reporter.us[fast], reporter.us[plain] / reporter.us[fast]);
    }
  }
  benchmark::Shutdown();
  return 0;
}
