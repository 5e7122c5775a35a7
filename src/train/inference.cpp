// Inference on a checkpoint: `flexdemo eval` (validation loss and perplexity on any number of
// ranks; chrF of translations for a T5 trained on pairs) and `flexdemo generate` (text from a
// GPT, a translation from such a T5; the tokenizer helper encodes and decodes).
#include "checkpoint_store.h"
#include "options.h"
#include "session.h"

#include "flexdemo/comm.h"
#include "flexdemo/safetensors.h"
#include "flexdemo/text.h"
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
#include <iterator>
#include <sstream>

namespace flexdemo::train {

namespace {

std::string model_arg(const Session& s) {
  return s.tokens.tokenizer_model.empty() ? "" : " --model '" + s.tokens.tokenizer_model + "'";
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

// Token ids of texts (one helper call for all), and texts of id sequences.
std::vector<std::vector<int64_t>> encode_texts(const Session& s,
                                               const std::vector<std::string>& texts) {
  std::string input;
  for (const std::string& t : texts) input += nlohmann::json(t).dump() + "\n";
  std::istringstream out(run_helper("encode --lines" + model_arg(s), input));
  std::vector<std::vector<int64_t>> ids;
  for (std::string line; std::getline(out, line);) {
    std::istringstream row(line);
    ids.emplace_back(std::istream_iterator<int64_t>(row), std::istream_iterator<int64_t>());
  }
  return ids;
}

std::vector<std::string> decode_ids(const Session& s,
                                    const std::vector<std::vector<int64_t>>& ids) {
  std::string input;
  for (const auto& row : ids) {
    for (int64_t id : row) input += std::to_string(id) + " ";
    input += "\n";
  }
  std::istringstream out(run_helper("decode --lines" + model_arg(s), input));
  std::vector<std::string> texts;
  for (std::string line; std::getline(out, line);) {
    texts.push_back(nlohmann::json::parse(line).get<std::string>());
  }
  return texts;
}

// Sources (token ids) as a [B, longest] tensor padded with -1 on the session's device.
at::Tensor padded(const Session& s, const std::vector<std::vector<int64_t>>& rows) {
  size_t longest = 1;
  for (const auto& r : rows) longest = std::max(longest, r.size());
  at::Tensor out = at::full({int64_t(rows.size()), int64_t(longest)}, int64_t(-1), at::kLong);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!rows[i].empty()) {
      out[int64_t(i)].narrow(0, 0, int64_t(rows[i].size())).copy_(at::tensor(rows[i], at::kLong));
    }
  }
  return out.to(s.device);
}

// Greedy translations of a batch of sources (ids ending in end-of-text): the likeliest next
// token until end-of-text or max_len tokens; the result holds no end-of-text.
std::vector<std::vector<int64_t>> translate_greedy(Session& s,
                                                   const std::vector<std::vector<int64_t>>& sources,
                                                   int64_t max_len) {
  const int64_t eot = s.tokens.eot, B = int64_t(sources.size());
  const at::Tensor source = padded(s, sources);
  const at::Tensor encoded = s.lm->encode(source);
  at::Tensor prefix = at::full({B, 1}, eot, at::dtype(at::kLong).device(s.device));
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(B));
  std::vector<bool> done(static_cast<size_t>(B), false);
  for (int64_t t = 0; t < max_len; ++t) {
    const at::Tensor next = s.lm->next_target_logits(encoded, source, prefix).argmax(1).cpu();
    bool all_done = true;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t id = next[b].item<int64_t>();
      if (!done[size_t(b)] && id == eot) done[size_t(b)] = true;
      if (!done[size_t(b)]) out[size_t(b)].push_back(id);
      all_done = all_done && done[size_t(b)];
    }
    if (all_done) break;
    prefix = at::cat({prefix, next.view({B, 1}).to(s.device)}, 1);
  }
  return out;
}

