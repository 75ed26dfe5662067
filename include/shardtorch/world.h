#pragma once
// World: who this process is (rank, world size, local rank, device), how it
// found the others (a c10d Store) and how it talks to them (a c10d Backend:
// Gloo for CPU tensors, NCCL for CUDA when LibTorch has it).
#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardtorch/collectives.h"
#include "shardtorch/export.h"

namespace shardtorch {

namespace detail {
class Progress;
class CollectiveContext;
class SetupJournal;
struct WorldAccess;
}  // namespace detail

/// What the launcher told this process: torchrun, OpenMPI, MPICH or Slurm.
struct SHARDTORCH_API LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;       // empty when not given
  int master_port = 0;           // 0 when not given
  std::string launcher;          // "torchrun", "openmpi", "mpich", "slurm" or "none"
  bool use_agent_store = false;  // torchrun's agent already hosts the TCPStore
  /// SHARDTORCH_TIMEOUT_S: replaces WorldOptions::timeout in from_env, so that
  /// a program's waits can be changed at launch.
  std::optional<std::chrono::milliseconds> timeout;
  /// SHARDTORCH_FILE_TIMEOUT_S: replaces WorldOptions::file_timeout likewise.
  std::optional<std::chrono::milliseconds> file_timeout;
  /// SHARDTORCH_REJOIN=1: this process replaces a lost rank of a running
  /// job (WorldOptions::rejoin).
  bool rejoin = false;
};

using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

/// Reads the launcher's variables through `lookup` (the process environment
/// by default). Throws, naming the variable and its value, on anything that is
/// not a number, a rank not below the world size or a port outside 1..65535.
SHARDTORCH_API LaunchEnv parse_launch_env(const EnvLookup& lookup = {});

struct SHARDTORCH_API WorldOptions {
  /// The largest world in which check_collectives is on by default: a long
  /// wait reads every rank's record from the store twice a second.
  static constexpr int kCheckedByDefaultUpTo = 64;

  /// Every collective and every store wait gives up after this long.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  /// The collectives of saving and loading checkpoints wait at least this
  /// long: they wait for other ranks' file writes, reads and fsyncs (rank 0's
  /// last write and fsync of a full state dict), which a large model on a
  /// slow file system can make longer than `timeout`.
  TORCH_ARG(std::chrono::milliseconds, file_timeout) = std::chrono::minutes(30);
  /// "auto" (NCCL for CUDA devices when built with it, else Gloo), "gloo", "nccl".
  TORCH_ARG(std::string, backend) = "auto";
  /// The device this rank computes on; default cuda:LOCAL_RANK when CUDA is
  /// available, else cpu.
  TORCH_ARG(std::optional<c10::Device>, device) = std::nullopt;
  /// Interface address Gloo binds to; default: loopback when MASTER_ADDR is
  /// local, else the host name.
  TORCH_ARG(std::string, gloo_hostname) = "";
  /// The ranks compare a fingerprint of each collective and every rank
  /// throws CollectivesDiverged, naming two ranks and where each is, instead
  /// of running collectives that do not pair (docs/reliability.md). In a
  /// training loop, from the third step on, one small exchange per step and
  /// group (docs/benchmarks.md); each group gets a second Gloo group for the
  /// exchanges. Unset (the default): on for CPU (Gloo) worlds of at most
  /// kCheckedByDefaultUpTo ranks, off otherwise. CPU (Gloo) only: true is
  /// ignored, with a warning, on CUDA. SHARDTORCH_CHECK_COLLECTIVES=0 or 1
  /// replaces it at launch. Every rank must end up with the same choice
  /// (checked when the world is created).
  TORCH_ARG(std::optional<bool>, check_collectives) = std::nullopt;
  /// This process replaces a lost rank of a job whose other ranks are still
  /// running and wait in World::rejoin() (docs/fault_tolerance.md,
  /// "Survivors that stay alive"): it joins them instead of starting a new
  /// job. Its set-up (shard(), the optimizer, Snapshots, the groups) must be
  /// the program's own, up to Snapshots::restore(). The collective check is
  /// off in such a World. SHARDTORCH_REJOIN=1 sets it at launch.
  TORCH_ARG(bool, rejoin) = false;
};

class SHARDTORCH_API World : public std::enable_shared_from_this<World> {
 public:
  /// From the launcher's environment (torchrun, mpirun or srun): rendezvous on
  /// a TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 hosts it unless torchrun's
  /// agent does). SHARDTORCH_TIMEOUT_S, when set, replaces options.timeout,
  /// and SHARDTORCH_FILE_TIMEOUT_S options.file_timeout.
  static std::shared_ptr<World> from_env(WorldOptions options = {});
  /// From an existing store (tests, custom launchers).
  static std::shared_ptr<World> create(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                                       WorldOptions options = {}, int local_rank = 0);

