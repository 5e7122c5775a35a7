// torch.distributed's ProcessGroup as a flexdemo communicator (flexdemo/comm.h): the transport
// of the package's engine, so that the DeMo step the trainer runs over MPI or NCCL runs over
// whatever group a PyTorch user has (gloo, NCCL, a torchft managed group), with the group's own
// timeouts and error handling. Collectives only; split() is not offered (the user makes groups).
#pragma once

#include "flexdemo/comm.h"

#include <memory>
#include <string>

namespace flexdemo::ops {

// The process group registered under `group_name` (torch.distributed's group_name), whose
// collectives take buffers on `device` (the CPU for gloo, the GPU for NCCL).
std::shared_ptr<comm::Communicator> process_group_communicator(const std::string& group_name,
                                                               at::Device device);

}  // namespace flexdemo::ops
