#pragma once
// Internal: running a communication hook (shardtorch/comm_hooks.h) on one
// bucket and waiting for its future, with errors that name the rank, the
// bucket and the shapes. The waiting thread is the one that launched the
// hook (the backward's); nothing here throws on another thread: the only
// callback added to a hook's future records completion and cannot throw.
#include <ATen/ATen.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "shardtorch/collectives.h"
#include "shardtorch/comm_hooks.h"

namespace shardtorch {
class World;
}

namespace shardtorch::detail {

/// The communication hook a bucketer reduces through (null: none), and where
/// its calls are counted (null: nowhere). Set outside a backward.
class HookSlot {
 public:
  void set(CommHook* hook, HookCounter* counter = nullptr) {
    hook_ = hook;
    counter_ = counter;
  }
  CommHook* hook() const { return hook_; }
  HookCounter* counter() const { return counter_; }

 private:
  CommHook* hook_ = nullptr;
  HookCounter* counter_ = nullptr;
};

/// A hook's reduction of one bucket, launched and not yet waited for.
struct HookCall {
  struct Signal {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  c10::intrusive_ptr<c10::ivalue::Future> future;
  std::shared_ptr<Signal> signal;
  std::string what;   // names the bucket
  std::string shape;  // the bucket as given to the hook, e.g. "float32[109]"
  std::vector<int64_t> sizes;
  std::chrono::steady_clock::time_point start;
  HookCounter* counter = nullptr;  // its time is added here when the future completes
  bool active() const { return static_cast<bool>(future); }
};

/// Calls hook.runHook(bucket), counting the call and the bucket's bytes in
/// `counter` (if not null). Throws naming the rank and `what` if the hook
/// throws or returns no future.
HookCall call_hook(CommHook& hook, c10d::GradBucket& bucket, int rank, std::string what,
                   HookCounter* counter = nullptr);
/// True once the hook's future has completed, false if `bound` passed first.
bool hook_done_within(const HookCall& call, std::chrono::milliseconds bound);
/// Waits, at most `timeout`, for the hook's future and returns its tensor.
/// Throws naming the rank, the bucket and the shapes when the future failed,
/// did not complete in time, or holds something other than a tensor of the
/// bucket's shape. `call` is spent afterwards, whatever happened.
at::Tensor finish_hook(CommHook& hook, HookCall& call, int rank, std::chrono::milliseconds timeout);
/// After a failure elsewhere: waits at most `timeout`, ignores the outcome.
void abandon_hook(HookCall& call, std::chrono::milliseconds timeout) noexcept;

/// What the ranks compare of a hook: its dynamic C++ type, and for a
/// CompressHook its dtype ("shardtorch::CompressHook(BFloat16)"); "no hook"
/// for null.
std::string describe_hook(const CommHook* hook);
/// Compares describe_hook(hook) across every rank of `world` through its
/// store (no collective: it pairs with nothing) and throws on every rank
/// when two differ, naming both ranks and both hooks. Every rank must call
/// it at the same point of its program (the n-th call on each rank is
/// compared with the n-th of the others); it waits at most the world's
/// timeout for the others. Nothing on a world of one rank.
void check_same_hook(World& world, const CommHook* hook);

}  // namespace shardtorch::detail
