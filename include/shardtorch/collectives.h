#pragma once
// Typed collectives over one c10d Backend, each with a timeout, error messages
// that name the rank, the operation, what it was for and the shapes, and
// accounting of calls, bytes sent and time spent.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtorch/error.h"
#include "shardtorch/export.h"

namespace shardtorch {

/// Counters of one kind of collective.
struct SHARDTORCH_API CollectiveCounter {
  int64_t calls = 0;
  int64_t bytes_sent = 0;  // per rank, ring algorithm estimate
  double seconds = 0.0;
};

/// What the library handed to a communication hook (shardtorch/comm_hooks.h).
/// The hook's own collectives run on its group directly: they are in no
/// CollectiveCounter, whatever they send.
struct SHARDTORCH_API HookCounter {
  int64_t calls = 0;         // buckets handed to the hook (runHook calls)
  int64_t bucket_bytes = 0;  // their bytes, in the bucket's dtype
  double seconds = 0.0;      // from each runHook call until its future completed, summed
};

struct SHARDTORCH_API CommStats {
  CollectiveCounter all_gather, reduce_scatter, all_reduce, broadcast;
  /// Point-to-point (pipeline stages): bytes_sent counts what this rank sent;
  /// a receive sends nothing (its seconds are the wait).
  CollectiveCounter send, recv;
  HookCounter comm_hook;  // ShardedModel::comm_stats() only; not in total_bytes_sent()
  int64_t total_bytes_sent() const {
    return all_gather.bytes_sent + reduce_scatter.bytes_sent + all_reduce.bytes_sent + broadcast.bytes_sent +
           send.bytes_sent;
  }
};

namespace detail {
class StreamOrderedWaits;
class CollectiveChecker;
class CollectiveContext;
class WaitBoard;
struct CheckedLaunch;
}  // namespace detail

/// Thrown on every rank of a group, before the collective runs, when the
/// ranks are at different collectives (checked communicators only:
/// WorldOptions::check_collectives): the message names two ranks that
/// differ and where each is (operation, what for, shapes, step, phase).
class SHARDTORCH_API CollectivesDiverged : public Error {
 public:
  using Error::Error;
};

/// A collective launched and not yet waited for.
struct SHARDTORCH_API PendingWork {
  c10::intrusive_ptr<c10d::Work> work;             // null while a checked launch waits for its check
  std::shared_ptr<detail::CheckedLaunch> checked;  // the check and launch, on a checked Comm
  /// Launched (or queued for its check) and not yet waited for.
  bool pending() const { return work || checked; }
  const char* op = "";
  std::string what, shapes;
  CollectiveCounter* counter = nullptr;
  int64_t bytes = 0;
  std::chrono::steady_clock::time_point start;
  /// Its number among the collectives launched on its Comm, from 1 (0: a
  /// point-to-point transfer, or a group of one).
  int64_t seq = 0;
};

class SHARDTORCH_API Comm {
 public:
  Comm(c10::intrusive_ptr<c10d::Backend> backend, int rank, int size, std::chrono::milliseconds timeout,
       c10::Device device = c10::Device(c10::kCPU));
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// The rank in the whole job of member `member` (errors name these).
  int global_rank(int member) const { return global_ranks_.empty() ? member : global_ranks_.at(member); }
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// Where this group's tensors must live (CUDA for NCCL).
  const c10::Device& device() const { return device_; }
  const c10::intrusive_ptr<c10d::Backend>& backend() const { return backend_; }

