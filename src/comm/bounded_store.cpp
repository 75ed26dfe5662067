#include "comm/bounded_store.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <exception>

namespace shardtorch::detail {

BoundedStore::BoundedStore(c10::intrusive_ptr<c10d::Store> inner, std::chrono::milliseconds bound, std::string name,
                           std::optional<Host> host)
    : c10d::Store(inner->getTimeout()), BoundedCalls(std::move(inner), bound, std::move(name), std::move(host)) {}

c10::intrusive_ptr<c10d::Store> underlying_store(c10::intrusive_ptr<c10d::Store> store) {
  while (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(store.get())) store = prefixed->getUnderlyingStore();
  return store;
}

c10::intrusive_ptr<BoundedStore> BoundedStore::fresh_connection() const {
  // A TCPStore client serves one call at a time: a clone is a connection of
  // its own. Other stores (a FileStore, a HashStore) are shared: a FileStore
  // counts its instances to delete its file, and a clone would have it
  // deleted while other ranks still use it.
  c10::intrusive_ptr<c10d::Store> copy = inner();
  if (dynamic_cast<c10d::TCPStore*>(underlying_store(inner()).get()) != nullptr) {
    try {
      copy = inner()->clone();
    } catch (const std::exception&) {  // no second connection: shared
    }
  }
  return c10::make_intrusive<BoundedStore>(copy, bound(), name(), host());
}

c10::intrusive_ptr<c10d::Store> BoundedStore::clone() { return fresh_connection(); }

void BoundedStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  run([key, value](c10d::Store& s) { s.set(key, value); });
}

std::vector<uint8_t> BoundedStore::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                              const std::vector<uint8_t>& desired) {
  return value_of<std::vector<uint8_t>>(
      [key, expected, desired](c10d::Store& s) { return s.compareSet(key, expected, desired); });
}

std::vector<uint8_t> BoundedStore::get(const std::string& key) {  // waits for the key first
  return value_of<std::vector<uint8_t>>([key](c10d::Store& s) { return s.get(key); }, std::nullopt,
                                        inner()->getTimeout());
}

int64_t BoundedStore::add(const std::string& key, int64_t value) {
  return value_of<int64_t>([key, value](c10d::Store& s) { return s.add(key, value); });
}

bool BoundedStore::deleteKey(const std::string& key) {
  return value_of<bool>([key](c10d::Store& s) { return s.deleteKey(key); });
}

bool BoundedStore::check(const std::vector<std::string>& keys) {
  return value_of<bool>([keys](c10d::Store& s) { return s.check(keys); });
}

int64_t BoundedStore::getNumKeys() {
  return value_of<int64_t>([](c10d::Store& s) { return s.getNumKeys(); });
}

void BoundedStore::wait(const std::vector<std::string>& keys) { wait(keys, inner()->getTimeout()); }

void BoundedStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  run([keys, timeout](c10d::Store& s) { s.wait(keys, timeout); }, std::nullopt, timeout);
}

const std::chrono::milliseconds& BoundedStore::getTimeout() const noexcept { return inner()->getTimeout(); }

void BoundedStore::setTimeout(const std::chrono::milliseconds& timeout) {
  run([timeout](c10d::Store& s) { s.setTimeout(timeout); });
}

void BoundedStore::append(const std::string& key, const std::vector<uint8_t>& value) {
  run([key, value](c10d::Store& s) { s.append(key, value); });
}

std::vector<std::vector<uint8_t>> BoundedStore::multiGet(const std::vector<std::string>& keys) {
  return value_of<std::vector<std::vector<uint8_t>>>([keys](c10d::Store& s) { return s.multiGet(keys); }, std::nullopt,
                                                     inner()->getTimeout());
}

void BoundedStore::multiSet(const std::vector<std::string>& keys, const std::vector<std::vector<uint8_t>>& values) {
  run([keys, values](c10d::Store& s) { s.multiSet(keys, values); });
}

bool BoundedStore::hasExtendedApi() const { return inner()->hasExtendedApi(); }

std::vector<std::string> BoundedStore::listKeys() {
  return value_of<std::vector<std::string>>([](c10d::Store& s) { return s.listKeys(); });
}

}  // namespace shardtorch::detail
