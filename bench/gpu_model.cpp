// `flexdemo-gpu-model`: the DeMo step's time on an H100 or H200, predicted before a GPU is lent. The CUDA
// kernels (cuda_kernels.cuh, unchanged) run under the CPU emulation on GPT-2 small's chunk grid
// (one sampled chunk or two per distinct tensor shape, weighted by its chunks), which records
// every traced access and multiply-add (tests/cuda_emulation.h): per kernel the warp FMA
// instructions, the shared-memory wavefronts (bank conflicts included), the global sectors per
// warp request, and the DRAM bytes each kernel must move. Each becomes a time at the GPU's
// rates; a kernel takes the longest of them (a roofline), plus its launch. The payloads' checksums
// and the screening of the received payloads are kernels too (seal, validate: checksums,
// positions, finite values and each payload's sum of squares). The host's part is measured here:
// the screening's verdict copied back and its scale check, and the tensor table's uploads.
//   flexdemo-gpu-model [--gpu h100|h200] [--scale 1] [--topk 32] [--chunk 64] [--values bf16]
//                      [--replicas 1] [--json FILE]
#include "emulated_gpu_step.h"  // first: the CUDA words the kernels use

#include "demo/kernels.h"
#include "demo/screen.h"
#include "flexdemo/names.h"

#include <ATen/Parallel.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

using namespace flexdemo;
using cuda_emulation::Counts;

namespace {

// The H100 and H200 (SXM): 132 SMs at 1.98 GHz; per SM and clock 4 warp FMA instructions (128
// lanes) and 128 bytes through the shared-memory/L1 pipe (one wavefront, or four 32-byte sectors);
// a launch about 4 us. DRAM: the H200 at the 4.3 TB/s a copy reached on a lent machine (4.8 TB/s
// peak), the H100 at 3.0 TB/s (3.35 peak; not measured here). Host <-> device copies at 25 GB/s
// (PCIe 5 x16 carries 64 GB/s each way at most; not measured here).
constexpr double kSms = 132, kClock = 1.98e9, kLaunch = 4e-6, kCopy = 25e9;
double dram_rate(const std::string& gpu) {
  return gpu == "h200" ? 4.3e12 : 3.0e12;
}
double kDram = 3.0e12;  // the chosen GPU's (main sets it)

struct Shape {
  std::vector<int64_t> dims;
  int tensors = 0;  // how many of GPT-2 small's tensors have it
};

// GPT-2 small (vocab 50304, width 768, context 1024, 12 layers): 124M parameters.
std::vector<Shape> gpt2_shapes(double scale) {
  const int64_t vocab = std::llround(50304 * scale), d = std::llround(768 * scale);
  const int64_t context = std::llround(1024 * scale);
  const int layers = std::max(1, int(12 * scale));
  std::map<std::vector<int64_t>, int> count;
  count[{vocab, d}] += 1;
  count[{context, d}] += 1;
  for (int l = 0; l < layers; ++l) {
    for (const std::vector<int64_t>& s : std::vector<std::vector<int64_t>>{{d},
                                                                           {d},
                                                                           {3 * d, d},
                                                                           {3 * d},
                                                                           {d, d},
                                                                           {d},
                                                                           {d},
                                                                           {d},
                                                                           {4 * d, d},
                                                                           {4 * d},
                                                                           {d, 4 * d},
                                                                           {d}}) {
      count[s] += 1;
    }
  }
  count[{d}] += 2;
  std::vector<Shape> shapes;
  for (const auto& [dims, n] : count) shapes.push_back({dims, n});
  return shapes;
}

// Per SM (Hopper): 228 KB of shared memory (1 KB of it reserved for each block), 2,048 threads,
// 65,536 registers (a warp's allocated in units of 256), 32 blocks. A barrier interval takes at
// least kBarrierCycles on a block's critical path (the barrier, then a dependent shared-memory
// access: assumed, about twice the ~30-cycle shared latency; not measured).
constexpr double kSmShared = 228 * 1024, kBarrierCycles = 60;

struct Kernel {
  std::string name;
  Counts counts;
  double dram_bytes = 0;
  int launches = 1;  // the kernels of this phase, one after another on the stream
  // Its busiest kernel's registers a thread (ptxas -v, nvcc 13.0, sm_90; the check's build log
  // prints them on the machine) and shared memory a block (dynamic and static).
  int registers = 32;
  double shared_bytes = 0;

