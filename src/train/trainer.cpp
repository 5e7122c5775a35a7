// The training loop: each step's global batch is split across replicas, then across the ranks
// of a shard group; micro-batches accumulate; the gradient is clipped by its global norm across
// the shards; the optimizer exchanges between replicas; metrics are summed over ranks.
#include "flexdemo/train.h"

#include "flexdemo/checkpoint.h"
#include "flexdemo/comm.h"
#include "flexdemo/data.h"
#include "flexdemo/model.h"
#include "flexdemo/optim.h"
#include "flexdemo/runtime.h"
#include "flexdemo/topology.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <fmt/core.h>
#include <zlib.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

namespace flexdemo::train {

namespace {

// The model a config asks for: the preset, with the dimensions given (> 0) overriding it.
model::GptConfig gpt_config(const TrainConfig& cfg, int64_t vocab) {
  model::GptConfig mc = model::gpt_preset(cfg.model, vocab);
  if (cfg.width > 0) mc.width = cfg.width;
  if (cfg.layers > 0) mc.layers = cfg.layers;
  if (cfg.heads > 0) mc.heads = cfg.heads;
  if (cfg.context > 0) mc.context = cfg.context;
  mc.dropout = cfg.dropout;
  return mc;
}

model::T5Config t5_config(const TrainConfig& cfg, int64_t vocab) {
  model::T5Config tc = model::t5_preset(cfg.model, vocab);
  if (cfg.width > 0) tc.width = cfg.width;
  if (cfg.layers > 0) tc.layers = cfg.layers;
  if (cfg.heads > 0) tc.heads = cfg.heads;
  return tc;
}

bool is_t5(const TrainConfig& cfg) {
  return cfg.model.rfind("t5-", 0) == 0;
}

std::string str(double v) {
  return fmt::format("{}", v);
}

}  // namespace

// Everything that can be checked without data or other ranks, so that bad input fails at once.
void TrainConfig::validate() const {
  auto fail = [](const std::string& what) { throw std::invalid_argument(what); };
  const auto& presets = model::model_presets();
  if (std::find(presets.begin(), presets.end(), model) == presets.end()) {
    fail("unknown --model '" + model +
         "'; accepted: gpt-nano, gpt-micro, gpt2-small, t5-nano, t5-small");
  }
  for (auto [value, name] : {std::pair{width, "width"}, std::pair{layers, "layers"},
                             std::pair{heads, "heads"}, std::pair{context, "context"}}) {
    if (value < 0) {
      fail(fmt::format("--{} must be >= 0 (0: the preset's), got {}", name, value));
    }
  }
  if (tokenizer != "bpe" && tokenizer != "bytes") {
    fail("unknown --tokenizer '" + tokenizer + "'; accepted: bpe, bytes");
  }
  if (tokenizer == "bpe" && (vocab < 260 || vocab > 65535)) {
    fail("--vocab must be in [260, 65535], got " + std::to_string(vocab));
  }
  if (steps < 1) fail("--steps must be >= 1, got " + std::to_string(steps));
  if (batch < 1) fail("--batch must be >= 1, got " + std::to_string(batch));
  if (micro_batch < 0) fail("--micro-batch must be >= 0, got " + std::to_string(micro_batch));
  if (seq < 1) fail("--seq must be >= 1, got " + std::to_string(seq));
  if (!(lr > 0)) fail("--lr must be > 0, got " + str(lr));
  if (warmup < 0) fail("--warmup must be >= 0, got " + std::to_string(warmup));
  if (!(min_lr_ratio >= 0 && min_lr_ratio <= 1)) {
    fail("--min-lr-ratio must be in [0, 1], got " + str(min_lr_ratio));
  }
  if (!(clip >= 0)) fail("--clip must be >= 0, got " + str(clip));
  if (optimizer != "flexdemo" && optimizer != "flexdemo-adamw" && optimizer != "adamw" &&
      optimizer != "sgd") {
    fail("unknown --optimizer '" + optimizer + "'; accepted: flexdemo, flexdemo-adamw, adamw, sgd");
  }
  if (eval_every < 0) fail("--eval-every must be >= 0, got " + std::to_string(eval_every));
  if (eval_seqs < 1) fail("--eval-seqs must be >= 1, got " + std::to_string(eval_seqs));
  if (progress != "auto" && progress != "bar" && progress != "lines") {
    fail("unknown --progress '" + progress + "'; accepted: auto, bar, lines");
  }
  if (log_every < 1) fail("--log-every must be >= 1, got " + std::to_string(log_every));
  if (threads < 1) fail("--threads must be >= 1, got " + std::to_string(threads));
  if (on_nonfinite != "skip" && on_nonfinite != "stop") {
    fail("unknown --on-nonfinite '" + on_nonfinite + "'; accepted: skip, stop");
  }
  if (check_replicas < 0) {
    fail("--check-replicas must be >= 0, got " + std::to_string(check_replicas));
  }
  if (checkpoint_every < 0) {
    fail("--checkpoint-every must be >= 0, got " + std::to_string(checkpoint_every));
  }
  if (topk < 1) fail("--topk must be >= 1, got " + std::to_string(topk));
  if (chunk < 1) fail("--chunk must be >= 1, got " + std::to_string(chunk));
  if (topk > chunk * chunk) {
    fail(fmt::format("--topk {} exceeds the {} coefficients of a --chunk {} chunk", topk,
                     chunk * chunk, chunk));
  }
  if (!(decay >= 0 && decay < 1)) fail("--decay must be in [0, 1), got " + str(decay));
  if (values != "fp32" && values != "bf16" && values != "int8" && values != "1bit") {
    fail("unknown --values '" + values + "'; accepted: fp32, bf16, int8, 1bit");
  }
  if (!replicator.empty() && replicator != "demo" && replicator != "full" && replicator != "none" &&
      replicator != "random") {
    fail("unknown --replicator '" + replicator + "'; accepted: demo, full, none, random");
  }
  if (replicate_every < 1) {
    fail("--replicate-every must be >= 1, got " + std::to_string(replicate_every));
  }
  const bool demo = optimizer == "flexdemo" || optimizer == "flexdemo-adamw";
  const bool demo_replicator = replicator == "demo" || (replicator.empty() && demo);
  if (overlap_step && !demo_replicator) {
    fail("--overlap-step needs the demo replicator (--optimizer flexdemo or flexdemo-adamw)");
  }
  if (exchange_in_backward) {
    // A unit's payloads leave during the backward: nothing may change its gradient afterwards.
    if (!demo_replicator) {
      fail("--exchange-in-backward needs the demo replicator (--optimizer flexdemo or "
           "flexdemo-adamw)");
    }
    if (overlap_step) fail("--exchange-in-backward and --overlap-step exclude each other");
    if (clip != 0) {
      fail("--exchange-in-backward needs --clip 0 (clipping scales by the whole gradient's norm, "
           "known only after the backward), got --clip " + str(clip));
    }
    if (on_nonfinite != "stop") {
      fail("--exchange-in-backward needs --on-nonfinite stop (a skipped step would already have "
           "sent its payloads), got --on-nonfinite " + on_nonfinite);
    }
  }
  if (!(weight_decay >= 0 && lr * weight_decay < 1)) {
    fail("--weight-decay must be >= 0 with --lr x --weight-decay < 1, got " + str(weight_decay));
  }
  if (ranks_per_node < 0) {
    fail("--ranks-per-node must be >= 0 (0: from MPI), got " + std::to_string(ranks_per_node));
  }
  if (shard_size < 0) {
    fail("--shard-size must be >= 0 (0: the whole node), got " + std::to_string(shard_size));
  }
  if (is_t5(*this)) {
    t5_config(*this, 260).validate();
  } else {
    const model::GptConfig mc = gpt_config(*this, 260);
    mc.validate();
    if (seq > mc.context) {
      fail(fmt::format("--seq {} exceeds the model's context {} (set --context)", seq, mc.context));
    }
  }
  if (keep_checkpoints < 1) {
    fail("--keep-checkpoints must be >= 1, got " + std::to_string(keep_checkpoints));
  }
  if (!(comm_timeout >= 0)) {
    fail("--comm-timeout must be >= 0 seconds (0: wait forever), got " + str(comm_timeout));
  }
  if (out.empty()) fail("--out must not be empty");
}

namespace {

nlohmann::ordered_json to_json(const TrainConfig& c) {
  return {{"model", c.model},
          {"width", c.width},
          {"layers", c.layers},
          {"heads", c.heads},
          {"context", c.context},
          {"dropout", c.dropout},
          {"data", c.data},
          {"tokenizer", c.tokenizer},
          {"vocab", c.vocab},
          {"steps", c.steps},
          {"batch", c.batch},
          {"micro_batch", c.micro_batch},
          {"seq", c.seq},
          {"lr", c.lr},
          {"warmup", c.warmup},
          {"min_lr_ratio", c.min_lr_ratio},
          {"clip", c.clip},
          {"weight_decay", c.weight_decay},
          {"optimizer", c.optimizer},
          {"replicator", c.replicator},
          {"sign", c.sign == 1},
          {"topk", c.topk},
          {"chunk", c.chunk},
          {"decay", c.decay},
          {"values", c.values},
          {"replicate_every", c.replicate_every},
          {"overlap_step", c.overlap_step},
          {"exchange_in_backward", c.exchange_in_backward},
          {"ranks_per_node", c.ranks_per_node},
          {"shard_size", c.shard_size},
          {"reshard", c.reshard},
          {"eval_every", c.eval_every},
          {"eval_seqs", c.eval_seqs},
          {"log_every", c.log_every},
          {"progress", c.progress},
          {"out", c.out},
          {"seed", c.seed},
          {"threads", c.threads},
          {"bf16", c.bf16},
          {"check_replicas", c.check_replicas},
          {"on_nonfinite", c.on_nonfinite},
          {"checkpoint_every", c.checkpoint_every},
          {"keep_checkpoints", c.keep_checkpoints},
          {"comm_timeout", c.comm_timeout}};
}

// The optimizer a --optimizer name stands for; --replicator and --sign override.
optim::DemoOptions optimizer_options(TrainConfig& c) {
  optim::DemoOptions o;
  const bool demo = c.optimizer == "flexdemo" || c.optimizer == "flexdemo-adamw";
  o.inner = c.optimizer == "flexdemo" || c.optimizer == "sgd" ? optim::InnerKind::SignSgd
                                                              : optim::InnerKind::AdamW;
  if (c.replicator.empty()) c.replicator = demo ? "demo" : "full";
  o.replicator = optim::parse_replicator_kind(c.replicator);
  if (c.sign < 0) c.sign = c.optimizer == "flexdemo" ? 1 : 0;
  o.sign = c.sign == 1;
  o.lr = c.lr;
  o.weight_decay = c.weight_decay;
  o.topk = c.topk;
  o.chunk = c.chunk;
  o.decay = c.decay;
  o.values = compress::parse_value_encoding(c.values);
  o.replicate_every = c.replicate_every;
  o.overlap_step = c.overlap_step;
  o.seed = c.seed;
  o.validate();
  return o;
}

double scheduled_lr(const TrainConfig& c, int64_t step) {
  if (step < c.warmup) return c.lr * double(step + 1) / double(c.warmup);
  const double span = std::max<int64_t>(1, c.steps - c.warmup);
  const double progress = std::min(1.0, double(step - c.warmup) / span);
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return c.lr * (c.min_lr_ratio + (1.0 - c.min_lr_ratio) * cosine);
}

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

// Everything a run needs, built the same way for training, evaluation and generation.
struct Session {
  TrainConfig cfg;
  optim::DemoOptions options;
  comm::Topology topo;
  data::TokenData tokens;
  std::unique_ptr<data::BatchSampler> train_data, val_data;
  std::unique_ptr<model::LanguageModel> lm;
  std::vector<optim::OptimParam> params;
  std::unique_ptr<optim::DemoOptimizer> optimizer;
  int64_t per_rank = 0, micro = 0;
  // --exchange-in-backward: on during the last micro-batch's backward, when a unit's gradients
  // becoming complete means they are final for the step.
  bool exchange_armed = false;
};

// Collective: rank 0's `error` (if not empty) is thrown on every rank, as std::invalid_argument
// when it is bad input; otherwise the other ranks would wait for rank 0 forever.
void raise_on_every_rank(comm::Communicator& world, const std::string& error, bool bad_input) {
  at::Tensor head = at::tensor({int64_t(error.size()), int64_t(bad_input)}, at::kLong);
  world.broadcast(head, 0);
  const int64_t length = head[0].item<int64_t>();
  if (length == 0) return;
  at::Tensor text = at::empty({length}, at::kByte);
  if (world.rank() == 0) std::memcpy(text.data_ptr(), error.data(), size_t(length));
  world.broadcast(text, 0);
  const std::string message(static_cast<const char*>(text.data_ptr()), size_t(length));
  if (head[1].item<int64_t>()) throw std::invalid_argument(message);
  throw std::runtime_error(message);
}

TrainConfig config_from_json(const nlohmann::json& j) {
  TrainConfig c;
  c.model = j.value("model", c.model);
  c.width = j.value("width", c.width);
  c.layers = j.value("layers", c.layers);
  c.heads = j.value("heads", c.heads);
  c.context = j.value("context", c.context);
  c.data = j.value("data", c.data);
  c.tokenizer = j.value("tokenizer", c.tokenizer);
  c.vocab = j.value("vocab", c.vocab);
  c.seq = j.value("seq", c.seq);
  c.chunk = j.value("chunk", c.chunk);
  c.seed = j.value("seed", c.seed);
  return c;
}

std::unique_ptr<Session> open_session(const TrainConfig& config,
                                      std::shared_ptr<comm::Communicator> world) {
  auto s = std::make_unique<Session>();
  TrainConfig& cfg = s->cfg;
  cfg = config;
  cfg.validate();
  set_num_threads(cfg.threads);
  at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
  s->options = optimizer_options(cfg);
  s->topo = comm::make_topology(world, {cfg.ranks_per_node, cfg.shard_size});
  const int P = world->size();
  const bool root = world->rank() == 0;
  if (cfg.batch % P != 0) {
    throw std::invalid_argument("--batch " + std::to_string(cfg.batch) +
                                " does not divide across the " + std::to_string(P) + " ranks");
  }
  s->per_rank = cfg.batch / P;
  s->micro = cfg.micro_batch > 0 ? cfg.micro_batch : s->per_rank;
  if (s->per_rank % s->micro != 0) {
    throw std::invalid_argument("--micro-batch " + std::to_string(s->micro) +
                                " does not divide the " + std::to_string(s->per_rank) +
                                " sequences of each rank");
  }

  // Data: rank 0 tokenizes (once per corpus, cached; this can take long, so no collective
  // timeout yet), the others read its cache. Its error is raised on every rank.
  comm::set_collective_timeout(0);
  const std::string helper = data::default_tokenize_helper();
  std::string error;
  bool bad_input = false;
  if (root) {
    try {
      s->tokens = data::load_token_data(cfg.data, cfg.tokenizer, cfg.vocab, helper);
    } catch (const std::invalid_argument& e) {
      error = e.what(), bad_input = true;
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  raise_on_every_rank(*world, error, bad_input);
  if (!root) s->tokens = data::load_token_data(cfg.data, cfg.tokenizer, cfg.vocab, helper);
  comm::set_collective_timeout(cfg.comm_timeout);
  for (const auto& [part, tokens] :
       {std::pair{"training", &s->tokens.train}, std::pair{"validation", &s->tokens.val}}) {
    if (int64_t(tokens->size()) < cfg.seq + 1) {
      throw std::invalid_argument(fmt::format(
          "--data {} holds {} {} tokens, fewer than one sequence of --seq {} + 1 (every 20th "
          "document is held out for validation)",
          cfg.data, tokens->size(), part, cfg.seq));
    }
  }
  s->train_data = std::make_unique<data::BatchSampler>(s->tokens.train, cfg.seq, cfg.seed);
  s->val_data = std::make_unique<data::BatchSampler>(s->tokens.val, cfg.seq, cfg.seed);

  shard::ShardOptions so;
  so.chunk = cfg.chunk;
  so.reshard_after_forward = cfg.reshard;
  if (is_t5(cfg)) {
    model::T5Config tc = t5_config(cfg, s->tokens.vocab_size);
    tc.eot = s->tokens.eot;
    s->lm = model::make_t5(tc, s->topo.shard_group, so, cfg.seed);
  } else {
    s->lm =
        model::make_gpt(gpt_config(cfg, s->tokens.vocab_size), s->topo.shard_group, so, cfg.seed);
  }
  std::vector<std::vector<size_t>> unit_tensors;  // the optimizer's indices of each unit's
  for (const auto& unit : s->lm->units()) {
    unit_tensors.emplace_back();
    for (const auto& p : unit->optim_params()) {
      unit_tensors.back().push_back(s->params.size());
      s->params.push_back(p);
    }
  }
  s->optimizer =
      std::make_unique<optim::DemoOptimizer>(s->params, s->options, s->topo.replica_group);
  if (cfg.exchange_in_backward) {
    // The backward reaches the units in the same order on every replica, so their buckets'
    // all-gathers start in the same order everywhere.
    for (size_t u = 0; u < unit_tensors.size(); ++u) {
      s->lm->units()[u]->on_gradients_ready([session = s.get(), tensors = unit_tensors[u]] {
        if (session->exchange_armed) session->optimizer->start_exchange(tensors);
      });
    }
  }
  return s;
}

// ====== Checkpoints ======
uint32_t file_crc32(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> buf(1 << 20);
  uLong crc = crc32(0L, Z_NULL, 0);
  while (in.read(buf.data(), std::streamsize(buf.size())) || in.gcount() > 0) {
    crc = crc32_z(crc, reinterpret_cast<const Bytef*>(buf.data()), size_t(in.gcount()));
  }
  return uint32_t(crc);
}

void sync_file(const std::filesystem::path& path) {  // a file's or a folder's contents to disk
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// A run keeps its checkpoints in OUT/checkpoints/step-N/: model.safetensors,
// optimizer-rank<r>.safetensors and manifest.json, written last with every file's CRC-32.
// A checkpoint is written into step-N.tmp/ and renamed into place: it is whole or absent.
namespace fs = std::filesystem;

fs::path checkpoints_root(const std::string& out) {
  return fs::path(out) / "checkpoints";
}

nlohmann::json read_manifest(const fs::path& dir) {
  std::ifstream in(dir / "manifest.json");
  if (!in) throw std::invalid_argument("no checkpoint in " + dir.string() + " (no manifest.json)");
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception&) {
    throw std::invalid_argument("checkpoint " + dir.string() +
                                " is damaged: manifest.json is not JSON");
  }
}

// Why a checkpoint folder cannot be used, or "" when it is complete and every file passes its
// CRC-32.
std::string checkpoint_damage(const fs::path& dir) {
  if (!fs::exists(dir / "manifest.json")) return "manifest.json is missing";
  try {
    const nlohmann::json manifest = read_manifest(dir);
    const auto& files = manifest.at("files");
    if (!files.is_object() || !files.contains("model.safetensors") ||
        !manifest.at("step").is_number_integer() ||
        !manifest.at("world_size").is_number_integer() || !manifest.at("topology").is_string() ||
        !manifest.at("config").is_object()) {
      return "manifest.json is incomplete";
    }
    for (const auto& [file, crc] : files.items()) {
      if (!crc.is_number_integer()) return "manifest.json holds a bad checksum for " + file;
      if (file.find('/') != std::string::npos || !fs::is_regular_file(dir / file) ||
          int64_t(file_crc32(dir / file)) != crc.get<int64_t>()) {
        return file + " is missing or fails its CRC-32";
      }
    }
  } catch (const std::exception&) {
    return "manifest.json is not a checkpoint manifest";
  }
  return "";
}

int64_t step_of(const fs::path& dir) {  // step-N -> N; -1 for anything else
  const std::string name = dir.filename().string();
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return -1;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
  }
  return std::stoll(name.substr(5));
}

// A run's checkpoint folders, newest first.
std::vector<fs::path> list_checkpoints(const fs::path& run) {
  std::vector<fs::path> dirs;
  if (fs::is_directory(checkpoints_root(run.string()))) {
    for (const auto& e : fs::directory_iterator(checkpoints_root(run.string()))) {
      if (e.is_directory() && step_of(e.path()) >= 0) dirs.push_back(e.path());
    }
  }
  std::sort(dirs.begin(), dirs.end(),
            [](const fs::path& a, const fs::path& b) { return step_of(a) > step_of(b); });
  return dirs;
}

// The checkpoint `where` names: a checkpoint folder (refused if damaged), or a run folder, whose
// newest valid checkpoint is taken; damaged newer ones are reported on stderr when `report`.
fs::path find_checkpoint(const std::string& where, bool report) {
  const fs::path p(where);
  if (!fs::is_directory(p)) {
    throw std::invalid_argument("no checkpoint at " + where + ": no such folder");
  }
  if (fs::exists(p / "manifest.json")) {
    const std::string damage = checkpoint_damage(p);
    if (!damage.empty()) {
      throw std::invalid_argument("checkpoint " + where + " is damaged: " + damage);
    }
    return p;
  }
  std::string reasons;
  std::vector<std::string> skipped;
  for (const fs::path& dir : list_checkpoints(p)) {
    const std::string damage = checkpoint_damage(dir);
    if (damage.empty()) {
      for (const std::string& line : skipped) {
        if (report) std::fprintf(stderr, "flexdemo: warning: %s\n", line.c_str());
      }
      return dir;
    }
    skipped.push_back("skipping damaged checkpoint " + dir.string() + ": " + damage);
    reasons += "; " + dir.filename().string() + ": " + damage;
  }
  throw std::invalid_argument(
      "no valid checkpoint in " + where +
      (reasons.empty() ? " (expected checkpoints/step-N/ folders)" : reasons));
}

// The options a resumed run must share with the run that wrote the checkpoint: they define
// the model, the data order and the optimizer state.
const char* const kResumeKeys[] = {
    "model",        "width",        "layers", "heads",      "context",   "data",
    "tokenizer",    "vocab",        "batch",  "seq",        "optimizer", "replicator",
    "sign",         "topk",         "chunk",  "decay",      "values",    "replicate_every",
    "weight_decay", "overlap_step", "seed",   "micro_batch"};

void check_resumable(const nlohmann::json& manifest, const nlohmann::ordered_json& run,
                     const std::string& where) {
  const auto& saved = manifest.at("config");
  for (const char* key : kResumeKeys) {
    if (saved.contains(key) && saved[key].dump() != run[key].dump()) {
      std::string option = key;
      std::replace(option.begin(), option.end(), '_', '-');
      throw std::invalid_argument("--resume: " + where + " was written with --" + option + " " +
                                  saved[key].dump() + ", this run has " + run[key].dump() +
                                  " (options that define the model, data and optimizer state "
                                  "must match)");
    }
  }
}

// Collective: the full parameters (rank 0 writes them), every rank's optimizer state and
// random state, and the manifest; then only the newest cfg.keep_checkpoints are kept.
void save_checkpoint(Session& s, int64_t step) {
  const auto& world = s.topo.world;
  const bool root = world->rank() == 0;
  const fs::path root_dir = checkpoints_root(s.cfg.out);
  const fs::path dir = root_dir / ("step-" + std::to_string(step));
  const fs::path tmp = root_dir / ("step-" + std::to_string(step) + ".tmp");
  if (root) {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  world->barrier();
  NamedTensors model_tensors;
  for (size_t u = 0; u < s.lm->units().size(); ++u) {
    const std::vector<at::Tensor> full = s.lm->units()[u]->gather();
    for (size_t i = 0; i < full.size(); ++i) {
      model_tensors.push_back({s.lm->param_names()[u][i], full[i]});
    }
  }
  if (root) {
    write_safetensors((tmp / "model.safetensors").string(), model_tensors,
                      {{"format", "pt"}, {"model", s.lm->describe()}});
  }
  NamedTensors state = s.optimizer->state_tensors();
  state.push_back({"rng_state", at::detail::getDefaultCPUGenerator().get_state()});
  const std::string mine = "optimizer-rank" + std::to_string(world->rank()) + ".safetensors";
  write_safetensors((tmp / mine).string(), state);
  // Every file's CRC-32 goes into the manifest, which is written last.
  at::Tensor crcs = at::empty({world->size()}, at::kLong);
  world->all_gather(at::full({1}, int64_t(file_crc32(tmp / mine)), at::kLong), crcs);
  if (root) {
    nlohmann::ordered_json manifest;
    manifest["files"]["model.safetensors"] = file_crc32(tmp / "model.safetensors");
    for (int r = 0; r < world->size(); ++r) {
      manifest["files"]["optimizer-rank" + std::to_string(r) + ".safetensors"] =
          crcs[r].item<int64_t>();
    }
    manifest["step"] = step;
    manifest["data_position"] = {{"seed", s.cfg.seed}, {"next_step", step}};
    manifest["world_size"] = world->size();
    manifest["topology"] = s.topo.describe();
    manifest["config"] = to_json(s.cfg);
    std::ofstream(tmp / "manifest.json") << manifest.dump(2) << "\n";
    sync_file(tmp / "manifest.json");
    sync_file(tmp);
    fs::remove_all(dir);
    fs::rename(tmp, dir);
    sync_file(root_dir);  // the rename itself
    const std::vector<fs::path> kept = list_checkpoints(s.cfg.out);
    for (size_t i = size_t(s.cfg.keep_checkpoints); i < kept.size(); ++i) fs::remove_all(kept[i]);
  }
  world->barrier();
}

// Loads weights (any topology) from checkpoint folder `dir` and, when `with_optimizer`, this
// rank's optimizer state (the same topology only). Returns the checkpoint's step.
int64_t load_checkpoint(Session& s, const fs::path& dir, bool with_optimizer) {
  const nlohmann::json manifest = read_manifest(dir);
  const auto& world = s.topo.world;
  std::map<std::string, at::Tensor> weights;
  for (auto& [name, t] : read_safetensors((dir / "model.safetensors").string())) weights[name] = t;
  for (size_t u = 0; u < s.lm->units().size(); ++u) {
    std::vector<at::Tensor> full;
    for (const std::string& name : s.lm->param_names()[u]) {
      auto it = weights.find(name);
      if (it == weights.end()) {
        throw std::invalid_argument(dir.string() + ": the checkpoint has no tensor " + name);
      }
      full.push_back(it->second);
    }
    s.lm->units()[u]->load(full);
  }
  const int64_t step = manifest.at("step").get<int64_t>();
  if (!with_optimizer) return step;
  if (manifest.at("world_size").get<int>() != world->size() ||
      manifest.at("topology").get<std::string>() != s.topo.describe()) {
    throw std::invalid_argument("--resume: " + dir.string() + " was written by " +
                                manifest.at("topology").get<std::string>() + "; this run is " +
                                s.topo.describe() + " (the topology must match)");
  }
  std::map<std::string, at::Tensor> saved;
  for (auto& [name, t] : read_safetensors(
           (dir / ("optimizer-rank" + std::to_string(world->rank()) + ".safetensors")).string())) {
    saved[name] = t;
  }
  at::NoGradGuard no_grad;
  for (auto& [name, t] : s.optimizer->state_tensors()) {
    auto it = saved.find(name);
    if (it == saved.end() || it->second.sizes() != t.sizes()) {
      throw std::invalid_argument("--resume: optimizer state " + name +
                                  " is missing or of another shape (other options?)");
    }
    t.copy_(it->second);
  }
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  gen.set_state(saved.at("rng_state"));
  s.optimizer->restore_steps(step);
  return step;
}

// Mean validation loss over eval_seqs windows shared by all ranks.
double evaluate(Session& s) {
  at::NoGradGuard no_grad;
  const auto& world = s.topo.world;
  const int64_t mine = std::max<int64_t>(1, s.cfg.eval_seqs / world->size());
  double sum = 0.0;
  for (int64_t done = 0; done < mine; done += s.micro) {
    const int64_t n = std::min(s.micro, mine - done);
    sum += s.lm->loss(s.val_data->windows(world->rank() * mine + done, n)).item<double>() * n;
  }
  at::Tensor mean = at::full({1}, sum / double(mine), at::kDouble);
  world->all_reduce(mean, comm::ReduceOp::Avg);
  return mean.item<double>();
}

}  // namespace

void check_replicas(const std::vector<at::Tensor>& shards,
                    const std::shared_ptr<comm::Communicator>& replica_group,
                    const std::shared_ptr<comm::Communicator>& world, int64_t step) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (const at::Tensor& shard : shards) {
    const at::Tensor t = shard.detach().contiguous();
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

int run_training(const TrainConfig& config, std::shared_ptr<comm::Communicator> world) {
  // A resumed run is checked against its checkpoint before any work.
  fs::path resume_from;
  nlohmann::json resume_manifest;
  if (!config.resume.empty()) {
    resume_from = find_checkpoint(config.resume, world->rank() == 0);
    resume_manifest = read_manifest(resume_from);
    TrainConfig resolved = config;
    optimizer_options(resolved);
    check_resumable(resume_manifest, to_json(resolved), resume_from.string());
  }
  auto session = open_session(config, world);
  Session& s = *session;
  const TrainConfig& cfg = s.cfg;
  const comm::Topology& topo = s.topo;
  const data::TokenData& tokens = s.tokens;
  const data::BatchSampler& train_data = *s.train_data;
  model::LanguageModel* lm = s.lm.get();
  std::vector<optim::OptimParam>& params = s.params;
  optim::DemoOptimizer& optimizer = *s.optimizer;
  const int64_t per_rank = s.per_rank, micro = s.micro;
  const int P = world->size();
  const bool root = world->rank() == 0;
  const int64_t start_step = cfg.resume.empty() ? 0 : load_checkpoint(s, resume_from, true);
  int64_t skipped_steps = 0;
  // Testing aid: FLEXDEMO_INJECT_NONFINITE="STEP:RANK" makes that rank's loss NaN at that step.
  int64_t inject_step = -1, inject_rank = -1;
  if (const char* inject = std::getenv("FLEXDEMO_INJECT_NONFINITE")) {
    if (std::sscanf(inject, "%ld:%ld", &inject_step, &inject_rank) != 2) {
      throw std::invalid_argument(std::string("FLEXDEMO_INJECT_NONFINITE must be STEP:RANK, got ") +
                                  inject);
    }
  }

  // Outputs (rank 0).
  std::ofstream metrics;
  if (root) {
    fs::create_directories(cfg.out);
    nlohmann::ordered_json resolved = to_json(cfg);
    resolved["topology"] = topo.describe();
    resolved["model_description"] = lm->describe();
    resolved["num_params"] = lm->num_params();
    resolved["vocab_size"] = tokens.vocab_size;
    std::ofstream(fs::path(cfg.out) / "config.json") << resolved.dump(2) << "\n";
    const fs::path metrics_path = fs::path(cfg.out) / "metrics.jsonl";
    // A resumed run continues the metrics of the steps its checkpoint holds; lines written after
    // that checkpoint (by a run that then died) are dropped, so each step appears once.
    std::string kept;
    if (start_step > 0) {
      std::ifstream in(metrics_path);
      for (std::string line; std::getline(in, line);) {
        const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (j.is_object() && j.value("step", int64_t(0)) <= start_step) kept += line + "\n";
      }
    }
    metrics.open(metrics_path, std::ios::trunc);
    metrics << kept;
    fmt::print("flexdemo train: {}; {}; {} + {} replicator; global batch {} x {} tokens\n",
               topo.describe(), lm->describe(), cfg.optimizer, cfg.replicator, cfg.batch, cfg.seq);
    std::fflush(stdout);
  }

  comm::TrafficMeter meter(topo);
  // mpirun hands ranks a terminal even when its own output goes to a file: --progress decides.
  const bool terminal =
      root && (cfg.progress == "bar" || (cfg.progress == "auto" && isatty(STDOUT_FILENO)));
  const int64_t first_row =
      topo.replica_rank * (cfg.batch / topo.replicas) + topo.shard_rank * per_rank;
  double val_loss = NAN, inter_bytes_total = 0.0, seconds_total = 0.0;
  const auto started = std::chrono::steady_clock::now();
  for (int64_t step = start_step; step < cfg.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    const double lr = scheduled_lr(cfg, step);
    optimizer.set_lr(lr);
    optimizer.zero_grad();
    double loss_sum = 0.0;
    for (int64_t a = 0; a < per_rank; a += micro) {
      const at::Tensor batch = train_data.rows(step, first_row + a, micro);
      at::Tensor loss;
      {
        at::autocast::set_cpu_enabled(cfg.bf16);
        loss = lm->loss(batch).to(at::kFloat) * (double(micro) / double(per_rank));
        at::autocast::set_cpu_enabled(false);
        at::autocast::clear_cache();
      }
      if (inject_step == step + 1 && inject_rank == world->rank()) loss = loss * NAN;
      s.exchange_armed = cfg.exchange_in_backward && a + micro >= per_rank;
      loss.backward();
      s.exchange_armed = false;
      loss_sum += loss.item<double>();
    }
    // A non-finite loss or gradient on any rank: every rank skips the step (or stops) alike.
    bool finite = std::isfinite(loss_sum);
    for (const auto& p : params) {
      if (finite && p.leaf.grad().defined())
        finite = at::isfinite(p.leaf.grad()).all().item<bool>();
    }
    at::Tensor nonfinite_ranks = at::full({1}, int64_t(finite ? 0 : 1), at::kLong);
    world->all_reduce(nonfinite_ranks, comm::ReduceOp::Sum);
    const bool skip = nonfinite_ranks.item<int64_t>() > 0;
    if (skip && cfg.on_nonfinite == "stop") {
      throw std::runtime_error(fmt::format(
          "non-finite loss or gradient at step {} on {} rank(s); stopping (--on-nonfinite skip "
          "would skip such steps)",
          step + 1, nonfinite_ranks.item<int64_t>()));
    }
    skipped_steps += skip ? 1 : 0;
    if (skip) optimizer.zero_grad();  // nothing reaches the residuals or the parameters
    if (cfg.clip > 0 && !skip) {  // the replica's full gradient norm, from the shards of its group
      at::Tensor sq = at::zeros({1}, at::kDouble);
      for (const auto& p : params) {
        if (p.leaf.grad().defined()) sq += p.leaf.grad().to(at::kDouble).pow(2).sum();
      }
      topo.shard_group->all_reduce(sq, comm::ReduceOp::Sum);
      const double norm = std::sqrt(sq.item<double>());
      if (norm > cfg.clip) {
        for (auto& p : params) {
          if (p.leaf.grad().defined()) p.leaf.mutable_grad().mul_(cfg.clip / norm);
        }
      }
    }
    if (!skip) optimizer.step();
    if (cfg.check_replicas > 0 && (step + 1) % cfg.check_replicas == 0) {
      check_replicas(optimizer.replicated_params(), topo.replica_group, world, step + 1);
    }
    const comm::StepTraffic traffic = meter.lap();
    const double step_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    // Summed over ranks: bytes; averaged: loss and times.
    at::Tensor sums = at::tensor({double(traffic.intra_sent), double(traffic.intra_received),
                                  double(traffic.inter_sent), double(traffic.inter_received)},
                                 at::kDouble);
    world->all_reduce(sums, comm::ReduceOp::Sum);
    at::Tensor means = at::tensor({loss_sum, step_s, traffic.intra_seconds + traffic.inter_seconds,
                                   double(traffic.inter_collectives)},
                                  at::kDouble);
    world->all_reduce(means, comm::ReduceOp::Avg);
    const bool eval_now =
        (cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0) || step + 1 == cfg.steps;
    if (eval_now) val_loss = evaluate(s);
    seconds_total += means[1].item<double>();
    inter_bytes_total += sums[2].item<double>();

    if (root) {
      nlohmann::ordered_json m;
      m["step"] = step + 1;
      m["loss"] = means[0].item<double>();
      m["lr"] = lr;
      m["tokens"] = (step + 1) * cfg.batch * cfg.seq;
      m["step_ms"] = 1e3 * means[1].item<double>();
      m["compute_ms"] = 1e3 * (means[1].item<double>() - means[2].item<double>());
      m["comm_ms"] = 1e3 * means[2].item<double>();
      m["intra_bytes_sent"] = int64_t(sums[0].item<double>());
      m["intra_bytes_recv"] = int64_t(sums[1].item<double>());
      m["inter_bytes_sent"] = int64_t(sums[2].item<double>());
      m["inter_bytes_recv"] = int64_t(sums[3].item<double>());
      m["inter_collectives"] = means[3].item<double>();
      m["skipped_steps"] = skipped_steps;
      m["elapsed_s"] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      if (eval_now) m["val_loss"] = val_loss;
      metrics << m.dump() << "\n" << std::flush;

      const double elapsed = m["elapsed_s"].get<double>();
      const double done = double(step + 1 - start_step);
      const double eta = elapsed / done * double(cfg.steps - step - 1);
      const double tokens_per_s = done * double(cfg.batch * cfg.seq) / elapsed;
      const std::string line =
          fmt::format("step {}/{}  loss {:.4f}{}  {:.0f} tok/s  {} between nodes/step  ETA {}",
                      step + 1, cfg.steps, m["loss"].get<double>(),
                      eval_now ? fmt::format("  val {:.4f}", val_loss) : std::string(),
                      tokens_per_s, human_bytes(sums[2].item<double>()), human_seconds(eta));
      if (terminal) {
        fmt::print("\r{:<100}", line);
        if (eval_now || step + 1 == cfg.steps) fmt::print("\n");
      } else if ((step + 1) % cfg.log_every == 0 || eval_now || step == 0) {
        fmt::print("{}\n", line);
      }
      std::fflush(stdout);
    }
    if ((cfg.checkpoint_every > 0 && (step + 1) % cfg.checkpoint_every == 0) ||
        step + 1 == cfg.steps) {
      save_checkpoint(s, step + 1);
    }
  }

  at::Tensor rss = at::full({1}, peak_rss_mb(), at::kDouble);
  at::Tensor all_rss = at::empty({P}, at::kDouble);
  world->all_gather(rss, all_rss);  // the largest rank's peak
  if (root) {
    nlohmann::ordered_json summary;
    summary["final_val_loss"] = val_loss;
    const double steps_run = double(std::max<int64_t>(1, cfg.steps - start_step));
    summary["tokens_per_s"] = steps_run * double(cfg.batch * cfg.seq) / seconds_total;
    summary["inter_bytes_per_step"] = inter_bytes_total / steps_run;
    summary["peak_rss_mb"] = all_rss.max().item<double>();
    summary["steps"] = cfg.steps;
    summary["optimizer"] = cfg.optimizer;
    summary["replicator"] = cfg.replicator;
    std::ofstream(fs::path(cfg.out) / "summary.json") << summary.dump(2) << "\n";
    fmt::print(
        "final validation loss {:.4f}; {:.0f} tokens/s; {} between nodes per step; "
        "outputs in {}\n",
        val_loss, summary["tokens_per_s"].get<double>(),
        human_bytes(summary["inter_bytes_per_step"].get<double>()), cfg.out);
  }
  return 0;
}

// ====== Evaluation and generation ======
namespace {

// A session on `world` holding a checkpoint's weights (its model and data; any topology).
std::unique_ptr<Session> open_checkpoint(const std::string& checkpoint, int64_t eval_seqs,
                                         std::shared_ptr<comm::Communicator> world) {
  const fs::path dir = find_checkpoint(checkpoint, world->rank() == 0);
  TrainConfig c = config_from_json(read_manifest(dir).at("config"));
  c.batch = world->size();
  c.eval_seqs = eval_seqs;
  auto s = open_session(c, world);
  load_checkpoint(*s, dir, /*with_optimizer=*/false);
  return s;
}

// Runs the tokenizer helper on `input`, returns its standard output.
std::string run_helper(const std::string& args, const std::string& input) {
  namespace fs = std::filesystem;
  const fs::path in = fs::temp_directory_path() / ("flexdemo-gen-" + std::to_string(getpid()));
  std::ofstream(in) << input;
  const std::string cmd =
      "'" + data::default_tokenize_helper() + "' " + args + " < '" + in.string() + "'";
  std::string out;
  if (FILE* pipe = popen(cmd.c_str(), "r")) {
    char buf[4096];
    for (size_t n; (n = fread(buf, 1, sizeof(buf), pipe)) > 0;) out.append(buf, n);
    if (pclose(pipe) != 0) throw std::runtime_error("tokenizer helper failed: " + cmd);
  }
  fs::remove(in);
  return out;
}

}  // namespace

int run_eval(const std::string& checkpoint, int64_t eval_seqs,
             std::shared_ptr<comm::Communicator> world) {
  if (eval_seqs < 1) throw std::invalid_argument("--eval-seqs must be >= 1");
  auto s = open_checkpoint(checkpoint, eval_seqs, world);
  const double loss = evaluate(*s);
  if (world->rank() == 0) {
    nlohmann::ordered_json out = {{"checkpoint", checkpoint},
                                  {"val_loss", loss},
                                  {"perplexity", std::exp(loss)},
                                  {"eval_seqs", eval_seqs}};
    fmt::print("{}\n", out.dump());
  }
  return 0;
}

int run_generate(const std::string& checkpoint, const GenerateOptions& o,
                 std::shared_ptr<comm::Communicator> world) {
  if (o.tokens < 0) {
    throw std::invalid_argument("--tokens must be >= 0, got " + std::to_string(o.tokens));
  }
  if (!(o.temperature >= 0)) {
    throw std::invalid_argument("--temperature must be >= 0, got " + str(o.temperature));
  }
  auto s = open_checkpoint(checkpoint, 1, world);
  const std::string model_arg =
      s->tokens.tokenizer_model.empty() ? "" : " --model '" + s->tokens.tokenizer_model + "'";
  std::vector<int64_t> ids;
  if (!o.prompt.empty()) {
    std::istringstream encoded(run_helper("encode" + model_arg, o.prompt));
    for (int64_t id; encoded >> id;) ids.push_back(id);
  }
  if (ids.empty()) ids.push_back(s->tokens.train.empty() ? 0 : s->tokens.train.back());
  at::NoGradGuard no_grad;
  at::Generator gen = at::detail::createCPUGenerator(o.seed);
  const int64_t context = s->lm->context();
  std::vector<int64_t> generated;
  for (int64_t t = 0; t < o.tokens; ++t) {
    const int64_t start = std::max<int64_t>(0, int64_t(ids.size()) - context);
    const at::Tensor window =
        at::tensor(std::vector<int64_t>(ids.begin() + start, ids.end()), at::kLong).view({1, -1});
    at::Tensor logits = s->lm->next_token_logits(window)[0];
    int64_t next = 0;
    if (o.temperature == 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      logits = logits / o.temperature;
      if (o.top_k > 0 && o.top_k < logits.numel()) {
        const at::Tensor kth = std::get<0>(logits.topk(o.top_k)).min();
        logits = logits.masked_fill(logits < kth, -INFINITY);
      }
      next = at::multinomial(at::softmax(logits, 0), 1, false, gen).item<int64_t>();
    }
    ids.push_back(next);
    generated.push_back(next);
  }
  if (world->rank() == 0) {
    std::ostringstream text;
    for (int64_t id : generated) text << id << " ";
    fmt::print("{}{}\n", o.prompt, run_helper("decode" + model_arg, text.str()));
  }
  return 0;
}

}  // namespace flexdemo::train
