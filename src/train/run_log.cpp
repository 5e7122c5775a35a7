// Metrics, progress and summary of a training run (see run_log.h).
#include "run_log.h"

#include "options.h"

#include "flexdemo/comm.h"
#include "flexdemo/runtime.h"

#include <ATen/ATen.h>
#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <sys/resource.h>
#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace flexdemo::train {

namespace fs = std::filesystem;

namespace {

double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return double(usage.ru_maxrss) / 1024.0;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "kB", "MB", "GB"};
  int u = 0;
  while (b >= 1000.0 && u < 3) b /= 1000.0, ++u;
  return fmt::format("{:.1f} {}", b, units[u]);
}

std::string human_seconds(double s) {
  const int64_t t = int64_t(s);
  return t >= 3600 ? fmt::format("{}h{:02}m", t / 3600, t / 60 % 60)
                   : fmt::format("{}m{:02}s", t / 60, t % 60);
}

// mpirun hands ranks a terminal even when its own output goes to a file: --progress decides.
bool live_line(const TrainConfig& cfg) {
  return cfg.progress == ProgressMode::Bar ||
         (cfg.progress == ProgressMode::Auto && isatty(STDOUT_FILENO));
}

}  // namespace

int64_t restarts() {
  int64_t total = 0;
  for (const char* variable : {"FLEXDEMO_RESTARTS", "SLURM_RESTART_COUNT"}) {
    const char* value = std::getenv(variable);
    if (value != nullptr && *value != '\0') total += std::atoll(value);
  }
  return total;
}

void pack_step_metrics(double loss, double step_s, const comm::StepTraffic& traffic,
                       int64_t peers_left_out, double* out) {
  const double values[kReducedMetrics] = {double(traffic.intra_sent),
                                          double(traffic.intra_received),
                                          double(traffic.inter_sent),
                                          double(traffic.inter_received),
                                          loss,
                                          step_s,
                                          traffic.intra_seconds + traffic.inter_seconds,
                                          double(traffic.inter_collectives),
                                          double(peers_left_out)};
  std::copy(values, values + kReducedMetrics, out);
}

void unpack_step_metrics(const double* sums, int ranks, StepMetrics& m) {
  m.intra_sent = sums[0];
  m.intra_recv = sums[1];
  m.inter_sent = sums[2];
  m.inter_recv = sums[3];
  m.loss = sums[4] / ranks;
  m.step_s = sums[5] / ranks;
  m.comm_s = sums[6] / ranks;
  m.inter_collectives = sums[7] / ranks;
  m.peers_left_out = sums[8];
}

RunLog::RunLog(const Session& s, int64_t start_step)
    : s_(s),
      start_step_(start_step),
      root_(s.topo.world->rank() == 0),
      terminal_(root_ && live_line(s.cfg)),
      started_(std::chrono::steady_clock::now()) {
  if (!root_) return;
  const TrainConfig& cfg = s.cfg;
  fs::create_directories(cfg.out);
  nlohmann::ordered_json resolved = to_json(cfg);
  resolved["topology"] = s.topo.describe();
  resolved["model_description"] = s.lm->describe();
  resolved["num_params"] = s.lm->num_params();
  resolved["vocab_size"] = s.tokens.vocab_size;
  resolved["blas"] = blas_description();
  if (s.tokens.pairs) {  // which corpus: gettext:LANG depends on the packages installed
    resolved["corpus"] = {{"train_pairs", s.tokens.train_pairs},
                          {"val_pairs", s.tokens.val_pairs},
                          {"checksum", s.tokens.checksum}};
  }
  std::ofstream(fs::path(cfg.out) / "config.json") << resolved.dump(2) << "\n";
  const fs::path metrics_path = fs::path(cfg.out) / "metrics.jsonl";
  std::string kept;
  if (start_step > 0) {
    std::ifstream in(metrics_path);
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.value("step", int64_t(0)) <= start_step) kept += line + "\n";
    }
  }
  metrics_.open(metrics_path, std::ios::trunc);
  metrics_ << kept;
  // Whose second moment preconditions, where one does: auto's choice said with its reason.
  const optim::OptimizerOptions o = optimizer_options(cfg);
  std::string moment;
  if (o.precondition) {
    const optim::SecondMoment m = optim::resolved_second_moment(o.second_moment, s.topo.replicas);
    moment = fmt::format(", {} second moment", name_of(m));
    if (o.second_moment == optim::SecondMoment::Auto) {
      moment += fmt::format(" (auto: {} replicas, shared from {})", s.topo.replicas,
                            optim::kSharedSecondMomentReplicas);
    }
    const optim::StatisticsEncoding values =
        optim::resolved_statistics_values(o.second_moment_values, o.demo_exchange);
    if (m == optim::SecondMoment::Shared && values != optim::StatisticsEncoding::Fp32) {
      moment += fmt::format(", its statistics at {}{}", name_of(values),
                            o.second_moment_values == optim::StatisticsEncoding::Auto
                                ? " (auto: the owners' exchange)"
                                : "");
    }
    // A step that sums the shared statistics preconditions every gradient at once: no exchange
    // of it starts in the backward.
    if (m == optim::SecondMoment::Shared && cfg.exchange_in_backward) {
      moment += o.second_moment_every == 1
                    ? ", summed every step, so --exchange-in-backward starts nothing early"
                    : fmt::format(", summed every {} steps, on which --exchange-in-backward "
                                  "starts nothing early",
                                  o.second_moment_every);
    }
  }
  fmt::print("flexdemo train: {}; {}; {} + {} replicator{}; global batch {} x {} tokens\n",
             s.topo.describe(), s.lm->describe(), name_of(cfg.optimizer), name_of(*cfg.replicator),
             moment, cfg.batch, cfg.seq);
  fmt::print("blas: {}\n", blas_description());
  std::fflush(stdout);
}

