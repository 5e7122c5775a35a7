// `flexdemo supervise -- COMMAND...`: runs a training job (mpirun ... flexdemo train ... --resume
// auto) and starts it again after a fault, at most --max-restarts times, each restart one line.
// A job that ends well, on bad input (exit code 2: bad options, a damaged last checkpoint with no
// older one) or because the supervisor itself was asked to stop is not restarted. A process of
// its own rather than a loop inside the trainer: a dead rank or a lost node ends the whole MPI
// job, so only something outside it can start it again (docs/reliability.md).
#include "subcommand.h"

#include <fmt/core.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

namespace flexdemo::app {

namespace {

volatile std::sig_atomic_t stop_signal = 0;  // SIGTERM or SIGUSR1 sent to the supervisor
volatile pid_t job_pid = 0;

// The supervisor was asked to stop: pass it on to the job (mpirun forwards SIGUSR1 to every
// rank; SIGTERM ends the ranks after writing a checkpoint), and restart no more.
void forward(int signal) {
  stop_signal = signal;
  if (job_pid > 0) ::kill(job_pid, signal);
}

struct Options {
  int max_restarts = 10;
  double backoff_s = 5.0;
  std::vector<std::string> command;
};

// Whether the command continues a run on every start: `--resume auto` (or --resume=auto).
bool resumes_automatically(const std::vector<std::string>& command) {
  for (size_t i = 0; i < command.size(); ++i) {
    if (command[i] == "--resume=auto") return true;
    if (command[i] == "--resume" && i + 1 < command.size() && command[i + 1] == "auto") return true;
  }
  return false;
}

// Runs the command once with FLEXDEMO_RESTARTS=restarts; its exit code (128 + N if a signal N
// ended it).
int run_once(const std::vector<std::string>& command, int restarts) {
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("supervise: fork failed");
  if (pid == 0) {
    ::setenv("FLEXDEMO_RESTARTS", std::to_string(restarts).c_str(), 1);
    std::vector<char*> argv;
    for (const std::string& a : command) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "flexdemo supervise: cannot run %s\n", argv[0]);
    std::_Exit(127);
  }
  job_pid = pid;
  if (stop_signal != 0) ::kill(pid, stop_signal);  // asked to stop while it started
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
  }
  job_pid = 0;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int supervise(const Options& o) {
  if (o.command.empty()) throw std::invalid_argument("supervise: no command given after --");
  if (!resumes_automatically(o.command)) {
    throw std::invalid_argument(
        "supervise: the command must continue its run when started again: give its flexdemo "
        "train --resume auto");
  }
  struct sigaction action {};
  action.sa_handler = forward;
  sigemptyset(&action.sa_mask);
  for (int signal : {SIGTERM, SIGUSR1}) ::sigaction(signal, &action, nullptr);
  for (int restarts = 0;; ++restarts) {
    const auto started = std::chrono::steady_clock::now();
    const int code = run_once(o.command, restarts);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (code == 0) {
      std::printf("flexdemo supervise: the job finished after %d restart%s\n", restarts,
                  restarts == 1 ? "" : "s");
      return 0;
    }
    if (code == 2) {
      std::fprintf(stderr,
                   "flexdemo supervise: the job stopped on bad input (exit code 2, see its line "
                   "above): not restarted\n");
      return 2;
    }
    if (stop_signal != 0) {
      std::fprintf(stderr,
                   "flexdemo supervise: stopped by signal %d (the job ended with exit code %d): "
                   "not restarted\n",
                   int(stop_signal), code);
      return code;
    }
    if (restarts == o.max_restarts) {
      std::fprintf(stderr,
                   "flexdemo supervise: the job ended with exit code %d after %.0f s; gave up "
                   "after %d restarts (--max-restarts)\n",
                   code, seconds, restarts);
      return code;
    }
    std::fprintf(stderr,
                 "flexdemo supervise: the job ended with exit code %d after %.0f s; restart %d "
                 "of %d in %.0f s, from its newest checkpoint\n",
                 code, seconds, restarts + 1, o.max_restarts, o.backoff_s);
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::duration<double>(o.backoff_s));
    if (stop_signal != 0) return code;
  }
}

}  // namespace

Subcommand add_supervise(CLI::App& app) {
  auto options = std::make_shared<Options>();
  Subcommand c;
  c.cli = app.add_subcommand(
      "supervise",
      "run a training job and start it again after a fault (a dead rank, a lost link or node, a "
      "preemption of some ranks), from its newest checkpoint: flexdemo supervise [options] -- "
      "mpirun ... flexdemo train ... --resume auto");
  c.cli->add_option("--max-restarts", options->max_restarts, "restarts at most")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  c.cli->add_option("--backoff", options->backoff_s, "seconds to wait before a restart")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  c.cli->add_option("command", options->command, "the job's command line, after --")->required();
  c.run = [options](std::shared_ptr<comm::Communicator>) { return supervise(*options); };
  return c;
}

}  // namespace flexdemo::app
