#pragma once
// Internal: a c10d::Store whose every call returns or throws within a bound
// (docs/reliability.md, "Rank 0's store"). c10d's TCPStore client waits for
// an answer with no limit: a store whose host process is stopped (SIGSTOP, a
// debugger, a hung node) holds every caller forever, and a caller behind it
// on the client's lock too.
//
// The calls go through a BoundedCalls (comm/bounded_calls.h): each returns
// or throws within its bound, and a closed connection fails every later
// call at once.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "comm/bounded_calls.h"

namespace shardtorch::detail {

/// The c10d::Store interface over a BoundedCalls.
class BoundedStore : public c10d::Store, public BoundedCalls {
 public:
  /// `inner`: where the calls go. `name`: the store in words, for errors
  /// ("the store at 127.0.0.1:29500").
  BoundedStore(c10::intrusive_ptr<c10d::Store> inner, std::chrono::milliseconds bound, std::string name,
               std::optional<Host> host = std::nullopt);

  /// A BoundedStore of its own (its own thread) over a clone of a TCPStore
  /// `inner` (its own connection: a call held up there holds up no other
  /// user of the store), over `inner` itself for other stores.
  c10::intrusive_ptr<BoundedStore> fresh_connection() const;

  c10::intrusive_ptr<c10d::Store> clone() override;
  using c10d::Store::set;
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  using c10d::Store::compareSet;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  const std::chrono::milliseconds& getTimeout() const noexcept override;
  void setTimeout(const std::chrono::milliseconds& timeout) override;
  void append(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string>& keys) override;
  void multiSet(const std::vector<std::string>& keys, const std::vector<std::vector<uint8_t>>& values) override;
  bool hasExtendedApi() const override;
  std::vector<std::string> listKeys() override;
};

/// The store under any PrefixStores wrapped around it (a TCPStore, a
/// FileStore, ...): what decides how its calls behave.
c10::intrusive_ptr<c10d::Store> underlying_store(c10::intrusive_ptr<c10d::Store> store);

}  // namespace shardtorch::detail
