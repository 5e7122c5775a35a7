"""Run by test_elastic.py under torchrun (gloo, CPU), 2 ranks a node: one leg of an elastic
run, or the uninterrupted run.

    dist_elastic.py FIRST LAST LOAD SAVE OUT [RANKS_PER_NODE [OPTION=VALUE ...]]

Trains steps [FIRST, LAST) of one job (the same global batch each step whatever the number of
nodes: node n takes its share of the step's rows, each of its ranks (2 by default) its share of
that), FSDP2 inside
the node and FlexDeMo's default step between nodes; LOAD (or "-"): a DCP checkpoint to start
from, loaded with flexdemo.ElasticLoadPlanner; SAVE (or "-"): where to write the last step's.
OPTION=VALUE: FlexDeMo's options (second_moment=own, second_moment_every=2). Rank 0 writes the
global mean loss of every step to OUT (JSON), each rank's per-replica state (a sum of norms, and
the residuals' and owners' residuals' sums) as loaded and as left, and the second moment's kind
after the load.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from transformers import GPT2Config, GPT2LMHeadModel

import flexdemo

ROWS, SEQ = 8, 32  # the global batch: 8 sequences of 32 tokens


def batch(step):
    """Learnable rows: each a random start, then token t + 1 = (5 t + 3) mod 64."""
    g = torch.Generator().manual_seed(7000 + step)
    rows = [torch.randint(0, 64, (ROWS,), generator=g)]
    for _ in range(SEQ - 1):
        rows.append((rows[-1] * 5 + 3) % 64)
    return torch.stack(rows, dim=1)


def residual_norms(opt):
    """This rank's per-replica state (the residuals and running mean squares), as one float64
    sum of norms: what the elastic load must carry."""
    total = 0.0
    for state in opt.state.values():
        for key, t in state.items():
            if ".replica" in key:
                total += t.double().norm().item()
    return total


def state_sums(opt):
    """This rank's residuals and owners' residuals, each kind's entries summed in float64
    (linear: a fold adds up)."""
    sums = {"residual": 0.0, "owner_residual": 0.0}
    for state in opt.state.values():
        for key, t in state.items():
            name = key.partition(".replica")[0]
            if name in sums:
                sums[name] += t.double().sum().item()
    return sums


def kind(opt):
    """The second moment's kind the engines keep, read from their state's names."""
    return "/".join(sorted(flexdemo.checkpoint.second_moment_kinds(
        key for state in opt.state.values() for key in state)))


def by_rank(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def main():
    first, last, load, save, out = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6]
    per_node = int(sys.argv[6]) if len(sys.argv) > 6 else 2
    options = {}
    for word in sys.argv[7:]:
        name, _, value = word.partition("=")
        options[name] = int(value) if value.isdigit() else value
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes, node, shard = world // per_node, rank // per_node, rank % per_node
    torch.manual_seed(3)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2,
                                       n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    mesh = flexdemo.hybrid_mesh(ranks_per_node=per_node, device_type="cpu")
    flexdemo.shard_model(model, mesh, blocks=model.transformer.h)
    opt = flexdemo.FlexDeMo(model.parameters(), mesh=mesh, lr=1e-3, compression_chunk=16,
                             **options)
    if load != "-":
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=load, planner=flexdemo.ElasticLoadPlanner())
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
    loaded = by_rank(residual_norms(opt))
    loaded_sums = by_rank(state_sums(opt))
    losses = []
    for step in range(first, last):
        rows = batch(step).chunk(nodes)[node].chunk(per_node)[shard]
        loss = model(rows, labels=rows).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank the same number of rows: the global mean
        losses.append(mean.item() / world)
    if save != "-":
        dcp.save({"model": get_model_state_dict(model),
                  "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=save)
    saved = by_rank(residual_norms(opt))
    saved_sums = by_rank(state_sums(opt))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "steps": opt._steps, "loaded_state": loaded,
                       "saved_state": saved, "loaded_sums": loaded_sums,
                       "saved_sums": saved_sums, "second_moment": kind(opt)}, f)
    dist.barrier()
    # Leave without the interpreter's teardown: on 1 node (a replicate dimension of one rank)
    # one rank of two aborted there in about a third of the runs ("terminate called without an
    # active exception", SIGABRT), after all of the above, with or without
    # dist.destroy_process_group() (torch 2.11, gloo; seen nowhere in flexdemo's own code).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
