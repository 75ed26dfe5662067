#include "ft/cross_replica_group.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "base/check.h"
#include "base/errors.h"
#include "comm/backends.h"

namespace shardtorch::ft::detail {

namespace {

// The rendezvous store of a cross-replica group. A test can make this
// process fail right after it published its address there
// (shardtorch::testing::inject_failure("cross-replica rendezvous")), as a
// member that dies at that moment does.
class RendezvousStore : public c10d::PrefixStore {
 public:
  using PrefixStore::PrefixStore;
  using Store::set;
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    PrefixStore::set(key, value);
    shardtorch::detail::failure_point("cross-replica rendezvous");
  }
};

// A build on a thread of its own (see build_group).
struct Build {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  c10::intrusive_ptr<c10d::Backend> pg;
  std::exception_ptr error;
};

c10::intrusive_ptr<c10d::Backend> connect(const std::string& primary, const std::string& prefix, int index, int size,
                                          std::chrono::milliseconds timeout, const std::string& host) {
  const auto colon = primary.rfind(':');
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(std::stoi(primary.substr(colon + 1)));
  so.isServer = false;
  so.waitWorkers = false;
  so.timeout = timeout;
  auto client = c10::make_intrusive<c10d::TCPStore>(primary.substr(0, colon), so);
  auto store = c10::make_intrusive<RendezvousStore>(prefix, client);
  return shardtorch::detail::make_gloo_backend(store, index, size, timeout, host);
}

// Connects to the rendezvous store at `primary` and builds the Gloo group of
// `size` members as member `index`, waiting at most `timeout` for it. The
// build runs on a thread of its own: Gloo's own waits (its store reads, then
// one connection after the other) can add up to several times its timeout
// when a member dies after publishing its address. A build given up on ends
// there by itself, within Gloo's and the store's own timeouts, and drops
// whatever it built; it holds nothing of the manager's.
c10::intrusive_ptr<c10d::Backend> build_group(const std::string& primary, const std::string& prefix, int index,
                                              int size, std::chrono::milliseconds timeout, const std::string& host) {
  auto b = std::make_shared<Build>();
  auto body = [b, primary, prefix, index, size, timeout, host] {
    c10::intrusive_ptr<c10d::Backend> built;
    std::exception_ptr error;
    try {
      built = connect(primary, prefix, index, size, timeout, host);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(b->mu);
    b->pg = std::move(built);
    b->error = error;
    b->done = true;
    b->cv.notify_all();
  };
  std::thread(body).detach();
  std::unique_lock<std::mutex> lock(b->mu);
  if (!b->cv.wait_for(lock, timeout, [&] { return b->done; }))
    SHARDTORCH_CHECK(false, "its members did not all connect within ManagerOptions::timeout (", timeout.count(),
                     " ms): a member may have died after the lighthouse admitted it, or published an address that "
                     "no longer answers. The next quorum builds it again");
  if (b->error) std::rethrow_exception(b->error);
  return std::move(b->pg);
}

}  // namespace

void CrossReplicaGroup::drop() {
  pg_.reset();
  name_.clear();
  members_.clear();
}

bool CrossReplicaGroup::serves(const Quorum& q) const {
  if (!pg_ || name_.empty() || members_ != ids(q)) return false;
  for (const auto& p : q.participants)
    if (p.held != name_) return false;
  return true;
}

void CrossReplicaGroup::configure(Quorum& q, int rank) {
  if (q.participants.size() <= 1) {
    drop();
    return;
  }
  if (serves(q)) return;
  q.rebuilt = true;
  drop();
  // The first counted group's rank 0 serves the rendezvous.
  pg_ = build_group(q.participants[static_cast<size_t>(q.counted.front())].store_address,
                    "shardtorch-ft/" + q.config + "/rank" + std::to_string(rank), q.me,
                    static_cast<int>(q.participants.size()), timeout_, host_);
  name_ = q.config;
  members_ = ids(q);
}

}  // namespace shardtorch::ft::detail
