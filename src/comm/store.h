// Rendezvous stores: c10d's TCPStore or FileStore behind Gloo's Store
// interface, so Gloo's full-mesh connect runs over them. Internal.
#pragma once

#include <chrono>
#include <memory>
#include <string>

namespace gloo::rendezvous {
class Store;
}

namespace shardtrain::comm::detail {

/// Opens the store named by `init_method` ("env://" for a TCP store at
/// master_addr:master_port hosted by rank 0, or "file:///path"). Throws
/// ConfigError for an unknown scheme, TimeoutError when the TCP store cannot
/// be reached within `timeout`.
std::shared_ptr<gloo::rendezvous::Store> open_store(const std::string& init_method,
                                                    const std::string& master_addr,
                                                    int master_port, int rank, int world_size,
                                                    std::chrono::milliseconds timeout);

}  // namespace shardtrain::comm::detail