  // Blocks one SM holds at once: what its threads, registers, shared memory and block slots
  // allow.
  int resident() const {
    const int threads = kernels::cuda::kThreads;
    const int warp_registers = (registers * 32 + 255) / 256 * 256;
    const int by_registers = 65536 / (warp_registers * (threads / 32));
    const int by_shared = int(kSmShared / (shared_bytes + 1024));
    return std::max(1, std::min({2048 / threads, by_registers, by_shared, 32}));
  }
  double occupancy() const {  // resident warps over the SM's 64
    return double(resident()) * kernels::cuda::kThreads / 32 / 64;
  }
  double waves() const { return counts.blocks / (kSms * resident()); }
  // The rates below hold for full waves: a last partial wave leaves SMs idle (a grid of fewer
  // blocks than SMs, most of them).
  double tail() const {
    const double w = waves();
    if (w >= 1) return std::ceil(w) / w;
    return counts.blocks > 0 && counts.blocks < kSms ? kSms / counts.blocks : 1.0;
  }
  // Issue: every traced warp instruction (multiply-adds, shared and global accesses; not the
  // index arithmetic and control flow around them, which ncu's count on a GPU gives), 4 a clock
  // per SM.
  double t_issue() const {
    return (counts.fma_instructions + counts.shared_requests + counts.global_requests) /
           (4 * kSms * kClock);
  }
  double t_lsu() const {
    return (counts.shared_wavefronts + counts.global_sectors / 4) / (kSms * kClock);
  }
  double t_dram() const { return dram_bytes / kDram; }
  // Latency: each wave's blocks pass their barriers one interval after another.
  double t_latency() const {
    if (counts.blocks <= 0) return 0.0;
    return std::ceil(std::max(1.0, waves())) * (counts.barriers / counts.blocks) * kBarrierCycles /
           kClock;
  }
  double predicted() const {
    return std::max(std::max({t_issue(), t_lsu(), t_dram()}) * tail(), t_latency()) +
           launches * kLaunch;
  }
  nlohmann::json json() const {
    return {{"fma_instructions", counts.fma_instructions},
            {"shared_requests", counts.shared_requests},
            {"shared_wavefronts", counts.shared_wavefronts},
            {"global_requests", counts.global_requests},
            {"global_sectors", counts.global_sectors},
            {"blocks", counts.blocks},
            {"barriers_per_block", counts.blocks > 0 ? counts.barriers / counts.blocks : 0.0},
            {"dram_bytes", dram_bytes},
            {"registers", registers},
            {"shared_bytes_per_block", shared_bytes},
            {"resident_blocks_per_sm", resident()},
            {"occupancy", occupancy()},
            {"waves", waves()},
            {"issue_ms", t_issue() * 1e3},
            {"lsu_ms", t_lsu() * 1e3},
            {"dram_ms", t_dram() * 1e3},
            {"latency_ms", t_latency() * 1e3},
            {"tail_factor", tail()},
            {"launches", launches},
            {"predicted_ms", predicted() * 1e3}};
  }
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The DeMo step's H100 or H200 time predicted from the CUDA kernels under the CPU "
               "emulation, and the host's part measured here"};
  std::string gpu = "h100";
  double scale = 1.0;
  int64_t topk = 32, chunk = 64;
  int replicas = 1;
  std::string values = "bf16", json_path;
  app.add_option("--scale", scale, "GPT-2 small's shapes scaled by this")
      ->check(CLI::Range(0.01, 1.0));
  app.add_option("--topk", topk, "coefficients kept per chunk")->check(CLI::Range(1, 16384));
  app.add_option("--chunk", chunk, "target chunk edge (divisor mode)")->check(CLI::Range(1, 128));
  app.add_option("--values", values, "wire encoding of the values")
      ->check(CLI::IsMember(names_of<compress::ValueEncoding>()));
  app.add_option("--replicas", replicas, "replicas whose payloads are decoded")
      ->check(CLI::Range(1, 1024));
  app.add_option("--json", json_path, "also write the model to this file");
  app.add_option("--gpu", gpu, "the GPU whose rates the model takes")
      ->check(CLI::IsMember({"h100", "h200"}));
  CLI11_PARSE(app, argc, argv);
  kDram = dram_rate(gpu);
  const auto encoding = parse_name<compress::ValueEncoding>(values);

  const std::vector<Shape> shapes = gpt2_shapes(scale);
  std::vector<dct::ChunkPlan> plans;
  int64_t params = 0;
  for (const Shape& s : shapes) {
    plans.push_back(dct::make_chunk_plan(s.dims, chunk, dct::ChunkMode::Divisor));
    params += plans.back().numel() * s.tensors;
  }
  const cuda_emulation::EmulatedGpuStep step(plans, topk, encoding, kernels::cuda::kThreads);

  at::manual_seed(0);
  std::vector<at::Tensor> grads, residuals, weights;
  for (const dct::ChunkPlan& plan : plans) {
    grads.push_back(at::randn({plan.rows, plan.cols}) * 1e-3);
    residuals.push_back(at::zeros({plan.padded_numel()}));
    weights.push_back(at::randn({plan.rows, plan.cols}) * 0.02);
  }
  at::Tensor send = at::empty({int64_t(step.bytes())}, at::kByte);

