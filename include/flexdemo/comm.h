// flexdemo/comm.h — the communicator: collectives over a group of ranks, behind one interface.
// Implements the interface and its MPI backend's entry points; the trainer and optimizers never
// call MPI directly. Tensors may live on any device (staged through host memory if needed).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace flexdemo::comm {

// Raised for every failed collective; carries the backend's own error text and the call site.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class ReduceOp { Sum, Avg };

// ====== Collective timeout ======
// Process-wide: a collective that has not completed after this many seconds raises CommError
// (a rank has died or hangs, or the network is down) instead of waiting forever. 0 waits forever,
// the default until set; the trainer sets it from --comm-timeout after its setup.
void set_collective_timeout(double seconds);
double collective_timeout();

// Traffic and time of one communicator since creation (or the last reset_stats()).
// Bytes are what a bandwidth-optimal ring moves per rank (NCCL-tests' "bus bytes"), so they
// follow from the payload alone, whatever algorithm the backend picks:
//   all-gather of n bytes per rank over P ranks: sent = received = (P-1) * n
//   all-reduce of n bytes:                        sent = received = 2 (P-1)/P * n
//   reduce-scatter of n input bytes:              sent = received = (P-1)/P * n
//   broadcast of n bytes:                         sent = n on the root, received = n elsewhere
//   all-to-all (variable sizes):                  sent = what goes to the other ranks,
//                                                 received = what comes from them
struct CommStats {
  uint64_t bytes_sent = 0;      // bytes this rank put on the wire
  uint64_t bytes_received = 0;  // bytes this rank took off the wire
  double seconds = 0.0;         // wall time this rank waited for collectives to complete
  uint64_t collectives = 0;     // completed collectives
};

// Handle to a non-blocking collective. wait() completes it (and copies results back to the
// caller's tensors when they were staged); it is idempotent. Destroying an unfinished handle waits.
// The same contract on every backend: between the i*() call and wait() the collective may read
// its inputs and write its outputs at any time (MPI reads host tensors until completion; NCCL
// reads on its own stream, after the work the caller had queued at the call), so the caller
// writes no input and reads no output until wait() returns. The backend keeps every tensor it
// uses alive (and, on a GPU, unavailable to the caching allocator) until the collective is done,
// even if the caller drops it. A collective that times out or fails raises CommError; on NCCL it
// aborts the communicator once, after which every collective on it raises CommError at once.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool is_completed() = 0;  // true once wait() returned or the operation finished
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Where this backend's collectives take tensors without staging them: the CPU (MPI) or its
  // GPU (NCCL). Tensors elsewhere are staged (MPI) or rejected (NCCL).
  virtual at::Device device() const { return at::kCPU; }

  // ====== Non-blocking collectives (complete with Work::wait) ======
  // output.numel() == size() * input.numel(); output[r] is rank r's input. Same dtype.
  virtual std::unique_ptr<Work> iall_gather(const at::Tensor& input, const at::Tensor& output) = 0;
  // Variable sizes: counts[r] = numel of rank r's input; output holds them back to back.
  virtual std::unique_ptr<Work> iall_gather_v(const at::Tensor& input, const at::Tensor& output,
                                              const std::vector<int64_t>& counts) = 0;
  // Personalised, variable sizes: input holds send_counts[r] elements for each rank r back to
  // back (rank order); output receives recv_counts[r] elements from each rank r back to back.
  // Every rank's send_counts[r] must equal rank r's recv_counts[rank()]. Same dtype.
  virtual std::unique_ptr<Work> iall_to_all_v(const at::Tensor& input,
                                              const std::vector<int64_t>& send_counts,
                                              const at::Tensor& output,
                                              const std::vector<int64_t>& recv_counts) = 0;
  // In place. float32, float64, bfloat16 (Sum and Avg); int32, int64 (Sum only).
  virtual std::unique_ptr<Work> iall_reduce(const at::Tensor& tensor, ReduceOp op) = 0;
  // input.numel() == size() * output.numel(); output = reduction of every rank's slice rank().
  virtual std::unique_ptr<Work> ireduce_scatter(const at::Tensor& input, const at::Tensor& output,
                                                ReduceOp op) = 0;
  virtual std::unique_ptr<Work> ibroadcast(const at::Tensor& tensor, int root) = 0;
  virtual std::unique_ptr<Work> ibarrier() = 0;

  // ====== Blocking forms ======
  void all_gather(const at::Tensor& input, const at::Tensor& output) {
    iall_gather(input, output)->wait();
  }
  void all_gather_v(const at::Tensor& input, const at::Tensor& output,
                    const std::vector<int64_t>& counts) {
    iall_gather_v(input, output, counts)->wait();
  }
  void all_to_all_v(const at::Tensor& input, const std::vector<int64_t>& send_counts,
                    const at::Tensor& output, const std::vector<int64_t>& recv_counts) {
    iall_to_all_v(input, send_counts, output, recv_counts)->wait();
  }
  void all_reduce(const at::Tensor& tensor, ReduceOp op) { iall_reduce(tensor, op)->wait(); }
  void reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op) {
    ireduce_scatter(input, output, op)->wait();
  }
  void broadcast(const at::Tensor& tensor, int root) { ibroadcast(tensor, root)->wait(); }
  void barrier() { ibarrier()->wait(); }

  // ====== Groups ======
  // Collective over this communicator: ranks with the same color form a new communicator,
  // ordered by key (ties by rank in this one).
  virtual std::shared_ptr<Communicator> split(int color, int key) = 0;
  // Collective: the ranks that share this rank's host (its shared-memory domain).
  virtual std::shared_ptr<Communicator> split_by_host() = 0;

  // ====== Accounting ======
  virtual CommStats stats() const = 0;
  virtual void reset_stats() = 0;
};

// ====== MPI backend ======
// Initialises MPI on construction (unless something else already did) and finalises it on
// destruction if it initialised it. Create one per process, before any communicator.
// A process not started by a launcher (mpirun, srun) is an MPI singleton: it gets a session
// directory of its own under the temporary folder (removed at the end), so that singletons
// started at the same moment never collide in OpenMPI's shared one.
class MpiRuntime {
 public:
  MpiRuntime(int* argc = nullptr, char*** argv = nullptr);
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  // All ranks of the job (MPI_COMM_WORLD). Errors raise CommError instead of aborting.
  std::shared_ptr<Communicator> world() const;

  // Ends every rank of the job with `code` (MPI_Abort): after a failure on one rank, the others
  // may be blocked in a collective that will never complete, so finalising would hang.
  [[noreturn]] static void abort_job(int code);

 private:
  bool owns_mpi_ = false;
  std::string session_dir_;  // the singleton's own session directory; empty: none made
};

// ====== NCCL backend (CUDA builds) ======
// Whether this build has it.
bool nccl_built();
// Collective over bootstrap (an MPI communicator over the same ranks, which shares NCCL's unique
// id): a communicator on `gpu`, one GPU per rank (two ranks on one GPU: std::invalid_argument).
// Its collectives run on their own CUDA stream; split() makes NCCL communicators too. Throws
// std::invalid_argument in a build without CUDA.
std::shared_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap,
                                                     at::Device gpu);

}  // namespace flexdemo::comm