// Beam search over one source: `beams` hypotheses extended by their likeliest tokens; one that
// ends in end-of-text is finished, scored by its log-probability divided by its length (with
// the end-of-text); stops when `beams` are finished or at max_len. With one beam: greedy.
std::vector<int64_t> translate_beam(Session& s, const std::vector<int64_t>& source_ids,
                                    int64_t max_len, int64_t beams) {
  const int64_t eot = s.tokens.eot;
  const at::Tensor source1 = padded(s, {source_ids});
  const at::Tensor encoded1 = s.lm->encode(source1);
  struct Hypothesis {
    std::vector<int64_t> ids;  // after the decoder's start
    double logp = 0.0;
  };
  std::vector<Hypothesis> alive = {{}}, finished;
  std::vector<double> finished_score;
  for (int64_t t = 0; t < max_len && !alive.empty() && int64_t(finished.size()) < beams; ++t) {
    const int64_t k = int64_t(alive.size());
    at::Tensor prefix = at::full({k, t + 1}, eot, at::kLong);
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = 0; j < t; ++j) prefix[i][j + 1] = alive[size_t(i)].ids[size_t(j)];
    }
    const at::Tensor logits =
        s.lm->next_target_logits(encoded1.expand({k, encoded1.size(1), encoded1.size(2)}),
                                 source1.expand({k, source1.size(1)}), prefix.to(s.device));
    at::Tensor total = at::log_softmax(logits.to(at::kDouble), 1).cpu();
    for (int64_t i = 0; i < k; ++i) total[i].add_(alive[size_t(i)].logp);
    const auto [values, flat] = total.view(-1).topk(std::min<int64_t>(2 * beams, total.numel()));
    std::vector<Hypothesis> next;
    for (int64_t c = 0; c < flat.numel() && int64_t(next.size()) < beams; ++c) {
      const int64_t from = flat[c].item<int64_t>() / total.size(1);
      const int64_t id = flat[c].item<int64_t>() % total.size(1);
      Hypothesis h{alive[size_t(from)].ids, values[c].item<double>()};
      if (id == eot) {
        if (int64_t(finished.size()) < beams) {
          finished_score.push_back(h.logp / double(h.ids.size() + 1));
          finished.push_back(std::move(h));
        }
      } else {
        h.ids.push_back(id);
        next.push_back(std::move(h));
      }
    }
    alive = std::move(next);
  }
  if (finished.empty()) {  // none ended within max_len: the likeliest unfinished one
    for (const Hypothesis& h : alive) {
      finished_score.push_back(h.logp / double(h.ids.size()));
      finished.push_back(h);
    }
  }
  const size_t best = size_t(std::max_element(finished_score.begin(), finished_score.end()) -
                             finished_score.begin());
  return finished[best].ids;
}

// Translations of sources: greedy in batches (beams 1), else beam search one by one.
std::vector<std::vector<int64_t>> translate(Session& s,
                                            const std::vector<std::vector<int64_t>>& sources,
                                            int64_t max_len, int64_t beams) {
  at::NoGradGuard no_grad;
  std::vector<std::vector<int64_t>> out;
  constexpr size_t kBatch = 32;
  for (size_t first = 0; first<sources.size(); first += beams> 1 ? 1 : kBatch) {
    if (beams > 1) {
      out.push_back(translate_beam(s, sources[first], max_len, beams));
      continue;
    }
    const size_t n = std::min(kBatch, sources.size() - first);
    for (auto& t :
         translate_greedy(s,
                          std::vector<std::vector<int64_t>>(sources.begin() + int64_t(first),
                                                            sources.begin() + int64_t(first + n)),
                          max_len)) {
      out.push_back(std::move(t));
    }
  }
  return out;
}

