// Inference on a checkpoint: `flexdemo eval` (validation loss and perplexity on any number of
// ranks) and `flexdemo generate` (text from a GPT; the tokenizer helper encodes and decodes).
#include "checkpoint_store.h"
#include "options.h"
#include "session.h"

#include "flexdemo/comm.h"
#include "flexdemo/train.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace flexdemo::train {

namespace {

// A session on `world` holding a checkpoint's weights (its model and data; any topology).
std::unique_ptr<Session> open_checkpoint(const std::string& checkpoint, int64_t eval_seqs,
                                         std::shared_ptr<comm::Communicator> world) {
  const std::filesystem::path dir = find_checkpoint(checkpoint, world->rank() == 0);
  TrainConfig c = model_config_from_json(read_manifest(dir).at("config"));
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
    throw std::invalid_argument(fmt::format("--temperature must be >= 0, got {}", o.temperature));
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
    at::Tensor logits = s->lm->next_token_logits(window.to(s->device))[0].to(at::kCPU, at::kFloat);
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
