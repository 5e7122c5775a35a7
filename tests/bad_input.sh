#!/usr/bin/env bash
# ctest: row N of docs/errors.md, a bad input and the one line it must produce. The command
# (`flexdemo ...` or `mpirun -np P flexdemo ...`) must exit with code 2, print exactly the
# documented line on stderr (once per rank under mpirun) and leave no --out folder behind.
# Files a row may name, made here: $DATA (a small text corpus), $EMPTY (an empty file),
# $BINARY (random bytes), $TINY (a corpus of 17 bytes), $EMPTYDIR, $TOML (a config file setting
# steps = 0), $TOML_UNKNOWN (a config with an unknown key), $TOML_SNAKE (a config setting
# min_lr_ratio = 2 by its config.json key), $BADPAIRS (a TSV of pairs, its line 2 without a
# tab), $RUN (a run with two valid
# checkpoints), $OTHER (a run of another model), $DAMAGED (a run whose checkpoints all fail
# their checksums), $NORANKS (that run's checkpoints without their table of ranks, as an older
# flexdemo wrote them), $BADRANKS (their table of ranks naming one place twice), $HF (that run exported as a transformers folder: a GPT2LMHeadModel of 257
# ids, no tokenizer files), $HF_ARCH (its config.json naming BertModel), $HF_LAYERS (claiming 2
# layers), $HF_SHAPE (claiming a context of 32), $HF_DTYPE (its first tensor in the file's
# header, wte, relabelled int32), $OUT (the --out folder).
#   tests/bad_input.sh BUILD_DIR DOCS_ERRORS_MD N
set -euo pipefail
build=$1
table=$2
row=$3
line=$(grep -E "^\| $row \| " "$table") || { echo "no row $row in $table"; exit 1; }
command=$(printf '%s\n' "$line" | cut -d'`' -f2)
expected=$(printf '%s\n' "$line" | cut -d'`' -f4)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# No GPU visible, whatever the machine has: the rows hold the same everywhere (row 83).
export FLEXDEMO_TOKENIZE="$build/flexdemo-tokenize" OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=
DATA=$work/data.txt EMPTY=$work/empty.txt BINARY=$work/binary.dat EMPTYDIR=$work/emptydir
TINY=$work/tiny.txt
TOML=$work/ok.toml TOML_UNKNOWN=$work/unknown.toml TOML_SNAKE=$work/snake.toml OUT=$work/out
RUN=$work/run OTHER=$work/other DAMAGED=$work/damaged BADPAIRS=$work/pairs.tsv
NORANKS=$work/noranks BADRANKS=$work/badranks
HF=$work/hf HF_ARCH=$work/hf-arch HF_LAYERS=$work/hf-layers HF_SHAPE=$work/hf-shape
HF_DTYPE=$work/hf-dtype
for d in $(seq 1 200); do printf 'document %d: a few words of text to train on.\n%%\n' "$d"; done > "$DATA"
: > "$EMPTY"
printf 'just a few words\n' > "$TINY"
head -c 4096 /dev/urandom > "$BINARY"
mkdir -p "$EMPTYDIR"
printf 'steps = 0\nbatch = 4\n' > "$TOML"
printf 'steps = 2\nlearning_rate = 0.1\n' > "$TOML_UNKNOWN"
printf 'min_lr_ratio = 2\n' > "$TOML_SNAKE"
printf 'a source\ta target\nno tab here\n' > "$BADPAIRS"
tiny=(--model gpt-nano --layers 1 --heads 2 --context 16 --seq 16 --batch 2 --chunk 8
      --tokenizer bytes --data "$DATA" --eval-seqs 2 --progress lines)
