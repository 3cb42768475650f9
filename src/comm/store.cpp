#include "comm/store.h"

#include <gloo/rendezvous/store.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/detail.h"
#include "shardtrain/core/error.h"

namespace shardtrain::comm::detail {

std::string first_line(const std::exception& e) {
  const std::string msg = e.what();
  return msg.substr(0, msg.find('\n'));
}

bool mentions_timeout(const std::string& text) {
  return text.find("imeout") != std::string::npos || text.find("imed out") != std::string::npos;
}

void throw_comm_error(const std::exception& cause, const std::string& text) {
  if (mentions_timeout(cause.what())) throw TimeoutError(text);
  throw CommError(text);
}

namespace {

// Gloo's rendezvous talks to a gloo::rendezvous::Store; LibTorch ships the
// TCP and file stores we want. This adapter lets the one use the other.
class C10dStoreAdapter final : public gloo::rendezvous::Store {
 public:
  C10dStoreAdapter(c10::intrusive_ptr<c10d::Store> store, std::string where)
      : store_(std::move(store)), where_(std::move(where)) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    guard("set", key, [&] { store_->set(key, std::vector<uint8_t>(data.begin(), data.end())); });
  }

  std::vector<char> get(const std::string& key) override {
    std::vector<char> out;
    guard("get", key, [&] {
      auto value = store_->get(key);
      out.assign(value.begin(), value.end());
    });
    return out;
  }

  void wait(const std::vector<std::string>& keys) override {
    guard("wait", keys.empty() ? "" : keys.front(), [&] { store_->wait(keys); });
  }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    guard("wait", keys.empty() ? "" : keys.front(), [&] { store_->wait(keys, timeout); });
  }

 private:
  // Names the store and the key in place of c10d's bare message.
  template <typename F>
  void guard(const char* what, const std::string& key, F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      throw_comm_error(
          e, ::shardtrain::detail::str_cat(
                 "rendezvous store ", where_, ": ", what, "('", key, "') failed: ", first_line(e),
                 ". Hint: every rank must start within the timeout (SHARDTRAIN_TIMEOUT_S) and "
                 "reach the master address; check that all ranks were launched and agree on "
                 "WORLD_SIZE."));
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::string where_;
};

}  // namespace

std::shared_ptr<gloo::rendezvous::Store> open_store(const std::string& init_method,
                                                    const std::string& master_addr,
                                                    int master_port, int rank, int world_size,
                                                    std::chrono::milliseconds timeout) {
  if (init_method == "env://") {
    ST_CHECK(master_port > 0 && master_port < 65536, ConfigError, "master port ", master_port,
             " is out of range; use 1..65535 (MASTER_PORT)");
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(master_port);
    opts.isServer = rank == 0;
    opts.numWorkers = static_cast<size_t>(world_size);
    opts.waitWorkers = false;
    opts.timeout = timeout;
    const std::string where = "tcp://" + master_addr + ":" + std::to_string(master_port);
    c10::intrusive_ptr<c10d::Store> store;
    try {
      store = c10::make_intrusive<c10d::TCPStore>(master_addr, opts);
    } catch (const std::exception& e) {
      throw_comm_error(
          e, ::shardtrain::detail::str_cat(
                 "cannot open the rendezvous store at ", where, " as rank ", rank, ": ",
                 first_line(e),
                 ". Hint: rank 0 hosts the store; check MASTER_ADDR/MASTER_PORT, that the port "
                 "is free on rank 0's machine, and that rank 0 started."));
    }
    store->setTimeout(timeout);
    return std::make_shared<C10dStoreAdapter>(std::move(store), where);
  }
  const std::string file_prefix = "file://";
  if (init_method.rfind(file_prefix, 0) == 0) {
    const std::string path = init_method.substr(file_prefix.size());
    ST_CHECK(!path.empty(), ConfigError, "init method '", init_method,
             "' names no file; use file:///absolute/path");
    c10::intrusive_ptr<c10d::Store> store;
    try {
      store = c10::make_intrusive<c10d::FileStore>(path, world_size);
    } catch (const std::exception& e) {
      throw CommError("cannot open the rendezvous file store " + path + ": " + first_line(e) +
                      ". Hint: the path must be on a file system every rank can write.");
    }
    store->setTimeout(timeout);
    return std::make_shared<C10dStoreAdapter>(std::move(store), init_method);
  }
  ST_CHECK(false, ConfigError, "unknown init method '", init_method,
           "'; use env:// (TCP store at MASTER_ADDR:MASTER_PORT) or file:///path");
  return nullptr;
}

}  // namespace shardtrain::comm::detail
