// The owners' exchange (--demo-exchange owners): DeMo whose bytes a node a step stay about two
// payloads whatever the number of replicas R, where the all-gather's grow as R - 1 (docs/
// algorithm.md, "The owners' exchange"). Every tensor's chunk rows, in order, are cut into R runs
// of about equal payload bytes; replica r owns run r. A step:
//   1. each replica encodes its payloads as the all-gather's replicator does (residual, DCT,
//      top-k, error feedback), one payload per piece (a tensor's rows within one run);
//   2. one all-to-all sends each owner its pieces' payloads from every replica;
//   3. the owner decodes their mean (the replicas whose payloads pass the checks) and keeps its
//      own top-k' of it, encoded at its own values (by default 2-bit values and as many
//      coefficients as fit in the replicas' payload bytes: about three times top-k at bf16);
//   4. one all-gather returns every owner's share to every replica, which decodes each (one
//      payload per coefficient) and applies the direction with the inner optimizer;
//   5. what the owner left out of the mean stays in a residual of its own (owner_feedback owner,
//      the default: error feedback at the owner too, decayed as the senders' residuals are), or
//      every coefficient a replica sent that its owner did not keep goes back into that
//      replica's residual (senders: error feedback at the senders alone).
// The owner's residual is state, kept in the residuals' layout (one tensor a parameter, non-zero
// in the rows this replica owns), with the number of replicas it was kept among. Where the rows'
// owners change (the link budget re-cuts the pieces, a checkpoint of another cut or number of
// replicas is loaded), what an owner held in rows it no longer owns goes into its own residual,
// R times over (optim::owner_residual_weight: R over the replicas continuing the same saved
// one), so that the replicas' mean of their residuals holds it, as the owner's did.
// The collectives are blocking; the payloads' bytes are the wire format's (compress.h).
#include "demo_exchange.h"
#include "replicator.h"
#include "step_rule.h"

#include "demo/screen.h"

#include "flexdemo/comm.h"
#include "flexdemo/elastic.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

namespace flexdemo::optim {
namespace {

// Some of a tensor's chunk rows, exchanged as a tensor of their own.
struct Piece {
  size_t tensor = 0;
  int64_t row0 = 0;     // its first row in the tensor (a multiple of the chunk's rows)
  dct::ChunkPlan plan;  // those rows: the tensor's plan with fewer rows
  int owner = 0;
};

// Every tensor's chunk rows in order, cut into `owners` runs of about equal payload bytes (a
// chunk row weighs its tensor's payload over its chunk rows); a piece: one tensor's rows in one
// run. A tensor of one chunk row (a vector) is never cut.
std::vector<Piece> cut_into_pieces(const std::vector<dct::ChunkPlan>& plans, int64_t topk,
                                   compress::ValueEncoding values, int owners) {
  std::vector<double> row_weight;
  double total = 0.0;
  for (const dct::ChunkPlan& plan : plans) {
    const double bytes = double(compress::wire_payload_bytes(plan, topk, values));
    row_weight.push_back(bytes / double(plan.row_chunks()));
    total += bytes;
  }
  std::vector<Piece> pieces;
  std::vector<int64_t> chunk_rows;  // per piece
  double before = 0.0;
  for (size_t t = 0; t < plans.size(); ++t) {
    for (int64_t i = 0; i < plans[t].row_chunks(); ++i) {
      const double middle = before + row_weight[t] / 2;
      before += row_weight[t];
      const int owner = std::min(owners - 1, int(middle * owners / total));
      if (!pieces.empty() && pieces.back().tensor == t && pieces.back().owner == owner) {
        ++chunk_rows.back();
        continue;
      }
      Piece p;
      p.tensor = t;
      p.row0 = i * plans[t].chunk_rows;
      p.owner = owner;
      pieces.push_back(p);
      chunk_rows.push_back(1);
    }
  }
  for (size_t k = 0; k < pieces.size(); ++k) {
    Piece& p = pieces[k];
    p.plan = plans[p.tensor];
    p.plan.padded_rows = chunk_rows[k] * p.plan.chunk_rows;
    p.plan.rows = std::min(p.row0 + p.plan.padded_rows, plans[p.tensor].rows) - p.row0;
  }
  return pieces;
}

}  // namespace

int64_t owner_topk_that_fits(const std::vector<dct::ChunkPlan>& plans, int64_t topk,
                             compress::ValueEncoding values, compress::ValueEncoding owner_values) {
  dct::ChunkPlan chunk;  // one chunk of the largest size among the plans
  for (const dct::ChunkPlan& plan : plans) {
    if (plan.chunk_numel() > chunk.chunk_numel()) {
      chunk.chunk_rows = chunk.rows = chunk.padded_rows = plan.chunk_rows;
      chunk.chunk_cols = chunk.cols = chunk.padded_cols = plan.chunk_cols;
    }
  }
  const size_t budget = compress::wire_payload_bytes(chunk, topk, values);
  int64_t k = std::min(topk, chunk.chunk_numel());
  while (k < chunk.chunk_numel() &&
         compress::wire_payload_bytes(chunk, k + 1, owner_values) <= budget) {
    ++k;
  }
  return std::max(k, topk);
}

namespace {

class OwnerReplicator final : public optim::Replicator {
 public:
  OwnerReplicator(const std::vector<dct::ChunkPlan>& plans, const optim::OptimizerOptions& options,
                  std::shared_ptr<comm::Communicator> group, at::Device device)
      : plans_(plans), options_(options), group_(std::move(group)), device_(device) {
    if (options.transform == optim::Transform::None) options_.fast_path = false;  // DCT kernels
    const auto floats = at::dtype(at::kFloat).device(device);
    for (const dct::ChunkPlan& plan : plans_) {
      residuals_.push_back(at::zeros({plan.padded_rows, plan.padded_cols}, floats));
      directions_.push_back(at::empty({plan.rows, plan.cols}, floats));
      if (owner_keeps()) {
        owner_residuals_.push_back(at::zeros({plan.padded_rows, plan.padded_cols}, floats));
      }
    }
    owner_replicas_ = at::full({1}, double(replicas()), at::dtype(at::kFloat));
    use_layout();
  }