case "$command" in
  *'$RUN'* | *'$OTHER'* | *'$DAMAGED'* | *'$NORANKS'* | *'$BADRANKS'* | *'$HF'*)
    "$build/flexdemo" train "${tiny[@]}" --width 16 --steps 2 --checkpoint-every 1 --out "$RUN" > /dev/null
    "$build/flexdemo" train "${tiny[@]}" --width 32 --steps 1 --out "$OTHER" > /dev/null
    cp -r "$RUN" "$DAMAGED"
    cp -r "$RUN" "$NORANKS"
    perl -0777 -pi -e 's/\n  "ranks": \[.*?\n  \],//s' "$NORANKS"/checkpoints/*/manifest.json
    cp -r "$RUN" "$BADRANKS"
    perl -0777 -pi -e 's/("ranks": \[)/$1\n    [\n      0,\n      0\n    ],/' "$BADRANKS"/checkpoints/*/manifest.json
    for f in "$DAMAGED"/checkpoints/*/model.safetensors; do printf 'X' | dd of="$f" bs=1 seek=100 conv=notrunc status=none; done
    "$build/flexdemo" export "$RUN" --out "$HF" > /dev/null
    for d in "$HF_ARCH" "$HF_LAYERS" "$HF_SHAPE" "$HF_DTYPE"; do cp -r "$HF" "$d"; done
    sed -i 's/GPT2LMHeadModel/BertModel/' "$HF_ARCH/config.json"
    sed -i 's/"n_layer": 1/"n_layer": 2/' "$HF_LAYERS/config.json"
    sed -i 's/"n_positions": 16/"n_positions": 32/' "$HF_SHAPE/config.json"
    perl -0777 -pi -e 's/"F32"/"I32"/' "$HF_DTYPE/model.safetensors"  # the first only
    ;;
esac

expand() { # the named files and the launcher in a documented string
  local s=$1
  for v in DATA EMPTYDIR EMPTY BINARY TINY TOML_UNKNOWN TOML_SNAKE TOML OUT RUN OTHER DAMAGED NORANKS BADRANKS BADPAIRS \
           HF_ARCH HF_LAYERS HF_SHAPE HF_DTYPE HF; do s=${s//\$$v/${!v}}; done
  printf '%s' "$s"
}
command=$(expand "$command")
expected=$(expand "$expected")
ranks=1
if [[ "$command" =~ ^mpirun\ -np\ ([0-9]+)\ flexdemo\ (.*)$ ]]; then
  ranks=${BASH_REMATCH[1]}
  run=(mpirun --allow-run-as-root --oversubscribe -x OMP_NUM_THREADS=1 -x FLEXDEMO_TOKENIZE
       -np "$ranks" "$build/flexdemo")
  command=${BASH_REMATCH[2]}
elif [[ "$command" =~ ^flexdemo\ (.*)$ ]]; then
  run=("$build/flexdemo")
  command=${BASH_REMATCH[1]}
else
  echo "row $row: the command must start with 'flexdemo' or 'mpirun -np P flexdemo'"; exit 1
fi
eval "args=($command)"
# shellcheck disable=SC2154
if [ "${args[0]}" = train ] && [[ " ${args[*]} " != *" --out "* ]]; then args+=(--out "$OUT"); fi

set +e
"${run[@]}" "${args[@]}" > "$work/stdout" 2> "$work/stderr"
rc=$?
set -e
echo "row $row: ${run[*]} ${args[*]}"
echo "exit code $rc; stderr:"
cat "$work/stderr"
fail=0
[ "$rc" -eq 2 ] || { echo "FAIL: expected exit code 2, got $rc"; fail=1; }
# Under mpirun, mpirun adds its own notes; every rank's line must be the documented one.
got=$(grep '^flexdemo' "$work/stderr" || true)
want=$(for _ in $(seq 1 "$ranks"); do printf '%s\n' "$expected"; done)
if [ "$ranks" -eq 1 ]; then got=$(cat "$work/stderr"); fi
[ "$got" = "$want" ] || { printf 'FAIL: expected stderr:\n%s\n' "$want"; fail=1; }
[ ! -e "$OUT" ] || { echo "FAIL: $OUT was created"; fail=1; }
exit "$fail"
