#pragma once
// Internal: what group rank 0 runs for its replica group: the lighthouse
// client, the heartbeats that tell the lighthouse the group lives, and the
// store that hosts the rendezvous of the cross-replica groups it is primary of.
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ft/lighthouse_client.h"
#include "ft/util.h"

namespace shardtorch::ft::detail {

class GroupPrimary {
 public:
  /// Binds the store to `host` alone (c10d's TCPStore would listen on every
  /// interface), on a port the kernel picks; heartbeats as `replica_id`
  /// every `heartbeat_interval`.
  GroupPrimary(const std::string& lighthouse, const std::string& host, std::chrono::milliseconds timeout,
               std::string replica_id, std::chrono::milliseconds heartbeat_interval);
  /// Stops the heartbeats (waits for one in flight, at most 1 s).
  ~GroupPrimary();
  GroupPrimary(const GroupPrimary&) = delete;
  GroupPrimary& operator=(const GroupPrimary&) = delete;

  LighthouseClient& lighthouse() { return *lighthouse_; }
  /// host:port of the store.
  const std::string& store_address() const { return store_address_; }
  std::vector<std::string> store_keys() const { return store_->listKeys(); }
  /// Drops every cross-replica rendezvous key but those of group `current`
  /// from the store, or it grows with every reconfiguration. Call after a
  /// step committed on a newly built group: every member has finished that
  /// group's rendezvous, and any other rendezvous in this store is over or
  /// stale (this group is a member of every quorum whose rendezvous it
  /// serves, and has not asked for the next one yet); a straggler that
  /// builds a stale group fails its step.
  void drop_old_rendezvous(const std::string& current, const FtLog& log);

 private:
  void beat();

  c10::intrusive_ptr<c10d::TCPStore> store_;
  std::string store_address_;
  std::unique_ptr<LighthouseClient> lighthouse_;
  std::string replica_id_;
  std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread heartbeats_;
};

}  // namespace shardtorch::ft::detail
