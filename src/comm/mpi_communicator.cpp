// MPI backend of the Communicator: non-blocking MPI collectives, host staging for tensors on
// other devices, byte/time accounting, and MPI errors turned into CommError (never an abort).
#include "flexdemo/comm.h"

#include "counts.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <mutex>
#include <sstream>
#include <thread>

#include <stdlib.h>  // mkdtemp, setenv

namespace flexdemo::comm {

namespace {
std::atomic<double> g_timeout_s{0.0};
}  // namespace

void set_collective_timeout(double seconds) {
  if (!(seconds >= 0)) {
    throw std::invalid_argument("collective timeout must be >= 0 seconds (0: none), got " +
                                std::to_string(seconds));
  }
  g_timeout_s = seconds;
}
double collective_timeout() {
  return g_timeout_s;
}

namespace {

// ====== Errors ======
void check_mpi(int code, const char* call, const char* file, int line) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  std::ostringstream msg;
  msg << call << " failed (" << file << ":" << line << "): " << std::string(text, length);
  throw CommError(msg.str());
}
#define FLEXDEMO_MPI_CHECK(call) check_mpi((call), #call, __FILE__, __LINE__)

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

// ====== bfloat16 reduction ======
// MPI has no bfloat16: a 2-byte contiguous type and a user sum that adds in float and rounds.
MPI_Datatype g_bf16_type = MPI_DATATYPE_NULL;
MPI_Op g_bf16_sum = MPI_OP_NULL;

void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const c10::BFloat16*>(in);
  auto* b = static_cast<c10::BFloat16*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = c10::BFloat16(float(a[i]) + float(b[i]));
}

MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return MPI_FLOAT;
    case at::kDouble:
      return MPI_DOUBLE;
    case at::kInt:
      return MPI_INT32_T;
    case at::kLong:
      return MPI_INT64_T;
    case at::kBFloat16:
      return g_bf16_type;
    default:
      throw std::invalid_argument(std::string("all-reduce does not support dtype ") +
                                  c10::toString(t) +
                                  "; accepted: float32, float64, bfloat16, int32, int64");
  }
}

int checked_count(int64_t n, const char* what) {
  require(n >= 0 && n <= INT_MAX, std::string(what) + " of " + std::to_string(n) +
                                      " elements exceeds MPI's int count limit");
  return static_cast<int>(n);
}

// A tensor as MPI sees it: contiguous host memory. `user` gets the result back on completion
// when it is not that memory itself (another device, or not contiguous).
struct Staged {
  at::Tensor user;
  at::Tensor host;
  bool copy_back = false;

  static Staged input(const at::Tensor& t) {
    Staged s{t, t, false};
    if (!t.is_cpu() || !t.is_contiguous()) s.host = t.to(at::kCPU).contiguous();
    return s;
  }
  static Staged output(const at::Tensor& t, bool keep_contents) {
    Staged s{t, t, false};
    if (!t.is_cpu() || !t.is_contiguous()) {
      s.host = keep_contents ? t.to(at::kCPU).contiguous()
                             : at::empty(t.sizes(), t.options().device(at::kCPU));
      s.copy_back = true;
    }
    return s;
  }
  void* data() const { return host.data_ptr(); }
};

struct SharedStats {
  std::mutex mutex;
  CommStats stats;
};

using Clock = std::chrono::steady_clock;

class MpiWork final : public Work {
 public:
  MpiWork(std::shared_ptr<SharedStats> stats, const char* name, int group_size, uint64_t bytes_sent,
          uint64_t bytes_received)
      : stats_(std::move(stats)),
        name_(name),
        group_size_(group_size),
        sent_(bytes_sent),
        received_(bytes_received),
        unwinding_(std::uncaught_exceptions()) {}
  ~MpiWork() override {
    // While an exception unwinds the stack (or after a timeout) the collective may never
    // complete: the job is being aborted, so do not wait for it.
    if (done_ || failed_ || std::uncaught_exceptions() > unwinding_) return;
    try {
      wait();
    } catch (...) {  // cannot throw from a destructor; the next collective reports it
    }
  }

