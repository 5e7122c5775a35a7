// NCCL backend of the Communicator (CUDA builds): one GPU per rank, bootstrapped through an MPI
// communicator over the same ranks (rank 0's unique id is broadcast over it). The communicator is
// non-blocking: its init, enqueues and collectives are polled against the collective timeout, and
// a timeout or an asynchronous error aborts it once (comm_life.h's rules: no wait and no destroy
// after an abort). Collectives run on the communicator's own stream after the caller's queued
// work; wait() blocks the host until they are done, as the MPI backend's does.
// Tensors elsewhere than this GPU are staged through it. Byte counts follow comm.h's formulas.
#include "flexdemo/comm.h"

#include "counts.h"

#include "comm/comm_life.h"

#include <ATen/ATen.h>

#include <stdexcept>
#include <string>

#if defined(FLEXDEMO_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <set>
#include <thread>
#endif

namespace flexdemo::comm {

#if defined(FLEXDEMO_CUDA)

namespace {

// ====== Errors ======
void check_nccl(ncclResult_t result, const char* call, const char* file, int line) {
  if (result == ncclSuccess) return;
  throw CommError(std::string(call) + " failed (" + file + ":" + std::to_string(line) +
                  "): " + ncclGetErrorString(result));
}
void check_cuda(cudaError_t result, const char* call, const char* file, int line) {
  if (result == cudaSuccess) return;
  throw CommError(std::string(call) + " failed (" + file + ":" + std::to_string(line) +
                  "): " + cudaGetErrorString(result));
}
#define FLEXDEMO_NCCL_CHECK(call) check_nccl((call), #call, __FILE__, __LINE__)
#define FLEXDEMO_CUDA_CHECK(call) check_cuda((call), #call, __FILE__, __LINE__)
// A collective's enqueue: in non-blocking mode it may return ncclInProgress (launch settles it).
#define FLEXDEMO_NCCL_ENQUEUE(call)                                                  \
  do {                                                                               \
    const ncclResult_t enqueued = (call);                                            \
    if (enqueued != ncclInProgress) check_nccl(enqueued, #call, __FILE__, __LINE__); \
  } while (0)

ncclDataType_t nccl_type(at::ScalarType t, bool reduction) {
  switch (t) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kInt:
      return ncclInt32;
    case at::kLong:
      return ncclInt64;
    case at::kByte:
      if (!reduction) return ncclUint8;
      [[fallthrough]];
    default:
      throw std::invalid_argument(
          std::string("NCCL collective does not support dtype ") + c10::toString(t) +
          "; accepted: float32, float64, bfloat16, int32, int64" + (reduction ? "" : ", uint8"));
  }
}

// A tensor as NCCL sees it: contiguous memory on this GPU; `user` gets the result back when it is
// not that memory itself.
struct Staged {
  at::Tensor user, device;
  bool copy_back = false;
  static Staged of(const at::Tensor& t, at::Device gpu, bool keep_contents, bool is_output) {
    Staged s{t, t, false};
    if (t.device() != gpu || !t.is_contiguous()) {
      s.device =
          keep_contents ? t.to(gpu).contiguous() : at::empty(t.sizes(), t.options().device(gpu));
      s.copy_back = is_output;
    }
    return s;
  }
};

struct SharedStats {
  std::mutex mutex;
  CommStats stats;
};

// One poll of the communicator's asynchronous state (non-blocking mode: init and enqueues may stay
// in progress; an error from any rank's side surfaces here).
detail::PollState nccl_state(ncclComm_t comm) {
  ncclResult_t async = ncclSuccess;
  const ncclResult_t queried = ncclCommGetAsyncError(comm, &async);
  if (queried != ncclSuccess) return {detail::PollState::Failed, ncclGetErrorString(queried)};
  if (async == ncclInProgress) return {detail::PollState::Pending, {}};
  if (async != ncclSuccess) {
    return {detail::PollState::Failed,
            std::string(ncclGetErrorString(async)) + " (" + ncclGetLastError(comm) + ")"};
  }
  return {detail::PollState::Done, {}};
}

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<SharedStats> stats, std::shared_ptr<detail::CommLife> life,
           ncclComm_t comm, at::Device gpu, const char* name, std::vector<Staged> outputs,
           std::vector<at::Tensor> keep, uint64_t sent, uint64_t received)
      : stats_(std::move(stats)),
        life_(std::move(life)),
        comm_(comm),
        gpu_(gpu),
        name_(name),
        outputs_(std::move(outputs)),
        keep_(std::move(keep)),
        sent_(sent),
        received_(received) {
    FLEXDEMO_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  }
  ~NcclWork() override {
    // An aborted communicator's collectives never complete: nothing to wait for (and its handle
    // is freed). The inputs' memory was recorded on the NCCL stream, so releasing it is safe.
    if (!completed_ && !life_->aborted()) {
      try {
        wait();
      } catch (...) {  // a destructor must not throw; the error was the caller's to see
      }
    }
    cudaEventDestroy(done_);
  }
  cudaEvent_t event() const { return done_; }

