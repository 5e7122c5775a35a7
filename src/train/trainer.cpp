// The training loop: each step's global batch is split across replicas, then across the ranks of
// a shard group; micro-batches accumulate; a non-finite step is skipped (or stops the run) on
// every rank alike; the gradient is clipped by its norm across the shards; the optimizer
// exchanges between replicas. The options are train_options.h's; the run's pieces are in
// session.h, checkpoint_store.h and run_log.h.
#include "flexdemo/train.h"

#include "checkpoint_store.h"
#include "hf_format.h"
#include "options.h"
#include "run_log.h"
#include "session.h"
#include "stop_signals.h"

#include "flexdemo/comm.h"
#include "flexdemo/elastic.h"
#include "flexdemo/link_budget.h"
#include "flexdemo/shard.h"
#include "runtime/autocast.h"

#include <ATen/ATen.h>
#include <fmt/core.h>
#include <zlib.h>

#include <array>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <stdexcept>

namespace flexdemo::train {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Testing aids: FLEXDEMO_INJECT_NONFINITE="STEP:RANK" makes that rank's loss NaN at that step;
// FLEXDEMO_INJECT_SIGNAL="STEP:RANK" sends that rank a SIGTERM in that step, before the ranks
// vote whether to stop after it (a preemption at a known step). Each takes a comma-separated
// list of such entries, so that a long run (bench/soak.sh) can plan several faults of a kind.
std::vector<std::string> split_list(const char* spec) {
  std::vector<std::string> items;
  std::string item;
  for (const char* c = spec; *c != '\0'; ++c) {
    if (*c == ',') {
      items.push_back(item);
      item.clear();
    } else {
      item += *c;
    }
  }
  items.push_back(item);
  return items;
}

struct Injection {
  std::vector<std::pair<int64_t, int64_t>> at_steps;  // (step, rank)

  static Injection from_env(const char* variable) {
    Injection inject;
    const char* spec = std::getenv(variable);
    if (spec == nullptr || *spec == '\0') return inject;
    for (const std::string& item : split_list(spec)) {
      long step = -1, rank = -1;
      char tail = 0;
      if (std::sscanf(item.c_str(), "%ld:%ld%c", &step, &rank, &tail) != 2) {
        throw std::invalid_argument(std::string(variable) +
                                    " must be STEP:RANK[,STEP:RANK...], got " + spec);
      }
      inject.at_steps.emplace_back(step, rank);
    }
    return inject;
  }
  bool at(int64_t s, int r) const {
    for (const auto& [step, rank] : at_steps) {
      if (step == s && rank == r) return true;
    }
    return false;
  }
};

// A testing aid: FLEXDEMO_INJECT_PAYLOAD="FIRST[-LAST]:RANK:KIND[,...]" makes that rank send
// tampered payloads between nodes in steps FIRST to LAST (1-based): KIND nan (non-finite values),
// scale=F (every value F times what it is, re-sealed) or corrupt (a flipped bit: the checksum
// fails).
struct PayloadInjection {
  struct Entry {
    int64_t first = -1, last = -1, rank = -1;
    compress::Tamper how = compress::Tamper::Scale;
    double factor = 1.0;
  };
  std::vector<Entry> entries;

  static PayloadInjection from_env() {
    PayloadInjection p;
    const char* spec = std::getenv("FLEXDEMO_INJECT_PAYLOAD");
    if (spec == nullptr || *spec == '\0') return p;
    for (const std::string& text : split_list(spec)) {
      Entry e;
      long first = -1, last = -1, rank = -1;
      char kind[64] = {0};
      const bool range = text.find('-') < text.find(':');
      const int got =
          range ? std::sscanf(text.c_str(), "%ld-%ld:%ld:%63s", &first, &last, &rank, kind)
                : std::sscanf(text.c_str(), "%ld:%ld:%63s", &first, &rank, kind);
      e.first = first;
      e.last = range ? last : first;
      e.rank = rank;
      const std::string k = kind;
      if (got != (range ? 4 : 3) || e.first < 1 || e.last < e.first) {
        e.first = -1;
      } else if (k == "nan") {
        e.factor = NAN;
      } else if (k == "corrupt") {
        e.how = compress::Tamper::Corrupt;
      } else if (k.rfind("scale=", 0) == 0) {
        e.factor = std::atof(k.c_str() + 6);
      } else {
        e.first = -1;
      }
      if (e.first < 0) {
        throw std::invalid_argument(
            std::string("FLEXDEMO_INJECT_PAYLOAD must be FIRST[-LAST]:RANK:") +
            "nan|corrupt|scale=F[,...], got " + spec);
      }
      p.entries.push_back(e);
    }
    return p;
  }
  // The entry for this step and rank, if any.
  const Entry* at(int64_t step, int r) const {
    for (const Entry& e : entries) {
      if (e.rank == r && step >= e.first && step <= e.last) return &e;
    }
    return nullptr;
  }
};

// What the trainer names a peer whose payloads failed the checks by: the world rank of each
// member of this rank's replica group, and each optimizer tensor's parameter name.
struct PeerNames {
  std::vector<int64_t> world_rank;  // by replica-group rank
  std::vector<std::string> tensor;  // by optimizer tensor index

