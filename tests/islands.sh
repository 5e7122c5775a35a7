#!/usr/bin/env bash
# ctest: islands (--island-nodes) work as nodes do. 2 islands x 2 nodes x 1 rank with shard groups
# spanning each island's two nodes (--shard-size 2) make the same groups of the same ranks as
# 2 nodes x 2 ranks with --shard-size 2: the same arithmetic on another layout. Both runs carry a
# corrupt payload from rank 2 at step 3 (FLEXDEMO_INJECT_PAYLOAD; --on-bad-peer drop) and the
# link budget with its probes' measurements injected (FLEXDEMO_INJECT_LINK: an endless probe,
# then an instant one), so:
#   * every step's loss, the bytes between replicas and the link budget's choices are equal, bit
#     for bit; the first line says the layout, the progress names what the replicas exchange
#     across (islands), and the bad payload's line names its island ("island 1 (rank 2)");
#   * the islands' run under `flexdemo supervise`, rank 1 preempted at step 10, resumes from its
#     checkpoint and equals the uninterrupted run, bit for bit;
#   * stopped at step 10 and resumed as 4 islands of 1 node (another island size: shard size 1,
#     4 replicas, the shards re-cut), the run finishes within 1% of the uninterrupted final loss
#     (the elastic test's bound for DeMo, tests/elastic_resume.sh).
#   tests/islands.sh BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/lib.sh"
build=$1
work=$(mktemp -d)
sup=""
trap 'rc=$?; [ -z "$sup" ] || kill -9 "$sup" 2>/dev/null || true
      [ $rc -eq 0 ] || { echo "--- last log:"; tail -20 "$work/last.log" 2>/dev/null; }
      rm -rf "$work"' EXIT
tiny_corpus "$work/corpus" 'document %d: text for the islands test.'
steps=20
export FLEXDEMO_INJECT_PAYLOAD=3:2:corrupt FLEXDEMO_INJECT_LINK=1e9,0,1e9 FLEXDEMO_INJECT_SIGNAL=
job=(mpirun --allow-run-as-root --oversubscribe -np 4 -x OMP_NUM_THREADS=1
  -x FLEXDEMO_TOKENIZE="$build/flexdemo-tokenize" -x FLEXDEMO_INJECT_PAYLOAD -x FLEXDEMO_INJECT_LINK
  -x FLEXDEMO_INJECT_SIGNAL
  "$build/flexdemo" train --model gpt-nano --width 32 --layers 2 --heads 2 --context 32 --seq 32
  --batch 8 --chunk 8 --tokenizer bytes --data "$work/corpus" --steps "$steps" --topk 32
  --values bf16 --link-budget auto --link-min-topk 4 --link-max-topk 32 --link-max-every 2
  --link-probe-every 5 --check-replicas 5 --checkpoint-every 5 --comm-timeout 30 --eval-seqs 4
  --eval-every 10 --progress lines --log-every 1)
islands=(--ranks-per-node 1 --island-nodes 2 --shard-size 2)
train() {  # OUT [options...]: the run's exit code, its log in OUT.log
  local out=$1 status=0
  shift
  "${job[@]}" --out "$out" "$@" > "$work/last.log" 2>&1 || status=$?
  cp "$work/last.log" "$out.log"
  return $status
}
choice='"link_budget":{"step":[0-9]*,"topk":[0-9]*,"values":"[a-z0-9]*","every":[0-9]*'
per_step() {  # every step's loss and bytes between replicas, and the link budget's choices
  grep -o "\"loss\":[^,]*\\|\"inter_bytes_sent\":[^,]*\\|$choice" "$1/metrics.jsonl"
}
fail() { echo "FAIL: $*"; exit 1; }

train "$work/nodes" --ranks-per-node 2 --shard-size 2 || fail "2 nodes x 2 ranks failed"
train "$work/islands" "${islands[@]}" || fail "2 islands x 2 nodes x 1 rank failed"
grep -q "flexdemo train: 2 islands x 2 nodes x 1 rank, shard size 2, 2 replicas" \
  "$work/islands.log" || fail "the first line does not say the islands' layout"
grep -q "between islands/step" "$work/islands.log" || fail "the progress does not name the islands"
grep -q "^flexdemo: step 3: island 1 (rank 2) sent [a-z_.0-9]* with a corrupt payload.*; left out" \
  "$work/islands.log" || fail "no line naming island 1 (rank 2) for the corrupt payload"