  void wait() override {
    if (completed_) return;
    const c10::cuda::CUDAGuard guard(gpu_);
    const double seconds =
        detail::settle(*life_, std::string("NCCL ") + name_, collective_timeout(), [&] {
          const cudaError_t state = cudaEventQuery(done_);
          if (state == cudaSuccess) return detail::PollState{detail::PollState::Done, {}};
          if (state != cudaErrorNotReady) {
            return detail::PollState{detail::PollState::Failed, cudaGetErrorString(state)};
          }
          detail::PollState comm = nccl_state(comm_);
          if (comm.kind == detail::PollState::Done) comm.kind = detail::PollState::Pending;
          return comm;
        });
    for (Staged& s : outputs_) {
      if (s.copy_back) s.user.copy_(s.device);
    }
    completed_ = true;
    std::lock_guard<std::mutex> lock(stats_->mutex);
    stats_->stats.bytes_sent += sent_;
    stats_->stats.bytes_received += received_;
    stats_->stats.seconds += seconds;
    stats_->stats.collectives += 1;
  }
  bool is_completed() override {
    return completed_ || (!life_->aborted() && cudaEventQuery(done_) == cudaSuccess);
  }

 private:
  std::shared_ptr<SharedStats> stats_;
  std::shared_ptr<detail::CommLife> life_;  // the communicator outlives its collectives
  ncclComm_t comm_;
  at::Device gpu_;
  const char* name_;
  std::vector<Staged> outputs_;
  std::vector<at::Tensor> keep_;  // inputs and outputs on the GPU, alive until done
  uint64_t sent_, received_;
  cudaEvent_t done_ = nullptr;
  bool completed_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Communicator> bootstrap, at::Device gpu)
      : bootstrap_(std::move(bootstrap)),
        gpu_(gpu),
        stats_(std::make_shared<SharedStats>()),
        stream_(c10::cuda::getStreamFromPool(false, gpu.index())) {
    if (!gpu.is_cuda()) throw std::invalid_argument("NCCL communicator: a CUDA device is needed");
    check_distinct_gpus();
    ncclUniqueId id;
    if (bootstrap_->rank() == 0) FLEXDEMO_NCCL_CHECK(ncclGetUniqueId(&id));
    at::Tensor bytes = at::empty({int64_t(sizeof(id))}, at::kByte);
    if (bootstrap_->rank() == 0) std::memcpy(bytes.data_ptr(), &id, sizeof(id));
    bootstrap_->broadcast(bytes, 0);
    std::memcpy(&id, bytes.data_ptr(), sizeof(id));
    const c10::cuda::CUDAGuard guard(gpu_);
    // Non-blocking, so that a peer that never arrives is a timeout, not a hang.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    const ncclResult_t started =
        ncclCommInitRankConfig(&comm, bootstrap_->size(), id, bootstrap_->rank(), &config);
    if (started != ncclSuccess && started != ncclInProgress) {
      if (comm != nullptr) ncclCommAbort(comm);
      check_nccl(started, "ncclCommInitRankConfig", __FILE__, __LINE__);
    }
    comm_ = comm;
    life_ = std::make_shared<detail::CommLife>([comm] { ncclCommAbort(comm); },
                                               [comm] { ncclCommDestroy(comm); });
    detail::settle(*life_, "ncclCommInitRank over " + std::to_string(bootstrap_->size()) + " ranks",
                   collective_timeout(), [comm] { return nccl_state(comm); });
  }
  // The communicator is destroyed (or not, if aborted) when the last of its collectives' handles
  // lets go of life_.
  ~NcclCommunicator() override = default;

  int rank() const override { return bootstrap_->rank(); }
  int size() const override { return bootstrap_->size(); }
  at::Device device() const override { return gpu_; }

  std::unique_ptr<Work> iall_gather(const at::Tensor& input, const at::Tensor& output) override {
    require_same(input, output, "all_gather");
    if (output.numel() != size() * input.numel()) {
      throw std::invalid_argument("all_gather: output must hold size() * input elements");
    }
    const Staged in = Staged::of(input, gpu_, true, false);
    const Staged out = Staged::of(output, gpu_, false, true);
    const uint64_t n = uint64_t(input.numel()) * input.element_size();
    return launch("all_gather", {out}, {in.device}, (size() - 1) * n, (size() - 1) * n, [&] {
      FLEXDEMO_NCCL_ENQUEUE(
          ncclAllGather(in.device.data_ptr(), out.device.data_ptr(), size_t(input.numel()),
                        nccl_type(input.scalar_type(), false), comm_, stream_.stream()));
    });
  }

  std::unique_ptr<Work> iall_gather_v(const at::Tensor& input, const at::Tensor& output,
                                      const std::vector<int64_t>& counts) override {
    require_same(input, output, "all_gather_v");
    if (int(counts.size()) != size() || counts[rank()] != input.numel()) {
      throw std::invalid_argument("all_gather_v: counts must list every rank's input size");
    }
    const Staged in = Staged::of(input, gpu_, true, false);
    const Staged out = Staged::of(output, gpu_, false, true);
    const size_t element = input.element_size();
    uint64_t others = 0;
    for (int r = 0; r < size(); ++r) others += r == rank() ? 0 : uint64_t(counts[r]) * element;
    const uint64_t mine = uint64_t(input.numel()) * element;
    return launch("all_gather_v", {out}, {in.device}, mine * (size() - 1), others, [&] {
      const ncclDataType_t type = nccl_type(input.scalar_type(), false);
      auto* base = static_cast<uint8_t*>(out.device.data_ptr());
      FLEXDEMO_NCCL_ENQUEUE(ncclGroupStart());
      int64_t offset = 0;
      for (int r = 0; r < size(); ++r) {  // one broadcast per rank into its place
        const void* send = r == rank() ? in.device.data_ptr() : nullptr;
        FLEXDEMO_NCCL_ENQUEUE(ncclBroadcast(send, base + offset * element, size_t(counts[r]), type,
                                            r, comm_, stream_.stream()));
        offset += counts[r];
      }
      FLEXDEMO_NCCL_ENQUEUE(ncclGroupEnd());
    });
  }

  std::unique_ptr<Work> iall_to_all_v(const at::Tensor& input,
                                      const std::vector<int64_t>& send_counts,
                                      const at::Tensor& output,
                                      const std::vector<int64_t>& recv_counts) override {
    const auto [sent, received] =
        detail::check_all_to_all_counts(size(), rank(), input, send_counts, output, recv_counts);
    const Staged in = Staged::of(input, gpu_, true, false);
    const Staged out = Staged::of(output, gpu_, false, true);
    const size_t element = input.element_size();
    return launch("all_to_all_v", {out}, {in.device}, sent, received, [&] {
      const ncclDataType_t type = nccl_type(input.scalar_type(), false);
      auto* send = static_cast<uint8_t*>(in.device.data_ptr());
      auto* recv = static_cast<uint8_t*>(out.device.data_ptr());
      FLEXDEMO_NCCL_ENQUEUE(ncclGroupStart());  // one send and one receive per peer, grouped
      int64_t send_at = 0, recv_at = 0;
      for (int r = 0; r < size(); ++r) {
        if (send_counts[r] > 0) {
          FLEXDEMO_NCCL_ENQUEUE(ncclSend(send + send_at * element, size_t(send_counts[r]), type, r,
                                         comm_, stream_.stream()));
        }
        if (recv_counts[r] > 0) {
          FLEXDEMO_NCCL_ENQUEUE(ncclRecv(recv + recv_at * element, size_t(recv_counts[r]), type, r,
                                         comm_, stream_.stream()));
        }
        send_at += send_counts[r];
        recv_at += recv_counts[r];
      }
      FLEXDEMO_NCCL_ENQUEUE(ncclGroupEnd());
    });
  }

  std::unique_ptr<Work> iall_reduce(const at::Tensor& tensor, ReduceOp op) override {
    const Staged t = Staged::of(tensor, gpu_, true, true);
    const uint64_t n = uint64_t(tensor.numel()) * tensor.element_size();
    const uint64_t bus = size() > 1 ? 2 * (size() - 1) * n / size() : 0;
    return launch("all_reduce", {t}, {}, bus, bus, [&] {
      FLEXDEMO_NCCL_ENQUEUE(ncclAllReduce(
          t.device.data_ptr(), t.device.data_ptr(), size_t(tensor.numel()),
          nccl_type(tensor.scalar_type(), true), nccl_op(tensor, op), comm_, stream_.stream()));
    });
  }

  std::unique_ptr<Work> ireduce_scatter(const at::Tensor& input, const at::Tensor& output,
                                        ReduceOp op) override {
    require_same(input, output, "reduce_scatter");
    if (input.numel() != size() * output.numel()) {
      throw std::invalid_argument("reduce_scatter: input must hold size() * output elements");
    }
    const Staged in = Staged::of(input, gpu_, true, false);
    const Staged out = Staged::of(output, gpu_, false, true);
    const uint64_t n = uint64_t(input.numel()) * input.element_size();
    const uint64_t bus = (size() - 1) * n / size();
    return launch("reduce_scatter", {out}, {in.device}, bus, bus, [&] {
      FLEXDEMO_NCCL_ENQUEUE(ncclReduceScatter(
          in.device.data_ptr(), out.device.data_ptr(), size_t(output.numel()),
          nccl_type(input.scalar_type(), true), nccl_op(input, op), comm_, stream_.stream()));
    });
  }

  std::unique_ptr<Work> ibroadcast(const at::Tensor& tensor, int root) override {
    if (root < 0 || root >= size()) throw std::invalid_argument("broadcast: bad root");
    const Staged t = Staged::of(tensor, gpu_, true, true);
    const uint64_t n = uint64_t(tensor.numel()) * tensor.element_size();
    return launch("broadcast", {t}, {}, rank() == root ? n : 0, rank() == root ? 0 : n, [&] {
      FLEXDEMO_NCCL_ENQUEUE(
          ncclBroadcast(t.device.data_ptr(), t.device.data_ptr(), size_t(tensor.numel()),
                        nccl_type(tensor.scalar_type(), false), root, comm_, stream_.stream()));
    });
  }

  std::unique_ptr<Work> ibarrier() override {
    const at::Tensor one = at::ones({1}, at::dtype(at::kInt).device(gpu_));
    return iall_reduce(one, ReduceOp::Sum);
  }

  std::shared_ptr<Communicator> split(int color, int key) override {
    return std::make_shared<NcclCommunicator>(bootstrap_->split(color, key), gpu_);
  }
  std::shared_ptr<Communicator> split_by_host() override {
    return std::make_shared<NcclCommunicator>(bootstrap_->split_by_host(), gpu_);
  }

  CommStats stats() const override {
    std::lock_guard<std::mutex> lock(stats_->mutex);
    return stats_->stats;
  }
  void reset_stats() override {
    std::lock_guard<std::mutex> lock(stats_->mutex);
    stats_->stats = {};
  }

 private:
  static void require_same(const at::Tensor& a, const at::Tensor& b, const char* what) {
    if (a.scalar_type() != b.scalar_type()) {
      throw std::invalid_argument(std::string(what) + ": input and output dtypes differ");
    }
  }
  static ncclRedOp_t nccl_op(const at::Tensor& t, ReduceOp op) {
    if (op == ReduceOp::Avg && !at::isFloatingType(t.scalar_type())) {
      throw std::invalid_argument("Avg reduces floating tensors only");
    }
    return op == ReduceOp::Sum ? ncclSum : ncclAvg;
  }

  // NCCL cannot put two ranks of one communicator on the same GPU: say so before it fails.
  void check_distinct_gpus() {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    const int64_t host_hash = int64_t(std::hash<std::string>()(host) & 0x7fffffffffffffffull);
    at::Tensor mine = at::tensor({host_hash, int64_t(gpu_.index())}, at::kLong);
    at::Tensor all = at::empty({2 * bootstrap_->size()}, at::kLong);
    bootstrap_->all_gather(mine, all);
    std::set<std::pair<int64_t, int64_t>> seen;
    for (int r = 0; r < bootstrap_->size(); ++r) {
      if (!seen.insert({all[2 * r].item<int64_t>(), all[2 * r + 1].item<int64_t>()}).second) {
        throw std::invalid_argument(
            "NCCL cannot put two ranks of one communicator on the same GPU: ranks share GPU " +
            std::to_string(all[2 * r + 1].item<int64_t>()) +
            " (one rank per GPU, or --intra-backend/--inter-backend mpi)");
      }
    }
  }

  // Runs `enqueue` on the communicator's stream after the caller's queued work; the returned
  // Work completes when it is done. The tensors it uses are recorded on that stream, so the
  // caching allocator does not hand their memory out again before the collective is done with
  // it, even if the caller drops them (or the Work, after an abort).
  template <typename Enqueue>
  std::unique_ptr<Work> launch(const char* name, std::vector<Staged> outputs,
                               std::vector<at::Tensor> keep, uint64_t sent, uint64_t received,
                               Enqueue&& enqueue) {
    const std::string what = std::string("NCCL ") + name;
    life_->throw_if_aborted(what);
    const c10::cuda::CUDAGuard guard(gpu_);
    cudaEvent_t ready;
    FLEXDEMO_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    FLEXDEMO_CUDA_CHECK(cudaEventRecord(ready, c10::cuda::getCurrentCUDAStream(gpu_.index())));
    FLEXDEMO_CUDA_CHECK(cudaStreamWaitEvent(stream_.stream(), ready, 0));
    cudaEventDestroy(ready);
    for (const Staged& s : outputs) keep.push_back(s.device);
    for (const at::Tensor& t : keep) {
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
    }
    auto work = std::make_unique<NcclWork>(stats_, life_, comm_, gpu_, name, std::move(outputs),
                                           std::move(keep), sent, received);
    enqueue();
    // Non-blocking mode: the enqueue may still be in progress; it must be done before the event
    // that marks the collective's end is recorded behind it.
    detail::settle(*life_, what + " (enqueue)", collective_timeout(),
                   [this] { return nccl_state(comm_); });
    FLEXDEMO_CUDA_CHECK(cudaEventRecord(work->event(), stream_.stream()));
    return work;
  }

  std::shared_ptr<Communicator> bootstrap_;
  at::Device gpu_;
  std::shared_ptr<SharedStats> stats_;
  c10::cuda::CUDAStream stream_;
  ncclComm_t comm_ = nullptr;
  std::shared_ptr<detail::CommLife> life_;  // abort once, never destroy after an abort
};

}  // namespace

bool nccl_built() {
  return true;
}

std::shared_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap,
                                                     at::Device gpu) {
  return std::make_shared<NcclCommunicator>(std::move(bootstrap), gpu);
}

#else  // without CUDA

bool nccl_built() {
  return false;
}

std::shared_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator>, at::Device) {
  throw std::invalid_argument(
      "NCCL needs a CUDA build of flexdemo (scripts/build.sh --cuda) and a GPU per rank");
}

#endif

}  // namespace flexdemo::comm