  // Collective over the replica group.
  explicit PeerNames(const Session& s) {
    const auto& group = s.topo.replica_group;
    at::Tensor all = at::empty({group->size()}, at::kLong);
    group->all_gather(at::full({1}, int64_t(s.topo.world->rank()), at::kLong), all);
    for (int r = 0; r < group->size(); ++r) world_rank.push_back(all[r].item<int64_t>());
    for (const auto& unit : s.lm->param_names())
      tensor.insert(tensor.end(), unit.begin(), unit.end());
  }
  // "node 1 (rank 2) sent blocks.0.attn.weight with non-finite values" (with islands of several
  // nodes: "island 1 ...")
  std::string describe(const Session& s, const optim::PeerFault& f) const {
    const int groups = s.topo.island_nodes * s.topo.ranks_per_node / s.topo.shard_size;
    return fmt::format("{} {} (rank {}) sent {} with {}",
                       s.topo.island_nodes > 1 ? "island" : "node", f.replica / groups,
                       world_rank.at(size_t(f.replica)),
                       f.tensor < tensor.size() ? tensor[f.tensor] : std::to_string(f.tensor),
                       f.describe());
  }
};

// After a step under --on-bad-peer drop: one line per peer left out of it (the first tensor that
// failed named, with how many did), printed by this replica group's first member. Returns how
// many peers this replica group left out (counted on its first member only, so that the sum
// over the world counts each replica group's once).
int64_t report_peer_faults(const Session& s, const PeerNames& names, int64_t step) {
  const std::vector<optim::PeerFault> faults = s.optimizer->take_peer_faults();
  if (faults.empty() || s.topo.replica_group->rank() != 0) return 0;
  std::map<int, std::vector<const optim::PeerFault*>> by_peer;
  for (const optim::PeerFault& f : faults) by_peer[f.replica].push_back(&f);
  for (const auto& [replica, list] : by_peer) {
    std::fprintf(
        stderr, "flexdemo: step %ld: %s%s; left out of this step's mean (--on-bad-peer drop)\n",
        long(step), names.describe(s, *list.front()).c_str(),
        list.size() > 1 ? fmt::format(" (and {} more tensors)", list.size() - 1).c_str() : "");
  }
  return int64_t(by_peer.size());
}

// Forward and backward of this rank's rows of step `step`'s global batch, micro-batch by
// micro-batch, the gradients accumulating. Returns the loss (the rank's mean).
double forward_backward(Session& s, int64_t step, const Injection& inject) {
  const TrainConfig& cfg = s.cfg;
  const int64_t first_row =
      s.topo.replica_rank * (cfg.batch / s.topo.replicas) + s.topo.shard_rank * s.per_rank;
  double loss_sum = 0.0;
  for (int64_t a = 0; a < s.per_rank; a += s.micro) {
    const at::Tensor batch = s.train_data->rows(step, first_row + a, s.micro).to(s.device);
    autocast::set_enabled(s.device.type(), cfg.bf16);
    at::Tensor loss = s.lm->loss(batch).to(at::kFloat) * (double(s.micro) / double(s.per_rank));
    autocast::set_enabled(s.device.type(), false);
    at::autocast::clear_cache();
    if (inject.at(step + 1, s.topo.world->rank())) loss = loss * NAN;
    {
      // In the last micro-batch's backward each unit's gradients become final as it finishes.
      std::optional<shard::ExchangeInBackward> early_exchange;
      if (cfg.exchange_in_backward && a + s.micro >= s.per_rank) {
        early_exchange.emplace(s.lm->units(), *s.optimizer);
      }
      loss.backward();
    }
    loss_sum += loss.item<double>();
  }
  return loss_sum;
}

// Why the ranks stop after this step, the same on every rank.
struct StopVote {
  int signal = 0;     // a stop signal caught on some rank (the first in SIGTERM, SIGINT, SIGUSR1)
  int signalled = 0;  // ranks that caught one
  bool out_of_time = false;  // --max-time, on rank 0's clock
  bool stop() const { return signalled > 0 || out_of_time; }
};

// A step that has ended, its metrics not yet reduced over the ranks.
struct PendingStep {
  StepMetrics metrics;                          // all but the reduced values
  std::array<double, kReducedMetrics> local{};  // this rank's (pack_step_metrics)
};

// What the ranks agree on in a step.
struct StepAgreement {
  int64_t nonfinite_ranks = 0;  // ranks whose loss or a gradient is not finite: skip the step
  StopVote vote;                // stop after this step
};

// A step's one collective over the world (besides the optimizer's exchange), after the forward
// and backward and before the optimizer step: whether every rank's loss and gradients are
// finite, the stop vote (a stop signal caught by any rank, or --max-time run out on rank 0's
// clock), and the metrics of the step before, `pending`, which it reduces over the ranks. So
// the exchange that the optimizer step starts is alone on the link between nodes until the next
// step's agreement: under --overlap-step it travels behind that step's forward and backward
// (a collective after it would wait in the link's queue behind its bytes). A few dozen bytes,
// whatever the world's size.
StepAgreement agree(const Session& s, bool finite, Clock::time_point started,
                    std::optional<PendingStep>& pending) {
  const auto& world = s.topo.world;
  const int mine = StopSignals::received();
  const bool root_out_of_time =
      world->rank() == 0 && s.cfg.max_time > 0 && seconds_since(started) >= s.cfg.max_time;
  // [non-finite, ranks that caught each stop signal, max-time, the pending metrics]
  constexpr int64_t kFirstMetric = 2 + kStopSignals;
  at::Tensor sums = at::zeros({kFirstMetric + kReducedMetrics}, at::kDouble);
  double* v = sums.data_ptr<double>();
  v[0] = finite ? 0 : 1;
  for (int i = 0; i < kStopSignals; ++i) v[1 + i] = mine == stop_signal(i) ? 1 : 0;
  v[1 + kStopSignals] = root_out_of_time ? 1 : 0;
  if (pending) std::copy(pending->local.begin(), pending->local.end(), v + kFirstMetric);
  world->all_reduce(sums, comm::ReduceOp::Sum);
  StepAgreement a;
  a.nonfinite_ranks = int64_t(v[0]);
  for (int i = 0; i < kStopSignals; ++i) {
    if (v[1 + i] > 0 && a.vote.signal == 0) a.vote.signal = stop_signal(i);
    a.vote.signalled += int(v[1 + i]);
  }
  a.vote.out_of_time = v[1 + kStopSignals] > 0;
  if (pending) unpack_step_metrics(v + kFirstMetric, world->size(), pending->metrics);
  return a;
}

// Collective: reduces the pending step's metrics over the ranks and records them, when no
// agreement is to carry them: before a checkpoint is written (a resumed run keeps the metrics
// of the steps its checkpoint holds), which the last step of a run always writes.
void reduce_pending(const Session& s, std::optional<PendingStep>& pending, RunLog& log) {
  if (!pending) return;
  at::Tensor sums = at::empty({kReducedMetrics}, at::kDouble);
  std::copy(pending->local.begin(), pending->local.end(), sums.data_ptr<double>());
  s.topo.world->all_reduce(sums, comm::ReduceOp::Sum);
  unpack_step_metrics(sums.data_ptr<double>(), s.topo.world->size(), pending->metrics);
  log.record(pending->metrics);
  pending.reset();
}

// The checkpoint a --resume names, checked against this run's options before any work; empty
// for a fresh run. --resume auto: --out's newest valid checkpoint if it has any checkpoint
// folder (none valid: bad input, not a fresh start over a run), else a fresh run.
std::filesystem::path checked_resume(const TrainConfig& config, const comm::Communicator& world) {
  if (config.resume.empty()) return {};
  const bool automatic = config.resume == "auto";
  if (automatic && list_checkpoints(config.out).empty()) return {};
  const std::filesystem::path from =
      find_checkpoint(automatic ? config.out : config.resume, world.rank() == 0);
  TrainConfig resolved = config;
  apply_init_from(resolved);
  resolved.resolve();
  check_resumable(read_manifest(from).at("config"), resolved, from.string());
  return from;
}

// --second-moment auto on a resume keeps the kind of second moment the checkpoint holds
// (optim::resumed_second_moment: the rule Python's FlexDeMo keeps too), so that a run resized
// across auto's choice (4 replicas) continues its statistics: where that is not the kind auto
// chose here, the session's optimizer is made again with it (collective). Another kind asked for
// is refused in one line. Returns the line that says what was kept, or nothing.
std::string keep_checkpoint_second_moment(Session& s, const std::filesystem::path& from) {
  if (from.empty()) return "";
  const optim::OptimizerOptions asked = optimizer_options(s.cfg);
  const optim::SavedSecondMoment saved =
      optim::saved_second_moment(state_file_names(from, /*rank=*/0));
  optim::OptimizerOptions kept;
  try {
    kept = optim::resumed_second_moment(asked, s.topo.replicas, saved);
  } catch (const optim::OptionsError& e) {
    throw std::invalid_argument("--resume: " + from.string() + ": " + e.spelled(flag_of));
  }
  if (kept.second_moment == asked.second_moment) return "";
  s.cfg.second_moment = kept.second_moment;  // and so in the checkpoints this run writes
  s.cfg.second_moment_every = kept.second_moment_every;
  s.cfg.second_moment_values = kept.second_moment_values;
  s.optimizer.reset();  // one optimizer's state in memory at a time
  s.optimizer = std::make_unique<optim::Optimizer>(s.params, optimizer_options(s.cfg),
                                                   s.topo.replica_group, s.topo.shard_group);
  return fmt::format(
      "--second-moment auto: the checkpoint's {} second moment kept (auto chooses by the "
      "replicas a run starts on: shared from {})",
      name_of(kept.second_moment), optim::kSharedSecondMomentReplicas);
}

// Collective: the line of a run stopped by a signal. It counts the ranks that caught one by now:
// a signal forwarded to every rank (mpirun does) can reach some after they voted, while others
// waited in the vote.
void report_stop(comm::Communicator& world, StopVote vote, int64_t step, const TrainConfig& cfg,
                 const std::string& checkpoint) {
  at::Tensor caught = at::full({1}, int64_t(StopSignals::received() != 0 ? 1 : 0), at::kLong);
  world.all_reduce(caught, comm::ReduceOp::Sum);
  vote.signalled = int(caught.item<int64_t>());
  if (world.rank() != 0) return;
  std::fflush(stdout);  // the summary line first, this one last
  std::fprintf(stderr,
               "flexdemo: stopped by %s (caught on %d rank%s) after step %ld of %ld: checkpoint %s "
               "written; continue with --resume %s\n",
               signal_name(vote.signal).c_str(), vote.signalled, vote.signalled == 1 ? "" : "s",
               long(step), long(cfg.steps), checkpoint.c_str(), cfg.out.c_str());
}

}  // namespace

