#pragma once
// Fault-tolerant training across replica groups, coordinated by torchft's
// lighthouse (docs/fault_tolerance.md). Each replica group is one World (one
// torchrun job) that shards the model as usual; the groups average their
// gradients through a Manager, which survives the loss of a group and heals
// a restarted one from a live peer. Part of shardtorch::shardtorch when built
// with SHARDTORCH_FT=ON, the default (it needs gRPC and protobuf).
#include <torch/arg.h>
#include <torch/nn/module.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardtorch/export.h"
#include "shardtorch/optim.h"
#include "shardtorch/world.h"

namespace shardtorch::ft {

struct SHARDTORCH_API ManagerOptions {
  /// host:port of torchft_lighthouse; empty: SHARDTORCH_FT_LIGHTHOUSE, else
  /// TORCHFT_LIGHTHOUSE.
  TORCH_ARG(std::string, lighthouse) = "";
  /// This replica group's name: the same on its ranks and across its
  /// restarts, different between groups ("0", "1", ...); empty:
  /// SHARDTORCH_FT_REPLICA_GROUP, else REPLICA_GROUP_ID.
  TORCH_ARG(std::string, replica_group) = "";
  /// The address the other groups reach this one at: the store that group
  /// rank 0 hosts for the cross-replica groups binds to it and advertises
  /// it, and Gloo binds to it. Loopback for groups on one machine.
  TORCH_ARG(std::string, host) = "127.0.0.1";
  /// Every cross-replica wait: building a cross-replica group, a collective,
  /// a heal's transfer.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::seconds(30);
  /// How long start_step()'s quorum may take (the lighthouse waits for
  /// stragglers up to its --join_timeout_ms).
  TORCH_ARG(std::chrono::milliseconds, quorum_timeout) = std::chrono::seconds(60);
  /// How often group rank 0 tells the lighthouse it is alive (the
  /// lighthouse's --heartbeat_timeout_ms decides when a silent group is dead).
  TORCH_ARG(std::chrono::milliseconds, heartbeat_interval) = std::chrono::milliseconds(100);
  /// Whether this process was restarted after a failure: in a quorum where
  /// no group is past step 0 it then heals from a group that was not
  /// restarted, and fails with an error if there is none, rather than train
  /// from its fresh weights; past step 0 the steps alone decide (a step set
  /// with set_step() counts). Default: TORCHELASTIC_RESTART_COUNT > 0.
  TORCH_ARG(std::optional<bool>, restarted) = std::nullopt;
  /// Log lines (group rank 0, stderr) for every quorum change, heal and
  /// step not committed.
  TORCH_ARG(bool, log) = true;
  /// Ask for the next step's quorum at the end of should_commit() rather
  /// than in start_step(), so that the lighthouse's round trip overlaps the
  /// optimizer step, data loading and forward. Then a group that dies
  /// between its commit and its next start_step() is in the others' next
  /// quorum, and that step fails for them (docs/fault_tolerance.md).
  TORCH_ARG(bool, prefetch_quorum) = false;
};

class Manager;
namespace detail {
/// For tests: the keys of the store this rank serves (a group's rank 0
/// serves the rendezvous of the cross-replica groups it is primary of);
/// empty on the other ranks.
std::vector<std::string> served_store_keys(const Manager& m);
}  // namespace detail

/// What the last step did (Manager::last_step()).
struct SHARDTORCH_API StepReport {
  int64_t step = 0;       // the step number this step was (committed steps before it)
  int64_t quorum_id = 0;  // the lighthouse's
  /// Replica groups whose gradients the update averages (sorted), and those
  /// that were healed in this step (they contributed none).
  std::vector<std::string> counted, healed;
  /// Groups in the lighthouse's quorum that this step went without: they
  /// are configured differently from the groups already training, and
  /// throw (docs/fault_tolerance.md, "Errors").
  std::vector<std::string> refused;
  /// Whether this step built a new cross-replica group (the quorum changed).
  bool reconfigured = false;
  bool committed = false;
  std::string error;  // why not committed ("" when committed)
};

/// Drives one replica group's side of fault-tolerant training. Per step:
///   manager.start_step();           // before forward: asks for the quorum
///   loss = ...; loss.backward();    // gradients averaged across the quorum
///   if (manager.should_commit()) opt.step();
/// Construct it on every rank of the group after shard() and the optimizer,
/// before the first backward: it registers the model's communication hook.
/// Any strategy inside a group, CPU offload included; not the optimizer's
/// overlap_with_backward (docs/fault_tolerance.md, "Strategies inside a group").
class SHARDTORCH_API Manager {
 public:
  Manager(std::shared_ptr<World> world, torch::nn::Module& root, ShardedOptimizer& opt, ManagerOptions options = {});
  /// Cancels a quorum request in flight rather than wait for the lighthouse.
  ~Manager();
  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;

  /// Starts this step's quorum in the background (it overlaps forward), or
  /// takes the one should_commit() asked for (prefetch_quorum); asks again
  /// if set_step() changed the step since.
  void start_step();
  /// Waits for this step's cross-replica work (quorum, reductions, a heal),
  /// then every rank of the group votes: true, on every rank alike, when
  /// each of them succeeded; then step the optimizer. False: skip the
  /// update (a peer failed; the next step runs with the new quorum). Throws
  /// only what cannot be voted down: a bad configuration (groups with
  /// different models), the lighthouse unreachable, a failure inside the group.
  bool should_commit();
  /// Steps committed so far: the training position, the same in every group
  /// of the quorum (a healed group takes its source's).
  int64_t step() const;
  /// Sets the committed step count, after loading a checkpoint (before the
  /// first start_step(), or between steps on every rank of the group).
  void set_step(int64_t step);
  const StepReport& last_step() const;
  /// State of the program's own (a data position...) that a heal carries
  /// from the source group to the healed one, with the step.
  void set_user_state(std::function<std::string()> save, std::function<void(const std::string&)> load);
  const std::string& replica_group() const;

  struct Impl;

 private:
  friend std::vector<std::string> detail::served_store_keys(const Manager& m);
  std::unique_ptr<Impl> impl_;
};

/// Indices of a data set for fault-tolerant training: the data set is split
/// into `groups` parts, one per replica group (by its index), and each part
/// into the group's ranks; batch(step) depends only on the step, so a healed
/// group reads exactly what it would have.
class SHARDTORCH_API ReplicaSampler {
 public:
  ReplicaSampler(int64_t dataset_size, int64_t groups, int64_t group_index, int rank, int world_size,
                 int64_t batch_size);
  /// The indices of this rank's batch at `step` (wrapping around its part).
  std::vector<int64_t> batch(int64_t step) const;

 private:
  int64_t begin_ = 0, length_ = 0, batch_ = 0;
};

}  // namespace shardtorch::ft
