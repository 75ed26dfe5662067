#pragma once
// In-memory snapshots that outlive the training process (docs/fault_tolerance.md,
// "In-memory snapshots"): every `every` steps each rank writes its whole shard
// state (parameter shards in the master dtype, optimizer state, buffers, the
// step and the program's registered state) to a file in node-local shared
// memory, and sends a copy to its buddy rank (on another node), which keeps
// it beside its own. After a failure and the launcher's restart, restore()
// loads the newest step every rank has, from its own copy or its buddy's,
// and falls back to a sharded checkpoint on disk when memory cannot serve.
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardtorch/export.h"
#include "shardtorch/optim.h"
#include "shardtorch/world.h"

namespace shardtorch {

struct SHARDTORCH_API SnapshotOptions {
  /// after_step(step) snapshots when step % every == 0.
  int every = 1;
  /// Where the snapshot files are: node-local memory (tmpfs) that outlives
  /// the process but not the node.
  std::string dir = "/dev/shm";
  /// The job's name, the same on every rank and across the launcher's
  /// restarts, in every file's name and header; snapshots of another job are
  /// never used. Empty: TORCHELASTIC_RUN_ID (torchrun's), else "shardtorch".
  std::string job;
  /// buddy[r]: the rank that keeps rank r's copy. Empty: the rank with the
  /// same local rank on the next node (LOCAL_WORLD_SIZE ranks per node),
  /// r + 1 (mod world) on one node. No rank is its own buddy (world 1: none).
  std::vector<int> buddy;
  /// A sharded checkpoint directory (save_sharded_checkpoint) that restore()
  /// loads when no step is in memory on every rank; empty: none (a fresh start).
  std::string fallback_dir;
  /// Every this many steps (a multiple of `every`; 0: never), the snapshot
  /// just taken is also published as a sharded checkpoint in fallback_dir
  /// (which must then be set, on one file system for every rank), in the
  /// background after the buddy copy; the checkpoint there stays whole until
  /// the new one is complete. The registered state of rank R is saved under
  /// "snapshot.rankR.NAME". A failure is a warning, and training goes on.
  /// Save no checkpoint of your own into fallback_dir meanwhile.
  int persist_every = 0;
};

/// Construct on every rank after shard() and the optimizer (collective: it
/// makes its own process group for the buddy copies). Per training loop:
///   Snapshots snaps(world, *model, opt.get(), options);
///   snaps.register_state("data", save, load);
///   int64_t step = std::max<int64_t>(snaps.restore(), 0);  // steps done (restore: -1, nothing)
///   while (step < steps) { train_one_step(); ++step; snaps.after_step(step); }
///   snaps.finish();                       // the job is done: its snapshots go
class SHARDTORCH_API Snapshots {
 public:
  Snapshots(std::shared_ptr<World> world, torch::nn::Module& root, ShardedOptimizer* opt, SnapshotOptions options = {});
  /// Waits for a buddy transfer in flight (its error is dropped).
  ~Snapshots();
  Snapshots(const Snapshots&) = delete;
  Snapshots& operator=(const Snapshots&) = delete;

  /// The program's own state (a data position, an RNG seed, a grad scaler's
  /// state_dict entries), saved with every snapshot and given back by
  /// restore(): text, per rank. Register before restore(), the same names
  /// on every rank.
  void register_state(const std::string& name, std::function<std::string()> save,
                      std::function<void(const std::string&)> load);
  /// Collective. The newest step that every rank has in memory (its own
  /// copy, or the copy its buddy holds, sent back to it), loaded on every
  /// rank with the registered state; returns that step. If memory cannot
  /// serve, the sharded checkpoint in fallback_dir is loaded instead (said
  /// on stderr) and its step returned; with none, -1 (nothing loaded).
  int64_t restore();
  /// Under a launcher that keeps the other ranks running when one is lost
  /// (a hand launch, spare processes): called by every rank still running
  /// once its step failed (a collective's error), instead of exiting. Waits
  /// for the lost rank's replacement (started with SHARDTORCH_REJOIN=1,
  /// which calls restore() as usual), connects again with it
  /// (World::rejoin), and restores as restore() does, except that a rank
  /// whose state is still that of the chosen step (no update began since
  /// its after_step) keeps it in place and takes back only its buffers and
  /// registered state. Returns the step; training goes on after it.
  int64_t rejoin();
  /// After the optimizer step `step` (steps counted from 1): snapshots
  /// when step % every == 0. Collects this rank's state and returns: the
  /// buffers are copied at once (a forward changes them); the rest is
  /// copied into the file in the background, overlapping the next forward
  /// and backward, and the optimizer's next update (its step, its first
  /// step inside a backward, a replica group's heal) waits for that copy.
  /// Without an optimizer the file is written before returning. The copy to
  /// the buddy follows in the background; the next snapshot waits for both
  /// (throwing their error, if any). Anything else that changes the
  /// parameters or the optimizer state in place before the next update
  /// (loading a checkpoint, editing weights) must call wait() first.
  void after_step(int64_t step);
  /// Waits for the snapshot in flight: the copy of the state, the buddy's
  /// copy and a persist (throwing the error of the first two, if any).
  void wait();
  /// The registered state, for a regular checkpoint's user_state (which
  /// restore() gives back to the registered loaders on a disk fallback).
  std::map<std::string, std::string> user_state() const;
  /// The bytes this rank keeps in `dir`: its own snapshots and the copies it
  /// holds for others (two generations of each). Waits for the snapshot in
  /// flight first (wait()).
  int64_t bytes_kept() const;
  /// buddy[r] for every rank r (the map in use).
  const std::vector<int>& buddies() const;
  /// Collective, at the clean end of the job: waits for the transfer in
  /// flight, then removes this job's snapshot files of this rank.
  void finish();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

namespace detail {
/// For tests: the path of rank `rank`'s own snapshot of `step` under
/// `options` (dir, job), and of the copy `holder` keeps of it.
SHARDTORCH_API std::string own_snapshot_path(const SnapshotOptions& options, int rank, int64_t step);
SHARDTORCH_API std::string held_snapshot_path(const SnapshotOptions& options, int rank, int holder, int64_t step);
/// The job name options.job resolves to.
SHARDTORCH_API std::string snapshot_job(const SnapshotOptions& options);
}  // namespace detail

}  // namespace shardtorch