  // Polls instead of MPI_Wait: with a deadline a dead or hung rank becomes an error, and
  // yielding the core lets oversubscribed ranks (more ranks than cores) make progress.
  void wait() override {
    if (done_) return;
    const double timeout = collective_timeout();
    const auto begin = Clock::now();
    for (;;) {
      int flag = 0;
      FLEXDEMO_MPI_CHECK(MPI_Test(&request_, &flag, MPI_STATUS_IGNORE));
      if (flag) break;
      const double waited = std::chrono::duration<double>(Clock::now() - begin).count();
      if (timeout > 0 && waited > timeout) {
        failed_ = true;
        std::ostringstream msg;
        msg << name_ << " over " << group_size_ << " ranks has not completed in " << timeout
            << " s: a rank has died or hangs, or the network is down";
        throw CommError(msg.str());
      }
      if (waited < 1e-3) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    finish(std::chrono::duration<double>(Clock::now() - begin).count());
  }
  bool is_completed() override {
    if (done_) return true;
    int flag = 0;
    FLEXDEMO_MPI_CHECK(MPI_Test(&request_, &flag, MPI_STATUS_IGNORE));
    if (flag) finish(0.0);
    return done_;
  }

  MPI_Request request_ = MPI_REQUEST_NULL;
  std::vector<Staged> outputs_;                 // copied back to the user's tensors at completion
  std::vector<at::Tensor> keep_alive_;          // inputs MPI reads until completion
  std::vector<int> counts_, displs_;            // argument arrays MPI reads until completion
  std::vector<int> recv_counts_, recv_displs_;  // all_to_all_v's second pair
  double divide_by_ = 1.0;                      // Avg: divide the outputs after the sum

 private:
  // blocked_s: how long this rank waited for the completion (a collective overlapped with
  // computation costs only what remains when it is waited for).
  void finish(double blocked_s) {
    done_ = true;
    for (auto& o : outputs_) {
      if (divide_by_ != 1.0) o.host.div_(divide_by_);
      if (o.copy_back) o.user.copy_(o.host);
    }
    std::lock_guard<std::mutex> lock(stats_->mutex);
    stats_->stats.bytes_sent += sent_;
    stats_->stats.bytes_received += received_;
    stats_->stats.seconds += blocked_s;
    stats_->stats.collectives += 1;
  }

  std::shared_ptr<SharedStats> stats_;
  const char* name_;  // the collective, for errors
  int group_size_;
  uint64_t sent_, received_;
  int unwinding_;  // exceptions in flight when the collective started
  bool done_ = false, failed_ = false;
};

uint64_t nbytes(const at::Tensor& t) {
  return uint64_t(t.numel()) * t.element_size();
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm, bool owns) : comm_(comm), owns_(owns) {
    FLEXDEMO_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    FLEXDEMO_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    FLEXDEMO_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_ && !finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  std::unique_ptr<Work> iall_gather(const at::Tensor& input, const at::Tensor& output) override {
    require(output.numel() == size_ * input.numel() && output.dtype() == input.dtype(),
            "all_gather: output must have size() * input.numel() = " +
                std::to_string(size_ * input.numel()) + " elements of the input's dtype, got " +
                std::to_string(output.numel()));
    const uint64_t n = nbytes(input);
    auto work = make_work("all_gather", (size_ - 1) * n, (size_ - 1) * n);
    Staged in = Staged::input(input), out = Staged::output(output, false);
    const int count = checked_count(int64_t(n), "all_gather");
    FLEXDEMO_MPI_CHECK(MPI_Iallgather(in.data(), count, MPI_BYTE, out.data(), count, MPI_BYTE,
                                      comm_, &work->request_));
    work->keep_alive_.push_back(in.host);
    work->outputs_.push_back(out);
    return work;
  }

  std::unique_ptr<Work> iall_gather_v(const at::Tensor& input, const at::Tensor& output,
                                      const std::vector<int64_t>& counts) override {
    require(int(counts.size()) == size_, "all_gather_v: need one count per rank (" +
                                             std::to_string(size_) + "), got " +
                                             std::to_string(counts.size()));
    require(counts[rank_] == input.numel(),
            "all_gather_v: counts[rank] = " + std::to_string(counts[rank_]) +
                " does not match the input's " + std::to_string(input.numel()) + " elements");
    const int64_t elem = input.element_size();
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    require(output.numel() == total && output.dtype() == input.dtype(),
            "all_gather_v: output must have sum(counts) = " + std::to_string(total) +
                " elements of the input's dtype, got " + std::to_string(output.numel()));
    const uint64_t received = uint64_t(total - counts[rank_]) * elem;
    auto work = make_work("all_gather_v", (size_ - 1) * nbytes(input), received);
    int64_t offset = 0;
    for (int64_t c : counts) {
      work->counts_.push_back(checked_count(c * elem, "all_gather_v"));
      work->displs_.push_back(checked_count(offset * elem, "all_gather_v offset"));
      offset += c;
    }
    Staged in = Staged::input(input), out = Staged::output(output, false);
    FLEXDEMO_MPI_CHECK(MPI_Iallgatherv(in.data(), work->counts_[rank_], MPI_BYTE, out.data(),
                                       work->counts_.data(), work->displs_.data(), MPI_BYTE, comm_,
                                       &work->request_));
    work->keep_alive_.push_back(in.host);
    work->outputs_.push_back(out);
    return work;
  }

  std::unique_ptr<Work> iall_to_all_v(const at::Tensor& input,
                                      const std::vector<int64_t>& send_counts,
                                      const at::Tensor& output,
                                      const std::vector<int64_t>& recv_counts) override {
    const auto [sent, received] =
        detail::check_all_to_all_counts(size_, rank_, input, send_counts, output, recv_counts);
    auto work = make_work("all_to_all_v", sent, received);
    const int64_t elem = input.element_size();
    auto place = [elem](const std::vector<int64_t>& counts, std::vector<int>& c,
                        std::vector<int>& d) {
      int64_t offset = 0;
      for (int64_t n : counts) {
        c.push_back(checked_count(n * elem, "all_to_all_v"));
        d.push_back(checked_count(offset * elem, "all_to_all_v offset"));
        offset += n;
      }
    };
    place(send_counts, work->counts_, work->displs_);
    place(recv_counts, work->recv_counts_, work->recv_displs_);
    Staged in = Staged::input(input), out = Staged::output(output, false);
    FLEXDEMO_MPI_CHECK(MPI_Ialltoallv(in.data(), work->counts_.data(), work->displs_.data(),
                                      MPI_BYTE, out.data(), work->recv_counts_.data(),
                                      work->recv_displs_.data(), MPI_BYTE, comm_, &work->request_));
    work->keep_alive_.push_back(in.host);
    work->outputs_.push_back(out);
    return work;
  }

  std::unique_ptr<Work> iall_reduce(const at::Tensor& tensor, ReduceOp op) override {
    const MPI_Datatype type = mpi_type(tensor.scalar_type());
    require(op == ReduceOp::Sum || at::isFloatingType(tensor.scalar_type()),
            "all_reduce: Avg needs a floating dtype, got " +
                std::string(c10::toString(tensor.scalar_type())));
    const uint64_t ring = 2 * (size_ - 1) * nbytes(tensor) / size_;
    auto work = make_work("all_reduce", ring, ring);
    Staged io = Staged::output(tensor, true);
    const MPI_Op mpi_op = tensor.scalar_type() == at::kBFloat16 ? g_bf16_sum : MPI_SUM;
    FLEXDEMO_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, io.data(),
                                      checked_count(tensor.numel(), "all_reduce"), type, mpi_op,
                                      comm_, &work->request_));
    if (op == ReduceOp::Avg) work->divide_by_ = size_;
    work->outputs_.push_back(io);
    return work;
  }

  std::unique_ptr<Work> ireduce_scatter(const at::Tensor& input, const at::Tensor& output,
                                        ReduceOp op) override {
    const MPI_Datatype type = mpi_type(input.scalar_type());
    require(input.numel() == size_ * output.numel() && output.dtype() == input.dtype(),
            "reduce_scatter: input must have size() * output.numel() = " +
                std::to_string(size_ * output.numel()) + " elements of the output's dtype, got " +
                std::to_string(input.numel()));
    require(op == ReduceOp::Sum || at::isFloatingType(input.scalar_type()),
            "reduce_scatter: Avg needs a floating dtype");
    const uint64_t ring = (size_ - 1) * nbytes(input) / size_;
    auto work = make_work("reduce_scatter", ring, ring);
    Staged in = Staged::input(input), out = Staged::output(output, false);
    const MPI_Op mpi_op = input.scalar_type() == at::kBFloat16 ? g_bf16_sum : MPI_SUM;
    FLEXDEMO_MPI_CHECK(MPI_Ireduce_scatter_block(in.data(), out.data(),
                                                 checked_count(output.numel(), "reduce_scatter"),
                                                 type, mpi_op, comm_, &work->request_));
    if (op == ReduceOp::Avg) work->divide_by_ = size_;
    work->keep_alive_.push_back(in.host);
    work->outputs_.push_back(out);
    return work;
  }

  std::unique_ptr<Work> ibroadcast(const at::Tensor& tensor, int root) override {
    const uint64_t n = nbytes(tensor);
    auto work = make_work("broadcast", rank_ == root ? n : 0, rank_ == root ? 0 : n);
    Staged io = Staged::output(tensor, rank_ == root);
    FLEXDEMO_MPI_CHECK(MPI_Ibcast(io.data(), checked_count(int64_t(n), "broadcast"), MPI_BYTE, root,
                                  comm_, &work->request_));
    work->outputs_.push_back(io);
    return work;
  }

  std::unique_ptr<Work> ibarrier() override {
    auto work = make_work("barrier", 0, 0);
    FLEXDEMO_MPI_CHECK(MPI_Ibarrier(comm_, &work->request_));
    return work;
  }

  std::shared_ptr<Communicator> split(int color, int key) override {
    MPI_Comm sub = MPI_COMM_NULL;
    FLEXDEMO_MPI_CHECK(MPI_Comm_split(comm_, color, key, &sub));
    return std::make_shared<MpiCommunicator>(sub, true);
  }

  std::shared_ptr<Communicator> split_by_host() override {
    MPI_Comm sub = MPI_COMM_NULL;
    FLEXDEMO_MPI_CHECK(
        MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &sub));
    return std::make_shared<MpiCommunicator>(sub, true);
  }

  CommStats stats() const override {
    std::lock_guard<std::mutex> lock(stats_->mutex);
    return stats_->stats;
  }
  void reset_stats() override {
    std::lock_guard<std::mutex> lock(stats_->mutex);
    stats_->stats = CommStats{};
  }

 private:
  std::unique_ptr<MpiWork> make_work(const char* name, uint64_t sent, uint64_t received) {
    return std::make_unique<MpiWork>(stats_, name, size_, sent, received);
  }

  MPI_Comm comm_;
  bool owns_;
  int rank_ = 0, size_ = 1;
  std::shared_ptr<SharedStats> stats_ = std::make_shared<SharedStats>();
};

}  // namespace

