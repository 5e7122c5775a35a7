#!/usr/bin/env python3
"""flexdemo's models checked by Hugging Face transformers itself (offline).

For a GPT (GPT2LMHeadModel), a LLaMA (LlamaForCausalLM: grouped-query attention, rotary positions
with another base, a head of its own) and a T5 (T5ForConditionalGeneration, trained on
translation pairs), both ways:
  - export: train a few steps with flexdemo on 2 ranks (sharded), `flexdemo export --format hf`,
    load the folder with transformers' AutoModelForCausalLM and AutoTokenizer;
  - import: a random model made by transformers, saved with save_pretrained, read by flexdemo
    (`flexdemo eval/generate FOLDER`, `flexdemo train --init-from FOLDER`);
and compare on the same token ids
  - the mean next-token loss and the next-token logits (`flexdemo eval --tokens --logits`),
    within 1e-4 relative;
  - greedy generation, token for token, and its text (`flexdemo generate --temperature 0`; T5:
    the greedy translation, `--beam 1`);
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

import sentencepiece  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

FLEXDEMO, WORK = sys.argv[1], sys.argv[2]
PROMPT = "The best way to"
T5_PROMPT = "Open the file number 7"
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


def made_by_transformers(name, auto_class, config, tokenizer_files, seed):
    """A random transformers model (weights drawn wider than its default initialisation, so its
    logits are far from uniform), saved with save_pretrained beside the given tokenizer files."""
    hf_dir = os.path.join(WORK, name + "-made")
    shutil.rmtree(hf_dir, ignore_errors=True)
    torch.manual_seed(seed)
    model = auto_class.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(hf_dir)
    for f in tokenizer_files:
        shutil.copy(f, hf_dir)
    return hf_dir, model, AutoTokenizer.from_pretrained(hf_dir)


def import_(name, config, tokenizer_dir):
    """A random decoder made by transformers, read by flexdemo."""
    files = [os.path.join(tokenizer_dir, f) for f in ("tokenizer.model", "tokenizer_config.json")]
    hf_dir, model, tokenizer = made_by_transformers(name, AutoModelForCausalLM, config, files, 11)
    run_dir = os.path.join(WORK, name + "-tuned")
    shutil.rmtree(run_dir, ignore_errors=True)
    same_outputs(f"import {name}", hf_dir, model, tokenizer)
    # Fine-tuning starts from it: the run takes the folder's shape and tokenizer.
    run(["train", "--init-from", hf_dir, "--ranks-per-node", "2", "--steps", "2", "--batch", "4",
         "--seq", "32", "--eval-seqs", "4", "--progress", "lines", "--out", run_dir], ranks=2)
    saved = json.load(open(os.path.join(run_dir, "config.json")))
    check(f"import {name}: fine-tuned run", saved["width"] == config.hidden_size and saved["model"] == name,
          f"config.json: model {saved['model']} (the family, no preset), width {saved['width']}")


def same_translation_outputs(name, ours_dir, hf_dir, model, tokenizer):
    """T5: loss and next-token logits by teacher forcing on the same source and target ids, and
    greedy translation, of flexdemo on ours_dir against transformers' model."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    source, target = torch.randint(0, vocab, (3, 12), generator=g), torch.randint(0, vocab, (3, 9), generator=g)
    ids_file, logits_file = os.path.join(WORK, name + "-ids.json"), os.path.join(WORK, name + "-logits.safetensors")
    with open(ids_file, "w") as f:
        json.dump({"source": source.tolist(), "target": target.tolist()}, f)
    ours = json.loads(run(["eval", ours_dir, "--tokens", ids_file, "--logits", logits_file]).strip().splitlines()[-1])
    start = torch.full((3, 1), model.config.decoder_start_token_id)
    with torch.no_grad():
        theirs_loss = model(input_ids=source, labels=target).loss.item()
        their_logits = model(input_ids=source, decoder_input_ids=torch.cat([start, target], 1)).logits[:, -1]
    check(f"{name}: loss", abs(ours["loss"] - theirs_loss) <= 1e-4 * abs(theirs_loss),
          f"flexdemo {ours['loss']:.7f}, transformers {theirs_loss:.7f}")
    our_logits = load_file(logits_file)["next_token_logits"]
    rel = ((our_logits - their_logits).abs().max() / their_logits.abs().max()).item()
    check(f"{name}: next-token logits", rel <= 1e-4, f"max difference / max |logit| = {rel:.2e}")

    # Greedy translation: the source ends with end-of-text (T5Tokenizer appends it), the decoder
    # starts with it; both stop at it or after NEW_TOKENS. transformers' ids are decoded by the
    # SentencePiece model itself, as flexdemo decodes (T5Tokenizer prints byte pieces as
    # "<0xD8>" where SentencePiece joins them into characters).
    spm = sentencepiece.SentencePieceProcessor(model_file=os.path.join(hf_dir, "spiece.model"))
    inputs = tokenizer(T5_PROMPT, return_tensors="pt")
    eot = model.config.eos_token_id
    check(f"{name}: tokenizer", inputs["input_ids"][0].tolist() == spm.encode(T5_PROMPT) + [eot],
          f"transformers {inputs['input_ids'][0].tolist()}, SentencePiece {spm.encode(T5_PROMPT)} + {eot}")
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=NEW_TOKENS, num_beams=1, do_sample=False)
    their_text, run_ids = "", []  # flexdemo's rule: sentinels as <extra_id_N>, runs between
    for t in generated[0].tolist()[1:]:
        if t == eot:
            continue
        if t < spm.get_piece_size():
            run_ids.append(t)
        else:
            their_text += spm.decode(run_ids) + f"<extra_id_{t - spm.get_piece_size()}>"
            run_ids = []
    their_text += spm.decode(run_ids)
    printed = run(["generate", ours_dir, "--prompt", T5_PROMPT, "--tokens", str(NEW_TOKENS), "--beam", "1"])
    our_text = printed[:-1] if printed.endswith("\n") else printed
    check(f"{name}: greedy translation", our_text == their_text,
          f"flexdemo {our_text!r}, transformers {their_text!r}")


