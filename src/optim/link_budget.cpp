// The link budget (flexdemo/link_budget.h): the ladder, the choice, and its measurements.
#include "flexdemo/link_budget.h"

#include "flexdemo/comm.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>

namespace flexdemo::optim {

namespace {

using Clock = std::chrono::steady_clock;

// Seconds this rank takes for an all-gather of `bytes` per rank over `group` (its buffers
// where the group's collectives take them).
double time_all_gather(comm::Communicator& group, int64_t bytes) {
  const at::Tensor send = at::zeros({bytes}, at::dtype(at::kByte).device(group.device()));
  const at::Tensor recv = at::empty({bytes * group.size()}, send.options());
  const Clock::time_point t0 = Clock::now();
  group.all_gather(send, recv);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

std::vector<compress::ValueEncoding> link_encodings(const std::string& list) {
  std::vector<compress::ValueEncoding> encodings;
  for (size_t begin = 0;;) {
    const size_t end = std::min(list.find(',', begin), list.size());
    try {
      encodings.push_back(parse_name<compress::ValueEncoding>(list.substr(begin, end - begin)));
    } catch (const std::invalid_argument& e) {
      throw OptionsError("{link_values} " + list + ": " + e.what());
    }
    if (end == list.size()) return encodings;
    begin = end + 1;
  }
}

LinkBounds link_bounds(const OptimizerOptions& o) {
  LinkBounds b;
  b.min_topk = o.link_min_topk;
  b.max_topk = o.link_max_topk;
  b.max_every = o.link_max_every;
  b.values = link_encodings(o.link_values);
  b.overlap = o.overlap_step;
  return b;
}

std::vector<ExchangeSchedule> link_ladder(const LinkBounds& b) {
  std::vector<ExchangeSchedule> ladder;
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

size_t choose_schedule(const std::vector<ExchangeSchedule>& ladder,
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

double LinkChoice::rank_bytes_per_s() const {
  const LinkMeasure& m = measure;
  return m.probe_s > m.latency_s
             ? double(replicas - 1) * m.probe_bytes / (m.probe_s - m.latency_s)
             : 0.0;
}

std::string LinkChoice::describe() const {
  char line[512];
  std::snprintf(line, sizeof line,
                "link budget before step %lld: %.1f Mbit/s a rank between replicas, latency "
                "%.2f ms, compute %.0f ms a step -> top-k %lld, %s values, exchange every "
                "%lld step%s (%.0f ms predicted against a budget of %.0f ms%s)",
                static_cast<long long>(step), rank_bytes_per_s() * 8e-6, 1e3 * measure.latency_s,
                1e3 * measure.compute_s, static_cast<long long>(schedule.topk),
                name_of(schedule.values).c_str(), static_cast<long long>(schedule.every),
                schedule.every == 1 ? "" : "s", 1e3 * exchange_s, 1e3 * budget_s,
                hidden() ? "" : ": not hidden, the fewest bytes allowed");
  return line;
}

ScheduleState schedule_state(const Optimizer& optimizer) {
  ScheduleState s{optimizer.schedule(), optimizer.schedule_in_flight(), optimizer.counters()};
  s.in_flight.every = s.set.every;
  return s;
}

void restore_schedule_before_state(Optimizer& optimizer, const ScheduleState& state) {
  for (auto& [name, t] : optimizer.state_tensors()) {
    if (name == "pending") t.fill_(0);  // nothing in flight: the layout changes at once
  }
  optimizer.set_schedule(state.in_flight);
}

void restore_schedule_after_state(Optimizer& optimizer, const ScheduleState& state,
                                  int64_t steps) {
  optimizer.restore_steps(steps, state.counters);
  optimizer.set_schedule(state.set);
}

LinkBudget::LinkBudget(std::vector<Optimizer*> optimizers,
                       std::vector<std::shared_ptr<comm::Communicator>> agreement,
                       std::shared_ptr<comm::Communicator> replicas, int64_t start_step)
    : optimizers_(std::move(optimizers)),
      replicas_(std::move(replicas)),
      active_(!optimizers_.empty() &&
              optimizers_.front()->options().link_budget == LinkBudgetMode::Auto),
      first_choice_(start_step + kWarmSteps) {
  for (auto& group : agreement) {
    if (group && group->size() > 1) agreement_.push_back(std::move(group));
  }
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
  const OptimizerOptions& o = optimizers_.front()->options();
  bounds_ = link_bounds(o);
  probe_every_ = o.link_probe_every;
  ladder_ = link_ladder(bounds_);
}

void LinkBudget::add_compute(double seconds) {
  if (!active_ || seen_steps_++ == 0) return;
  compute_sum_ += seconds;
  ++compute_steps_;
}

LinkMeasure LinkBudget::measure(int64_t choice) {
  LinkMeasure m;
  m.probe_bytes = kProbeBytes;
  if (replicas_ && replicas_->size() > 1) {
    for (Optimizer* o : optimizers_) o->wait_in_flight();  // the probe has the link to itself
    // Every replica group probes at once, as they exchange (barriers over groups that tile the
    // world, in turn: one over the world).
    for (const auto& group : agreement_) group->barrier();
    comm::Communicator& group = *replicas_;
    m.latency_s = time_all_gather(group, 8);
    for (int i = 0; i < 2; ++i) m.latency_s = std::min(m.latency_s, time_all_gather(group, 8));
    // The slower of two: the first can ride a rate limiter's burst allowance or the TCP
    // window left open by the exchange before, which the exchanges' sustained rate cannot.
    m.probe_s = time_all_gather(group, int64_t(kProbeBytes));
    m.probe_s = std::max(m.probe_s, time_all_gather(group, int64_t(kProbeBytes)));
  }
  m.compute_s = compute_steps_ > 0 ? compute_sum_ / double(compute_steps_) : 0.0;
  if (!injected_probe_s_.empty()) {
    m.latency_s = 0.0;
    m.probe_s = injected_probe_s_[std::min(size_t(choice), injected_probe_s_.size() - 1)];
    m.compute_s = 1.0;
  }
  return m;
}

std::optional<LinkChoice> LinkBudget::before_step(int64_t step) {
  if (!active_ || step < first_choice_ || (step - kWarmSteps) % probe_every_ != 0) {
    return std::nullopt;
  }
  const LinkMeasure mine = measure((step - kWarmSteps) / probe_every_);
  // Every rank's measures and link bytes (all its optimizers'), so that every rank chooses
  // from the slowest's.
  const size_t n = 3 + ladder_.size();
  at::Tensor local = at::empty({int64_t(n)}, at::kDouble);
  auto l = local.accessor<double, 1>();
  l[0] = mine.latency_s;
  l[1] = mine.probe_s;
  l[2] = mine.compute_s;
  for (size_t i = 0; i < ladder_.size(); ++i) {
    double bytes = 0.0;
    for (const Optimizer* o : optimizers_) bytes += o->link_bytes(ladder_[i]);
    l[3 + i] = bytes;
  }
  at::Tensor slowest = local;
  for (const auto& group : agreement_) {  // the largest over each group in turn: over them all
    const at::Tensor mine_there = slowest.to(group->device());
    at::Tensor all = at::empty({group->size() * int64_t(n)}, mine_there.options());
    group->all_gather(mine_there, all);
    slowest = all.view({-1, int64_t(n)}).amax(0).cpu();
  }
  auto w = slowest.accessor<double, 1>();
  LinkChoice c;
  c.step = step + 1;
  c.measure = mine;
  c.measure.latency_s = w[0];
  c.measure.probe_s = w[1];
  c.measure.compute_s = w[2];
  std::vector<double> wire_bytes;
  for (size_t i = 0; i < ladder_.size(); ++i) wire_bytes.push_back(w[3 + i]);
  const size_t pick = choose_schedule(ladder_, wire_bytes, c.measure, bounds_.overlap);
  c.schedule = ladder_[pick];
  for (Optimizer* o : optimizers_) o->set_schedule(c.schedule);
  compute_sum_ = 0.0;
  compute_steps_ = 0;
  c.replicas = replicas_ ? replicas_->size() : 1;
  c.wire_bytes = wire_bytes[pick];
  c.exchange_s = c.measure.exchange_s(c.wire_bytes);
  c.budget_s = exchange_budget_s(bounds_.overlap, c.measure.compute_s, c.schedule.every);
  return c;
}

}  // namespace flexdemo::optim