int run_training(const TrainConfig& config, std::shared_ptr<comm::Communicator> world) {
  const StopSignals signals;  // from here on, a stop signal is noted; the run stops at a step's end
  const std::filesystem::path resume_from = checked_resume(config, *world);
  const std::unique_ptr<Session> session = open_session(config, world);
  Session& s = *session;
  const TrainConfig& cfg = s.cfg;
  const std::string kept_moment = keep_checkpoint_second_moment(s, resume_from);
  int64_t step = resume_from.empty() ? 0 : load_checkpoint(s, resume_from, true);
  const Injection inject = Injection::from_env("FLEXDEMO_INJECT_NONFINITE");
  const Injection inject_signal = Injection::from_env("FLEXDEMO_INJECT_SIGNAL");
  const PayloadInjection inject_payload = PayloadInjection::from_env();
  const PeerNames peer_names(s);
  RunLog log(s, step);
  if (!kept_moment.empty() && world->rank() == 0) fmt::print("{}\n", kept_moment);
  optim::LinkBudget link({s.optimizer.get()}, {s.topo.world}, s.topo.replica_group, step);
  comm::TrafficMeter meter(s.topo);
  int64_t skipped_steps = 0;
  const Clock::time_point started = Clock::now();
  StopVote vote;
  std::optional<PendingStep> pending;  // the step before, until this step's agreement
  std::string checkpoint;              // the newest written
  while (step < cfg.steps && !vote.stop()) {
    const Clock::time_point t0 = Clock::now();
    int64_t peers_left_out = 0;
    std::optional<optim::LinkChoice> link_choice = link.before_step(step);
    if (link_choice && world->rank() == 0) {
      fmt::print("{}\n", link_choice->describe());
      std::fflush(stdout);
    }
    const Clock::time_point computing = Clock::now();
    s.optimizer->set_lr(scheduled_lr(cfg, step));
    s.optimizer->zero_grad();
    if (const PayloadInjection::Entry* tamper = inject_payload.at(step + 1, world->rank())) {
      s.optimizer->tamper_next_exchange(tamper->how, tamper->factor);
    }
    const double loss = forward_backward(s, step, inject);
    link.add_compute(seconds_since(computing));
    if (inject_signal.at(step + 1, world->rank())) std::raise(SIGTERM);
    const StepAgreement agreed =
        agree(s, std::isfinite(loss) && optim::all_finite(s.params), started, pending);
    vote = agreed.vote;
    if (pending) {
      log.record(pending->metrics);
      pending.reset();
    }
    if (agreed.nonfinite_ranks > 0) {
      if (cfg.on_nonfinite == NonFinitePolicy::Stop) {
        throw std::runtime_error(fmt::format(
            "non-finite loss or gradient at step {} on {} rank(s); stopping (--on-nonfinite "
            "skip would skip such steps)",
            step + 1, agreed.nonfinite_ranks));
      }
      s.optimizer->zero_grad();  // nothing reaches the residuals or the parameters
      ++skipped_steps;
      if (world->rank() == 0) {
        fmt::print(stderr,
                   "flexdemo: step {}: non-finite loss or gradient on {} rank(s); step skipped "
                   "(--on-nonfinite skip)\n",
                   step + 1, agreed.nonfinite_ranks);
      }
    } else {
      if (cfg.clip > 0) optim::clip_grad_norm(s.params, cfg.clip, *s.topo.shard_group);
      try {
        s.optimizer->step();
      } catch (const optim::PeerFaultError& e) {
        throw std::runtime_error(fmt::format("step {}: {}; stopping (--on-bad-peer stop)", step + 1,
                                             peer_names.describe(s, e.fault())));
      }
      peers_left_out = report_peer_faults(s, peer_names, step + 1);
    }
    ++step;
    if (cfg.check_replicas > 0 && step % cfg.check_replicas == 0) {
      check_replicas(s.optimizer->replicated_params(), s.topo.replica_group, world, step);
    }
    pending.emplace();
    StepMetrics& m = pending->metrics;
    pack_step_metrics(loss, seconds_since(t0), meter.lap(), peers_left_out, pending->local.data());
    m.step = step;
    m.elapsed_s = log.elapsed_s();
    m.lr = scheduled_lr(cfg, step - 1);
    m.skipped_steps = skipped_steps;
    m.link_choice = std::move(link_choice);
    if (link.active()) m.schedule = s.optimizer->schedule_in_flight();
    const bool last = step == cfg.steps || vote.stop();
    // Stopped by a signal, the time left is the scheduler's grace period: checkpoint, no eval.
    const bool final_eval = step == cfg.steps || (vote.out_of_time && vote.signalled == 0);
    if ((cfg.eval_every > 0 && step % cfg.eval_every == 0) || final_eval) m.val_loss = evaluate(s);
    // The last step always writes one, so no step's metrics are left pending after the loop.
    if ((cfg.checkpoint_every > 0 && step % cfg.checkpoint_every == 0) || last) {
      reduce_pending(s, pending, log);  // metrics.jsonl holds every step a checkpoint has
      checkpoint = save_checkpoint(s, step).string();
    }
  }
  log.finish(step);
  if (vote.signalled == 0 || step == cfg.steps) {
    if (vote.out_of_time && world->rank() == 0) {
      fmt::print("stopping after step {} of {}: --max-time {} s reached (checkpoint written)\n",
                 step, cfg.steps, cfg.max_time);
    }
    return 0;
  }
  report_stop(*world, vote, step, cfg, checkpoint);
  return kExitStopped;
}