// ====== Runtime ======
namespace {

// Whether a launcher (mpirun, or srun through PMI/PMIx) started this process as a rank of a job.
bool launched_as_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

// A singleton's own OpenMPI session directory: OpenMPI's default one is shared by every process
// of the user on the host, and one that finishes removes it while another starts in it ("mkdir
// ... File exists ... orte_init failed"). Empty when the user chose one or it cannot be made.
std::string make_private_session_dir() {
  if (launched_as_rank() || std::getenv("OMPI_MCA_orte_tmpdir_base") != nullptr) return "";
  std::error_code error;
  std::string pattern =
      (std::filesystem::temp_directory_path(error) / "flexdemo-mpi-XXXXXX").string();
  if (error || ::mkdtemp(pattern.data()) == nullptr) return "";
  ::setenv("OMPI_MCA_orte_tmpdir_base", pattern.c_str(), 1);  // the singleton's helper inherits it
  return pattern;
}

// Open MPI's defaults that make the dense all-reduce over TCP two to four times slower than the
// links allow (measured on scripts/cluster.sh's emulated cluster, 5.3 MB, 100 Mbit/s links;
// docs/results/many-nodes.md). Its nonblocking all-reduce (coll/libnbc) takes a binomial tree
// whenever the buffer is in place, as ours is, or there are fewer than 4 ranks: every byte
// passes the root, 2 log2(N) buffers in sequence (2,179 ms at 4 nodes where a ring needs 640).
// Algorithm 3 is the bandwidth-optimal reduce-scatter and all-gather (685 ms; it falls back to
// the ring below one element a rank). And with one TCP connection between two ranks that send
// to each other at once, each direction gets half the link (891 ms against 465 with two, 2
// nodes). Defaults only: a value the user set (in the environment or `mpirun --mca`) wins.
void set_open_mpi_defaults() {
  ::setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "3", /*overwrite=*/0);
  ::setenv("OMPI_MCA_btl_tcp_links", "2", /*overwrite=*/0);
}

}  // namespace