// A JSON list of token id lists of one length, each id in [0, vocab).
at::Tensor id_rows(const nlohmann::json& rows, const std::string& what, int64_t vocab,
                   size_t min_length) {
  const std::string file = "--tokens " + what;
  std::vector<std::vector<int64_t>> list;
  try {
    list = rows.get<std::vector<std::vector<int64_t>>>();
  } catch (const nlohmann::json::exception&) {
    throw std::invalid_argument(file + ": expected lists of token ids of one length");
  }
  if (list.empty()) throw std::invalid_argument(file + ": no rows");
  for (const auto& row : list) {
    if (row.size() < min_length || row.size() != list[0].size()) {
      throw std::invalid_argument(
          fmt::format("{}: rows must have one length of at least {} ids", file, min_length));
    }
    for (int64_t id : row) {
      if (id < 0 || id >= vocab) {
        throw std::invalid_argument(
            fmt::format("{}: id {} is outside the vocabulary [0, {})", file, id, vocab));
      }
    }
  }
  at::Tensor ids = at::empty({int64_t(list.size()), int64_t(list[0].size())}, at::kLong);
  for (size_t i = 0; i < list.size(); ++i) ids[int64_t(i)].copy_(at::tensor(list[i], at::kLong));
  return ids;
}

// eval --tokens: the rows' mean next-token loss, printed, and their next-token logits. A decoder
// reads [[ids...], ...]; an encoder-decoder {"source": [[...]], "target": [[...]]}, scored by
// teacher forcing (the decoder starts with end-of-text) whatever it was trained on.
int score_tokens(Session& s, const std::string& checkpoint, const EvalOptions& o) {
  std::ifstream in(o.tokens);
  if (!in) throw std::invalid_argument("--tokens: cannot read " + o.tokens);
  nlohmann::json file;
  try {
    file = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception&) {
    throw std::invalid_argument("--tokens " + o.tokens + ": not JSON");
  }
  const int64_t vocab = s.tokens.vocab_size + (s.lm->seq2seq() ? model::kT5Sentinels : 0);
  at::NoGradGuard no_grad;
  double loss = 0;
  at::Tensor logits;
  int64_t rows = 0;
  if (s.lm->seq2seq()) {
    if (!file.is_object() || !file.contains("source") || !file.contains("target")) {
      throw std::invalid_argument(
          "--tokens " + o.tokens +
          ": an encoder-decoder reads {\"source\": [[ids]], \"target\": [[ids]]}");
    }
    const at::Tensor source = id_rows(file["source"], o.tokens, vocab, 1).to(s.device);
    const at::Tensor target = id_rows(file["target"], o.tokens, vocab, 1).to(s.device);
    if (source.size(0) != target.size(0)) {
      throw std::invalid_argument("--tokens " + o.tokens + ": as many sources as targets");
    }
    rows = source.size(0);
    const at::Tensor encoded = s.lm->encode(source);
    const at::Tensor start = at::full({rows, 1}, int64_t(s.tokens.eot), target.options());
    const at::Tensor decoder_in = at::cat({start, target}, 1);
    for (int64_t t = 0; t < target.size(1); ++t) {
      const at::Tensor next =
          s.lm->next_target_logits(encoded, source, decoder_in.narrow(1, 0, t + 1));
      loss += at::cross_entropy_loss(next, target.select(1, t)).item<double>();
    }
    loss /= double(target.size(1));
    logits = s.lm->next_target_logits(encoded, source, decoder_in);
  } else {
    const at::Tensor ids = id_rows(file, o.tokens, vocab, 2).to(s.device);
    if (ids.size(1) > s.lm->context()) {
      throw std::invalid_argument(fmt::format("--tokens {}: rows of {} ids exceed the context {}",
                                              o.tokens, ids.size(1), s.lm->context()));
    }
    rows = ids.size(0);
    loss = s.lm->loss(ids).item<double>();
    logits = s.lm->next_token_logits(ids);
  }
  if (!o.logits.empty() && s.topo.world->rank() == 0) {
    write_safetensors(o.logits, {{"next_token_logits", logits.to(at::kCPU, at::kFloat)}});
  }
  const nlohmann::ordered_json out = {
      {"checkpoint", checkpoint}, {"tokens", o.tokens}, {"rows", rows}, {"loss", loss}};
  if (s.topo.world->rank() == 0) fmt::print("{}\n", out.dump());
  return 0;
}

}  // namespace