def export_t5(pairs):
    run_dir, hf_dir = os.path.join(WORK, "t5"), os.path.join(WORK, "t5-hf")
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(hf_dir, ignore_errors=True)
    run(["train", "--model", "t5-nano", "--width", "32", "--heads", "4", "--ff", "64", "--data", pairs, "--vocab", "300",
         "--ranks-per-node", "2", "--steps", "150", "--lr", "4e-3", "--batch", "8", "--seq", "32", "--target-seq", "32",
         "--eval-seqs", "4", "--progress", "lines", "--out", run_dir], ranks=2)
    run(["export", run_dir, "--format", "hf", "--out", hf_dir])
    model = AutoModelForSeq2SeqLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    same_translation_outputs("export t5", run_dir, hf_dir, model, tokenizer)
    return hf_dir


def import_t5(tokenizer_dir, vocab):
    """A random T5 made by transformers, read by flexdemo."""
    config = T5Config(vocab_size=vocab, d_model=48, d_kv=12, d_ff=96, num_layers=2, num_heads=4,
                      feed_forward_proj="relu", dropout_rate=0.0, decoder_start_token_id=1, eos_token_id=1,
                      pad_token_id=1)
    files = [os.path.join(tokenizer_dir, f) for f in ("spiece.model", "tokenizer_config.json")]
    hf_dir, model, tokenizer = made_by_transformers("t5", AutoModelForSeq2SeqLM, config, files, 12)
    same_translation_outputs("import t5", hf_dir, hf_dir, model, tokenizer)


os.makedirs(WORK, exist_ok=True)
from transformers import AutoModelForSeq2SeqLM, GPT2Config, LlamaConfig, T5Config  # noqa: E402

gpt_dir = export("gpt", ["--model", "gpt-nano", "--width", "32", "--layers", "2", "--heads", "2", "--context", "64"])
export("llama", ["--model", "llama-nano", "--width", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                 "--ff", "80", "--context", "64", "--rope-theta", "50000", "--no-tied-head"])
vocab = AutoTokenizer.from_pretrained(gpt_dir).vocab_size
import_("gpt", GPT2Config(vocab_size=vocab, n_positions=64, n_embd=48, n_layer=2, n_head=3, bos_token_id=1, eos_token_id=1), gpt_dir)
import_("llama", LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                             rms_norm_eps=1e-5, rope_theta=20000.0, tie_word_embeddings=True,
                             bos_token_id=1, eos_token_id=1), gpt_dir)
# T5 on translation pairs (a small TSV: its tokenizer is trained on it).
pairs = os.path.join(WORK, "pairs.tsv")
with open(pairs, "w") as f:
    for i in range(300):
        f.write(f"Open the file number {i}\tOuvrir le fichier numéro {i}\n")
        f.write(f"Close window {i} now\tFermer la fenêtre {i} maintenant\n")
t5_dir = export_t5(pairs)
import_t5(t5_dir, AutoModelForSeq2SeqLM.from_pretrained(t5_dir).config.vocab_size)
if failures:
    sys.exit(f"{len(failures)} check(s) failed: {', '.join(failures)}")
print("transformers agrees with flexdemo on every check")
