#!/usr/bin/env python3
"""flexdemo's models checked by Hugging Face transformers itself (offline).

For a GPT and a LLaMA (grouped-query attention, and a head of its own): train a few steps with
flexdemo on 2 ranks (sharded), `flexdemo export --format hf`, load the folder with transformers'
AutoModelForCausalLM and AutoTokenizer, and compare on the same token ids
  - the mean next-token loss and the next-token logits (`flexdemo eval --tokens --logits`),
    within 1e-4 relative;
  - greedy generation, token for token, and its text (`flexdemo generate --temperature 0`);
  - the tokenizer's ids for the prompt.
Usage: hf_interop.py FLEXDEMO_BINARY WORK_DIR
"""
import json
import os
import shutil
import subprocess
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

FLEXDEMO, WORK = sys.argv[1], sys.argv[2]
PROMPT = "The best way to"
NEW_TOKENS = 12
failures = []


def run(args, ranks=None):
    cmd = [FLEXDEMO] + args
    if ranks:
        cmd = ["mpirun", "--oversubscribe", "-np", str(ranks)] + cmd
        if os.geteuid() == 0:
            cmd.insert(1, "--allow-run-as-root")
    done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    return done.stdout


def check(what, ok, detail):
    print(f"{'ok  ' if ok else 'FAIL'} {what}: {detail}")
    if not ok:
        failures.append(what)


def compare(name, train_args):
    run_dir, hf_dir = os.path.join(WORK, name), os.path.join(WORK, name + "-hf")
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(hf_dir, ignore_errors=True)
    run(["train", "--ranks-per-node", "2", "--steps", "4", "--batch", "4", "--seq", "32",
         "--eval-seqs", "4", "--progress", "lines", "--out", run_dir] + train_args, ranks=2)
    run(["export", run_dir, "--format", "hf", "--out", hf_dir])

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    vocab = model.config.vocab_size

    # Loss and next-token logits on the same ids.
    ids = torch.randint(0, vocab, (3, 20), generator=torch.Generator().manual_seed(7))
    ids_file, logits_file = os.path.join(WORK, name + "-ids.json"), os.path.join(WORK, name + "-logits.safetensors")
    with open(ids_file, "w") as f:
        json.dump(ids.tolist(), f)
    ours = json.loads(run(["eval", run_dir, "--tokens", ids_file, "--logits", logits_file]).strip().splitlines()[-1])
    with torch.no_grad():
        out = model(ids, labels=ids)
    theirs_loss = out.loss.item()
    check(f"{name}: loss", abs(ours["loss"] - theirs_loss) <= 1e-4 * abs(theirs_loss),
          f"flexdemo {ours['loss']:.7f}, transformers {theirs_loss:.7f}")
    our_logits = load_file(logits_file)["next_token_logits"]
    their_logits = out.logits[:, -1]
    rel = ((our_logits - their_logits).abs().max() / their_logits.abs().max()).item()
    check(f"{name}: next-token logits", rel <= 1e-4, f"max difference / max |logit| = {rel:.2e}")

    # The tokenizer: the prompt's ids as flexdemo's SentencePiece model gives them.
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    helper = os.environ.get("FLEXDEMO_TOKENIZE", os.path.join(os.path.dirname(FLEXDEMO), "flexdemo-tokenize"))
    spm = subprocess.run([helper, "encode", "--lines", "--model", os.path.join(hf_dir, "tokenizer.model")],
                         input=json.dumps(PROMPT) + "\n", capture_output=True, text=True, check=True)
    helper_ids = [int(t) for t in spm.stdout.split()]
    check(f"{name}: tokenizer", prompt_ids == helper_ids, f"transformers {prompt_ids}, flexdemo {helper_ids}")

    # Greedy generation, token for token (end-of-text does not stop either side).
    sequence = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            next_id = model(sequence).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_id], 1)
    their_text = tokenizer.decode(sequence[0].tolist(), skip_special_tokens=True)
    our_text = run(["generate", run_dir, "--prompt", PROMPT, "--tokens", str(NEW_TOKENS),
                    "--temperature", "0"]).rstrip("\n")
    check(f"{name}: greedy generation", our_text == their_text,
          f"flexdemo {our_text!r}, transformers {their_text!r}")
    # transformers' own generate (what the README shows) continues the same way until it stops.
    with torch.no_grad():
        generated = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    n = generated.shape[1]
    check(f"{name}: model.generate", generated[0].tolist() == sequence[0, :n].tolist(),
          f"{n - len(prompt_ids)} tokens")


os.makedirs(WORK, exist_ok=True)
compare("gpt", ["--model", "gpt-nano", "--width", "32", "--layers", "2", "--heads", "2", "--context", "64"])
compare("llama", ["--model", "llama-nano", "--width", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                  "--ff", "80", "--context", "64", "--rope-theta", "50000", "--no-tied-head"])
if failures:
    sys.exit(f"{len(failures)} check(s) failed: {', '.join(failures)}")
print("transformers agrees with flexdemo on every check")
