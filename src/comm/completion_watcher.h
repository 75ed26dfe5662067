// CompletionWatcher: learns when launched collectives complete, without
// blocking the thread that launched them.
//
// Gloo's reduce-scatter Work reports completion only through wait():
// isCompleted() stays false and it has no future (torch 2.13, measured). A
// thread of the watcher's own therefore waits for each collective it is
// given, in the order given, and records the outcome; the launching thread
// waits with a bound (wait_for) and then finishes the
// collective itself with Comm::finish (statistics, errors). Used for CPU
// collectives; on CUDA, Work::isCompleted() answers directly. No exception
// leaves the thread: each reaches the waiter of its collective.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

namespace shardtorch::detail {

struct CheckedLaunch;

/// The outcome of one watched collective, shared by the watcher's thread
/// and the thread that asks.
struct CompletionState {
  /// True once done, false if `bound` passed first.
  bool wait_for(std::chrono::milliseconds bound);
  /// Until done (the watcher's wait is bounded by the collective's timeout).
  void wait();
  /// What the collective's wait() threw (null if it succeeded); call once done.
  std::exception_ptr error();
  /// Marks it done with `error` (null: succeeded), wakes the waiters and
  /// lets go of what keep() was given.
  void settle(std::exception_ptr error);
  /// Holds `what` (the buffers and the backend of a collective no one waits
  /// for any more) until settle(); false, keeping nothing, if already done.
  bool keep(std::shared_ptr<void> what);
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr failure;
  std::shared_ptr<void> kept;
};

class CompletionWatcher {
 public:
  CompletionWatcher();
  CompletionWatcher(const CompletionWatcher&) = delete;
  CompletionWatcher& operator=(const CompletionWatcher&) = delete;
  /// Returns at once if the thread is waiting for a collective: the thread
  /// goes on waiting for it and for those queued behind it (each bounded by
  /// its timeout; it keeps what it uses), so that a destructor never waits
  /// for a peer that stopped. One still waiting for its launch is abandoned
  /// (CheckedLaunch::abandon): after a divergence it may never come.
  ~CompletionWatcher();

  /// Starts watching `work`: its wait(timeout) runs on the watcher's thread.
  /// Where `work` is null, `checked` (a launch waiting for its check) gives
  /// it there first; what the check throws is the collective's error.
  std::shared_ptr<CompletionState> watch(c10::intrusive_ptr<c10d::Work> work, std::chrono::milliseconds timeout,
                                         std::shared_ptr<CheckedLaunch> checked = nullptr);

 private:
  struct Item {
    c10::intrusive_ptr<c10d::Work> work;
    std::shared_ptr<CheckedLaunch> checked;
    std::chrono::milliseconds timeout{0};
    std::shared_ptr<CompletionState> state;
  };
  struct Shared;  // what the thread uses: it may outlive the watcher
  /// The thread: run(), and if its own machinery throws (not a collective:
  /// those errors go to their waiters), every waiter hears of that instead.
  static void loop(Shared& s) noexcept;
  static void run(Shared& s);
  /// The item's wait (its check first, if any); throws its error.
  static void wait(Item& item);

  std::shared_ptr<Shared> s_;
  std::thread thread_;  // started by the first watch()
};

}  // namespace shardtorch::detail
