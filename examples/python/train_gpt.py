"""Train a transformers model with FlexDeMo from your own PyTorch loop, against AdamW-HSDP.

    torchrun --nproc-per-node 4 examples/python/train_gpt.py            # 2 nodes x 2 ranks
    torchrun --nnodes 2 --nproc-per-node 8 ... train_gpt.py --ranks-per-node 8   # a real cluster
    torchrun --nproc-per-node 4 ... train_gpt.py --ranks-per-node 1 --island-nodes 2
                                        # 2 islands x 2 nodes x 1 rank: FSDP2 across each
                                        # island's nodes, FlexDeMo between the islands

A GPT2LMHeadModel (or LlamaForCausalLM, --model llama) made from a config (random weights,
nothing downloaded), a SentencePiece BPE trained on the text (--data), and the same data, seed,
schedule and steps for both optimizers:
- flexdemo: FSDP2 inside each node (flexdemo.shard_model on the mesh's shard dimension) and
  FlexDeMo between nodes (one compressed all-gather a step over the replicate dimension);
- adamw-hsdp: FSDP2 on the whole 2-D mesh (reduce-scatter inside a node, all-reduce of the
  gradient shards between nodes) and torch.optim.AdamW.
Prints the validation loss and the bytes each rank sends between nodes per step, and saves each
run's checkpoint (DCP: model and optimizer, every rank's part) and its model in transformers'
format (OUT/<optimizer>/model: config.json, model.safetensors, tokenizer.model).
"""

import argparse
import json
import math
import os
import shutil
import time

import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard

import flexdemo


def arguments():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--optimizers", default="flexdemo,adamw-hsdp",
                   help="comma-separated: flexdemo, adamw-hsdp")
    p.add_argument("--data", default="/usr/share/games/fortunes",
                   help="a text file, or a folder of them (files ending .dat are skipped)")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--island-nodes", type=int, default=1,
                   help="nodes an island holds (the trainer's --island-nodes): shards span an "
                        "island's ranks and the replicas are the islands")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20, help="linear warmup, then cosine to 10%%")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: off)")
    p.add_argument("--topk", type=int, default=64,
                   help="DCT coefficients kept per chunk (64 at fp8: over 100x fewer bytes between "
                        "nodes than AdamW-HSDP; FlexDeMo's own default, 112, gives 69x)")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--values", default="fp8", choices=flexdemo.ops.VALUE_ENCODINGS,
                   help="wire encoding of the kept values")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out", default="runs/python-example")
    return p.parse_args()


# ====== Data: a BPE trained on the text, random windows ======
def read_text(path):
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if not n.endswith(".dat"))
        files = [os.path.join(path, n) for n in names
                 if os.path.isfile(os.path.join(path, n)) and not os.path.islink(os.path.join(path, n))]
    elif os.path.isfile(path):
        files = [path]
    else:
        raise SystemExit("train_gpt: --data {}: no such file or folder".format(path))
    return "\n".join(open(f, encoding="utf-8", errors="ignore").read() for f in files)


def tokens(args, out):
    """The text as token ids (rank 0 trains the tokenizer; every rank reads it)."""
    model_file = os.path.join(out, "tokenizer.model")
    text = read_text(args.data)
    if dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(text.splitlines()), model_prefix=model_file[:-len(".model")],
            vocab_size=args.vocab, model_type="bpe", character_coverage=1.0,
            bos_id=-1, eos_id=-1, unk_id=0, pad_id=-1, minloglevel=2)
    dist.barrier()
    sp = spm.SentencePieceProcessor(model_file=model_file)
    ids = torch.tensor([t for line in sp.encode(text.splitlines()) for t in line + [0]])
    split = int(len(ids) * 0.95)
    return ids[:split], ids[split:]


def windows(ids, starts, seq):
    """Sequences of seq tokens (transformers shifts the labels inside the model)."""
    return torch.stack([ids[s:s + seq] for s in starts.tolist()])


# ====== Model ======
def device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
        torch.device("cpu")


def make_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    if args.model == "gpt":
        config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width,
                            n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config).to(device())
        return model, model.transformer.h
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width,
                         intermediate_size=args.width * 8 // 3 // 8 * 8,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         max_position_embeddings=args.seq, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(config).to(device())
    return model, model.model.layers


