// Training checkpoints on disk (see checkpoint_store.h): atomic folders, CRC-32 per file in the
// manifest, the newest valid one found on resume, old ones pruned.
#include "checkpoint_store.h"

#include "options.h"

#include "flexdemo/comm.h"
#include "flexdemo/link_budget.h"
#include "flexdemo/safetensors.h"
#include "flexdemo/shard.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <zlib.h>

#include <fcntl.h>
#include <unistd.h>
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <vector>

namespace flexdemo::train {

namespace fs = std::filesystem;

namespace {

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

fs::path checkpoints_root(const std::string& out) {
  return fs::path(out) / "checkpoints";
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

// This rank's optimizer and random state, as this rank wrote them (the same topology).
void load_own_state(Session& s, const fs::path& dir) {
  const std::map<std::string, at::Tensor> saved = read_state_file(dir, s.topo.world->rank());
  at::NoGradGuard no_grad;
  for (auto& [name, t] : s.optimizer->state_tensors()) {
    auto it = saved.find(name);
    if (it == saved.end() && owner_residual_state(name)) {
      t.zero_();
      continue;
    }
    if (it == saved.end() || it->second.sizes() != t.sizes()) {
      throw std::invalid_argument("--resume: optimizer state " + name +
                                  " is missing or of another shape (other options?)");
    }
    t.copy_(it->second);
  }
  fold_owner_residual(s, [&saved](const std::string& name, const at::Tensor& like) {
    auto it = saved.find(name);
    return it == saved.end() || it->second.sizes() != like.sizes() ? at::Tensor() : it->second;
  });
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  gen.set_state(saved.at("rng_state"));
}

}  // namespace

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

fs::path save_checkpoint(Session& s, int64_t step) {
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
  // Every file's CRC-32 goes into the manifest, which is written last, with each rank's place
  // (its replica and shard: what elastic resume needs to find a replica's shards).
  at::Tensor crcs = at::empty({world->size()}, at::kLong);
  world->all_gather(at::full({1}, int64_t(file_crc32(tmp / mine)), at::kLong), crcs);
  at::Tensor places = at::empty({world->size(), 2}, at::kLong);
  world->all_gather(
      at::tensor({int64_t(s.topo.replica_rank), int64_t(s.topo.shard_rank)}, at::kLong), places);
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
    manifest["ranks"] = nlohmann::ordered_json::array();  // [replica, shard] of each world rank
    for (int r = 0; r < world->size(); ++r) {
      manifest["ranks"].push_back({places[r][0].item<int64_t>(), places[r][1].item<int64_t>()});
    }
    manifest["config"] = to_json(s.cfg);
    if (s.cfg.link_budget == LinkBudgetMode::Auto) {  // a schedule that changes while training
      const optim::ScheduleState e = optim::schedule_state(*s.optimizer);
      manifest["exchange"] = {
          {"topk", e.set.topk},
          {"values", name_of(e.set.values)},
          {"every", e.set.every},
          {"in_flight", {{"topk", e.in_flight.topk}, {"values", name_of(e.in_flight.values)}}},
          {"exchanges", e.counters.exchanges},
          {"folded", e.counters.folded}};
    }
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
  return dir;
}

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
  // --link-budget auto: the schedule of the exchange in flight sizes its payloads in the state;
  // the schedule set takes over after them.
  std::optional<optim::ScheduleState> schedule;
  if (manifest.contains("exchange")) {
    const nlohmann::json& e = manifest.at("exchange");
    const int64_t every = e.at("every").get<int64_t>();
    const auto read = [every](const nlohmann::json& j) {
      return optim::ExchangeSchedule{
          j.at("topk").get<int64_t>(),
          parse_name<compress::ValueEncoding>(j.at("values").get<std::string>()), every};
    };
    schedule = optim::ScheduleState{
        read(e), read(e.at("in_flight")),
        {e.at("exchanges").get<int64_t>(), e.at("folded").get<int64_t>()}};
    optim::restore_schedule_before_state(*s.optimizer, *schedule);
  }
  if (manifest.at("world_size").get<int>() == world->size() &&
      manifest.at("topology").get<std::string>() == s.topo.describe()) {
    load_own_state(s, dir);
  } else {
    load_state_elastic(s, dir, manifest, step);
  }
  if (schedule) {
    optim::restore_schedule_after_state(*s.optimizer, *schedule, step);
  } else {
    s.optimizer->restore_steps(step);
  }
  return step;
}

bool is_transformers_folder(const std::string& where) {
  const fs::path config = fs::path(where) / "config.json";
  if (!fs::is_regular_file(config) || fs::exists(fs::path(where) / "checkpoints")) return false;
  try {
    return nlohmann::json::parse(std::ifstream(config)).contains("architectures");
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

std::unique_ptr<Session> open_checkpoint(const std::string& where, int64_t eval_seqs,
                                         std::shared_ptr<comm::Communicator> world) {
  if (is_transformers_folder(where)) {  // its model, on the default data
    TrainConfig c;
    c.init_from = where;
    c.batch = world->size();
    c.eval_seqs = eval_seqs;
    return open_session(c, world);
  }
  const fs::path dir = find_checkpoint(where, world->rank() == 0);
  TrainConfig c = model_config_from_json(read_manifest(dir).at("config"));
  c.batch = world->size();
  c.eval_seqs = eval_seqs;
  auto s = open_session(c, world);
  load_checkpoint(*s, dir, /*with_optimizer=*/false);
  return s;
}

}  // namespace flexdemo::train
