#include "comm/store.h"

#include <gloo/rendezvous/store.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <iostream>

#include "comm/detail.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"

namespace shardtrain::comm::detail {

using ::shardtrain::detail::str_cat;

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

// c10d's FileStore as a KvStore. It keeps no times, so it cannot tell a
// heartbeat's age.
class FileKvStore final : public KvStore {
 public:
  FileKvStore(c10::intrusive_ptr<c10d::Store> store, std::string where)
      : store_(std::move(store)), where_(std::move(where)) {}

  void set(const std::string& key, const std::string& value) override {
    guard("set", key, [&] { store_->set(key, std::vector<uint8_t>(value.begin(), value.end())); });
  }
  std::optional<std::string> try_get(const std::string& key) override {
    std::optional<std::string> out;
    guard("get", key, [&] {
      if (!store_->check({key})) return;
      const auto value = store_->get(key);
      out = std::string(value.begin(), value.end());
    });
    return out;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    int64_t sum = 0;
    guard("add", key, [&] { sum = store_->add(key, delta); });
    return sum;
  }
  bool wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    try {
      store_->wait(keys, timeout);
      return true;
    } catch (const std::exception& e) {
      if (mentions_timeout(e.what())) return false;
      throw CommError(str_cat("rendezvous store ", where_, ": wait failed: ", first_line(e)));
    }
  }
  std::optional<int64_t> age_ms(const std::string&) override { return std::nullopt; }
  std::string where() const override { return where_; }

 private:
  template <typename F>
  void guard(const char* what, const std::string& key, F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      throw_comm_error(e, str_cat("rendezvous store ", where_, ": ", what, "('", key,
                                  "') failed: ", first_line(e)));
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::string where_;
};

// Gloo's rendezvous over a KvStore; a key that never appears is named.
class GlooStore final : public gloo::rendezvous::Store {
 public:
  GlooStore(std::shared_ptr<KvStore> store, std::chrono::milliseconds timeout)
      : store_(std::move(store)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    wait({key}, timeout_);
    const auto value = store_->try_get(key);
    ST_CHECK(value.has_value(), CommError, "rendezvous store ", store_->where(), ": key '", key,
             "' vanished");
    return std::vector<char>(value->begin(), value->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    if (store_->wait(keys, timeout)) return;
    throw TimeoutError(str_cat(
        "rendezvous store ", store_->where(), ": waited ", timeout.count() / 1000.0,
        " s for '", keys.empty() ? "" : keys.front(),
        "'. Hint: every rank must start within the timeout (SHARDTRAIN_TIMEOUT_S) and reach the "
        "master address; check that all ranks were launched and agree on WORLD_SIZE."));
  }

 private:
  std::shared_ptr<KvStore> store_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

std::shared_ptr<KvStore> open_store(const CommOptions& options) {
  const std::string& init_method = options.init_method();
  if (init_method == "env://") {
    if (!options.store().empty()) {
      const std::string& at = options.store();
      const size_t colon = at.rfind(':');
      const int port = colon == std::string::npos ? 0 : std::atoi(at.c_str() + colon + 1);
      ST_CHECK(colon != std::string::npos && colon > 0 && port > 0 && port < 65536, ConfigError,
               "SHARDTRAIN_STORE='", at, "' is not address:port");
      return connect_store(at.substr(0, colon), port, options.job_token(), options.timeout());
    }
    ST_CHECK(options.master_port() > 0 && options.master_port() < 65536, ConfigError,
             "master port ", options.master_port(), " is out of range; use 1..65535 (MASTER_PORT)");
    if (options.rank() == 0) {
      // No launcher hosts the store: rank 0 does, on the master address only.
      if (options.job_token().empty() && options.master_addr() != "127.0.0.1" &&
          options.master_addr() != "localhost" && options.master_addr() != "::1") {
        std::cerr << "shardtrain: warning: the rendezvous store on " << options.master_addr()
                  << " accepts any process that reaches it; set SHARDTRAIN_JOB_TOKEN to one "
                     "secret on every rank (shardtrain launch does this for you)\n";
      }
      return std::make_shared<StoreServer>(
          options.master_addr(), options.master_port(), options.job_token(),
          [](const std::string& line) { std::cerr << "shardtrain: " << line << "\n"; });
    }
    return connect_store(options.master_addr(), options.master_port(), options.job_token(),
                         options.timeout());
  }
  const std::string file_prefix = "file://";
  if (init_method.rfind(file_prefix, 0) == 0) {
    const std::string path = init_method.substr(file_prefix.size());
    ST_CHECK(!path.empty(), ConfigError, "init method '", init_method,
             "' names no file; use file:///absolute/path");
    c10::intrusive_ptr<c10d::Store> store;
    try {
      store = c10::make_intrusive<c10d::FileStore>(path, options.world_size());
    } catch (const std::exception& e) {
      throw CommError("cannot open the rendezvous file store " + path + ": " + first_line(e) +
                      ". Hint: the path must be on a file system every rank can write.");
    }
    store->setTimeout(options.timeout());
    return std::make_shared<FileKvStore>(std::move(store), init_method);
  }
  ST_CHECK(false, ConfigError, "unknown init method '", init_method,
           "'; use env:// (TCP store at MASTER_ADDR:MASTER_PORT) or file:///path");
  return nullptr;
}

std::shared_ptr<gloo::rendezvous::Store> gloo_store(std::shared_ptr<KvStore> store,
                                                    std::chrono::milliseconds timeout) {
  return std::make_shared<GlooStore>(std::move(store), timeout);
}

}  // namespace shardtrain::comm::detail
