#pragma once
// Internal: the check that ranks are at the same collective before it runs
// (docs/reliability.md, "Ranks that diverge after shard()").
//
// Every collective of a checked Comm goes through its CollectiveChecker: a
// thread of the Comm's own that, per collective and in the order given,
// all-gathers a fixed-size fingerprint on the Comm's backend, compares the
// ranks' fingerprints and only then launches the collective. The fingerprint
// exchange has the same size on every rank, so it always pairs; the data
// collective is launched only where every rank's fingerprint is the same, so
// it never runs mismatched. On a mismatch every rank throws the same
// CollectivesDiverged, naming two ranks and where each is. The launching
// thread never waits for the check (launches stay asynchronous), so
// communicators whose collectives ranks reach in different orders (the
// all-gathers and the reduce-scatters of a backward) do not wait on each
// other. A thread that waits for a collective whose check is next in order
// and not started runs the check itself, saving two thread hand-offs.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace shardtorch::detail {

/// Where this rank is in training, shared by a World's communicators and
/// written by its sharded models: part of every collective's fingerprint, so
/// that ranks at the same unit's collective in different micro-batches,
/// steps or with gradient sync differing are told apart. Thread-safe.
class CollectiveContext {
 public:
  void backward_begins(bool sync);
  void backward_ends();
  void step_done();
  /// The inputs of the root unit's forward in grad mode: the first since the
  /// last step is kept (a different batch size per rank is then caught at
  /// the step's next collective).
  void root_inputs(const std::vector<at::Tensor>& inputs);

  struct Snapshot {
    int64_t step = 0, backwards = 0, phase = 0, inputs_hash = 0;
    std::string words;  // "step 2, after 1 backward since the step, in a backward with gradient sync on; ..."
  };
  Snapshot snapshot() const;

 private:
  mutable std::mutex mu_;
  int64_t step_ = 0;
  int64_t backwards_ = 0;  // finished since the last step
  int in_backward_ = 0;
  bool sync_ = true;
  bool inputs_seen_ = false;
  int64_t inputs_hash_ = 0;
  std::string inputs_;
};

struct CheckerShared;  // what the checker's thread uses: it may outlive the checker

/// One collective waiting for its check: filled by the checker's thread, or
/// by the thread that waits for it when that thread comes first.
struct CheckedLaunch {
  std::vector<int64_t> fingerprint;
  std::string description;  // in words, for the error
  std::function<c10::intrusive_ptr<c10d::Work>()> start;
  std::chrono::milliseconds timeout{0};

  /// Blocks until the check is done; returns the launched collective, or
  /// throws the check's error (CollectivesDiverged, or the failure of the
  /// fingerprint exchange or of the launch). When this launch is next in its
  /// checker's order and no exchange is running, the calling thread runs the
  /// check itself (it would wait for it anyway): no thread hand-off.
  c10::intrusive_ptr<c10d::Work> launched();
  void settle(c10::intrusive_ptr<c10d::Work> work, std::exception_ptr error);

  std::weak_ptr<CheckerShared> checker;  // set by submit()
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  c10::intrusive_ptr<c10d::Work> work;
  std::exception_ptr error;
};

class CollectiveChecker {
 public:
  CollectiveChecker(c10::intrusive_ptr<c10d::Backend> backend, int rank, int size);
  /// Stops the thread; one still inside an exchange (a peer that never
  /// comes) is left to finish on its own (it holds what it uses).
  ~CollectiveChecker();
  CollectiveChecker(const CollectiveChecker&) = delete;
  CollectiveChecker& operator=(const CollectiveChecker&) = delete;

  /// Queues a collective: `start` runs on the checker's thread once every
  /// rank's fingerprint equals this one.
  std::shared_ptr<CheckedLaunch> submit(std::vector<int64_t> fingerprint, std::string description,
                                        std::function<c10::intrusive_ptr<c10d::Work>()> start,
                                        std::chrono::milliseconds timeout);

 private:
  std::shared_ptr<CheckerShared> s_;
  std::thread thread_;
};

/// FNV-1a, 64 bits (as an int64): the same on every rank for the same text.
int64_t text_hash(const std::string& s);

}  // namespace shardtorch::detail