  void set_layout(int64_t topk, compress::ValueEncoding values) override {
    if (topk == options_.topk && values == options_.values) return;
    options_.topk = topk;  // nothing is ever in flight between steps: from the next step on
    options_.values = values;
    use_layout();
  }
  std::optional<std::pair<int64_t, compress::ValueEncoding>> layout() const override {
    return std::make_pair(options_.topk, options_.values);
  }

  void accumulate(const std::vector<at::Tensor>& grads, double lr) override {
    const std::vector<at::Tensor> pieces = piece_grads(grads);
    for (size_t k = 0; k < pieces_.size(); ++k) backend_->accumulate(k, pieces[k], lr);
  }

  void exchange(const std::vector<at::Tensor>& grads, double lr, StepRule& inner) override {
    const int R = replicas(), me = rank();
    // 1. This replica's payloads, one per piece, in the owners' order.
    backend_->encode(all_, piece_grads(grads), lr);
    if (tamper_) tamper();
    // 2. Each owner its pieces' payloads from every replica.
    if (R > 1) {
      group_->all_to_all_v(all_.send, share_bytes_, received_,
                           std::vector<int64_t>(size_t(R), share_bytes_[me]));
    } else {
      received_.copy_(all_.send);
    }
    // 3. The owner: the mean of the replicas that pass and its top-k' (its share's payloads).
    for (at::Tensor& g : owner_grads_) g.zero_();
    Updates mean;
    mean.fused.assign(pieces_.size(), std::nullopt);
    mean.apply = [this](size_t piece, const at::Tensor& d) {  // an owner's pieces are a run
      owner_grads_[piece - shares_[rank()].tensors.front()].copy_(d);
    };
    std::vector<optim::PeerFault> found;
    std::vector<char> share_passed(size_t(R), 0);
    const std::vector<int> kept =
        passing_replicas(*backend_, shares_[me], received_, R, options_, found);
    note_faults(found, -1);
    decode_passing(*backend_, shares_[me], received_, R, kept, mean);
    if (owner_backend_) {  // an owner of nothing (more replicas than chunk rows) skips this
      owner_backend_->encode(owned_, owner_grads_, 1.0);
    }
    // 4. Every owner's share to every replica; each decoded and the directions applied.
    if (R > 1) {
      group_->all_gather_v(owned_.send, gathered_, return_bytes_);
    } else {
      gathered_.copy_(owned_.send);
    }
    for (at::Tensor& d : directions_) d.zero_();
    Updates put;
    put.fused.assign(pieces_.size(), std::nullopt);
    put.apply = [this](size_t piece, const at::Tensor& d) {
      const Piece& p = pieces_[piece];
      directions_[p.tensor].narrow(0, p.row0, p.plan.rows).copy_(d);
    };
    for (int r = 0; r < R; ++r) {
      if (return_bytes_[r] == 0) {  // an owner of nothing
        share_passed[r] = 1;
        continue;
      }
      const at::Tensor share = gathered_.narrow(0, return_offsets_[r], return_bytes_[r]);
      found.clear();
      const std::vector<int> whole =
          passing_replicas(*backend_, returns_[r], share, 1, options_, found);
      note_faults(found, r);
      share_passed[r] = !whole.empty();
      decode_passing(*backend_, returns_[r], share, 1, whole, put);
    }
    for (size_t i = 0; i < plans_.size(); ++i) inner.apply(i, directions_[i]);
    // 5. What the owners left out: with its owner (kept in 3.), or with its senders. A share that
    // failed the checks goes back to its senders whole, so its owner keeps none of it (nor a
    // residual that made it non-finite).
    if (owner_keeps() && !share_passed[me]) {
      for (at::Tensor& held : owner_scratch_) held.zero_();
    }
    keep_what_owners_left_out(share_passed);
  }

