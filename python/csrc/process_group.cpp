// A flexdemo communicator over a c10d ProcessGroup (process_group.h). Every collective is the
// group's own non-blocking one; the accounting follows comm.h's formulas, as the MPI and NCCL
// communicators' does, so bytes a node read the same through every door.
#include "process_group.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <numeric>
#include <stdexcept>
#include <utility>
#include <vector>

namespace flexdemo::ops {
namespace {

using c10d::ProcessGroup;

// A c10d Work; wait() completes it, then whatever the collective still has to do on the host
// (the average's division, a variable gather's copy), once.
class GroupWork final : public comm::Work {
 public:
  GroupWork(c10::intrusive_ptr<c10d::Work> work, std::shared_ptr<comm::CommStats> stats, uint64_t sent,
            uint64_t received, std::function<void()> then = {})
      : work_(std::move(work)),
        stats_(std::move(stats)),
        sent_(sent),
        received_(received),
        then_(std::move(then)) {}
  ~GroupWork() override {
    try {
      wait();
    } catch (...) {  // a destructor must not throw; the failure was the caller's to see
    }
  }

  void wait() override {
    if (done_) return;
    const auto start = std::chrono::steady_clock::now();
    try {
      work_->wait();
    } catch (const std::exception& e) {
      done_ = true;
      throw comm::CommError(std::string("torch.distributed collective: ") + e.what());
    }
    done_ = true;
    if (then_) then_();
    stats_->seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    stats_->bytes_sent += sent_;
    stats_->bytes_received += received_;
    ++stats_->collectives;
  }
  bool is_completed() override { return done_ || work_->isCompleted(); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::shared_ptr<comm::CommStats> stats_;
  uint64_t sent_, received_;
  std::function<void()> then_;
  bool done_ = false;
};

uint64_t bytes_of(const at::Tensor& t) {
  return uint64_t(t.numel()) * uint64_t(t.element_size());
}

class GroupCommunicator final : public comm::Communicator {
 public:
  GroupCommunicator(c10::intrusive_ptr<ProcessGroup> group, at::Device device)
      : group_(std::move(group)), device_(device) {}

  int rank() const override { return group_->getRank(); }
  int size() const override { return group_->getSize(); }
  at::Device device() const override { return device_; }

  std::unique_ptr<comm::Work> iall_gather(const at::Tensor& input,
                                          const at::Tensor& output) override {
    check(output.numel() == input.numel() * size(), "all-gather: output is not size() inputs");
    at::Tensor in = input, out = output;
    const uint64_t n = bytes_of(input) * uint64_t(size() - 1);
    return done(group_->_allgather_base(out, in), n, n);
  }

  // Variable sizes, as an all-to-all that sends every rank this rank's whole input (the same
  // bytes on the wire as a variable all-gather: c10d has none).
  std::unique_ptr<comm::Work> iall_gather_v(const at::Tensor& input, const at::Tensor& output,
                                            const std::vector<int64_t>& counts) override {
    check(int(counts.size()) == size(), "all-gather-v: one count per rank");
    check(counts[size_t(rank())] == input.numel(), "all-gather-v: this rank's count");
    const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t(0));
    check(output.numel() == total, "all-gather-v: output is not the counts' sum");
    at::Tensor repeated =
        input.reshape({1, input.numel()}).expand({size(), input.numel()}).contiguous();
    repeated = repeated.reshape({-1});
    std::vector<int64_t> send(size_t(size()), input.numel());
    return all_to_all(repeated, send, output, counts);
  }

  std::unique_ptr<comm::Work> iall_to_all_v(const at::Tensor& input,
                                            const std::vector<int64_t>& send_counts,
                                            const at::Tensor& output,
                                            const std::vector<int64_t>& recv_counts) override {
    return all_to_all(input, send_counts, output, recv_counts);
  }

  std::unique_ptr<comm::Work> iall_reduce(const at::Tensor& tensor, comm::ReduceOp op) override {
    std::vector<at::Tensor> tensors = {tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;  // Avg: the sum, then divided (gloo has no AVG)
    const uint64_t n = 2 * uint64_t(size() - 1) * bytes_of(tensor) / uint64_t(size());
    std::function<void()> then;
    if (op == comm::ReduceOp::Avg) {
      const int replicas = size();
      then = [tensor, replicas] { tensor.div_(replicas); };
    }
    return done(group_->allreduce(tensors, options), n, n, std::move(then));
  }

  std::unique_ptr<comm::Work> ireduce_scatter(const at::Tensor& input, const at::Tensor& output,
                                              comm::ReduceOp op) override {
    at::Tensor in = input, out = output;
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    const uint64_t n = uint64_t(size() - 1) * bytes_of(input) / uint64_t(size());
    std::function<void()> then;
    if (op == comm::ReduceOp::Avg) {
      const int replicas = size();
      then = [output, replicas] { output.div_(replicas); };
    }
    return done(group_->_reduce_scatter_base(out, in, options), n, n, std::move(then));
  }

  std::unique_ptr<comm::Work> ibroadcast(const at::Tensor& tensor, int root) override {
    std::vector<at::Tensor> tensors = {tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    const uint64_t n = bytes_of(tensor);
    return done(group_->broadcast(tensors, options), rank() == root ? n : 0,
                rank() == root ? 0 : n);
  }

  std::unique_ptr<comm::Work> ibarrier() override { return done(group_->barrier(), 0, 0); }

  std::shared_ptr<comm::Communicator> split(int, int) override {
    throw std::invalid_argument("flexdemo: a torch.distributed group is not split here; give "
                                "FlexDeMo the groups (or a DeviceMesh) instead");
  }
  std::shared_ptr<comm::Communicator> split_by_host() override { return split(0, 0); }

  comm::CommStats stats() const override { return *stats_; }
  void reset_stats() override { *stats_ = {}; }

 private:
  static void check(bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("flexdemo: process group ") + what);
  }

  std::unique_ptr<comm::Work> done(c10::intrusive_ptr<c10d::Work> work, uint64_t sent,
                                   uint64_t received, std::function<void()> then = {}) {
    return std::make_unique<GroupWork>(std::move(work), stats_, sent, received, std::move(then));
  }

  std::unique_ptr<comm::Work> all_to_all(const at::Tensor& input,
                                         const std::vector<int64_t>& send_counts,
                                         const at::Tensor& output,
                                         const std::vector<int64_t>& recv_counts) {
    check(int(send_counts.size()) == size() && int(recv_counts.size()) == size(),
          "all-to-all: one count per rank");
    at::Tensor in = input, out = output;
    std::vector<int64_t> send = send_counts, recv = recv_counts;
    uint64_t sent = 0, received = 0;
    for (int r = 0; r < size(); ++r) {
      if (r == rank()) continue;
      sent += uint64_t(send[size_t(r)]) * uint64_t(input.element_size());
      received += uint64_t(recv[size_t(r)]) * uint64_t(output.element_size());
    }
    return done(group_->alltoall_base(out, in, recv, send), sent, received);
  }

  c10::intrusive_ptr<ProcessGroup> group_;
  at::Device device_;
  std::shared_ptr<comm::CommStats> stats_ = std::make_shared<comm::CommStats>();
};

}  // namespace

std::shared_ptr<comm::Communicator> process_group_communicator(const std::string& group_name,
                                                               at::Device device) {
  return std::make_shared<GroupCommunicator>(c10d::resolve_process_group(group_name), device);
}

}  // namespace flexdemo::ops
