// The preemption signals' handler: async-signal-safe (an atomic, write, _exit) and nothing else.
#include "stop_signals.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

namespace flexdemo::train {

namespace {

constexpr int kSignals[kStopSignals] = {SIGTERM, SIGINT, SIGUSR1};
std::atomic<int> g_first{0};
struct sigaction g_before[kStopSignals];

void on_signal(int signal) {
  int none = 0;
  if (g_first.compare_exchange_strong(none, signal)) return;  // the first: noted only
  static const char kLine[] =
      "flexdemo: a second stop signal: stopping at once, without a checkpoint (the newest one "
      "written is kept)\n";
  [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, kLine, sizeof(kLine) - 1);
  ::_exit(128 + signal);
}

}  // namespace

StopSignals::StopSignals() {
  g_first = 0;
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // reads and writes in progress go on
  for (int i = 0; i < kStopSignals; ++i) ::sigaction(kSignals[i], &action, &g_before[i]);
}

StopSignals::~StopSignals() {
  for (int i = 0; i < kStopSignals; ++i) ::sigaction(kSignals[i], &g_before[i], nullptr);
}

int stop_signal(int i) {
  return kSignals[i];
}

int StopSignals::received() {
  return g_first.load();
}

std::string signal_name(int signal) {
  switch (signal) {
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    case SIGUSR1:
      return "SIGUSR1";
    default:
      return "signal " + std::to_string(signal);
  }
}

}  // namespace flexdemo::train