  /// `out` (numel = size × in.numel()) receives every rank's `in`, in rank order.
  void all_gather_into(at::Tensor& out, at::Tensor& in, const std::string& what);
  /// Sums `in` (numel = size × out.numel()) across ranks; rank r receives chunk r.
  void reduce_scatter_into(at::Tensor& out, at::Tensor& in, const std::string& what);
  void all_reduce(at::Tensor& t, c10d::ReduceOp op, const std::string& what);
  /// all_gather_into, launched and returned at once; wait() finishes it. `out`
  /// and `in` must stay alive (and unwritten) until then.
  PendingWork all_gather_async(at::Tensor& out, at::Tensor& in, const std::string& what);
  /// reduce_scatter_into, launched and returned at once; wait() finishes it.
  /// `out` and `in` must stay alive (and `in` unwritten) until then.
  PendingWork reduce_scatter_async(at::Tensor& out, at::Tensor& in, const std::string& what);
  /// Launches a summing all-reduce and returns at once; wait() finishes it.
  PendingWork all_reduce_async(at::Tensor& t, const std::string& what);
  /// Whether the bucketers reduce-scatter with reduce_scatter_in_place_async.
  /// On by default for Gloo, whose reduce-scatter in c10d is an all-reduce of
  /// a clone of the input (then this rank's chunk is copied out): in place,
  /// the same exchange runs without the clone and the output buffer. Off for
  /// NCCL, whose reduce-scatter sends half an all-reduce's bytes.
  bool reduce_scatter_in_place() const { return reduce_scatter_in_place_; }
  /// Overrides that choice (tests run the other path with it).
  void set_reduce_scatter_in_place(bool on) { reduce_scatter_in_place_ = on; }
  /// A summing reduce-scatter done as an all-reduce of `in` in place: once
  /// wait() returns, chunk r of `in` (numel / size elements from r × that)
  /// holds rank r's reduced shard, and this rank reads its own. `in` must
  /// stay alive and unwritten until then. Counted as a reduce-scatter (its
  /// ring volume, as reduce_scatter_async is counted on every backend).
  PendingWork reduce_scatter_in_place_async(at::Tensor& in, const std::string& what);
  /// Waits for a launched collective; `pending` is spent afterwards, whether
  /// the collective succeeded or failed. Where host_waits(), this thread
  /// blocks until the collective completed or the timeout passed. Otherwise
  /// (CUDA) the current stream waits for it and this thread goes on; the
  /// collective is settled later: each wait() first checks, without
  /// blocking, the ones waited for before, and throws for one that failed or
  /// that the device has not passed within the timeout (naming it).
  void wait(PendingWork& pending);
  /// Whether wait() blocks the calling thread: on the CPU (Gloo), and on CUDA
  /// where the environment sets SHARDTORCH_BLOCKING_WAIT=1.
  bool host_waits() const { return host_waits_; }
  /// Finishes a collective whose Work was waited for elsewhere (on another
  /// thread): `error` is what that wait threw, if anything. Errors, fault
  /// injection and statistics as wait(); `pending` is spent afterwards.
  void finish(PendingWork& pending, std::exception_ptr error);
  void broadcast(at::Tensor& t, int root, const std::string& what);
  /// Point-to-point, for pipeline stages: sends `t` to member `peer`, or
  /// receives into `t` (contiguous, of the sent shape and dtype) from it;
  /// `tag` pairs a send with its receive. Not part of the collective check
  /// (two members take part, not the group): checked collectives started
  /// before are launched first. wait() finishes it, with the timeout and
  /// the errors of a collective (naming the peer's state when it fails).
  PendingWork send_async(const at::Tensor& t, int peer, int tag, const std::string& what);
  PendingWork recv_async(const at::Tensor& t, int peer, int tag, const std::string& what);
  /// Every rank's string, in rank order (two all-gathers: lengths, then bytes).
  std::vector<std::string> all_gather_strings(const std::string& mine, const std::string& what);

  /// Fingerprint exchanges the check has run on this communicator (0 unchecked).
  int64_t check_exchanges() const;
  /// Blocks until every collective started through this Comm is on its
  /// backend (a checked Comm holds some back until their fingerprints are
  /// exchanged): call it before running a collective on backend() directly,
  /// so that every rank's backend sees the same order. Throws what the check
  /// threw.
  void flush_launches();
  bool checks() const { return static_cast<bool>(checker_); }

  const CommStats& stats() const { return stats_; }
  void reset_stats() { stats_ = CommStats{}; }

  /// For its lifetime, `comm`'s collectives wait at least `at_least` (never
  /// less than they did): those of the checkpoints, which wait for other
  /// ranks' file reads and writes.
  class SHARDTORCH_API TimeoutAtLeast {
   public:
    TimeoutAtLeast(Comm& comm, std::chrono::milliseconds at_least) : comm_(comm), saved_(comm.timeout_) {
      comm.timeout_ = std::max(saved_, at_least);
    }
    ~TimeoutAtLeast() { comm_.timeout_ = saved_; }
    TimeoutAtLeast(const TimeoutAtLeast&) = delete;
    TimeoutAtLeast& operator=(const TimeoutAtLeast&) = delete;

   private:
    Comm& comm_;
    std::chrono::milliseconds saved_;
  };

