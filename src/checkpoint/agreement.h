#pragma once
// Internal: how the ranks agree during a checkpoint save or load, so that no
// rank carries on alone after another failed and no collective is left
// waiting for a rank that threw.
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/log.h"
#include "shardtorch/collectives.h"

namespace shardtorch {
class World;
}

namespace shardtorch::detail {

class ShardState;

/// Collective: every rank reports what went wrong on it ("" if nothing) and,
/// when nothing did, a fingerprint of what it read. If any rank failed, every
/// rank throws checkpoint::SafetensorsError "<what>: rank R: <R's error>" (R
/// the first that failed); if the fingerprints differ, every rank throws
/// naming the two.
void agree_on_errors(World& world, const std::string& error, const std::string& what,
                     const std::string& fingerprint = "");

/// agree_on_errors after rank 0 published the checkpoint at `dir` (`error`
/// "" there) or failed to: if the agreement itself fails (a rank died after
/// its files were written), rank 0's error says the checkpoint is complete.
void agree_after_publish(World& world, const std::string& error, const std::string& what, const std::string& dir);

/// The first half of agree_on_errors: throws as it does if any rank failed,
/// else returns every rank's fingerprint, in rank order, for the caller to
/// compare in its own words.
std::vector<std::string> agreed_fingerprints(World& world, const std::string& error, const std::string& what,
                                             const std::string& fingerprint);

/// Collective, the end of a checkpoint load: agrees on what the check phase
/// found (`error`, `fingerprint`), runs the planned `changes`, agrees again
/// (a failure while copying says the model is partly loaded), then rebuilds
/// what the new values make stale (after_optimizer_step). The agreements run
/// over `world` (every rank loading), the model's World by default.
/// `progress`: advanced by one per change, finished after the second
/// agreement (its totals set here: the changes, and the file bytes read).
void load_agreed(ShardState& state, const std::string& error, const std::string& fingerprint,
                 const std::vector<std::function<void()>>& changes, const std::string& what, World* world = nullptr,
                 ProgressReporter* progress = nullptr);

/// For its lifetime, every communicator of the model (and `also`'s, the
/// World of a save or load over several models) waits at least the world's
/// file_timeout: the checkpoints' collectives, which wait for other ranks'
/// file writes, reads and fsyncs.
/// While it lives, also notes `operation` ("save_sharded_checkpoint") as
/// this rank's progress on the model's World and on `also`, so that a peer
/// that waits for this rank's files names where it is, and "<operation>
/// done" when it ends. An exception leaves the record as the failure wrote it.
class FileWaits {
 public:
  FileWaits(ShardState& state, const std::string& operation, World* also = nullptr);
  ~FileWaits();
  FileWaits(const FileWaits&) = delete;
  FileWaits& operator=(const FileWaits&) = delete;

 private:
  std::vector<World*> worlds_;
  std::string operation_;
  int exceptions_;  // std::uncaught_exceptions() at construction
  std::vector<std::unique_ptr<Comm::TimeoutAtLeast>> raised_;
};

}  // namespace shardtorch::detail