MpiRuntime::MpiRuntime(int* argc, char*** argv) {
  int initialized = 0;
  FLEXDEMO_MPI_CHECK(MPI_Initialized(&initialized));
  if (!initialized) {
    session_dir_ = make_private_session_dir();
    set_open_mpi_defaults();
    int provided = 0;
    FLEXDEMO_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided));
    owns_mpi_ = true;
  }
  FLEXDEMO_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  if (g_bf16_type == MPI_DATATYPE_NULL) {
    FLEXDEMO_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &g_bf16_type));
    FLEXDEMO_MPI_CHECK(MPI_Type_commit(&g_bf16_type));
    FLEXDEMO_MPI_CHECK(MPI_Op_create(&bf16_sum, /*commute=*/1, &g_bf16_sum));
  }
}

MpiRuntime::~MpiRuntime() {
  if (!owns_mpi_) return;
  if (g_bf16_sum != MPI_OP_NULL) MPI_Op_free(&g_bf16_sum);
  if (g_bf16_type != MPI_DATATYPE_NULL) MPI_Type_free(&g_bf16_type);
  MPI_Finalize();
  if (!session_dir_.empty()) {
    std::error_code ignored;  // what is left is OpenMPI's; a failure to remove it is harmless
    std::filesystem::remove_all(session_dir_, ignored);
  }
}

void MpiRuntime::abort_job(int code) {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; this keeps [[noreturn]] honest
}

std::shared_ptr<Communicator> MpiRuntime::world() const {
  return std::make_shared<MpiCommunicator>(MPI_COMM_WORLD, false);
}

}  // namespace flexdemo::comm
