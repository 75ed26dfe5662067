#pragma once
// Internal (tests and benchmarks include it from src/).
// ReduceScatterBucketer: coalesces small gradient reduce-scatters and runs
// them asynchronously, so that they overlap the rest of backward.
//
// Inputs are flat tensors of world × shard elements (chunk r goes to rank r).
// Per key (dtype, device, process group) one bucket holds a [world, cols]
// buffer being filled; an input is copied into the next free column range.
//
//   Filling ──launch──▶ InFlight ──wait──▶ Done (callbacks run, buffers freed)
//
// - A bucket is launched (one asynchronous reduce-scatter for everything in
//   it) when the next input would not fit within its capacity (bucket_mb), or
//   at once when the input just added would not fit a second time: blocks of
//   a model are mostly the same size, so waiting for the next one would only
//   delay the launch by a unit's backward.
// - An input whose shard exceeds the capacity is launched on its own (after
//   the queued bucket, to keep the order).
// - Launched buckets are waited for in launch order; their callbacks run
//   then, in submission order. At most `max_in_flight` collectives are in
//   flight: launching one more first waits for the oldest, for a bounded
//   time (kReduceScatterLimitWait, at most a quarter of the collective
//   timeout). If the oldest has not completed by then, the launch goes out
//   beside it, past the limit (counted in launches().counts().past_limit, reported
//   once on stderr): a rank that finished several units early (the data
//   routed around them) must not block there while a peer, which reduces
//   those units later, waits for it in an all-gather on the other
//   communicator (docs/design.md, COMMUNICATORS). flush() launches every
//   partly filled bucket and waits for everything.
// - Completion on the CPU is learnt from a watcher thread that waits for
//   each launch in order (c10d's Gloo reduce-scatter, the path taken when
//   reduce_scatter_in_place() is off, reports completion only through
//   wait()); on CUDA from Work::isCompleted(). The callbacks, the
//   statistics and the errors stay on the calling thread.
// - On Gloo a launch is an all-reduce of the bucket's input in place, and
//   the callbacks read this rank's row of it: c10d's Gloo reduce-scatter is
//   that all-reduce run on a clone of the input, so this saves the clone
//   and the output buffer (Comm::reduce_scatter_in_place). On NCCL it is a
//   reduce-scatter into an output buffer.
// - Buffers are allocated when filling starts, sized from the previous
//   backward's high-water mark and grown (by doubling, up to the capacity)
//   only as far as the inputs need. A full bucket's buffers go with its
//   collective and are freed when it completes; a partly filled bucket is
//   launched from a compact copy and keeps its buffers for the next fill.
//   free(), called at the end of each backward, releases the rest: buckets
//   exist only during backward. Alive at once: one filling buffer per key
//   and at most max_in_flight launched ones (more only past the limit).
// - discard() (a failed backward, the bucketer's destruction) waits at most
//   kDiscardWait for what is in flight, ignoring errors, lets go of what is
//   still running then (kept alive until it ends), drops the callbacks and
//   frees everything.
//
// - A communication hook (launches().hook().set) takes the place of the all-reduce across
//   replicas: when a reduce-scatter completes, this rank's chunk of it goes
//   to the hook (with or without replicas), its future stays in flight in
//   the same queue, and the callbacks get what the future holds.
//
// reduce_scatter() callbacks receive views of the reduced shard valid only
// during the call; all_reduce() callbacks the reduced input, which may be kept.
#include <ATen/ATen.h>

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "comm/hook_call.h"
#include "shardtorch/collectives.h"
#include "shardtorch/comm_hooks.h"
#include "base/memory_tracker.h"