grep -q "^flexdemo: step 3: node 1 (rank 2) sent" "$work/nodes.log" ||
  fail "no line naming node 1 (rank 2) for the corrupt payload"
# its four choices follow the injected probes: endless (top-k 4), instant (32), endless, endless
[ "$(grep -o "$choice" "$work/islands/metrics.jsonl" | sed 's/.*"topk":\([0-9]*\).*/\1/' |
  tr '\n' ' ')" = "4 32 4 4 " ] ||
  fail "the link budget's choices are not the injected probes' (top-k 4, 32, 4, 4)"
[ "$(per_step "$work/nodes" | wc -l)" -ge $((2 * steps + 3)) ] || fail "too few metrics lines"
diff <(per_step "$work/nodes") <(per_step "$work/islands") > "$work/diff" ||
  { echo "FAIL: the layouts' losses, bytes or link choices differ:"; head "$work/diff"; exit 1; }

# Under supervise: rank 1 preempted in step 10 (a checkpoint, exit code 75), restarted once.
FLEXDEMO_INJECT_SIGNAL=10:1 "$build/flexdemo" supervise --backoff 0 --max-restarts 2 -- \
  "${job[@]}" "${islands[@]}" --out "$work/supervised" --resume auto > "$work/last.log" 2>&1 &
sup=$!
wait_for_exit "$sup" 300 || fail "the supervised run did not end in 300 s"
sup=""
[ "$rc" -eq 0 ] || fail "supervise ended with $rc"
grep -q "the job finished after 1 restart$" "$work/last.log" || fail "no restart, or more than one"
[ "$(grep -o '^{"step":[0-9]*' "$work/supervised/metrics.jsonl" | cut -d: -f2)" = \
  "$(seq 1 $steps)" ] || fail "the supervised metrics.jsonl does not hold steps 1..$steps once"
diff <(per_step "$work/islands") <(per_step "$work/supervised") > "$work/diff" ||
  { echo "FAIL: the supervised run differs from the uninterrupted one:"; head "$work/diff"
    exit 1; }

# Another island size: stopped at step 10, resumed as 4 islands of 1 node (shard size 1).
rc=0
FLEXDEMO_INJECT_SIGNAL=10:0 train "$work/resized" "${islands[@]}" || rc=$?
[ $rc -eq 75 ] || fail "the run to resize ended with $rc, expected 75 (stopped)"
# 4 replicas would share the second moment by default (--second-moment auto), 2 did not. Asked
# for the shared one, the resume meets the other kind's state: refused in one line naming the
# options that keep it; auto keeps the checkpoint's own and says so (the shared statistics'
# encoding asked for then goes unused).
rc=0
train "$work/refused" --ranks-per-node 1 --island-nodes 1 --shard-size 1 --second-moment shared \
  --resume "$work/resized" || rc=$?
[ $rc -ne 0 ] || fail "a resume onto the other kind of second moment was not refused"
grep -q "the checkpoint holds the own second moment, this run's is shared (4 replicas): pass --second-moment own or auto" \
  "$work/last.log" || fail "the refusal does not name --second-moment own: $(tail -3 "$work/last.log")"
train "$work/resized" --ranks-per-node 1 --island-nodes 1 --shard-size 1 \
  --second-moment-values bf16 --resume "$work/resized" ||
  fail "the run resumed as 4 islands of 1 node failed"
grep -q "^--second-moment auto: the checkpoint's own second moment kept (auto chooses" \
  "$work/last.log" || fail "auto did not say it kept the checkpoint's own second moment"
grep -q "^resuming step 10, written by" "$work/last.log" || fail "no elastic resume from step 10"
grep -q "flexdemo train: 4 nodes x 1 rank, shard size 1, 4 replicas" "$work/last.log" ||
  fail "the resized run's first line does not say 4 nodes x 1 rank, shard size 1"
final() { grep -o '"loss":[^,]*' "$1/metrics.jsonl" | tail -1 | cut -d: -f2; }
awk -v a="$(final "$work/islands")" -v b="$(final "$work/resized")" \
  'BEGIN { d = (b - a) / a; exit !((d < 0 ? -d : d) <= 0.01) }' ||
  fail "resized: final loss $(final "$work/resized"), uninterrupted $(final "$work/islands")"
echo "2 islands x 2 nodes x 1 rank equal 2 nodes x 2 ranks (shard size 2) with a bad peer and the" \
  "link budget, bit for bit, over $steps steps; supervised, equal again; resized to 4 islands of" \
  "1 node, final loss $(final "$work/resized") against $(final "$work/islands")"
