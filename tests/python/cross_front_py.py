"""The Python door of the cross-front check (test_cross_front.py), under torchrun on 4 ranks
(gloo) as 2 replicas x 2 shards: FlexDeMo steps this rank's shards (torch.chunk's rows, as
FSDP2's local shards) with the gradients given; after each run (a line of configs.txt: the step
and name=value options) writes OUT/<line>.rank<r>.f32: the shards, then the engine's state
tensors in name order. The C++ door (tests/cross_front.cpp) writes the same files."""

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import flexdemo


def main():
    src, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    replica, shard = rank // 2, rank % 2
    replicate = [dist.new_group([0, 2]), dist.new_group([1, 3])][shard]
    shard_group = [dist.new_group([0, 1]), dist.new_group([2, 3])][replica]
    shapes = [tuple(int(d) for d in line.split()) for line in open(os.path.join(src, "shapes.txt"))
              if line.strip()]
    start = torch.from_numpy(np.fromfile(os.path.join(src, "params.f32"), dtype=np.float32))
    grads = torch.from_numpy(np.fromfile(os.path.join(src, "grads.f32"), dtype=np.float32))
    steps = grads.numel() // (2 * start.numel())

    def shards(flat):
        out, at = [], 0
        for s in shapes:
            n = int(np.prod(s))
            out.append(flat[at:at + n].view(s).chunk(2, 0)[shard].contiguous())
            at += n
        return out

    for line, config in enumerate(open(os.path.join(src, "configs.txt")).read().splitlines()):
        step, *words = config.split()
        options = dict(w.split("=", 1) for w in words)
        params = [torch.nn.Parameter(t) for t in shards(start.clone())]
        opt = flexdemo.FlexDeMo(params, step=step, replicate_group=replicate,
                                shard_group=shard_group, **options)
        for s in range(steps):
            mine = grads[(s * 2 + replica) * start.numel():(s * 2 + replica + 1) * start.numel()]
            for p, g in zip(params, shards(mine)):
                p.grad = g
            opt.step()
        engine = opt._engines[0]
        state = sorted(zip(engine.state_names(), engine.state_tensors()), key=lambda x: x[0])
        written = [p.detach() for p in params] + [t for _, t in state]
        with open(os.path.join(out, "{}.rank{}.f32".format(line, rank)), "wb") as f:
            for t in written:
                f.write(t.float().contiguous().numpy().tobytes())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
