"""The Python door of the cross-front check (test_cross_front.py), under torchrun (gloo) as
replicas x SHARDS (argv[3], default 2): FlexDeMo steps this rank's shards (torch.chunk's rows, as
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
    shard_count = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    replica_count = world // shard_count
    replica, shard = rank // shard_count, rank % shard_count
    # Every group made on every rank, in the same order (torch.distributed's rule).
    replicate_groups = [dist.new_group(list(range(s, world, shard_count)))
                        for s in range(shard_count)]
    shard_groups = [dist.new_group(list(range(r * shard_count, (r + 1) * shard_count)))
                    for r in range(replica_count)]
    replicate = replicate_groups[shard]
    shard_group = shard_groups[replica] if shard_count > 1 else None
    shapes = [tuple(int(d) for d in line.split()) for line in open(os.path.join(src, "shapes.txt"))
              if line.strip()]
    start = torch.from_numpy(np.fromfile(os.path.join(src, "params.f32"), dtype=np.float32))
    grads = torch.from_numpy(np.fromfile(os.path.join(src, "grads.f32"), dtype=np.float32))
    steps = grads.numel() // (replica_count * start.numel())

    def shards(flat):
        out, at = [], 0
        for s in shapes:
            n = int(np.prod(s))
            out.append(flat[at:at + n].view(s).chunk(shard_count, 0)[shard].clone())
            at += n
        return out

    for line, config in enumerate(open(os.path.join(src, "configs.txt")).read().splitlines()):
        step, *words = config.split()
        options = dict(w.split("=", 1) for w in words)
        params = [torch.nn.Parameter(t) for t in shards(start.clone())]
        opt = flexdemo.FlexDeMo(params, step=step, replicate_group=replicate,
                                shard_group=shard_group, **options)
        for s in range(steps):
            at = (s * replica_count + replica) * start.numel()
            mine = grads[at:at + start.numel()]
            for p, g in zip(params, shards(mine)):
                p.grad = g
            opt.step()
        engine = opt._engines[0]
        state = sorted(zip(engine.state_names(), engine.state_tensors()), key=lambda x: x[0])
        written = [p.detach() for p in params] + [t for _, t in state]
        stem = os.path.join(out, "{}.rank{}".format(line, rank))
        with open(stem + ".bytes", "w") as f:
            f.write("{}\n".format(opt.bytes_sent))
        with open(stem + ".f32", "wb") as f:
            for t in written:
                f.write(t.float().contiguous().numpy().tobytes())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
