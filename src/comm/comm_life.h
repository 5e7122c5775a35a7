// The rules of a device communicator's life that need no device (nccl_communicator.cpp applies
// them to NCCL; test_comm_life.cpp checks them on the CPU):
// - it is aborted at most once, and never destroyed after an abort (ncclCommAbort frees it);
// - after an abort every wait fails at once with the abort's reason: none polls the freed handle;
// - when not aborted, it is destroyed once, after the last collective handle that uses it (the
//   handles share ownership of its CommLife);
// - anything that may stay "in progress" (a non-blocking init, a collective) is polled against a
//   deadline, and passing it, or an asynchronous error, aborts the communicator.
#pragma once

#include "flexdemo/comm.h"

#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace flexdemo::comm::detail {

class CommLife {
 public:
  // abort and destroy act on the handle; either may be empty (nothing to release).
  CommLife(std::function<void()> abort, std::function<void()> destroy)
      : abort_(std::move(abort)), destroy_(std::move(destroy)) {}
  CommLife(const CommLife&) = delete;
  CommLife& operator=(const CommLife&) = delete;
  ~CommLife() {
    if (!aborted_ && destroy_) destroy_();
  }

  // The first call aborts the communicator and keeps `why`; later calls do nothing.
  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_) return;
    aborted_ = true;
    why_ = why;
    if (abort_) abort_();
  }
  bool aborted() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return aborted_;
  }
  // Throws CommError naming `what` and the abort's reason if the communicator was aborted.
  void throw_if_aborted(const std::string& what) const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_) throw CommError(what + ": the communicator was aborted earlier (" + why_ + ")");
  }

 private:
  mutable std::mutex mutex_;
  std::function<void()> abort_, destroy_;
  bool aborted_ = false;
  std::string why_;
};

// What one poll of an operation found: done, still running, or failed with a message.
struct PollState {
  enum Kind { Done, Pending, Failed } kind = Pending;
  std::string error;
};

// Polls `poll` (() -> PollState) until the operation is done. A failure, or a timeout_s > 0
// passed, aborts `life` and throws CommError naming `what`; an earlier abort throws at once.
// Returns the seconds waited.
template <typename Poll>
double settle(CommLife& life, const std::string& what, double timeout_s, Poll&& poll) {
  life.throw_if_aborted(what);
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const PollState state = poll();
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (state.kind == PollState::Done) return waited;
    if (state.kind == PollState::Failed) {
      const std::string message = what + " failed: " + state.error;
      life.abort(message);
      throw CommError(message);
    }
    if (timeout_s > 0 && waited > timeout_s) {
      const std::string message = what + " did not complete within " + std::to_string(timeout_s) +
                                  " s (a rank has died or hangs, or the network is down)";
      life.abort(message);
      throw CommError(message);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(waited < 1e-3 ? 2 : 20));
  }
}

}  // namespace flexdemo::comm::detail
