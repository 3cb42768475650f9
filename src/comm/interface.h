// Which network interface a rank binds and advertises to its peers.
#pragma once

#include <string>

namespace shardtrain::comm::detail {

struct Endpoint {
  std::string iface;    // interface name, e.g. "eth0" ("?" when no interface holds the address)
  std::string address;  // numeric address bound and advertised, e.g. "10.0.0.2"
  std::string why;      // how it was chosen, for the start-up line
  bool named = false;   // the interface was named by the environment
};

/// SHARDTRAIN_SOCKET_IFNAME, else GLOO_SOCKET_IFNAME, names the interface;
/// without either, the interface whose address the kernel uses to reach
/// `master_addr` (loopback exactly when the master is this machine's
/// loopback). Throws CommError when the master cannot be resolved or routed
/// to, or the named interface has no IPv4 address.
Endpoint choose_endpoint(const std::string& master_addr);

}  // namespace shardtrain::comm::detail
