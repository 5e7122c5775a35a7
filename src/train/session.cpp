// Opening a session: options checked, topology made, data tokenized once (rank 0) and read by
// all, the model built of sharded units and the optimizer over their shards; and evaluation.
#include "session.h"

#include "hf_format.h"
#include "options.h"

#include "flexdemo/comm.h"
#include "demo/kernels.h"
#include "flexdemo/runtime.h"
#include "runtime/autocast.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/core.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace flexdemo::train {

namespace {

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

// Rank 0 tokenizes (once per corpus, cached; this can take long, so no collective timeout yet),
// the others read its cache. Its error is raised on every rank.
data::TokenData load_tokens(const TrainConfig& cfg, comm::Communicator& world) {
  comm::set_collective_timeout(0);
  const std::string helper = data::default_tokenize_helper();
  const std::string tokenizer = name_of(cfg.tokenizer);
  data::TokenData tokens;
  std::string error;
  bool bad_input = false;
  if (world.rank() == 0) {
    try {
      tokens = data::load_token_data(cfg.data, tokenizer, cfg.vocab, helper, cfg.tokenizer_model);
    } catch (const std::invalid_argument& e) {
      error = e.what(), bad_input = true;
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  raise_on_every_rank(world, error, bad_input);
  if (world.rank() != 0)
    tokens = data::load_token_data(cfg.data, tokenizer, cfg.vocab, helper, cfg.tokenizer_model);
  comm::set_collective_timeout(cfg.comm_timeout);
  if (tokens.pairs) return tokens;  // (validate() checked the model)
  for (const auto& [part, split] :
       {std::pair{"training", &tokens.train}, std::pair{"validation", &tokens.val}}) {
    if (int64_t(split->size()) < cfg.seq + 1) {
      throw std::invalid_argument(fmt::format(
          "--data {} holds {} {} tokens, fewer than one sequence of --seq {} + 1 (every 20th "
          "document is held out for validation)",
          cfg.data, split->size(), part, cfg.seq));
    }
  }
  return tokens;
}

// This rank's device: --device resolved (auto: a GPU when there is one), GPU local_rank % GPUs.
at::Device choose_device(const TrainConfig& cfg, const comm::Topology& topo) {
  const bool gpus = kernels::cuda_available();
  if (cfg.device == DeviceKind::Cuda && !gpus) {
    throw std::invalid_argument(
        "--device cuda: no usable GPU (needs a CUDA build, scripts/build.sh --cuda, and a visible "
        "GPU)");
  }
  const bool cuda = cfg.device == DeviceKind::Cuda || (cfg.device == DeviceKind::Auto && gpus);
  if (!cuda) {
    for (const auto& [flag, backend] : {std::pair{"--intra-backend", cfg.intra_backend},
                                        std::pair{"--inter-backend", cfg.inter_backend}}) {
      if (backend == BackendKind::Nccl) {
        throw std::invalid_argument(fmt::format("{} nccl needs --device cuda", flag));
      }
    }
    return at::kCPU;
  }
  return at::Device(at::kCUDA, int8_t(topo.local_rank % int(at::getNumGPUs())));
}

// NCCL for the shard group (auto: on GPUs when no two ranks of the node share one) and the
// replica group (only when asked), bootstrapped through their MPI communicators.
void choose_backends(const TrainConfig& cfg, at::Device device, comm::Topology& topo) {
  if (!device.is_cuda()) return;
  const bool own_gpu = topo.ranks_per_node <= int(at::getNumGPUs());
  // Asked for, NCCL serves even a group of one rank (a smoke test); auto only where it moves data.
  if (cfg.intra_backend == BackendKind::Nccl ||
      (cfg.intra_backend == BackendKind::Auto && own_gpu && topo.shard_size > 1)) {
    topo.shard_group = comm::make_nccl_communicator(topo.shard_group, device);
  }
  if (cfg.inter_backend == BackendKind::Nccl) {
    topo.replica_group = comm::make_nccl_communicator(topo.replica_group, device);
  }
}

}  // namespace

uint64_t rank_seed(const TrainConfig& cfg, int rank) {
  return cfg.seed + 0x9e3779b97f4a7c15ull * uint64_t(rank + 1);
}

std::unique_ptr<Session> open_session(const TrainConfig& config,
                                      std::shared_ptr<comm::Communicator> world) {
  auto s = std::make_unique<Session>();
  TrainConfig& cfg = s->cfg;
  cfg = config;
  apply_init_from(cfg);
  cfg.validate();
  cfg.resolve();
  set_num_threads(cfg.threads);
  const optim::OptimizerOptions options = optimizer_options(cfg);
  s->topo = comm::make_topology(world, {cfg.ranks_per_node, cfg.shard_size, cfg.island_nodes});
  // Every draw from LibTorch's default generators (T5's span corruption, dropout) follows --seed:
  // unseeded, they start from a random seed in every process.
  at::manual_seed(rank_seed(cfg, world->rank()));
  s->device = choose_device(cfg, s->topo);
  choose_backends(cfg, s->device, s->topo);
  autocast::set_dtype(s->device.type(), at::kBFloat16);
  const int P = world->size();
  if (cfg.batch % P != 0) {
    throw std::invalid_argument(
        fmt::format("--batch {} does not divide across the {} ranks", cfg.batch, P));
  }
  s->per_rank = cfg.batch / P;
  s->micro = cfg.micro_batch > 0 ? cfg.micro_batch : s->per_rank;
  if (s->per_rank % s->micro != 0) {
    throw std::invalid_argument(fmt::format(
        "--micro-batch {} does not divide the {} sequences of each rank", s->micro, s->per_rank));
  }

  s->tokens = load_tokens(cfg, *world);
  if (s->tokens.pairs) {
    const int64_t target_seq = cfg.target_seq > 0 ? cfg.target_seq : cfg.seq;
    for (const auto& [sampler, split] :
         {std::pair{&s->train_data, &s->tokens.train}, std::pair{&s->val_data, &s->tokens.val}}) {
      *sampler =
          std::make_unique<data::PairSampler>(*split, s->tokens.eot, cfg.seq, target_seq, cfg.seed);
    }
  } else {
    s->train_data = std::make_unique<data::BatchSampler>(s->tokens.train, cfg.seq, cfg.seed);
    s->val_data = std::make_unique<data::BatchSampler>(s->tokens.val, cfg.seq, cfg.seed);
  }

  shard::ShardOptions so;
  so.chunk = cfg.chunk;
  so.reshard_after_forward = cfg.reshard;
  so.device = s->device;
  const model::ModelFamily f = family(cfg);
  if (f == model::ModelFamily::T5) {
    model::T5Config tc = t5_config(cfg, s->tokens.vocab_size);
    tc.eot = s->tokens.eot;
    if (s->tokens.pairs) tc.source_len = cfg.seq;
    s->lm = model::make_t5(tc, s->topo.shard_group, so, cfg.seed);
  } else if (f == model::ModelFamily::Llama) {
    s->lm = model::make_llama(llama_config(cfg, s->tokens.vocab_size), s->topo.shard_group, so,
                              cfg.seed);
  } else {
    s->lm =
        model::make_gpt(gpt_config(cfg, s->tokens.vocab_size), s->topo.shard_group, so, cfg.seed);
  }
  load_init_from(*s);
  s->params = shard::optim_params(s->lm->units());
  s->optimizer = std::make_unique<optim::Optimizer>(s->params, options, s->topo.replica_group,
                                                    s->topo.shard_group);
  return s;
}

double evaluate(Session& s) {
  at::NoGradGuard no_grad;
  const auto& world = s.topo.world;
  const int64_t mine = std::max<int64_t>(1, s.cfg.eval_seqs / world->size());
  // Batches weigh by the tokens they score, so the mean is the same for any batching.
  at::Tensor sums = at::zeros({2}, at::kDouble);  // loss x tokens, tokens
  for (int64_t done = 0; done < mine; done += s.micro) {
    const int64_t n = std::min(s.micro, mine - done);
    const at::Tensor windows = s.val_data->windows(world->rank() * mine + done, n);
    const double tokens = double(s.val_data->scored_tokens(windows));
    sums[0] += s.lm->loss(windows.to(s.device)).item<double>() * tokens;
    sums[1] += tokens;
  }
  world->all_reduce(sums, comm::ReduceOp::Sum);
  return (sums[0] / sums[1]).item<double>();
}

}  // namespace flexdemo::train
