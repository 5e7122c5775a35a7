// Faulty peers: a gathered bucket's payloads checked before a value of them is decoded. Called by
// the DeMo replicators (src/optim/demo_exchange.h), which both doors (the trainer and the Python
// package) run, so both leave out the same peers for the same bytes.
#pragma once

#include "flexdemo/compress.h"
#include "flexdemo/dct.h"
#include "flexdemo/optim.h"  // PeerFault (its fields; describe() is the library's)

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace flexdemo::demo {

// `replicas` payload sets back to back, replica_bytes each; tensor t's payload at offsets[t] in
// each, for plans[t], k and encoding. Each payload is validated (header, checksum, indices), its
// values finite, and its values' L2 norm at most scale_bound times the lower median of the
// replicas' norms for that tensor (0: no scale check; with two replicas the smaller is the
// reference). Returns every failure, by tensor and then replica; PeerFault::tensor indexes plans.
std::vector<optim::PeerFault> screen_payloads(const uint8_t* gathered, int replicas,
                                              size_t replica_bytes,
                                              const std::vector<dct::ChunkPlan>& plans,
                                              const std::vector<size_t>& offsets, int64_t k,
                                              compress::ValueEncoding encoding, double scale_bound);

// One payload's checks but the scale's (screen_payloads' per payload): the fault, or none and
// its values' norm in *norm (their sum of squares' root, summed in codec.h's order).
std::optional<optim::PeerFault> check_payload(const uint8_t* payload, const dct::ChunkPlan& plan,
                                              int64_t k, compress::ValueEncoding encoding,
                                              int replica, size_t tensor, double* norm);

// The scale check of tensor `tensor` alone: of the replicas judged (passed every other check),
// each whose norm exceeds scale_bound times the lower median of the judged ones' norms, appended
// to `found` (with fewer than two judged, or scale_bound 0, none). screen_payloads' last step, and
// the GPU's screening's after its kernels.
void add_out_of_scale(const std::vector<double>& norms, const std::vector<char>& judged,
                      size_t tensor, double scale_bound, std::vector<optim::PeerFault>& found);

// compress::decode_mean_sparse of payloads that passed screen_payloads (or this replica's own,
// as it encoded them): the same means, without validating them again.
compress::SparseChunks mean_of_screened(const std::vector<const uint8_t*>& payloads,
                                        const dct::ChunkPlan& plan, int64_t k,
                                        compress::ValueEncoding encoding);

}  // namespace flexdemo::demo

namespace flexdemo::compress {

// The test aid: one payload made faulty as `how` says (compress.h's Tamper), `factor` for Scale.
void tamper_payload(uint8_t* data, const dct::ChunkPlan& plan, int64_t k, ValueEncoding encoding,
                    Tamper how, double factor = 1.0);

}  // namespace flexdemo::compress
