#!/usr/bin/env bash
# ctest: single-process commands started at the same moment never collide in OpenMPI's session
# directory. 16 `flexdemo train` runs (each an MPI singleton, refused for a missing corpus after
# MPI is up) start together with TMPDIR holding a plain *file* where OpenMPI's shared session
# directory (ompi.HOST.UID) would go: a process that used that directory could not start (exit 1,
# "mkdir ... Not a directory"). Each must exit 2 with its documented line, and leave nothing of
# its own session directory behind.
#   tests/concurrent_commands.sh BUILD_DIR
set -euo pipefail
build=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/tmp"
touch "$work/tmp/ompi.$(hostname).$(id -u)"
n=16
for i in $(seq 1 $n); do
  TMPDIR="$work/tmp" "$build/flexdemo" train --data "$work/missing-$i" --out "$work/out-$i" \
    > "$work/stdout-$i" 2> "$work/stderr-$i" &
done
fail=0
for i in $(seq 1 $n); do
  rc=0
  wait -n || rc=$?
  [ "$rc" -eq 2 ] || { echo "FAIL: a command exited $rc, expected 2"; fail=1; }
done
for i in $(seq 1 $n); do
  expected="flexdemo: error: --data: no such file or folder: $work/missing-$i"
  [ "$(cat "$work/stderr-$i")" = "$expected" ] ||
    { echo "FAIL: command $i printed:"; cat "$work/stderr-$i"; fail=1; }
done
left=$(find "$work/tmp" -mindepth 1 -maxdepth 1 -name 'flexdemo-mpi-*' | wc -l)
[ "$left" -eq 0 ] || { echo "FAIL: $left session directories left behind"; fail=1; }
echo "$n single-process commands at once: each exited 2 with its own line; none used the shared session directory"
exit "$fail"