  std::vector<optim::PeerFault> take_peer_faults() override {
    return std::exchange(peer_faults_, {});
  }
  void tamper_next_exchange(compress::Tamper how, double factor) override {
    tamper_ = {how, factor};
  }

  optim::ExchangeTraffic traffic() const override { return traffic_; }
  NamedTensors state_tensors() const override {
    NamedTensors state = optim::numbered("residual", residuals_);
    if (owner_keeps()) {
      for (auto& named : optim::numbered("owner_residual", owner_residuals_)) {
        state.push_back(std::move(named));
      }
      state.push_back({"owner_replicas", owner_replicas_});
    }
    return state;
  }
  // After a load: the owner's residual settled for this run's replicas and cut.
  void restore_counters(int64_t, int64_t) override {
    if (!owner_keeps()) return;
    if (owner_replicas_.item<double>() != double(replicas())) {
      // Kept among another number of replicas (0: the checkpoint held none): all of it into
      // this replica's residual.
      const double weight = owner_weight();
      for (size_t t = 0; t < plans_.size(); ++t) {
        residuals_[t].add_(owner_residuals_[t].to(residuals_[t].device()), weight);
        owner_residuals_[t].zero_();
      }
      owner_replicas_.fill_(double(replicas()));
    }
    fold_unowned_owner_residual();
  }
  const at::Tensor& residual(size_t i) const override { return residuals_.at(i); }

 private:
  int replicas() const { return group_ ? group_->size() : 1; }
  int rank() const { return group_ ? group_->rank() : 0; }
  bool owner_keeps() const { return options_.owner_feedback == optim::OwnerFeedback::Owner; }

  // How many times over the owner's residual goes into this replica's residual (the header's
  // rule), for the replicas it was kept among (0 where a load found none: it is zero).
  double owner_weight() const {
    const auto saved = int64_t(owner_replicas_.item<double>());
    return saved > 0 ? optim::owner_residual_weight(rank(), replicas(), saved) : 0.0;
  }

  // What the owner's residual holds in rows this replica does not own (under this cut) into
  // this replica's residual (the header's rule).
  void fold_unowned_owner_residual() {
    if (!owner_keeps()) return;
    const int me = rank();
    const double weight = owner_weight();
    for (size_t k = 0; k < pieces_.size(); ++k) {
      const Piece& p = pieces_[k];
      if (p.owner == me) continue;
      at::Tensor held = owner_residuals_[p.tensor].narrow(0, p.row0, p.plan.padded_rows);
      piece_residuals_[k].add_(held, weight);
      held.zero_();
    }
  }