void check_replicas(const std::vector<at::Tensor>& shards,
                    const std::shared_ptr<comm::Communicator>& replica_group,
                    const std::shared_ptr<comm::Communicator>& world, int64_t step) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (const at::Tensor& shard : shards) {
    const at::Tensor t = shard.detach().to(at::kCPU).contiguous();
    crc =
        crc32_z(crc, static_cast<const Bytef*>(t.data_ptr()), size_t(t.numel()) * t.element_size());
  }
  const int R = replica_group->size();
  at::Tensor all = at::empty({R}, at::kLong);
  replica_group->all_gather(at::full({1}, int64_t(crc), at::kLong), all);
  std::string differing;
  for (int r = 1; r < R; ++r) {
    if (all[r].item<int64_t>() != all[0].item<int64_t>()) differing += " " + std::to_string(r);
  }
  at::Tensor bad = at::full({1}, int64_t(differing.empty() ? 0 : 1), at::kLong);
  world->all_reduce(bad, comm::ReduceOp::Sum);
  if (bad.item<int64_t>() > 0) {
    throw std::runtime_error(
        "replica drift at step " + std::to_string(step) + ": " +
        (differing.empty()
             ? std::string("another replica group's parameters differ")
             : "replicas" + differing + " differ from replica 0 (CRC-32 of the shards)"));
  }
}

}  // namespace flexdemo::train
