#!/usr/bin/env bash
# An emulated cluster on this machine: N nodes as network namespaces, each joined by a veth pair
# to a bridge in a "switch" namespace of its own, each node's link rate-limited by tbf, and
# mpirun across them over TCP. No traffic leaves these namespaces. Needs root.
#
#   scripts/cluster.sh up N S RATE [K INSIDE]
#                                      N nodes, S ranks per node, RATE like 100mbit or none (a
#                                      delay may follow: 100mbit@20ms); with K and INSIDE, islands
#                                      of K consecutive nodes (flexdemo train --island-nodes K):
#                                      a node's traffic to its own island's nodes goes at INSIDE
#                                      (e.g. 10gbit or 10gbit@0.1ms), to the others' at RATE
#   scripts/cluster.sh bytes           per node, the bytes it sent inside its island and between
#                                      islands since up (the links' own counters)
#   scripts/cluster.sh run [--nodes-file F] -- CMD...
#                                      mpirun CMD on N*S ranks (flexdemo learns S from the env),
#                                      or on the nodes F lists now (numbers, e.g. "1,2"; read at
#                                      each start: a hostfile rewritten between restarts); every
#                                      FLEXDEMO_* variable set here reaches every rank
#   scripts/cluster.sh link I down|up  take node I's link to the switch down (a lost link: its
#                                      packets are dropped, connections stay open) or up again
#   scripts/cluster.sh node I down|up  a node lost (every process in it killed, its link down)
#                                      or back (its link up)
#   scripts/cluster.sh down            remove everything (also after a failed run)
set -euo pipefail

prefix=fdc                          # namespace and link names start with this
subnet=10.77.0                      # the nodes are $subnet.1 .. $subnet.N
state=/run/flexdemo-cluster         # N, S, RATE and the rsh agent of the cluster that is up