  // The pieces for options_'s top-k and values, their residuals (views of the tensors'), the
  // owners' shares and every buffer.
  void use_layout() {
    const int R = replicas(), me = rank();
    pieces_ = cut_into_pieces(plans_, options_.topk, options_.values, R);
    owner_values_ = options_.owner_values;
    owner_topk_ = options_.owner_topk > 0
                      ? options_.owner_topk
                      : owner_topk_that_fits(plans_, options_.topk, options_.values, owner_values_);
    piece_plans_.clear();
    piece_residuals_.clear();
    for (const Piece& p : pieces_) {
      piece_plans_.push_back(p.plan);
      piece_residuals_.push_back(
          residuals_[p.tensor].narrow(0, p.row0, p.plan.padded_rows));  // whole rows: contiguous
    }
    fold_unowned_owner_residual();  // the owners may have changed (before the backends copy)
    const at::Device replica_device = group_ ? group_->device() : at::Device(at::kCPU);
    backend_ = make_backend(piece_plans_, backend_options(options_), piece_residuals_, device_, replica_device);
    // The shares: owner r's pieces are a run of pieces_ (the runs are in owner order).
    shares_.clear();
    shares_.resize(size_t(R));
    share_bytes_.assign(size_t(R), 0);
    all_ = Bucket{};
    all_.topk = options_.topk;
    all_.values = options_.values;
    traffic_ = {};
    for (size_t k = 0; k < pieces_.size(); ++k) {
      const size_t bytes = compress::wire_payload_bytes(piece_plans_[k], all_.topk, all_.values);
      Bucket& share = shares_[size_t(pieces_[k].owner)];
      share.tensors.push_back(k);
      share.offsets.push_back(share.bytes);
      share.bytes += bytes;
      all_.tensors.push_back(k);
      all_.offsets.push_back(all_.bytes);
      all_.bytes += bytes;
      traffic_.kept_coefficients +=
          piece_plans_[k].num_chunks() * compress::clamp_topk(options_.topk, piece_plans_[k]);
    }
    for (const dct::ChunkPlan& plan : plans_) traffic_.params += plan.numel();
    traffic_.wire_bytes = all_.bytes;
    for (int r = 0; r < R; ++r) {
      shares_[r].topk = all_.topk;
      shares_[r].values = all_.values;
      share_bytes_[r] = int64_t(shares_[r].bytes);
    }
    // The owners' payloads back: the same pieces at the owners' top-k and values.
    returns_.clear();
    returns_.resize(size_t(R));
    return_bytes_.assign(size_t(R), 0);
    return_offsets_.assign(size_t(R), 0);
    return_at_.clear();
    int64_t returned = 0;
    for (int r = 0; r < R; ++r) {
      Bucket& back = returns_[r];
      back.topk = owner_topk_;
      back.values = owner_values_;
      back.tensors = shares_[r].tensors;
      return_offsets_[r] = returned;
      for (size_t k : back.tensors) {
        back.offsets.push_back(back.bytes);
        return_at_.push_back(size_t(returned) + back.bytes);
        back.bytes += compress::wire_payload_bytes(piece_plans_[k], back.topk, back.values);
      }
      return_bytes_[r] = int64_t(back.bytes);
      returned += return_bytes_[r];
    }
    all_.send = backend_->buffer(int64_t(all_.bytes));
    received_ = backend_->buffer(int64_t(shares_[me].bytes) * R);
    gathered_ = backend_->buffer(returned);
    // The owner's stage: its pieces again, over its own residual's rows (owner_feedback owner),
    // or a scratch residual that each encode overwrites (decay 0) with the mean's coefficients.
    std::vector<dct::ChunkPlan> owned_plans;
    owner_grads_.clear();
    owner_scratch_.clear();
    const auto floats = at::dtype(at::kFloat).device(device_);
    for (size_t k : shares_[me].tensors) {
      const dct::ChunkPlan& plan = piece_plans_[k];
      owned_plans.push_back(plan);
      owner_grads_.push_back(at::zeros({plan.rows, plan.cols}, floats));
      const Piece& p = pieces_[k];
      owner_scratch_.push_back(
          owner_keeps() ? owner_residuals_[p.tensor].narrow(0, p.row0, p.plan.padded_rows)
                        : at::zeros({plan.padded_rows, plan.padded_cols}, floats));
    }
    demo::BackendOptions owner_options = backend_options(options_);
    if (!owner_keeps()) owner_options.decay = 0.0;
    owned_ = Bucket{};
    owned_.topk = owner_topk_;
    owned_.values = owner_values_;
    owned_.offsets = returns_[me].offsets;
    owned_.bytes = returns_[me].bytes;
    for (size_t k = 0; k < owned_plans.size(); ++k) owned_.tensors.push_back(k);
    owner_backend_ = owned_plans.empty() ? nullptr
                                         : make_backend(owned_plans, owner_options, owner_scratch_,
                                                        device_, replica_device);
    owned_.send = backend_->buffer(int64_t(owned_.bytes));
  }

