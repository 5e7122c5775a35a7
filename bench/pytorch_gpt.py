#!/usr/bin/env python3
"""PyTorch's own speed on flexdemo's GPT (src/model/gpt.cpp, the same shapes and operations):
eager mode, AdamW, random tokens, one GPU. Prints one JSON object with tokens_per_s, measured
over --steps steps after --warmup. The baseline scripts/gpu-check.sh sets flexdemo's speed beside.

    python3 bench/pytorch_gpt.py --width 768 --layers 12 --heads 12 --vocab 4096 --seq 256 --batch 16
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln_2 = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.fc_proj = torch.nn.Linear(4 * width, width)

    def forward(self, x):  # block_forward in gpt.cpp: attention by matmul, softmax, matmul
        B, T, C = x.shape
        H, D = self.heads, C // self.heads
        q, k, v = self.qkv(self.ln_1(x)).split(C, 2)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = torch.softmax(att.masked_fill(future, float("-inf")), -1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        out = x + self.proj(y)
        return out + self.fc_proj(F.gelu(self.fc(self.ln_2(out)), approximate="tanh"))


class Gpt(torch.nn.Module):
    def __init__(self, vocab, width, layers, heads, context):
        super().__init__()
        self.wte = torch.nn.Parameter(torch.randn(vocab, width) * 0.02)
        self.wpe = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)

    def forward(self, tokens):
        x = F.embedding(tokens, self.wte) + self.wpe[: tokens.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.t()  # tied head


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast of the forward")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (gpu-check.sh --rehearse)")
    a = p.parse_args()
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = Gpt(a.vocab, a.width, a.layers, a.heads, a.context).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.bf16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(a.warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    sync()
    seconds = time.perf_counter() - start
    print(json.dumps({"tokens_per_s": a.steps * a.batch * a.seq / seconds,
                      "step_ms": 1000 * seconds / a.steps, "loss": float(loss)}))


if __name__ == "__main__":
    main()
