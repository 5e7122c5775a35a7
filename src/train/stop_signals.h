// Preemption: schedulers send SIGTERM (or SIGINT, or SIGUSR1 ahead of a deadline) before they
// kill a job. While a StopSignals lives, the first such signal is only noted, so that the ranks
// can agree to stop at the next step boundary and write a checkpoint; a second one ends the
// process at once. Internal to src/train.
#pragma once

#include <string>

namespace flexdemo::train {

class StopSignals {
 public:
  // Catches SIGTERM, SIGINT and SIGUSR1. The second of them ends the process at once with exit
  // code 128 + its number and one line on stderr (no checkpoint). The handlers before come back
  // when it goes.
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The number of the first signal caught, 0 while none.
  static int received();
};

// The signals caught, in a fixed order: stop_signal(i), i < kStopSignals (SIGTERM, SIGINT,
// SIGUSR1), so that ranks can count each one in a fixed-size vote.
inline constexpr int kStopSignals = 3;
int stop_signal(int i);

// "SIGTERM", "SIGINT", "SIGUSR1" (others: "signal N").
std::string signal_name(int signal);

}  // namespace flexdemo::train