  // What the owners left out stays with its senders: every coefficient this replica sent that
  // its owner did not keep goes back into this replica's residual (owner_feedback senders), and
  // all of a piece whose owner's share failed the checks (either feedback: this replica applied
  // none of it). The owners' shares lie in gathered_ as this replica's own payloads lie in
  // all_.send (the same pieces, order and layout).
  void keep_what_owners_left_out(const std::vector<char>& share_passed) {
    if (owner_keeps() &&
        std::all_of(share_passed.begin(), share_passed.end(), [](char passed) { return passed; })) {
      return;
    }
    const at::Tensor mine = all_.send.to(at::kCPU), owners = gathered_.to(at::kCPU);
    std::vector<char> taken;
    for (size_t k = 0; k < pieces_.size(); ++k) {
      const dct::ChunkPlan& plan = piece_plans_[k];
      const size_t size = compress::wire_payload_bytes(plan, all_.topk, all_.values);
      const compress::SparseChunks sent = compress::decode_mean_sparse(
          {mine.data_ptr<uint8_t>() + all_.offsets[k]}, size, plan, all_.topk, all_.values);
      const bool applied = share_passed[size_t(pieces_[k].owner)];
      if (applied && owner_keeps()) continue;
      compress::SparseChunks kept;
      if (applied) {
        kept = compress::decode_mean_sparse(
            {owners.data_ptr<uint8_t>() + return_at_[k]},
            compress::wire_payload_bytes(plan, owner_topk_, owner_values_), plan, owner_topk_,
            owner_values_);
      }
      const int64_t* sent_counts = sent.counts.data_ptr<int64_t>();
      const int64_t* kept_counts = applied ? kept.counts.data_ptr<int64_t>() : nullptr;
      std::vector<int64_t> index;
      std::vector<float> value;
      taken.assign(size_t(plan.chunk_numel()), 0);
      for (int64_t c = 0; c < plan.num_chunks(); ++c) {
        const int32_t* pos = sent.positions.data_ptr<int32_t>() + c * sent.positions.size(1);
        const float* val = sent.values.data_ptr<float>() + c * sent.values.size(1);
        if (applied) {
          const int32_t* k_pos = kept.positions.data_ptr<int32_t>() + c * kept.positions.size(1);
          for (int64_t j = 0; j < kept_counts[c]; ++j) taken[k_pos[j]] = 1;
        }
        for (int64_t j = 0; j < sent_counts[c]; ++j) {
          if (!taken[pos[j]]) {
            index.push_back(plan.chunk_origin(c) + plan.offset_in_chunk(pos[j]));
            value.push_back(val[j]);
          }
        }
        if (applied) {
          const int32_t* k_pos = kept.positions.data_ptr<int32_t>() + c * kept.positions.size(1);
          for (int64_t j = 0; j < kept_counts[c]; ++j) taken[k_pos[j]] = 0;
        }
      }
      if (index.empty()) continue;
      at::Tensor flat = piece_residuals_[k].view(-1);
      flat.index_add_(0, at::tensor(index, at::kLong).to(flat.device()),
                      at::tensor(value, at::kFloat).to(flat.device()));
    }
  }

