# "Hosts" for multi-host tests and benchmarks: Linux network namespaces.
# Sourced, not run; needs root.
#
#   hosts_up TAG NET      two hosts joined by a veth pair: namespaces TAG-a
#                         and TAG-b; veth TAG-0 (in TAG-a, address ${NET}1/24)
#                         and TAG-1 (in TAG-b, ${NET}2/24); sets
#                         HOST_NS=(TAG-a TAG-b), HOST_DEV=(TAG-0 TAG-1) and
#                         HOST_ADDR=(${NET}1 ${NET}2), indexed by node.
#   hosts_up_n TAG NET N  N hosts (2..200) on one bridge: namespaces TAG-h0
#                         .. TAG-h(N-1), each with veth TAG-K (address
#                         ${NET}(K+1)/24) whose peer sits in the bridge's own
#                         namespace TAG-br, so every host reaches every other
#                         and nothing touches the root namespace. Sets the
#                         same arrays, N entries each.
#   mpirun_two_hosts DIR TAG NET K ARGS...
#                         after hosts_up: one mpirun on host 0 starting K
#                         ranks on each of the two hosts (ARGS: more mpirun
#                         options, then the program). Its remote agent, written
#                         to DIR, enters host 1's namespace instead of using
#                         ssh; each host gets a host name of its own (TAG-host0,
#                         TAG-host1; a UTS namespace), as Open MPI tells nodes
#                         apart by name and would otherwise take both for one
#                         and share memory across. Traffic stays on NET0/24.
#   hosts_kill NODE       SIGKILLs every process in that node's namespace.
#   hosts_down            kills everything in every host and deletes the
#                         namespaces (the veths and the bridge go with them);
#                         safe to call more than once, and after a set-up that
#                         failed half-way.
#
# Device names are at most 15 characters: keep TAG to 9 or fewer.

hosts_up() {
  local tag=$1 net=$2 node
  HOST_NS=("$tag-a" "$tag-b")
  HOST_DEV=("$tag-0" "$tag-1")
  HOST_ADDR=("${net}1" "${net}2")
  ip link add "${HOST_DEV[0]}" type veth peer name "${HOST_DEV[1]}"
  for node in 0 1; do
    ip netns add "${HOST_NS[node]}"
    ip link set "${HOST_DEV[node]}" netns "${HOST_NS[node]}"
    ip -n "${HOST_NS[node]}" addr add "${HOST_ADDR[node]}/24" dev "${HOST_DEV[node]}"
    ip -n "${HOST_NS[node]}" link set lo up
    ip -n "${HOST_NS[node]}" link set "${HOST_DEV[node]}" up
  done
}

hosts_up_n() {
  local tag=$1 net=$2 n=$3 node
  [ "$n" -ge 2 ] && [ "$n" -le 200 ] || { echo "hosts_up_n: N must be 2..200, got $n" >&2; return 2; }
  HOST_NS=() HOST_DEV=() HOST_ADDR=()
  HOST_BRIDGE_NS="$tag-br"
  ip netns add "$HOST_BRIDGE_NS"
  ip -n "$HOST_BRIDGE_NS" link add br0 type bridge
  ip -n "$HOST_BRIDGE_NS" link set br0 up
  for ((node = 0; node < n; node++)); do
    HOST_NS+=("$tag-h$node")
    HOST_DEV+=("$tag-$node")
    HOST_ADDR+=("${net}$((node + 1))")
    ip netns add "${HOST_NS[node]}"
    # The host's end is made inside the bridge namespace, then moved out.
    ip -n "$HOST_BRIDGE_NS" link add "p$node" type veth peer name "${HOST_DEV[node]}"
    ip -n "$HOST_BRIDGE_NS" link set "${HOST_DEV[node]}" netns "${HOST_NS[node]}"
    ip -n "$HOST_BRIDGE_NS" link set "p$node" master br0
    ip -n "$HOST_BRIDGE_NS" link set "p$node" up
    ip -n "${HOST_NS[node]}" addr add "${HOST_ADDR[node]}/24" dev "${HOST_DEV[node]}"
    ip -n "${HOST_NS[node]}" link set lo up
    ip -n "${HOST_NS[node]}" link set "${HOST_DEV[node]}" up
  done
}

mpirun_two_hosts() {
  local dir=$1 tag=$2 net=$3 k=$4
  shift 4
  cat >"$dir/agent.sh" <<AGENT
#!/bin/sh
# Called as an ssh would be: HOST COMMAND...; HOST is host 1's address.
host=\$1; shift
[ "\$host" = "${HOST_ADDR[1]}" ] || { echo "agent: unknown host \$host" >&2; exit 1; }
exec ip netns exec "${HOST_NS[1]}" unshare --uts sh -c "hostname $tag-host1; \$*"
AGENT
  chmod +x "$dir/agent.sh"
  ip netns exec "${HOST_NS[0]}" unshare --uts sh -c 'hostname "$0-host0"; exec "$@"' "$tag" \
    mpirun -np $((2 * k)) --host "${HOST_ADDR[0]}:$k,${HOST_ADDR[1]}:$k" \
    --mca plm_rsh_agent "$dir/agent.sh" --mca oob_tcp_if_include "${net}0/24" \
    --mca btl_tcp_if_include "${net}0/24" "$@"
}

hosts_kill() {
  ip netns pids "${HOST_NS[$1]}" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
}

hosts_down() {
  local node
  for node in "${!HOST_NS[@]}"; do
    [ -n "${HOST_NS[node]:-}" ] || continue
    hosts_kill "$node"
    ip netns del "${HOST_NS[node]}" 2>/dev/null || true
  done
  if [ -n "${HOST_BRIDGE_NS:-}" ]; then
    ip netns del "$HOST_BRIDGE_NS" 2>/dev/null || true
  fi
}
