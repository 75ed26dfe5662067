#pragma once
// Internal: where a rank gets a round's quorum from. Group rank 0 asks the
// lighthouse and, when the group has other ranks, hands the answer to them
// through the group's store; they wait for it there.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "ft/config.h"
#include "ft/group_primary.h"
#include "ft/quorum.h"
#include "shardtorch/world.h"

namespace shardtorch::ft::detail {

/// This replica as its quorum requests state it.
struct Identity {
  std::string group;       // the replica group's name
  std::string replica_id;  // "group:random": this incarnation's, the same on its ranks
  std::string key_prefix;  // of this incarnation's keys in the group's store
  Config config;
  bool restarted = false;
};

class QuorumSource {
 public:
  /// `primary`: group rank 0's (null on the other ranks); it outlives this.
  QuorumSource(std::shared_ptr<World> world, GroupPrimary* primary, const Identity& me,
               std::chrono::milliseconds quorum_timeout)
      : world_(std::move(world)), primary_(primary), me_(me), quorum_timeout_(quorum_timeout) {}
  /// The answer to `ask` as text (encode's, or encode_error's when it could
  /// not be had, or once `cancelled` is set).
  std::string text(const Ask& ask, const std::atomic<bool>& cancelled);

 private:
  std::string ask_lighthouse(const Ask& ask);
  std::string wait_for_rank0(const std::string& key, const std::atomic<bool>& cancelled);

  std::shared_ptr<World> world_;
  GroupPrimary* primary_;
  const Identity& me_;
  std::chrono::milliseconds quorum_timeout_;
  int64_t posted_ = -1;  // group rank 0: the last round whose answer is in the group's store
};

}  // namespace shardtorch::ft::detail