int run_eval(const std::string& checkpoint, const EvalOptions& o,
             std::shared_ptr<comm::Communicator> world) {
  if (o.eval_seqs < 1) throw std::invalid_argument("--eval-seqs must be >= 1");
  if (o.translate < 0) {
    throw std::invalid_argument("--translate must be >= 0, got " + std::to_string(o.translate));
  }
  if (o.beam < 1) throw std::invalid_argument("--beam must be >= 1, got " + std::to_string(o.beam));
  auto s = open_checkpoint(checkpoint, o.eval_seqs, world);
  if (!o.tokens.empty()) return score_tokens(*s, checkpoint, o);
  if (!o.logits.empty()) throw std::invalid_argument("--logits needs --tokens");
  const double loss = evaluate(*s);
  nlohmann::ordered_json out = {{"checkpoint", checkpoint},
                                {"val_loss", loss},
                                {"perplexity", std::exp(loss)},
                                {"eval_seqs", o.eval_seqs}};
  if (s->tokens.pairs && o.translate > 0) {
    // The first validation pairs, sources cut as in training, references whole.
    std::vector<std::vector<int64_t>> sources, references;
    std::vector<int64_t> side;
    for (int32_t id : s->tokens.val) {
      side.push_back(id);
      if (id != s->tokens.eot) continue;
      if (sources.size() == references.size()) {
        if (int64_t(side.size()) > s->cfg.seq) {
          side.resize(size_t(s->cfg.seq));
          side.back() = s->tokens.eot;
        }
        sources.push_back(side);
      } else {
        side.pop_back();
        references.push_back(side);
        if (int64_t(references.size()) == o.translate) break;
      }
      side.clear();
    }
    const int64_t max_len = s->cfg.target_seq > 0 ? s->cfg.target_seq : s->cfg.seq;
    const std::vector<std::vector<int64_t>> hypotheses = translate(*s, sources, max_len, o.beam);
    std::vector<std::vector<int64_t>> both = hypotheses;
    both.insert(both.end(), references.begin(), references.end());
    const std::vector<std::string> texts = decode_ids(*s, both);
    const std::vector<std::string> hyp_texts(texts.begin(),
                                             texts.begin() + int64_t(hypotheses.size()));
    const std::vector<std::string> ref_texts(texts.begin() + int64_t(hypotheses.size()),
                                             texts.end());
    out["chrf"] = data::chrf(hyp_texts, ref_texts);
    out["translated"] = hypotheses.size();
    out["beam"] = o.beam;
  }
  if (world->rank() == 0) fmt::print("{}\n", out.dump());
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
  if (o.beam < 1) throw std::invalid_argument("--beam must be >= 1, got " + std::to_string(o.beam));
  auto s = open_checkpoint(checkpoint, 1, world);
  std::vector<int64_t> ids;
  if (!o.prompt.empty()) ids = encode_texts(*s, {o.prompt}).at(0);
  // A T5 trained on pairs, or one from transformers, translates; span corruption's throws below.
  if (s->lm->seq2seq() && (s->tokens.pairs || !s->cfg.init_from.empty())) {
    if (int64_t(ids.size()) >= s->cfg.seq) ids.resize(size_t(s->cfg.seq - 1));
    ids.push_back(s->tokens.eot);
    const std::vector<int64_t> target = translate(*s, {ids}, o.tokens, o.beam).at(0);
    if (world->rank() == 0) fmt::print("{}\n", decode_ids(*s, {target}).at(0));
    return 0;
  }
  const size_t prompt_length = ids.size();
  if (ids.empty()) ids.push_back(s->tokens.train.empty() ? 0 : s->tokens.train.back());
  at::NoGradGuard no_grad;
  at::Generator gen = at::detail::createCPUGenerator(o.seed);
  const int64_t context = s->lm->context();
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
  }
  // Prompt and continuation decoded together: decoded apart, the continuation's first piece
  // loses the space that joins it to the prompt ("The best way toa ...").
  if (prompt_length == 0) ids.erase(ids.begin());  // the start token stood in for a prompt
  if (world->rank() == 0) fmt::print("{}\n", decode_ids(*s, {ids}).at(0));
  return 0;
}

}  // namespace flexdemo::train