def setup(args, name, mesh):
    """The model sharded for this optimizer, the optimizer, and the bytes a rank sends between
    nodes per step."""
    model, blocks = make_model(args)
    if name == "flexdemo":
        flexdemo.shard_model(model, mesh, blocks=blocks)
        opt = flexdemo.FlexDeMo(model.parameters(), mesh=mesh, lr=args.lr,
                                compression_topk=args.topk, compression_chunk=args.chunk,
                                values=args.values)
        # One all-gather of its payloads a step: a rank sends them to each other node (ring).
        return model, opt, opt.bucket_bytes * (opt.replicas - 1)
    flexdemo.fsdp.broadcast_from_rank0(model)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # A ring all-reduce of the gradient shards over R nodes sends 2 (R - 1) / R of them a rank.
    nodes = mesh["replicate"].size()
    shard_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    return model, opt, shard_bytes * 2 * (nodes - 1) // nodes


def lr_at(args, step):
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, val, args, shard, shards):
    g = torch.Generator().manual_seed(args.seed + 1)
    starts = torch.randint(0, len(val) - args.seq, (args.eval_seqs,), generator=g)
    rows = windows(val, starts, args.seq).chunk(shards)[shard].to(device())
    loss = model(rows, labels=rows).loss
    total = torch.stack([loss.detach()])
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train(args, name, mesh, train_ids, val_ids):
    model, opt, bytes_per_step = setup(args, name, mesh)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(args, s))
    rank, world = dist.get_rank(), dist.get_world_size()
    shard, shards = mesh["shard"].get_local_rank(), mesh["shard"].size()
    per_rank = args.batch // world
    started, losses = time.time(), []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 1000 + step)
        starts = torch.randint(0, len(train_ids) - args.seq, (args.batch,), generator=g)
        rows = windows(train_ids, starts[rank * per_rank:(rank + 1) * per_rank],
                       args.seq).to(device())
        loss = model(rows, labels=rows).loss
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        scheduler.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val = evaluate(model, val_ids, args, shard, shards)
            losses.append((step + 1, val))
            if rank == 0:
                print("{:>10}  step {:>5}/{}  train {:.4f}  val {:.4f}  {:.1f} s".format(
                    name, step + 1, args.steps, loss.item(), val, time.time() - started),
                    flush=True)
    out = os.path.join(args.out, name)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=os.path.join(out, "checkpoint"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if rank == 0:
        export = os.path.join(out, "model")
        model.save_pretrained(export, state_dict=full)
        shutil.copy(os.path.join(args.out, "tokenizer.model"), export)
    if name == "flexdemo":
        assert opt.bytes_sent == args.steps * bytes_per_step  # as the engine counted them
    return dict(optimizer=name, val_loss=losses[-1][1], evals=losses,
                bytes_between_nodes_per_step_and_rank=bytes_per_step,
                seconds=time.time() - started)


def main():
    args = arguments()
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "cpu:gloo,cuda:nccl")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = dist.get_world_size()
    if args.batch % world:
        raise SystemExit("train_gpt: --batch {} must divide among {} ranks".format(args.batch,
                                                                                 world))
    try:
        mesh = flexdemo.hybrid_mesh(ranks_per_node=args.ranks_per_node,
                                    island_nodes=args.island_nodes)
    except ValueError as e:
        raise SystemExit("train_gpt: {}".format(e))
    train_ids, val_ids = tokens(args, args.out)
    results = [train(args, name, mesh, train_ids, val_ids)
               for name in args.optimizers.split(",")]
    between = "islands" if args.island_nodes > 1 else "nodes"
    if dist.get_rank() == 0:
        print("\n{:<12} {:>10} {:>32} {:>10}".format("optimizer", "val loss",
                                                    "bytes between {}/step/rank".format(between),
                                                    "seconds"))
        for r in results:
            print("{:<12} {:>10.4f} {:>32,.0f} {:>10.1f}".format(
                r["optimizer"], r["val_loss"], r["bytes_between_nodes_per_step_and_rank"],
                r["seconds"]))
        if len(results) == 2:
            a, b = results
            print("{} vs {}: val loss {:+.2%}, {:.0f}x fewer bytes between {}".format(
                a["optimizer"], b["optimizer"], a["val_loss"] / b["val_loss"] - 1,
                b["bytes_between_nodes_per_step_and_rank"] /
                max(1, a["bytes_between_nodes_per_step_and_rank"]), between))
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
