#include "comm/interface.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "shardtrain/core/error.h"

namespace shardtrain::comm::detail {

using ::shardtrain::detail::str_cat;

namespace {

std::string numeric(const sockaddr_in& addr) {
  char buf[INET_ADDRSTRLEN] = {0};
  return inet_ntop(AF_INET, &addr.sin_addr, buf, sizeof(buf)) != nullptr ? buf : "";
}

// The first interface that is up and for which match(name, IPv4 address)
// holds, as {name, address}; {"", ""} when none.
template <typename Match>
std::pair<std::string, std::string> find_ipv4(Match&& match) {
  std::pair<std::string, std::string> found;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return found;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET || !(a->ifa_flags & IFF_UP)) continue;
    const std::string addr = numeric(*reinterpret_cast<const sockaddr_in*>(a->ifa_addr));
    if (match(a->ifa_name, addr)) {
      found = {a->ifa_name, addr};
      break;
    }
  }
  freeifaddrs(list);
  return found;
}

const char* env_interface(std::string& source) {
  for (const char* name : {"SHARDTRAIN_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') {
      source = name;
      return v;
    }
  }
  return nullptr;
}

}  // namespace

Endpoint choose_endpoint(const std::string& master_addr) {
  Endpoint e;
  std::string source;
  if (const char* iface = env_interface(source)) {
    e.iface = iface;
    e.named = true;
    e.address = find_ipv4([&](const std::string& name, const std::string&) { return name == e.iface; }).second;
    ST_CHECK(!e.address.empty(), CommError, source, "='", e.iface,
             "' names no interface that is up with an IPv4 address on this host; list them with "
             "`ip -4 addr` and name one the ranks share, or unset ", source,
             " to use the one that routes to the master address");
    e.why = str_cat("from ", source);
    return e;
  }
  // The kernel's choice of source address for a datagram to the master: a
  // UDP connect() only consults the routing table, it sends nothing.
  // Gloo's TCP transport here is IPv4; an IPv6 loopback master means this host.
  const std::string target = master_addr == "::1" ? "127.0.0.1" : master_addr;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(target.c_str(), "9", &hints, &found);
  ST_CHECK(rc == 0 && found != nullptr, CommError, "cannot resolve the master address '",
           master_addr, "' (", gai_strerror(rc),
           "); set MASTER_ADDR (--master-addr) to host 0's address or name");
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_in local{};
  socklen_t len = sizeof(local);
  const bool routed = fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
                      getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
  const int err = errno;
  if (fd >= 0) close(fd);
  freeaddrinfo(found);
  ST_CHECK(routed, CommError, "no route from this host to the master address '", master_addr,
           "' (", std::strerror(err),
           "); check the address, or name the interface with SHARDTRAIN_SOCKET_IFNAME");
  e.address = numeric(local);
  e.iface = find_ipv4([&](const std::string&, const std::string& addr) { return addr == e.address; }).first;
  if (e.iface.empty()) e.iface = "?";
  e.why = str_cat("routes to ", master_addr);
  return e;
}

}  // namespace shardtrain::comm::detail