void RunLog::record(const StepMetrics& m) {
  const TrainConfig& cfg = s_.cfg;
  if (m.val_loss) val_loss_ = *m.val_loss;
  seconds_total_ += m.step_s;
  inter_bytes_total_ += m.inter_sent;
  peers_left_out_ += m.peers_left_out;
  if (!root_) return;
  nlohmann::ordered_json j;
  j["step"] = m.step;
  j["loss"] = m.loss;
  j["lr"] = m.lr;
  j["tokens"] = m.step * cfg.batch * cfg.seq;
  j["step_ms"] = 1e3 * m.step_s;
  j["compute_ms"] = 1e3 * (m.step_s - m.comm_s);
  j["comm_ms"] = 1e3 * m.comm_s;
  j["intra_bytes_sent"] = int64_t(m.intra_sent);
  j["intra_bytes_recv"] = int64_t(m.intra_recv);
  j["inter_bytes_sent"] = int64_t(m.inter_sent);
  j["inter_bytes_recv"] = int64_t(m.inter_recv);
  j["inter_collectives"] = m.inter_collectives;
  j["skipped_steps"] = m.skipped_steps;
  j["peers_left_out"] = int64_t(m.peers_left_out);
  const double elapsed = m.elapsed_s;
  j["elapsed_s"] = elapsed;
  if (m.val_loss) j["val_loss"] = *m.val_loss;
  if (m.schedule) {
    j["topk"] = m.schedule->topk;
    j["values"] = name_of(m.schedule->values);
    j["every"] = m.schedule->every;
  }
  if (const std::optional<optim::LinkChoice>& c = m.link_choice) {
    nlohmann::ordered_json l;
    l["step"] = c->step;
    l["topk"] = c->schedule.topk;
    l["values"] = name_of(c->schedule.values);
    l["every"] = c->schedule.every;
    l["latency_ms"] = 1e3 * c->measure.latency_s;
    l["probe_ms"] = 1e3 * c->measure.probe_s;
    l["rank_mbit_s"] = c->rank_bytes_per_s() * 8e-6;
    l["compute_ms"] = 1e3 * c->measure.compute_s;
    l["wire_bytes"] = int64_t(c->wire_bytes);
    l["exchange_ms"] = 1e3 * c->exchange_s;
    l["budget_ms"] = 1e3 * c->budget_s;
    l["hidden"] = c->hidden();
    j["link_budget"] = l;
  }
  metrics_ << j.dump() << "\n" << std::flush;

  const double done = double(m.step - start_step_);
  const double eta = elapsed / done * double(cfg.steps - m.step);
  const double tokens_per_s = done * double(cfg.batch * cfg.seq) / elapsed;
  const std::string line = fmt::format(
      "step {}/{}  loss {:.4f}{}  {:.0f} tok/s  {} between {}/step  ETA {}", m.step, cfg.steps,
      m.loss, m.val_loss ? fmt::format("  val {:.4f}", *m.val_loss) : std::string(), tokens_per_s,
      human_bytes(m.inter_sent), between(), human_seconds(eta));
  if (terminal_) {
    fmt::print("\r{:<100}", line);
    if (m.val_loss || m.step == cfg.steps) fmt::print("\n");
  } else if (m.step % cfg.log_every == 0 || m.val_loss || m.step == 1) {
    fmt::print("{}\n", line);
  }
  std::fflush(stdout);
}

double RunLog::elapsed_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
}

void RunLog::finish(int64_t steps_done) {
  const auto& world = s_.topo.world;
  at::Tensor rss = at::full({1}, peak_rss_mb(), at::kDouble);
  at::Tensor all_rss = at::empty({world->size()}, at::kDouble);
  world->all_gather(rss, all_rss);  // the largest rank's peak
  if (!root_) return;
  const TrainConfig& cfg = s_.cfg;
  nlohmann::ordered_json summary;
  summary["final_val_loss"] = val_loss_;
  const double steps_run = double(std::max<int64_t>(1, steps_done - start_step_));
  summary["tokens_per_s"] = steps_run * double(cfg.batch * cfg.seq) / seconds_total_;
  summary["inter_bytes_per_step"] = inter_bytes_total_ / steps_run;
  summary["peak_rss_mb"] = all_rss.max().item<double>();
  summary["steps"] = steps_done;
  summary["peers_left_out"] = int64_t(peers_left_out_);
  summary["restarts"] = restarts();
  summary["optimizer"] = name_of(cfg.optimizer);
  summary["replicator"] = name_of(*cfg.replicator);
  std::ofstream(fs::path(cfg.out) / "summary.json") << summary.dump(2) << "\n";
  fmt::print("{}; {:.0f} tokens/s; {} between {} per step; outputs in {}\n",
             std::isnan(val_loss_) ? std::string("no validation loss measured")
                                   : fmt::format("final validation loss {:.4f}", val_loss_),
             summary["tokens_per_s"].get<double>(),
             human_bytes(summary["inter_bytes_per_step"].get<double>()), between(), cfg.out);
}

}  // namespace flexdemo::train