  /// This process's rank in this World (in a World of some ranks, made by
  /// subworld() or a DeviceMesh, its index among them).
  int rank() const { return rank_; }
  int size() const { return size_; }
  /// This process's rank in the whole job (what error messages name).
  int global_rank() const { return global_ranks_.empty() ? rank_ : global_ranks_[rank_]; }
  /// The rank in the whole job of this World's rank `r`.
  int global_rank_of(int r) const { return global_ranks_.empty() ? r : global_ranks_.at(r); }
  /// The World this one was made from (null for the whole job's).
  const std::shared_ptr<World>& parent() const { return parent_; }
  int local_rank() const { return local_rank_; }
  const c10::Device& device() const { return device_; }
  std::chrono::milliseconds timeout() const { return options_.timeout(); }
  std::chrono::milliseconds file_timeout() const { return options_.file_timeout(); }
  const std::string& backend_name() const { return backend_name_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }
  /// Collectives over all ranks.
  Comm& comm() { return *comm_; }

  /// A collective barrier (an all-reduce of one element) with the timeout.
  void barrier();

  /// Where this rank is, for its peers' errors (docs/reliability.md): when a
  /// collective fails, the error names the peers that died, stopped reporting
  /// or were elsewhere since before it started, and where each last was.
  /// shardtorch notes its own phases (shard(), each unit's forward and
  /// backward, the end of backward, the optimizer step); a program may note
  /// its own ("evaluation", "saving"). No I/O here: a thread of the world's
  /// writes the record to the store when it changed, at most every 20 ms,
  /// and every 0.5 s.
  void note_progress(const std::string& phase, const std::string& unit = "");
  /// Counts an optimizer step (shardtorch's optimizers call it).
  void note_step_done();
  /// Whether this world's collectives are checked (WorldOptions::check_collectives).
  bool checks_collectives() const { return comm_->checks(); }

  /// A process group of some ranks (this one among them), e.g. for hybrid
  /// sharding; a member's index in the group is its place in `ranks`.
  /// Collective over its members: only they call this, with the same ranks in
  /// the same order and the same tag, in the same order among their groups of
  /// that tag and ranks (which, with a count, key its rendezvous in the
  /// store); it runs one collective on the new group before returning. A rank
  /// named twice, or members listing the ranks in different orders, is an
  /// error on every member.
  std::shared_ptr<Comm> new_group(const std::vector<int>& ranks, const std::string& tag);

  /// A World of some ranks of this one (this rank among them): its rank() is
  /// this rank's place in `ranks`, its size() their number, and everything a
  /// World does (shard() over it, checkpoints, the collective check, the
  /// peer reports, which name ranks of the whole job) works in it. Collective
  /// over its members, as new_group. DeviceMesh makes one per dimension.
  std::shared_ptr<World> subworld(const std::vector<int>& ranks, const std::string& tag);

  /// After a collective failed because a rank was lost, on every rank still
  /// running (the whole job's World): waits (at most timeout()) for a
  /// replacement started with WorldOptions::rejoin (SHARDTORCH_REJOIN=1),
  /// then connects this World and every group made from it again, with it,
  /// and answers its set-up's collectives with those of this rank's own
  /// set-up (recorded up to the first Snapshots::restore(), optimizer step
  /// or forward of a sharded model). The Comms keep their identity; the collective check is off from
  /// here on. Nothing may be in flight on any of them. Snapshots::rejoin()
  /// calls it and then restores the lost rank's state.
  void rejoin();

  World(const World&) = delete;
  World& operator=(const World&) = delete;

 private:
  friend struct detail::WorldAccess;  // the library's own access (src/comm/world_access.h)
  World() = default;
  /// The whole job's World (this one, unless made by subworld()).
  World& root();
  void agree_on_order(c10d::Store& store, const std::vector<int>& ranks, const std::vector<int>& members,
                      const std::string& tag);
  int rank_ = 0, size_ = 1, local_rank_ = 0;
  c10::Device device_ = c10::Device(c10::kCPU);
  WorldOptions options_;
  std::string backend_name_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<Comm> comm_;
  std::map<std::string, int> groups_made_;  // by tag and ranks (of the whole job's World)
  std::shared_ptr<World> parent_;           // a subworld's: the World it was made from
  std::vector<int> global_ranks_;           // a subworld's: its ranks in the whole job
  std::shared_ptr<detail::Progress> progress_;
  std::shared_ptr<detail::CollectiveContext> context_;
  std::shared_ptr<detail::WaitBoard> waits_;  // when the collectives are checked
  // The whole job's World: what rejoin() connects again, and where.
  std::shared_ptr<detail::SetupJournal> journal_;
  c10::intrusive_ptr<c10d::Store> base_store_;  // store_ forwards to it, or to its epoch's prefix
  int64_t epoch_ = 0;                           // rejoins so far
  std::vector<std::weak_ptr<Comm>> comms_;      // the world's and its groups'
};

}  // namespace shardtorch
