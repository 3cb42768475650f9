// The stores a group's rendezvous runs over: our own TCP store (kv_store.h)
// or c10d's FileStore, each behind the KvStore interface, and an adapter
// that lets Gloo's full-mesh connect use either. Internal.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "comm/kv_store.h"

namespace gloo::rendezvous {
class Store;
}

namespace shardtrain::comm {
struct CommOptions;
}

namespace shardtrain::comm::detail {

/// Opens the store named by options.init_method(): "env://" for the TCP
/// store the launcher hosts at options.store(), or without one, the store
/// rank 0 hosts at master_addr:master_port (bound to that address only);
/// or "file:///path". Throws ConfigError for an unknown scheme, CommError
/// (TimeoutError) when the store cannot be hosted or reached.
std::shared_ptr<KvStore> open_store(const CommOptions& options);

/// Gloo's view of `store`: get() waits up to `timeout` for the key.
std::shared_ptr<gloo::rendezvous::Store> gloo_store(std::shared_ptr<KvStore> store,
                                                    std::chrono::milliseconds timeout);

}  // namespace shardtrain::comm::detail
