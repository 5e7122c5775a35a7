// --link-budget auto (see link_budget.h).
#include "link_budget.h"

#include "options.h"

#include "flexdemo/comm.h"

#include <ATen/ATen.h>
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>

namespace flexdemo::train {

namespace {

using Clock = std::chrono::steady_clock;

// Seconds this rank takes for an all-gather of `bytes` per rank over `group`.
double time_all_gather(comm::Communicator& group, int64_t bytes) {
  const at::Tensor send = at::zeros({bytes}, at::kByte);
  const at::Tensor recv = at::empty({bytes * group.size()}, at::kByte);
  const Clock::time_point t0 = Clock::now();
  group.all_gather(send, recv);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

std::vector<optim::ExchangeSchedule> link_ladder(const LinkBounds& b) {
  std::vector<optim::ExchangeSchedule> ladder;
  for (int64_t k = b.max_topk;; k = std::max(b.min_topk, k / 2)) {
    for (compress::ValueEncoding v : b.values) ladder.push_back({k, v, 1});
    if (k == b.min_topk) break;
  }
  for (int64_t every = 2;; every = std::min(b.max_every, every * 2)) {
    if (every > b.max_every) break;
    ladder.push_back({b.min_topk, b.values.back(), every});
    if (every == b.max_every) break;
  }
  return ladder;
}

double LinkMeasure::exchange_s(double bytes) const {
  return latency_s + std::max(0.0, probe_s - latency_s) * bytes / probe_bytes;
}

double exchange_budget_s(bool overlap, double compute_s, int64_t every) {
  return (overlap ? 0.8 : 0.1) * double(every) * compute_s;
}

size_t choose_schedule(const std::vector<optim::ExchangeSchedule>& ladder,
                       const std::vector<double>& wire_bytes, const LinkMeasure& measure,
                       bool overlap) {
  for (size_t i = 0; i < ladder.size(); ++i) {
    if (measure.exchange_s(wire_bytes[i]) <=
        exchange_budget_s(overlap, measure.compute_s, ladder[i].every)) {
      return i;
    }
  }
  return ladder.size() - 1;
}

LinkBudget::LinkBudget(Session& s, int64_t start_step)
    : s_(s),
      active_(s.cfg.link_budget == LinkBudgetMode::Auto),
      first_choice_(start_step + kWarmSteps) {
  if (!active_) return;
  if (const char* inject = std::getenv("FLEXDEMO_INJECT_LINK"); inject && *inject) {
    std::istringstream list(inject);
    for (std::string item; std::getline(list, item, ',');) {
      try {
        injected_probe_s_.push_back(std::stod(item));
      } catch (const std::exception&) {
        throw std::invalid_argument(std::string("FLEXDEMO_INJECT_LINK must be seconds, "
                                                "comma-separated, got ") +
                                    inject);
      }
    }
  }
  bounds_.min_topk = s.cfg.link_min_topk;
  bounds_.max_topk = s.cfg.link_max_topk;
  bounds_.max_every = s.cfg.link_max_every;
  bounds_.values = link_encodings(s.cfg.link_values);
  bounds_.overlap = s.cfg.overlap_step;
  ladder_ = link_ladder(bounds_);
}

void LinkBudget::add_compute(double seconds) {
  if (!active_ || seen_steps_++ == 0) return;
  compute_sum_ += seconds;
  ++compute_steps_;
}

LinkMeasure LinkBudget::measure(int64_t choice) {
  comm::Communicator& world = *s_.topo.world;
  comm::Communicator& replicas = *s_.topo.replica_group;
  LinkMeasure m;
  m.probe_bytes = kProbeBytes;
  if (replicas.size() > 1) {
    s_.optimizer->wait_in_flight();  // the probe has the link to itself
    world.barrier();                 // every replica group probes at once, as they exchange
    m.latency_s = time_all_gather(replicas, 8);
    for (int i = 0; i < 2; ++i) m.latency_s = std::min(m.latency_s, time_all_gather(replicas, 8));
    // The slower of two: the first can ride a rate limiter's burst allowance or the TCP
    // window left open by the exchange before, which the exchanges' sustained rate cannot.
    m.probe_s = time_all_gather(replicas, int64_t(kProbeBytes));
    m.probe_s = std::max(m.probe_s, time_all_gather(replicas, int64_t(kProbeBytes)));
  }
  m.compute_s = compute_steps_ > 0 ? compute_sum_ / double(compute_steps_) : 0.0;
  if (!injected_probe_s_.empty()) {
    m.latency_s = 0.0;
    m.probe_s = injected_probe_s_[std::min(size_t(choice), injected_probe_s_.size() - 1)];
    m.compute_s = 1.0;
  }
  return m;
}

std::optional<nlohmann::ordered_json> LinkBudget::before_step(int64_t step) {
  const int64_t every = s_.cfg.link_probe_every;
  if (!active_ || step < first_choice_ || (step - kWarmSteps) % every != 0) return std::nullopt;
  const LinkMeasure mine = measure((step - kWarmSteps) / every);
  // Every rank's measures and wire bytes, so that every rank chooses from the slowest's.
  const size_t n = 3 + ladder_.size();
  at::Tensor local = at::empty({int64_t(n)}, at::kDouble);
  auto l = local.accessor<double, 1>();
  l[0] = mine.latency_s;
  l[1] = mine.probe_s;
  l[2] = mine.compute_s;
  for (size_t i = 0; i < ladder_.size(); ++i) {
    l[3 + i] = double(s_.optimizer->wire_bytes(ladder_[i]));
  }
  at::Tensor all = at::empty({s_.topo.world->size() * int64_t(n)}, at::kDouble);
  s_.topo.world->all_gather(local, all);
  const at::Tensor slowest = all.view({-1, int64_t(n)}).amax(0);
  auto w = slowest.accessor<double, 1>();
  LinkMeasure m = mine;
  m.latency_s = w[0];
  m.probe_s = w[1];
  m.compute_s = w[2];
  std::vector<double> wire_bytes;
  for (size_t i = 0; i < ladder_.size(); ++i) wire_bytes.push_back(w[3 + i]);
  const size_t pick = choose_schedule(ladder_, wire_bytes, m, bounds_.overlap);
  const optim::ExchangeSchedule& chosen = ladder_[pick];
  s_.optimizer->set_schedule(chosen);
  compute_sum_ = 0.0;
  compute_steps_ = 0;

  const int replicas = s_.topo.replica_group->size();
  const double predicted = m.exchange_s(wire_bytes[pick]);
  const double budget = exchange_budget_s(bounds_.overlap, m.compute_s, chosen.every);
  // What a rank's all-gather moved per second: (R - 1) probes in, (R - 1) out.
  const double rank_bytes_per_s =
      m.probe_s > m.latency_s ? double(replicas - 1) * kProbeBytes / (m.probe_s - m.latency_s) : 0;
  nlohmann::ordered_json j;
  j["step"] = step + 1;  // the first step that uses it
  j["topk"] = chosen.topk;
  j["values"] = name_of(chosen.values);
  j["every"] = chosen.every;
  j["latency_ms"] = 1e3 * m.latency_s;
  j["probe_ms"] = 1e3 * m.probe_s;
  j["rank_mbit_s"] = rank_bytes_per_s * 8e-6;
  j["compute_ms"] = 1e3 * m.compute_s;
  j["wire_bytes"] = int64_t(wire_bytes[pick]);
  j["exchange_ms"] = 1e3 * predicted;
  j["budget_ms"] = 1e3 * budget;
  j["hidden"] = predicted <= budget;
  if (s_.topo.world->rank() == 0) {
    fmt::print(
        "link budget before step {}: {:.1f} Mbit/s a rank between nodes, latency {:.2f} ms, "
        "compute {:.0f} ms a step -> top-k {}, {} values, exchange every {} step{} ({:.0f} ms "
        "predicted against a budget of {:.0f} ms{})\n",
        step + 1, rank_bytes_per_s * 8e-6, 1e3 * m.latency_s, 1e3 * m.compute_s, chosen.topk,
        name_of(chosen.values), chosen.every, chosen.every == 1 ? "" : "s", 1e3 * predicted,
        1e3 * budget, predicted <= budget ? "" : ": not hidden, the fewest bytes allowed");
    std::fflush(stdout);
  }
  return j;
}

}  // namespace flexdemo::train
