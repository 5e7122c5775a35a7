"""Run by test_distributed.py under ``torchrun --nproc-per-node 2`` (gloo, CPU): one node of two
ranks sharding a model with FSDP2, one of whose parameters is shorter along dim 0 than the group
(FSDP2 leaves rank 1's local shard of it empty; it is a parameter group of its own, so that
group holds nothing on rank 1), stepped by FlexDeMo with each tensor's RMS capped
(its whole tensor's, the shards' sums of squares gathered over the shard group by position: every
rank must give the engine the same tensors, the empty one too).

Checked against each rank's own unsharded copy of the model stepped by FlexDeMo alone (the whole
batch; FSDP2's gradients are the two halves' mean, equal to rounding): after STEPS steps the
sharded parameters equal the unsharded ones to TOLERANCE. The step keeps every coefficient (top-k
16 of 4 x 4 chunks: no selection can flip) at fp32 and eps 1e-4 (no near-zero gradient divided
by itself), so a rounding difference in the gradients stays a rounding difference: measured at
most 6.1e-8 (linear.weight; relative to each tensor's largest element). With each shard capped by
its own RMS instead (the engine given no shard group, the empty tensor left out): 4.2e-4.
Exits non-zero (AssertionError) where a check fails; a hang ends at torchrun's timeout.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import flexdemo

STEPS, TOLERANCE = 10, 1e-5
OPTIONS = dict(lr=1e-2, compression_topk=16, compression_chunk=4, values="fp32", eps=1e-4,
               rms_cap=0.05)


class Model(torch.nn.Module):
    """A linear map plus a [1, 16] offset: FSDP2 cuts dim 0 in two, so rank 1's offset is empty."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.linear = torch.nn.Linear(16, 16)
        self.offset = torch.nn.Parameter(torch.randn(1, 16))

    def forward(self, x):
        return self.linear(x) + self.offset


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 16, generator=g)
    return x, x.flip(1) * 0.5


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    alone = [dist.new_group([r]) for r in range(2)]  # every group made on every rank
    mesh = init_device_mesh("cpu", (2,))

    def groups(model):  # the offset alone in a group: wholly empty on rank 1
        return [{"params": list(model.linear.parameters())}, {"params": [model.offset]}]

    whole = Model()
    whole_opt = flexdemo.FlexDeMo(groups(whole), replicate_group=alone[rank], **OPTIONS)
    sharded = Model()
    fully_shard(sharded, mesh=mesh)
    opt = flexdemo.FlexDeMo(groups(sharded), shard_group=mesh.get_group(), **OPTIONS)
    shapes = [tuple(p.to_local().shape) for p in sharded.parameters()]
    assert (1, 16) in shapes if rank == 0 else (0, 16) in shapes, (rank, shapes)

    for step in range(STEPS):
        x, y = batch(step)
        torch.nn.functional.mse_loss(whole(x), y).backward()
        whole_opt.step()
        whole_opt.zero_grad(set_to_none=True)
        rows = slice(4 * rank, 4 * rank + 4)
        torch.nn.functional.mse_loss(sharded(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for (name, a), b in zip(sharded.named_parameters(), whole.parameters()):
        full = a.full_tensor().detach()
        worst = ((full - b.detach()).abs().max() / b.detach().abs().max()).item()
        assert worst <= TOLERANCE, "{}: sharded against unsharded {:.3g}".format(name, worst)
        assert not torch.equal(b.detach(), Model().state_dict()[name]), name  # it trained
        if rank == 0:
            print("{}: sharded against unsharded, relative {:.3g}".format(name, worst))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