 private:
  friend class World;  // turns the check on and sets the peer report of the groups it makes
  /// From now on the ranks compare a fingerprint of each collective
  /// (operation, what for, element count, dtype, and where `context` says
  /// the rank is) and every rank throws CollectivesDiverged instead of
  /// running it when they differ (docs/reliability.md). The fingerprints
  /// travel on `check`, a group of the same members made for this alone.
  /// Collective: every member must turn it on at the same point. CPU (Gloo)
  /// groups only. `board`, `name` (the same on every member) and `members`
  /// (their ranks in the World): where a long wait is compared with the
  /// other communicators' (ranks that diverge across communicators).
  void enable_checks(std::shared_ptr<detail::CollectiveContext> context, c10::intrusive_ptr<c10d::Backend> check,
                     std::shared_ptr<detail::WaitBoard> board = nullptr, const std::string& name = "",
                     std::vector<int> members = {});
  /// The check stops (World::rejoin): collectives run unchecked from here on.
  /// Collectives the check had queued but not launched fail, and none of
  /// them is launched later (on a connection a rejoin replaced).
  void disable_checks();
  /// What a failed collective's error adds about the peers (the world sets
  /// it: which died or did not arrive, and where each last was); given when
  /// the collective started and its PendingWork::seq, it must not throw.
  using PeerReport = std::function<std::string(std::chrono::steady_clock::time_point started, int64_t seq)>;
  /// How many collectives this Comm has launched (PendingWork::seq of the
  /// last), shared with the World's progress record.
  std::shared_ptr<const std::atomic<int64_t>> launched_count() const { return launched_; }
  void set_peer_report(PeerReport report) { peer_report_ = std::move(report); }

  void run(const char* op, const std::string& what, const std::string& shapes, CollectiveCounter& counter,
           int64_t bytes, const std::function<c10::intrusive_ptr<c10d::Work>()>& launch,
           std::optional<std::chrono::steady_clock::time_point> started = std::nullopt, int64_t seq = 0);
  /// Waits for `p` on this thread, whatever the device (the blocking calls).
  void wait_on_host(PendingWork& p);
  /// Runs `wait`, then fault injection; errors name the collective and the
  /// time since `start`, and the peer report its number `seq`; counts the
  /// collective in `counter`.
  void complete(const char* op, const std::string& what, const std::string& shapes, CollectiveCounter& counter,
                int64_t bytes, std::chrono::steady_clock::time_point start, const std::function<void()>& wait,
                int64_t seq = 0);
  /// Checks, without blocking, the collectives wait() let the stream wait for;
  /// throws for the oldest that has not completed within the timeout.
  void settle_earlier();
  /// Starts a collective for wait(); a failure to start names the operation.
  /// `start` may run later, on the checker's thread: it holds what it uses.
  /// `numel`, `dtype` and `extra` (a root, a reduce op) go into the fingerprint.
  PendingWork launch(const char* op, const std::string& what, std::string shapes, CollectiveCounter& counter,
                     int64_t bytes, std::function<c10::intrusive_ptr<c10d::Work>()> start, const at::Tensor& data,
                     int64_t extra = 0);
  /// The collective, launched when every rank's fingerprint agrees (checked
  /// Comm) or at once; throws what the check or the launch threw.
  c10::intrusive_ptr<c10d::Work> launched(PendingWork& p);
  /// launch() of a summing all-reduce of `t` in place, named and counted as given.
  PendingWork launch_sum(at::Tensor& t, const char* op, std::string shapes, CollectiveCounter& counter, int64_t bytes,
                         const std::string& what);
  void check_flat(const at::Tensor& out, const at::Tensor& in, const char* op, const std::string& what) const;
  void check_gather(const at::Tensor& out, const at::Tensor& in, const std::string& what) const;

  /// "shardtorch: rank G/N" for the world's Comm; "shardtorch: rank G (member
  /// i of n)" for a group's: how this Comm's messages begin.
  std::string who() const;

  c10::intrusive_ptr<c10d::Backend> backend_;
  int rank_, size_;
  std::vector<int> global_ranks_;  // a group's members' ranks in the whole job (World sets them); empty: the world
  std::chrono::milliseconds timeout_;
  c10::Device device_;
  bool reduce_scatter_in_place_;
  bool host_waits_;
  std::unique_ptr<detail::StreamOrderedWaits> unsettled_;  // when !host_waits_
  std::shared_ptr<detail::CollectiveContext> context_;
  std::unique_ptr<detail::CollectiveChecker> checker_;  // when checks()
  CommStats stats_;
  PeerReport peer_report_;
  std::shared_ptr<std::atomic<int64_t>> launched_ = std::make_shared<std::atomic<int64_t>>(0);
};

/// "float32[12, 4]"
SHARDTORCH_API std::string describe(const at::Tensor& t);

}  // namespace shardtorch