die() { echo "cluster.sh: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "needs root to create network namespaces (run as root or with sudo)"

nodes() { ip netns list | awk '{print $1}' | grep -E "^${prefix}-node[0-9]+$" || true; }

down() {
  for ns in $(nodes) "${prefix}-switch"; do
    if ip netns list | awk '{print $1}' | grep -qx "$ns"; then
      ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
      ip netns del "$ns"
    fi
  done
  rm -rf "$state"
}

# A link's spec: none, RATE or RATE@DELAY (100mbit, 10gbit@0.1ms).
check_link() {  # WHAT SPEC
  [[ "$2" == none || "$2" =~ ^[0-9]+(k|m|g)?bit(@[0-9.]+(us|ms|s))?$ ]] ||
    die "$1 must look like 100mbit, 1gbit or 10gbit@0.1ms, or be none; got '$2'"
}
# A node's link as two HTB classes: 1:10 to its island's nodes at INSIDE, 1:20 (the default) to
# every other node at BETWEEN, each with its delay (netem) if the spec has one.
island_links() {  # NS DEV NODE N K INSIDE BETWEEN
  local ns=$1 dev=$2 i=$3 n=$4 k=$5 inside=$6 between=$7 class spec rate delay j
  ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: htb default 20
  for class in 10 20; do
    spec=$([ "$class" = 10 ] && echo "$inside" || echo "$between")
    rate=${spec%%@*}
    [ "$rate" = none ] && rate=100gbit
    ip netns exec "$ns" tc class add dev "$dev" parent 1: classid "1:$class" htb rate "$rate" \
      ceil "$rate" burst 64kb cburst 64kb quantum 60000
    if [[ "$spec" == *@* ]]; then
      delay=${spec#*@}
      ip netns exec "$ns" tc qdisc add dev "$dev" parent "1:$class" handle "$class:" netem \
        delay "$delay" limit 100000 ||
        die "a delay needs the kernel's netem (sch_netem), which this one lacks: give rates alone"
    fi
  done
  for j in $(seq 1 "$n"); do
    if [ "$j" != "$i" ] && [ $(((j - 1) / k)) = $(((i - 1) / k)) ]; then
      ip netns exec "$ns" tc filter add dev "$dev" parent 1: protocol ip prio 1 u32 \
        match ip dst "$subnet.$j/32" flowid 1:10
    fi
  done
}

up() {
  local n=$1 s=$2 rate=$3 k=${4:-} inside=${5:-}
  [[ "$n" =~ ^[1-9][0-9]*$ && "$n" -le 200 ]] || die "N must be 1..200, got '$n'"
  [[ "$s" =~ ^[1-9][0-9]*$ ]] || die "S (ranks per node) must be >= 1, got '$s'"
  check_link RATE "$rate"
  if [ -n "$k" ]; then
    [[ "$k" =~ ^[1-9][0-9]*$ ]] && [ $((n % k)) -eq 0 ] ||
      die "K (nodes an island) must divide the $n nodes, got '$k'"
    check_link INSIDE "$inside"
  elif [[ "$rate" == *@* ]]; then
    die "a delay needs islands (up N S RATE K INSIDE); got '$rate' alone"
  fi
  down
  trap 'down' ERR
  ip netns add "${prefix}-switch"
  ip -n "${prefix}-switch" link set lo up
  ip -n "${prefix}-switch" link add br0 type bridge
  ip -n "${prefix}-switch" link set br0 up
  for i in $(seq 1 "$n"); do
    local ns="${prefix}-node$i"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add "${prefix}$i-a" type veth peer name "${prefix}$i-b"
    ip link set "${prefix}$i-a" netns "$ns"
    ip link set "${prefix}$i-b" netns "${prefix}-switch"
    ip -n "$ns" addr add "$subnet.$i/24" dev "${prefix}$i-a"
    ip -n "$ns" link set "${prefix}$i-a" up
    ip -n "${prefix}-switch" link set "${prefix}$i-b" master br0
    ip -n "${prefix}-switch" link set "${prefix}$i-b" up
    if [ -n "$k" ]; then
      island_links "$ns" "${prefix}$i-a" "$i" "$n" "$k" "$inside" "$rate"
    elif [ "$rate" != none ]; then
      ip netns exec "$ns" tc qdisc add dev "${prefix}$i-a" root tbf rate "$rate" burst 64kb latency 50ms
    fi
  done
  mkdir -p "$state"
  printf 'N=%s\nS=%s\nRATE=%s\nK=%s\nINSIDE=%s\n' "$n" "$s" "$rate" "$k" "$inside" > "$state/env"
  # mpirun's rsh agent: start the remote command inside the namespace of the address it names.
  # Each node's daemon gets a session directory of its own: the nodes share one /tmp, where
  # daemons starting at once collide ("mkdir ... File exists", seen at 8 nodes).
  cat > "$state/agent" <<AGENT
#!/bin/sh
host=\$1; shift
node=\${host##*.}
mkdir -p $state/tmp/node\$node
exec ip netns exec ${prefix}-node\$node env OMPI_MCA_orte_tmpdir_base=$state/tmp/node\$node \\
  /bin/sh -c "\$*"
AGENT
  chmod +x "$state/agent"
  trap - ERR
  if [ -n "$k" ]; then
    echo "cluster.sh: $((n / k)) islands x $k nodes x $s ranks, links at $inside inside an" \
      "island, $rate between islands (flexdemo train --island-nodes $k)"
  else
    echo "cluster.sh: $n nodes x $s ranks, links at $rate"
  fi
}

bytes() {
  [ -f "$state/env" ] || die "no cluster is up (scripts/cluster.sh up N S RATE)"
  # shellcheck disable=SC1091
  . "$state/env"
  [ -n "$K" ] || die "bytes: the cluster has no islands (up N S RATE K INSIDE)"
  local i
  for i in $(seq 1 "$N"); do
    ip netns exec "${prefix}-node$i" tc -s class show dev "${prefix}$i-a" | awk -v node="$i" '
      /^class htb 1:10/ { c = "inside" } /^class htb 1:20/ { c = "between" }
      /Sent/ && c != "" { b[c] = $2; c = "" }
      END { printf "node %d: %s bytes inside its island, %s between islands\n", node, b["inside"], b["between"] }'
  done
}

run() {
  [ -f "$state/env" ] || die "no cluster is up (scripts/cluster.sh up N S RATE)"
  # shellcheck disable=SC1091
  . "$state/env"
  local list
  list=$(seq 1 "$N")
  if [ "${1:-}" = "--nodes-file" ]; then
    [ -f "${2:-}" ] || die "--nodes-file: no file '${2:-}'"
    list=$(tr ',' ' ' < "$2")
    shift 2
  fi
  [ "${1:-}" = "--" ] && shift
  [ $# -gt 0 ] || die "run needs a command: scripts/cluster.sh run -- CMD..."
  local hosts="" count=0 first="" i
  for i in $list; do
    first=${first:-$i}
    [[ "$i" =~ ^[1-9][0-9]*$ && "$i" -le "$N" ]] || die "nodes must be 1..$N, got '$i'"
    hosts="$hosts${hosts:+,}$subnet.$i:$S"
    count=$((count + 1))
  done
  [ "$count" -gt 0 ] || die "no nodes to run on"
  local pass=() name
  for name in $(compgen -e | grep '^FLEXDEMO_' | grep -v '^FLEXDEMO_RANKS_PER_NODE$'); do
    pass+=(-x "$name")
  done
  ip netns exec "${prefix}-node$first" mpirun --allow-run-as-root --oversubscribe \
    -np $((count * S)) -H "$hosts" --mca plm_rsh_agent "$state/agent" \
    --mca btl tcp,self --mca btl_tcp_if_include "$subnet.0/24" \
    --mca oob_tcp_if_include "$subnet.0/24" \
    --mca rtc_hwloc_vmhole none \
    -x OMP_NUM_THREADS=1 -x FLEXDEMO_RANKS_PER_NODE="$S" -x PATH "${pass[@]}" "$@"
}

link() {
  local i=$1 to=$2
  [ -f "$state/env" ] || die "no cluster is up (scripts/cluster.sh up N S RATE)"
  # shellcheck disable=SC1091
  . "$state/env"
  [[ "$i" =~ ^[1-9][0-9]*$ && "$i" -le "$N" ]] || die "node must be 1..$N, got '$i'"
  [[ "$to" == down || "$to" == up ]] || die "the link goes down or up, got '$to'"
  ip -n "${prefix}-switch" link set "${prefix}$i-b" "$to"
}

node() {
  local i=$1 to=$2
  [[ "$to" == down || "$to" == up ]] || die "a node goes down or up, got '$to'"
  # Down: its processes die first, so that the other nodes' sockets see it gone at once (as when
  # a node's job processes crash); with only its link cut, mpirun would wait for TCP to give up.
  if [ "$to" = down ]; then
    ip netns pids "${prefix}-node$i" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  fi
  link "$i" "$to"
}

cmd=${1:-}
shift || true
case "$cmd" in
  up) [ $# -eq 3 ] || [ $# -eq 5 ] || die "usage: scripts/cluster.sh up N S RATE [K INSIDE]"; up "$@" ;;
  bytes) bytes ;;
  run) run "$@" ;;
  link) [ $# -eq 2 ] || die "usage: scripts/cluster.sh link I down|up"; link "$@" ;;
  node) [ $# -eq 2 ] || die "usage: scripts/cluster.sh node I down|up"; node "$@" ;;
  down) down ;;
  *) die "usage: scripts/cluster.sh up N S RATE [K INSIDE] | bytes | run [--nodes-file F] -- CMD... | link I down|up | node I down|up | down" ;;
esac
