"""Run by test_link_budget.py under ``torchrun --nproc-per-node 4`` (gloo, CPU): 2 nodes x 2 ranks.

FlexDeMo(link_budget="auto") under overlap, its measurements replaced by FLEXDEMO_INJECT_LINK
(set by the test: an endless probe, then an instant one, in turn) so that its choices are known
in closed form, as tests/link_budget_resume.sh checks the trainer's: nothing fits an endless
probe (the ladder's last schedule, top-k 4 at 2bit every 2 steps), everything fits an instant one
(the first, top-k 32 at bf16 every step); choices before steps 4, 9, 14, ... (link_probe_every 5).
Checks, raising AssertionError (a non-zero exit) when one fails; rank 0 writes what it saw to the
JSON file given as argv[1]:
- the choices, on every rank alike;
- the replicas' committed parameters stay bit-identical;
- DCP checkpoints after step 5 (an exchange in flight of another size than the options' top-k
  and values give) and after step 14 (an every-2 interval starting, a top-k change pending
  behind the exchange in flight), each loaded into a fresh model and optimizer, continue exactly
  as the uninterrupted run: losses and parameters bit for bit. (A resume continues the choices
  from kWarmSteps after it, as the trainer's: both points keep every choice of the uninterrupted
  run.)
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

from dist_flexdemo import local_params, model_with_seed, train

import flexdemo

STEPS, RESUMES = 30, (5, 14)
OPTIONS = dict(lr=1e-3, compression_topk=32, compression_chunk=16, values="bf16", overlap=True,
               link_budget="auto", link_min_topk=4, link_max_topk=32, link_max_every=2,
               link_probe_every=5)
EXPECTED = [dict(step=4, topk=4, values="2bit", every=2), dict(step=9, topk=32, values="bf16", every=1),
            dict(step=14, topk=4, values="2bit", every=2), dict(step=19, topk=32, values="bf16", every=1),
            dict(step=24, topk=4, values="2bit", every=2), dict(step=29, topk=32, values="bf16", every=1)]


def hybrid(seed):
    mesh = flexdemo.hybrid_mesh(ranks_per_node=2, device_type="cpu")
    model = model_with_seed(seed)
    flexdemo.shard_model(model, mesh, blocks=model.transformer.h)
    return mesh, model, flexdemo.FlexDeMo(model.parameters(), mesh=mesh, **OPTIONS)


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    node, shard = rank // 2, rank % 2
    mesh, model, opt = hybrid(seed=100 + rank)
    group = mesh.get_group("shard")
    with tempfile.TemporaryDirectory() as scratch:
        shared = [scratch]
        dist.broadcast_object_list(shared, src=0)
        ckpt = {at: os.path.join(shared[0], "step{}".format(at)) for at in RESUMES}
        losses, done = [], 0
        for at in RESUMES + (STEPS,):
            losses += train(model, opt, node, shard, 2, group, range(done, at))
            done = at
            if at in ckpt:
                dcp.save({"model": get_model_state_dict(model),
                          "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt[at])
        assert opt.link_choices == EXPECTED, "choices {}".format(opt.link_choices)

        # Under overlap the parameters also carry each replica's preview of the exchange in
        # flight; what is identical on every replica is the committed parameters.
        replicate = mesh.get_group("replicate")
        committed = [getattr(s["committed"], "to_local", lambda: s["committed"])()
                     for s in opt.state.values() if "committed" in s]
        assert committed, "no committed parameters in the state under overlap"
        for c in committed:
            gathered = [torch.empty_like(c) for _ in range(2)]
            dist.all_gather(gathered, c.contiguous(), group=replicate)
            assert torch.equal(gathered[0], gathered[1]), "replicas differ"

        resumed_choices = {}
        for at in RESUMES:
            _, fresh, fresh_opt = hybrid(seed=999 + rank)
            state = {"model": get_model_state_dict(fresh),
                     "optim": get_optimizer_state_dict(fresh, fresh_opt)}
            dcp.load(state, checkpoint_id=ckpt[at])
            set_model_state_dict(fresh, state["model"])
            set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
            resumed = train(fresh, fresh_opt, node, shard, 2, group, range(at, STEPS))
            assert resumed == losses[at:], "resumed at {}: {} vs uninterrupted {}".format(
                at, resumed, losses[at:])
            for a, b in zip(local_params(fresh), local_params(model)):
                assert torch.equal(a, b), "resumed at {}: parameters differ".format(at)
            assert fresh_opt.link_choices == [c for c in EXPECTED if c["step"] > at], (
                fresh_opt.link_choices)
            resumed_choices[at] = fresh_opt.link_choices
        dist.barrier()
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(dict(choices=opt.link_choices, resumed_choices=resumed_choices,
                           losses=losses), f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
