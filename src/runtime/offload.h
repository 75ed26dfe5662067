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
//     goes on. Above kMaxInFlightBytes of device buffers, to_host waits for
//     the worker. drain(), at the end of backward, waits until every
//     callback has run and rethrows the first that threw.
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

class Offloader {
 public:
  /// `device`: where units compute; `pin`: pin host buffers (accelerators).
  Offloader(c10::Device device, bool pin);
  ~Offloader();
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
  /// worker thread once the copy finished, in issue order, before drain()
  /// returns. `owned`: nobody else writes `device_tensor` afterwards (no
  /// protective device copy is made).
  void to_host(const at::Tensor& device_tensor, bool owned, std::function<void(const at::Tensor&)> done);
  /// Waits until every callback has run; rethrows the first that threw.
  void drain();
  /// Waits until no copy reads or writes host memory and the worker is idle
  /// (before the CPU writes master shards, e.g. an optimizer step or loading
  /// a checkpoint).
  void wait_idle();
  /// Drops pending copies without running their callbacks, and any error
  /// (after a failed backward).
  void discard();
  /// Device bytes held by copies to host not yet seen finished; capped at
  /// kMaxInFlightBytes (to_host then waits for the worker).
  int64_t in_flight_bytes() const;
  static constexpr int64_t kMaxInFlightBytes = int64_t{256} << 20;
  /// Bytes of every to_device / to_host copy so far.
  int64_t bytes_to_device() const { return bytes_to_device_; }
  int64_t bytes_to_host() const { return bytes_to_host_; }

 private:
  struct Pending {
    at::Tensor device_copy;  // kept alive until the side stream is done with it
    int64_t device_bytes = 0;
    at::Tensor host;
    std::optional<c10::Event> copied;
    std::function<void(const at::Tensor&)> done;
  };
  bool accelerator() const { return !device_.is_cpu(); }
  void work();         // the worker's loop
  void wait_worker();  // until the queue is empty and the worker idle

  c10::Device device_;
  bool pin_;
  std::optional<c10::Stream> side_;
  int64_t bytes_to_device_ = 0, bytes_to_host_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;  // any change below
  std::deque<Pending> queue_;   // copies not yet taken by the worker
  bool busy_ = false;           // the worker holds a copy
  bool dropping_ = false;       // discard(): release copies, run no callback
  bool stop_ = false;
  int64_t in_flight_bytes_ = 0;
  std::exception_ptr error_;  // the first callback that threw since drain()
  std::thread worker_;        // started at the first to_host
};

}  // namespace shardtorch::detail
