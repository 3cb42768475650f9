# Two "hosts" for multi-host tests and benchmarks: Linux network namespaces
# joined by a veth pair. Sourced, not run; needs root.
#
#   hosts_up TAG NET      namespaces TAG-a and TAG-b; veth TAG-0 (in TAG-a,
#                         address ${NET}1/24) and TAG-1 (in TAG-b, ${NET}2/24);
#                         sets HOST_NS=(TAG-a TAG-b), HOST_DEV=(TAG-0 TAG-1)
#                         and HOST_ADDR=(${NET}1 ${NET}2), indexed by node.
#   hosts_kill NODE       SIGKILLs every process in that node's namespace.
#   hosts_down            kills everything in both and deletes them (the veth
#                         pair goes with them); safe to call more than once.

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

hosts_kill() {
  ip netns pids "${HOST_NS[$1]}" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
}

hosts_down() {
  local node
  for node in 0 1; do
    [ -n "${HOST_NS[node]:-}" ] || continue
    hosts_kill "$node"
    ip netns del "${HOST_NS[node]}" 2>/dev/null || true
  done
}