namespace shardtorch {

/// Gradient reductions (reduce-scatters, OptimizerOnly's all-reduces) a
/// sharded model's bucketer keeps in flight during backward.
constexpr int kMaxReduceScattersInFlight = 2;
/// How long a launch waits for room under that limit before it goes out
/// past it (at most a quarter of the group's collective timeout).
constexpr std::chrono::milliseconds kReduceScatterLimitWait{1000};
/// How long discard() waits, in all, for the CPU collectives in flight to
/// complete; those still running then are let go, their buffers and backend
/// kept alive until they end (a peer that stopped holds them for the whole
/// collective timeout).
constexpr std::chrono::milliseconds kDiscardWait{2000};

namespace detail {
class CompletionWatcher;
struct CompletionState;

/// A launch's callbacks, each with the (start, length) of its part of the output.
using ReductionPieces = std::vector<std::pair<std::pair<int64_t, int64_t>, std::function<void(const at::Tensor&)>>>;

/// A bucketer's launched collectives, waited for in launch order, at most
/// `max_in_flight` at once (more only past make_room's bounded wait).
/// Completing one runs its callbacks, or first passes its output on, as a
/// launch of its own: across the replicas, or to the communication hook.
class LaunchQueue {
 public:
  /// A reduce-scatter; an all-reduce whose callbacks get all of its input;
  /// the all-reduce across the replicas that continues a reduce-scatter.
  enum class Kind { ReduceScatter, AllReduce, AcrossReplicas };
  /// What has been launched so far.
  struct Counts {
    int64_t launched = 0;         // collectives (coalesced buckets and bypasses)
    int64_t while_in_flight = 0;  // with an earlier one still in flight (overlap)
    int64_t past_limit = 0;  // with max_in_flight already in flight, the oldest not complete within the bounded wait
  };

  LaunchQueue(MemoryTracker* mem, int max_in_flight);
  ~LaunchQueue();

  /// Waits for the oldest launches until fewer than max_in_flight remain, or,
  /// `bounded`, until the oldest has not completed within the bounded wait
  /// (then `next`, the launch to come, goes out past the limit). Unbounded,
  /// each wait is the collective's own (its timeout).
  void make_room(const std::string& next, bool bounded = true);
  /// Launches one collective of `input` (call make_room() first): a
  /// reduce-scatter into `output`, or, `output` undefined, one in place; or
  /// an all-reduce. `bytes` (input and output, tracked under Mem::Buckets)
  /// go with it.
  void launch(Comm& group, at::Tensor input, at::Tensor output, int64_t bytes, ReductionPieces pieces,
              const std::string& what, Kind kind, Comm* replicas = nullptr);
  /// Waits for every launch and runs the callbacks (the end of a backward).
  void complete_all();
  /// After an error: waits for every launch (errors ignored; on CPU at most
  /// kDiscardWait in all, then lets the rest go, kept alive until they end)
  /// and drops its callbacks.
  void discard();

  /// Collectives launched and not yet waited for.
  int64_t size() const { return static_cast<int64_t>(in_flight_.size()); }
  /// Bytes the launches hold.
  int64_t bytes() const;
  const Counts& counts() const { return counts_; }
  /// A hook set here gets every reduce-scatter's output (this rank's chunk
  /// of a launch), and every all-reduce's whole result, before the
  /// callbacks, in place of the all-reduce across the replicas; it outlives
  /// this. Not set during a backward.
  HookSlot& hook() { return hook_; }

 private:
  struct Launched {
    Comm* group = nullptr;
    Comm* replicas = nullptr;  // a reduce-scatter whose output goes on across these
    PendingWork work;
    at::Tensor input, output;  // alive until the collective is done
    int64_t bytes = 0;         // tracked under Mem::Buckets
    ReductionPieces pieces;
    std::shared_ptr<CompletionState> completion;  // CPU: set by the watcher thread
    bool to_hook = false;                         // a reduction whose output goes on to the hook
    bool whole = false;                           // an all-reduce: its output is all of its input
    HookCall call;                                // the hook's reduction (then `work` is empty)
  };

  /// True once the oldest launch has completed, false if `bound` passed first.
  bool oldest_done_within(std::chrono::milliseconds bound);
  /// `l`'s reduce-scatter is done: launches the all-reduce of its output
  /// across `l.replicas`, which takes over its callbacks and bytes.
  void launch_across_replicas(Launched& l, const std::string& what);
  /// `l`'s reduce-scatter is done: hands its output to the hook, whose
  /// future takes over its callbacks and bytes in the queue.
  void launch_hook(Launched& l, const std::string& what);
  /// Waits for `l`'s collective (watched or not) and finishes it: statistics,
  /// errors (thrown).
  void wait_for_launch(Launched& l);
  /// Waits for the oldest launch and runs its callbacks.
  void complete_oldest();