  // Each piece's rows of its tensor's gradient (undefined where the gradient is).
  std::vector<at::Tensor> piece_grads(const std::vector<at::Tensor>& grads) const {
    std::vector<at::Tensor> out;
    for (const Piece& p : pieces_) {
      const at::Tensor& g = grads[p.tensor];
      const dct::ChunkPlan& plan = plans_[p.tensor];
      out.push_back(g.defined() ? g.reshape({plan.rows, plan.cols}).narrow(0, p.row0, p.plan.rows)
                                : at::Tensor());
    }
    return out;
  }

  // Faults found in a bucket of pieces: named by tensor, and (owner >= 0) by the owner whose
  // share it was.
  void note_faults(std::vector<optim::PeerFault>& found, int owner) {
    for (optim::PeerFault& f : found) {
      f.tensor = pieces_[f.tensor].tensor;
      if (owner >= 0) f.replica = owner;
    }
    peer_faults_.insert(peer_faults_.end(), found.begin(), found.end());
  }

  // The test aid: this replica's payloads of the exchange, tampered before they are sent.
  void tamper() {
    at::Tensor host = all_.send.is_cpu() ? all_.send : all_.send.to(at::kCPU);
    for (size_t k = 0; k < pieces_.size(); ++k) {
      compress::tamper_payload(host.data_ptr<uint8_t>() + all_.offsets[k], piece_plans_[k],
                               all_.topk, all_.values, tamper_->first, tamper_->second);
    }
    if (!all_.send.is_cpu()) all_.send.copy_(host);
    tamper_.reset();
  }

  std::vector<dct::ChunkPlan> plans_;  // the tensors'
  optim::OptimizerOptions options_;
  std::shared_ptr<comm::Communicator> group_;
  at::Device device_;
  std::vector<at::Tensor> residuals_;   // per tensor: float32 block-layout DCT coefficients
  std::vector<at::Tensor> directions_;  // per tensor: this step's decoded direction
  std::vector<Piece> pieces_;
  std::vector<dct::ChunkPlan> piece_plans_;
  std::vector<at::Tensor> piece_residuals_;  // views of residuals_
  std::unique_ptr<Backend> backend_;         // over the pieces
  Bucket all_;                               // every piece; send: this replica's payloads
  std::vector<Bucket> shares_;               // per owner: its pieces (offsets within the share)
  std::vector<int64_t> share_bytes_;
  // The owners' payloads back (their own top-k and values): per owner, and each piece's offset.
  std::vector<Bucket> returns_;
  std::vector<int64_t> return_bytes_, return_offsets_;
  std::vector<size_t> return_at_;
  int64_t owner_topk_ = 0;
  compress::ValueEncoding owner_values_ = compress::ValueEncoding::Bf16;
  at::Tensor received_;  // R x this owner's share: every replica's payloads of it
  at::Tensor gathered_;  // every owner's share, back to back
  // owner_feedback owner: per tensor, the owner's residual (non-zero in the rows it owns), and
  // the replicas it was kept among ([1]: a loaded one's tells its cut).
  std::vector<at::Tensor> owner_residuals_;
  at::Tensor owner_replicas_;
  // The owner's stage: its pieces' mean directions, residuals (views of owner_residuals_, or
  // scratch), backend and payloads.
  std::vector<at::Tensor> owner_grads_, owner_scratch_;
  std::unique_ptr<Backend> owner_backend_;
  Bucket owned_;
  optim::ExchangeTraffic traffic_;
  std::vector<optim::PeerFault> peer_faults_;
  std::optional<std::pair<compress::Tamper, double>> tamper_;
};

}  // namespace

std::unique_ptr<Replicator> make_owner_replicator(const std::vector<dct::ChunkPlan>& plans,
                                                  const OptimizerOptions& options,
                                                  std::shared_ptr<comm::Communicator> group,
                                                  at::Device device) {
  return std::make_unique<OwnerReplicator>(plans, options, std::move(group), device);
}

}  // namespace flexdemo::optim
