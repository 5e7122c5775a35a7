#!/usr/bin/env bash
# ctest: a node sending faulty payloads between nodes (FLEXDEMO_INJECT_PAYLOAD) to a 2 nodes x 2
# ranks job (tiny GPT, FlexDeMo). Under --on-bad-peer drop (the default) each kind (non-finite
# values, values 1000x too large, a corrupt payload) is named in one line a step (node, rank,
# step, tensor), counted in summary.json, and the run ends normally; under --on-bad-peer stop the
# job ends non-zero with that line; with the scale check off, a 1000x node is not left out.
#   tests/faulty_peer.sh BUILD_DIR
set -euo pipefail
build=$1
source "$(dirname "$0")/lib.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tiny_corpus "$work/corpus" 'document %d: text for the faulty peer test.'
train() {  # RUN INJECTION [train options...]
  local out=$1 inject=$2
  shift 2
  mpirun --allow-run-as-root --oversubscribe -np 4 -x OMP_NUM_THREADS=1 \
    -x FLEXDEMO_TOKENIZE="$build/flexdemo-tokenize" -x FLEXDEMO_INJECT_PAYLOAD="$inject" \
    "$build/flexdemo" train --model gpt-nano --width 32 --layers 2 --heads 2 --context 32 \
    --seq 32 --batch 8 --chunk 8 --tokenizer bytes --data "$work/corpus" --ranks-per-node 2 \
    --steps 6 --comm-timeout 30 --eval-seqs 4 --progress lines --log-every 1000 "$@" \
    --out "$out" >"$out.log" 2>&1
}
left_out() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['peers_left_out'])" "$1/summary.json"; }
fail() { echo "FAIL: $*"; cat "$work"/*.log | grep -v '^step' | tail -20; exit 1; }

for kind in nan scale=1000 corrupt; do
  case $kind in
    nan) what="non-finite values" ;;
    scale=1000) what="values [0-9.e+]*x the replicas' lower median norm" ;;
    corrupt) what="a corrupt payload (invalid wire payload: checksum mismatch)" ;;
  esac
  # rank 2 is node 1's first rank: shard 0's replica group sees it, in steps 3 and 4
  train "$work/drop" "3-4:2:$kind" || fail "$kind: the run under drop ended with $?"
  for step in 3 4; do
    grep -q "^flexdemo: step $step: node 1 (rank 2) sent [a-z_.0-9]* with $what.*; left out of this step's mean (--on-bad-peer drop)$" "$work/drop.log" ||
      fail "$kind: no line naming node 1 (rank 2) at step $step"
  done
  [ "$(grep -c 'left out' "$work/drop.log")" -eq 2 ] || fail "$kind: expected 2 lines"
  [ "$(left_out "$work/drop")" -eq 2 ] || fail "$kind: summary.json counts $(left_out "$work/drop")"
  rc=0
  train "$work/stop" "3:2:$kind" --on-bad-peer stop || rc=$?
  [ $rc -ne 0 ] || fail "$kind: the run under stop ended well"
  grep -q "flexdemo: error: step 3: node 1 (rank 2) sent [a-z_.0-9]* with $what; stopping (--on-bad-peer stop)" "$work/stop.log" ||
    fail "$kind: no line naming the fault under stop"
  [ ! -f "$work/stop/summary.json" ] || fail "$kind: a summary after stopping"
  rm -rf "$work/drop" "$work/stop"
done
train "$work/off" "3-4:2:scale=1000" --peer-scale-bound 0 || fail "the run with the check off"
[ "$(left_out "$work/off")" -eq 0 ] || fail "a 1000x node left out with the scale check off"
# A list of injections (as bench/soak.sh plans them): each fires at its own step and rank.
train "$work/list" "2:2:corrupt,5:3:nan" || fail "the run with a list of injections"
grep -q "^flexdemo: step 2: node 1 (rank 2) sent [a-z_.0-9]* with a corrupt payload" "$work/list.log" ||
  fail "list: no line for the corrupt payload at step 2"
grep -q "^flexdemo: step 5: node 1 (rank 3) sent [a-z_.0-9]* with non-finite values" "$work/list.log" ||
  fail "list: no line for the non-finite values at step 5"
[ "$(left_out "$work/list")" -eq 2 ] || fail "list: summary.json counts $(left_out "$work/list")"
train "$work/clean" "" || fail "the clean run"
[ "$(left_out "$work/clean")" -eq 0 ] || fail "a healthy node left out"
echo "faulty peers: named and left out (drop), stopped (stop), every kind"
