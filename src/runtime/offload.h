#pragma once
// Internal: the copies of CPU offload (docs/offload.md).
//
// The fp32 master shards, the gradient shards and the optimizer state live in
// host memory (pinned when the compute device is an accelerator). Two kinds of
// copy cross between host and device:
//
//   to_device: before a unit's all-gather, its host shard is copied to the
//     compute device and cast to the compute dtype. On an accelerator the copy
//     runs on a side stream, and the compute stream does not wait for it:
//
//       compute:  ... unit k-1 ... | wait gather k | unit k forward ......
//       side:                        wait (E) | copy k+1 |
//       backend:                                          | gather k+1 |
//
//     The side stream first waits for an event E recorded on the compute
//     stream (the destination, and the all-gather's output, are blocks of the
//     compute stream's caching allocator that kernels queued before may still
//     read). The all-gather is launched with the side stream current
//     (on_side_stream), so the backend orders it after the copy only; the
//     compute stream meets it when it waits for the gathered unit. Freed
//     after that wait, the copy's block returns to the compute stream's pool
//     with everything that read it ordered before. A reader on the compute
//     stream calls current_waits_for_copies() first instead.
//     The copy moves the master dtype (fp32) and casts on the device, or
//     the master's bf16 copy under a bf16 compute dtype
//     (HostShard::upload_source). All of
//     this assumes the stream current at unshard_async is the one current
//     when the unit is waited for and computes (the caller's stream).
//   to_host: after a reduce-scatter, the reduced gradient shard is copied to
//     host memory. On an accelerator the source is first copied on the
//     current stream (device to device, cheap) into a buffer the offloader
//     owns, so the bucket it came from may be reused at once (a tensor the
//     caller hands over is used as it is); the side stream
//     waits for that and copies to pinned host memory while backward goes on.
//     A host thread (the worker) takes the copies in issue order, waits for
//     each to finish, releases its device buffer and hands the gradient on
//     (the callback adds it into the host gradient shard, and may step the
//     optimizer: ShardedOptimizer::overlap_with_backward), while backward
//     goes on (HostCopyWorker). Above kMaxInFlightBytes of device buffers,
//     to_host waits for the worker. worker().drain(), at the end of
//     backward, waits until every callback has run and rethrows the first
//     that threw.
//
// With host and device both the CPU the same calls run, without streams:
// to_device is a cast copy, to_host a copy, and the worker still runs the
// callbacks. That is the path the CPU tests exercise.
#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

namespace shardtorch::detail {

/// The host thread of to_host: takes the copies in issue order, waits for
/// each to finish, releases its device buffer and runs its callback; keeps
/// the first error for drain().
class HostCopyWorker {
 public:
  /// A copy to host memory handed to the worker.
  struct Pending {
    at::Tensor device_copy;  // kept alive until the side stream is done with it
    int64_t device_bytes = 0;
    at::Tensor host;
    std::optional<c10::Event> copied;
    std::function<void(const at::Tensor&)> done;
  };

  HostCopyWorker() = default;
  /// Stops the thread; pending callbacks are dropped.
  ~HostCopyWorker();
  HostCopyWorker(const HostCopyWorker&) = delete;
  HostCopyWorker& operator=(const HostCopyWorker&) = delete;

  /// Queues `p` (the thread starts at the first); waits while more than
  /// kMaxInFlightBytes of device buffers are held.
  void push(Pending p);
  /// Waits until every callback has run; rethrows the first that threw.
  void drain();
  /// Waits until the queue is empty and the worker idle.
  void wait();
  /// Drops pending copies without running their callbacks: waits for the
  /// worker, runs `then` (with the copies still dropped), then forgets any error.
  void drop(const std::function<void()>& then);
  /// Device bytes held by copies not yet seen finished; capped at
  /// kMaxInFlightBytes (push then waits).
  int64_t in_flight_bytes() const;
  static constexpr int64_t kMaxInFlightBytes = int64_t{256} << 20;

 private:
  void work();  // the thread's loop

  mutable std::mutex mu_;
  std::condition_variable cv_;  // any change below
  std::deque<Pending> queue_;   // copies not yet taken by the worker
  bool busy_ = false;           // the worker holds a copy
  bool dropping_ = false;       // drop(): release copies, run no callback
  bool stop_ = false;
  int64_t in_flight_bytes_ = 0;
  std::exception_ptr error_;  // the first callback that threw since drain()
  std::thread thread_;        // started at the first push
};

class Offloader {
 public:
  /// `device`: where units compute; `pin`: pin host buffers (accelerators).
  Offloader(c10::Device device, bool pin);
  Offloader(const Offloader&) = delete;
  Offloader& operator=(const Offloader&) = delete;

  bool pin() const { return pin_; }
  /// A copy of `host` on the compute device in `dtype`. On an accelerator the
  /// current stream does not wait for it: launch what reads it inside
  /// on_side_stream(), or call current_waits_for_copies() first.
  at::Tensor to_device(const at::Tensor& host, at::ScalarType dtype);
  /// Runs `launch` with the side stream current, after the work the current
  /// stream has queued so far (just runs it without an accelerator): a
  /// collective launched there waits for the copies, not for compute.
  void on_side_stream(const std::function<void()>& launch);
  /// The current stream waits for the copies to the device made so far.
  void current_waits_for_copies();
  /// Copies `device_tensor` to host memory; `done(host_copy)` runs on the
  /// worker thread once the copy finished, in issue order, before
  /// worker().drain() returns. `owned`: nobody else writes `device_tensor`
  /// afterwards (no protective device copy is made).
  void to_host(const at::Tensor& device_tensor, bool owned, std::function<void(const at::Tensor&)> done);
  /// The thread that runs to_host's callbacks (drain() at the end of backward).
  HostCopyWorker& worker() { return worker_; }
  /// Waits until no copy reads or writes host memory and the worker is idle
  /// (before the CPU writes master shards, e.g. an optimizer step or loading
  /// a checkpoint).
  void wait_idle();
  /// Drops pending copies without running their callbacks, and any error
  /// (after a failed backward).
  void discard();
  /// Bytes of every to_device / to_host copy so far.
  int64_t bytes_to_device() const { return bytes_to_device_; }
  int64_t bytes_to_host() const { return bytes_to_host_; }

 private:
  bool accelerator() const { return !device_.is_cpu(); }

  c10::Device device_;
  bool pin_;
  std::optional<c10::Stream> side_;
  int64_t bytes_to_device_ = 0, bytes_to_host_ = 0;
  HostCopyWorker worker_;  // last: its thread stops first
};

}  // namespace shardtorch::detail