  // Sampled chunks: the first and the middle one of each shape, weighted to all its chunks.
  Kernel encode, seal, validate, decode;
  encode.name = "encode";
  seal.name = "seal";
  validate.name = "validate";  // the screening: checksums (2 kernels), chunks, sums
  validate.launches = 4;
  seal.launches = 2;
  decode.name = "decode_step";
  encode.registers = 60, encode.shared_bytes = 4.0 * double(step.layout().encode_shared_floats) + 2080;
  decode.registers = 56, decode.shared_bytes = 4.0 * double(step.layout().decode_shared_floats) + 1024;
  validate.registers = 56, validate.shared_bytes = 3072;  // the chunks' kernel; crc_finish's
  seal.registers = 32, seal.shared_bytes = 3072;
  const auto start = std::chrono::steady_clock::now();
  double bucket_bytes = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const kernels::cuda::TensorDesc& d = step.layout().tensors[i];
    const int64_t chunks = plans[i].num_chunks();
    std::vector<unsigned> blocks = {unsigned(d.first_chunk)};
    if (chunks > 2) blocks.push_back(unsigned(d.first_chunk + chunks / 2));
    const double weight = double(shapes[i].tensors) * double(chunks) / double(blocks.size());
    Counts counts;
    step.encode(grads, residuals, 0.0, 1.0, send, &blocks, &counts);
    encode.counts.add(counts, weight);
    at::Tensor gathered = send.repeat({replicas});
    counts = Counts{};
    step.decode_step(gathered, replicas, weights, {}, {}, kernels::AdamWHyper{}, &blocks, &counts);
    decode.counts.add(counts, weight);
    const double n = double(shapes[i].tensors);
    const double payload = double(step.layout().payload_bytes[i]) * n;
    bucket_bytes += payload;
    // What each kernel must move through DRAM: the gradient read, the residual read and written,
    // the payload written; the replicas' payloads read, the parameters read and written.
    encode.dram_bytes +=
        n * (4.0 * double(plans[i].numel()) + 8.0 * double(plans[i].padded_numel())) + payload;
    decode.dram_bytes += n * 8.0 * double(plans[i].numel()) + replicas * payload;
    // The checksums read the payloads again (sealing one bucket, validating every replica's).
    seal.dram_bytes += payload;
    validate.dram_bytes += replicas * payload;
  }
  // The checksums over the whole bucket of distinct shapes, weighted to GPT-2's tensors; the
  // positions' check sampled as above (replica 0's; the others' are alike).
  {
    const double per_shape_copies = double(bucket_bytes) / double(step.bytes());
    const at::Tensor gathered = send.repeat({replicas});
    Counts counts;
    step.seal_on_device(send, &counts);
    seal.counts.add(counts, per_shape_copies);
    // The screening: the checksums, then a thread per (replica, chunk) and a block per
    // (replica, tensor), over the distinct shapes' bucket, weighted as the checksums are.
    counts = Counts{};
    std::vector<uint32_t> errors = step.check_checksums(gathered, replicas, &counts);
    const std::vector<double> chunk_squares =
        step.screen_chunks(gathered, replicas, errors, nullptr, &counts);
    step.screen_sums(chunk_squares, replicas, &counts);
    // (Only the sampled chunks were encoded: the others' positions fail, which changes no
    // traced access.)
    validate.counts.add(counts, per_shape_copies);
  }
  const double emulated_s = seconds_since(start);
  // The host's part, measured: what the CUDA path does on the host each step once the kernels
  // screen the gathered bucket (GpuStep::screen_on_device, CudaBackend::screen): the verdict
  // (12 bytes a replica and tensor) copied back at kCopy after a wait of about a launch, the
  // scale check over it (demo::add_out_of_scale per tensor), and the tensor table with the step's
  // pointers copied for each of the two uploads (encode, decode) at kCopy after a host memcpy.
  // The host's times are the fastest of 9 on this CPU's one thread (the least disturbed).
  const size_t tensor_count = [&] {
    size_t n = 0;
    for (const Shape& sh : shapes) n += size_t(sh.tensors);
    return n;
  }();
  double check_s = 0, upload_s = 0;
  {
    at::set_num_threads(1);
    std::vector<double> squares(size_t(replicas) * tensor_count);
    for (size_t e = 0; e < squares.size(); ++e) squares[e] = 1.0 + double(e % 7) * 1e-3;
    const std::vector<kernels::cuda::TensorDesc> descs(tensor_count, step.layout().tensors[0]);
    std::vector<kernels::cuda::TensorDesc> pinned(tensor_count);
    std::vector<double> check_times, upload_times;
    for (int rep = 0; rep < 9; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      std::vector<optim::PeerFault> found;
      std::vector<double> norms(static_cast<size_t>(replicas));
      const std::vector<char> judged(static_cast<size_t>(replicas), 1);
      for (size_t i = 0; i < tensor_count; ++i) {
        for (int r = 0; r < replicas; ++r) norms[r] = std::sqrt(squares[r * tensor_count + i]);
        demo::add_out_of_scale(norms, judged, i, 4.0, found);
      }
      check_times.push_back(seconds_since(t0));
      if (!found.empty()) throw std::logic_error("gpu-model: the scale check left a replica out");
      t0 = std::chrono::steady_clock::now();
      std::memcpy(pinned.data(), descs.data(), descs.size() * sizeof(descs[0]));
      upload_times.push_back(seconds_since(t0));
    }
    check_s = *std::min_element(check_times.begin(), check_times.end());
    upload_s = *std::min_element(upload_times.begin(), upload_times.end());
  }
  const double verdict_bytes = 12.0 * double(replicas) * double(tensor_count);
  const double table_bytes = double(tensor_count * sizeof(kernels::cuda::TensorDesc));
  const double verdict_s = kLaunch + verdict_bytes / kCopy;
  const double uploads_s = 2 * (upload_s + table_bytes / kCopy);
  const double host_s = verdict_s + check_s + uploads_s;

  double kernels_s = 0;
  for (const Kernel* k : {&encode, &seal, &validate, &decode}) kernels_s += k->predicted();
  std::printf(
      "GPT-2 small x %.2f: %lld parameters, %zu distinct shapes, chunk %lld, top-k %lld, %s, %d "
      "replica(s); bucket %.2f MB\n",
      scale, (long long)params, shapes.size(), (long long)chunk, (long long)topk, values.c_str(),
      replicas, bucket_bytes / 1e6);
  std::printf("%-12s %9s %9s %9s %8s %6s %6s %7s %7s %7s %7s %6s %10s\n", "kernel", "FMA Ginst",
              "shd Mwave", "glb Msect", "DRAM MB", "waves", "occup", "issue", "lsu", "dram",
              "latency", "tail", "predicted");
  for (const Kernel* k : {&encode, &seal, &validate, &decode}) {
    std::printf("%-12s %9.3f %9.2f %9.2f %8.1f %6.1f %5.0f%% %7.3f %7.3f %7.3f %7.3f %6.3f %7.3f ms\n",
                k->name.c_str(), k->counts.fma_instructions / 1e9,
                k->counts.shared_wavefronts / 1e6, k->counts.global_sectors / 1e6,
                k->dram_bytes / 1e6, k->waves(), 100 * k->occupancy(), k->t_issue() * 1e3,
                k->t_lsu() * 1e3, k->t_dram() * 1e3, k->t_latency() * 1e3, k->tail(),
                k->predicted() * 1e3);
  }
  std::printf("kernels: %.3f ms predicted on an %s; host: %.3f ms (the screening's verdict, %.0f "
              "bytes, waited for and copied back %.3f ms; its scale check %.4f ms, the fastest of "
              "9 here on one thread; the tensor table's two uploads %.3f ms, copies at %.0f GB/s "
              "assumed)\n",
              kernels_s * 1e3, gpu == "h200" ? "H200" : "H100", host_s * 1e3, verdict_bytes,
              verdict_s * 1e3, check_s * 1e3, uploads_s * 1e3, kCopy / 1e9);
  std::printf("demo step: %.3f ms predicted (kernels + host), emulated in %.0f s\n",
              (kernels_s + host_s) * 1e3, emulated_s);
  if (!json_path.empty()) {
    nlohmann::json report = {{"params", params},
                             {"scale", scale},
                             {"topk", topk},
                             {"chunk", chunk},
                             {"values", values},
                             {"replicas", replicas},
                             {"bucket_bytes", bucket_bytes},
                             {"encode", encode.json()},
                             {"seal", seal.json()},
                             {"validate", validate.json()},
                             {"decode_step", decode.json()},
                             {"kernels_ms", kernels_s * 1e3},
                             {"gpu", gpu},
                             {"dram_tb_s", kDram / 1e12},
                             {"host_ms", host_s * 1e3},
                             {"host_verdict_ms", verdict_s * 1e3},
                             {"host_scale_check_ms", check_s * 1e3},
                             {"host_uploads_ms", uploads_s * 1e3},
                             {"host_share", host_s / (kernels_s + host_s)},
                             {"demo_step_ms", (kernels_s + host_s) * 1e3}};
    std::ofstream(json_path) << report.dump(2) << "\n";
  }
  return 0;
}
