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

// The name of a stop signal, for the handler: no allocation.
const char* stop_signal_name(int signal) {
  switch (signal) {
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    default:
      return "SIGUSR1";
  }
}

void write_stderr(const char* text) {
  [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, text, std::strlen(text));
}

void on_signal(int signal) {
  int none = 0;
  if (g_first.compare_exchange_strong(none, signal)) return;  // the first: noted only
  // Named: two signals pending at once are delivered lowest number first, whatever their order.
  write_stderr("flexdemo: a second stop signal (");
  write_stderr(stop_signal_name(signal));
  write_stderr("): stopping at once, without a checkpoint (the newest one written is kept)\n");
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
  for (const int stop : kSignals) {
    if (signal == stop) return stop_signal_name(signal);
  }
  return "signal " + std::to_string(signal);
}

}  // namespace flexdemo::train