  MemoryTracker* mem_;
  int max_in_flight_;
  std::deque<Launched> in_flight_;
  Counts counts_;
  HookSlot hook_;
  size_t hook_calls_ = 0;                       // in this backward: the GradBucket index
  std::unique_ptr<CompletionWatcher> watcher_;  // made by the first CPU launch
};
}  // namespace detail

class ReduceScatterBucketer {
 public:
  using Callback = std::function<void(const at::Tensor& reduced_shard)>;

  /// bucket_mb: size of one bucket's [world, cap] input buffer in MiB; 0
  /// disables coalescing (every input is reduced on its own).
  /// max_in_flight: collectives launched and not yet waited for (>= 1).
  explicit ReduceScatterBucketer(double bucket_mb = 25.0, MemoryTracker* mem = nullptr,
                                 int max_in_flight = kMaxReduceScattersInFlight);
  ~ReduceScatterBucketer();

  /// Queues `input` (1-D, numel divisible by the group size) for a summing
  /// reduce-scatter over `group`; `callback` gets this rank's reduced shard.
  /// `input` is copied into a bucket, or, when too big for one, kept and
  /// reduced as it is: the caller must not write it afterwards, nor read it
  /// (on Gloo it is all-reduced in place).
  /// `replicas` (HybridShard, more than one rank): the reduced shard is then
  /// summed across it too before `callback` runs, by one all-reduce per
  /// launch (a bucket, not an input), launched when the reduce-scatter
  /// completes and left in flight in the same queue. It goes out at once,
  /// past the limit if need be: waiting for room there could wait for a
  /// replica whose shard-group peer waits in an all-gather of this rank, and
  /// completing another launch there would run its callbacks, and launch
  /// its all-reduces, before those of the launch being completed, in an
  /// order other ranks need not share. Every input of a (dtype, device,
  /// group) key must name the same `replicas`.
  void reduce_scatter(const at::Tensor& input, Comm& group, Callback callback, const std::string& what,
                      Comm* replicas = nullptr);
  /// Queues `input` for a summing all-reduce over `group`: launched at once,
  /// alone, after what is queued for the same dtype and group, under the
  /// same limit in flight; `callback` gets the whole reduced input, which is
  /// `input` itself when that was contiguous (reduced in place: the caller
  /// must not read or write it meanwhile) and which nothing else writes
  /// afterwards. It waits for room as long as the collective timeout allows
  /// (OptimizerOnly's gradients: no gather in backward to deadlock with).
  /// With a hook, the reduced input goes on to it first (see launches()).
  void all_reduce(const at::Tensor& input, Comm& group, Callback callback, const std::string& what);
  /// The launched collectives: their counts, the hook.
  detail::LaunchQueue& launches() { return launches_; }
  /// Launches everything queued, waits for every collective in flight and
  /// runs the callbacks.
  void flush();
  /// Frees every bucket's buffers (call after flush()).
  void free();
  /// After an error: waits for the collectives in flight (errors ignored;
  /// at most kDiscardWait on CPU, see above), drops everything queued
  /// without running callbacks, frees the buffers.
  void discard();

  /// Bytes held by bucket buffers now (filling and in flight).
  int64_t allocated_bytes() const;

 private:
  struct Bucket {
    Comm* group = nullptr;
    Comm* replicas = nullptr;  // summed across after the reduce-scatter (HybridShard)
    at::Tensor buffer;         // [world, cols]; undefined when not filling
    at::Tensor output;         // [cols]; undefined when reduced in place (Gloo)
    int64_t cap = 0;           // most columns allowed (bucket_mb)
    int64_t high_water = 0;    // most columns used at a launch so far
    int64_t offset = 0;        // columns used
    detail::ReductionPieces pieces;
    std::vector<std::string> whats;
  };
  using Key = std::tuple<int /*dtype*/, std::string /*device*/, const void* /*group*/>;

  Bucket& bucket_for(const at::Tensor& input, Comm& group);
  /// Makes room for `cols` columns (<= cap), keeping the columns in use.
  void reserve(Bucket& b, int64_t cols, const at::TensorOptions& opts);
  /// Launches the bucket's queued columns.
  void launch_bucket(Bucket& b);

  int64_t bucket_bytes_;
  MemoryTracker* mem_;
  std::map<Key, Bucket> buckets_;
  detail::LaunchQueue launches_;
};

}  // namespace shardtorch
