#!/usr/bin/env python3
"""flexdemo's models checked by Hugging Face transformers itself (offline).

For a GPT (GPT2LMHeadModel) and a LLaMA (LlamaForCausalLM: grouped-query attention, rotary
positions with another base, a head of its own), both ways:
  - export: train a few steps with flexdemo on 2 ranks (sharded), `flexdemo export --format hf`,
    load the folder with transformers' AutoModelForCausalLM and AutoTokenizer;
  - import: a random model made by transformers, saved with save_pretrained, read by flexdemo
    (`flexdemo eval/generate FOLDER`, `flexdemo train --init-from FOLDER`);
and compare on the same token ids
  - the mean next-token loss and the next-token logits (`flexdemo eval --tokens --logits`),
    within 1e-4 relative;
  - greedy generation, token for token, and its text (`flexdemo generate --temperature 0`);
  - the tokenizer's ids for the prompt (export).
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


def same_outputs(name, ours_dir, model, tokenizer):
    """Loss, next-token logits and greedy generation of flexdemo on ours_dir (a run or a
    transformers folder) against transformers' model."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (3, 20), generator=torch.Generator().manual_seed(7))
    ids_file, logits_file = os.path.join(WORK, name + "-ids.json"), os.path.join(WORK, name + "-logits.safetensors")
    with open(ids_file, "w") as f:
        json.dump(ids.tolist(), f)
    ours = json.loads(run(["eval", ours_dir, "--tokens", ids_file, "--logits", logits_file]).strip().splitlines()[-1])
    with torch.no_grad():
        out = model(ids, labels=ids)
    theirs_loss = out.loss.item()
    check(f"{name}: loss", abs(ours["loss"] - theirs_loss) <= 1e-4 * abs(theirs_loss),
          f"flexdemo {ours['loss']:.7f}, transformers {theirs_loss:.7f}")
    our_logits = load_file(logits_file)["next_token_logits"]
    their_logits = out.logits[:, -1]
    rel = ((our_logits - their_logits).abs().max() / their_logits.abs().max()).item()
    check(f"{name}: next-token logits", rel <= 1e-4, f"max difference / max |logit| = {rel:.2e}")

    # Greedy generation, token for token (end-of-text does not stop either side).
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    sequence = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            next_id = model(sequence).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_id], 1)
    their_text = tokenizer.decode(sequence[0].tolist(), skip_special_tokens=True)
    printed = run(["generate", ours_dir, "--prompt", PROMPT, "--tokens", str(NEW_TOKENS),
                   "--temperature", "0"])
    our_text = printed[:-1] if printed.endswith("\n") else printed  # the line's own newline
    check(f"{name}: greedy generation", our_text == their_text,
          f"flexdemo {our_text!r}, transformers {their_text!r}")
    return prompt_ids, sequence


def export(name, train_args):
    run_dir, hf_dir = os.path.join(WORK, name), os.path.join(WORK, name + "-hf")
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(hf_dir, ignore_errors=True)
    run(["train", "--ranks-per-node", "2", "--steps", "30", "--batch", "4", "--seq", "32",
         "--eval-seqs", "4", "--progress", "lines", "--out", run_dir] + train_args, ranks=2)
    run(["export", run_dir, "--format", "hf", "--out", hf_dir])

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompt_ids, sequence = same_outputs(f"export {name}", run_dir, model, tokenizer)

    # The tokenizer: the prompt's ids as flexdemo's SentencePiece model gives them.
    helper = os.environ.get("FLEXDEMO_TOKENIZE", os.path.join(os.path.dirname(FLEXDEMO), "flexdemo-tokenize"))
    spm = subprocess.run([helper, "encode", "--lines", "--model", os.path.join(hf_dir, "tokenizer.model")],
                         input=json.dumps(PROMPT) + "\n", capture_output=True, text=True, check=True)
    helper_ids = [int(t) for t in spm.stdout.split()]
    check(f"export {name}: tokenizer", prompt_ids == helper_ids,
          f"transformers {prompt_ids}, flexdemo {helper_ids}")
    # transformers' own generate (what the README shows) continues the same way until it stops.
    with torch.no_grad():
        generated = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    n = generated.shape[1]
    check(f"export {name}: model.generate", generated[0].tolist() == sequence[0, :n].tolist(),
          f"{n - len(prompt_ids)} tokens")


    return hf_dir


def import_(name, config, tokenizer_dir):
    """A random transformers model (weights drawn wider than its default initialisation, so its
    logits are far from uniform) read by flexdemo."""
    hf_dir, run_dir = os.path.join(WORK, name + "-made"), os.path.join(WORK, name + "-tuned")
    shutil.rmtree(hf_dir, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(hf_dir)
    for f in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, f), hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    same_outputs(f"import {name}", hf_dir, model, tokenizer)
    # Fine-tuning starts from it: the run takes the folder's shape and tokenizer.
    run(["train", "--init-from", hf_dir, "--ranks-per-node", "2", "--steps", "2", "--batch", "4",
         "--seq", "32", "--eval-seqs", "4", "--progress", "lines", "--out", run_dir], ranks=2)
    saved = json.load(open(os.path.join(run_dir, "config.json")))
    check(f"import {name}: fine-tuned run", saved["width"] == config.hidden_size,
          f"config.json: model {saved['model']}, width {saved['width']}")


os.makedirs(WORK, exist_ok=True)
from transformers import GPT2Config, LlamaConfig  # noqa: E402

gpt_dir = export("gpt", ["--model", "gpt-nano", "--width", "32", "--layers", "2", "--heads", "2", "--context", "64"])
export("llama", ["--model", "llama-nano", "--width", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                 "--ff", "80", "--context", "64", "--rope-theta", "50000", "--no-tied-head"])
vocab = AutoTokenizer.from_pretrained(gpt_dir).vocab_size
import_("gpt", GPT2Config(vocab_size=vocab, n_positions=64, n_embd=48, n_layer=2, n_head=3, bos_token_id=1, eos_token_id=1), gpt_dir)
import_("llama", LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                             rms_norm_eps=1e-5, rope_theta=20000.0, tie_word_embeddings=True,
                             bos_token_id=1, eos_token_id=1), gpt_dir)
if failures:
    sys.exit(f"{len(failures)} check(s) failed: {', '.join(failures)}")
print("transformers agrees with flexdemo on every check")
