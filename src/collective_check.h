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
//
// Ranks that first differ on two or more communicators each wait for an
// exchange another never joins. A wait longer than WaitBoard::kQuiet is
// written to the World's store (which collective of which communicator, that
// communicator's members, and how many each communicator of the rank has
// issued). Waiting rank r waits for rank p when p is a member of r's
// communicator, waits too, and has not issued r's collective there; a cycle
// of such edges through r, seen twice in a row with the same records, makes
// every rank of the cycle throw CollectivesDiverged naming each of them.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

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

/// One rank's checked communicators and, for its long waits, their records
/// in the store (see the top of this file). Shared by a World's checkers;
/// thread-safe.
class WaitBoard {
 public:
  /// A wait this long is written to the store and compared with the peers'.
  static constexpr std::chrono::milliseconds kQuiet{1000};
  /// Then compared again this often; a cycle of waits seen twice in a row is an error.
  static constexpr std::chrono::milliseconds kProbe{500};

  WaitBoard(c10::intrusive_ptr<c10d::Store> store, int rank);
  /// A communicator: its name, the same on every member, and its members'
  /// ranks in the World (by index in the communicator). Returns its number.
  int add(std::string name, std::vector<int> members);
  /// The number of the next collective issued on communicator `comm` (1, 2, ...).
  int64_t issue(int comm);
  /// The error another rank (or this one) found for a cycle of waits through this rank, "" if none. Never throws.
  std::string cycle_reported() const;

  /// One wait for collective `seq` of communicator `comm`: probe() as it
  /// lasts, then the destructor clears its record (kept after a cycle, for
  /// the other ranks' probes). Never throws.
  class Wait {
   public:
    /// `description` must outlive the Wait (it is not copied: one is made per checked wait).
    Wait(std::shared_ptr<WaitBoard> board, int comm, int64_t seq, const std::string& description);
    ~Wait();
    Wait(const Wait&) = delete;
    Wait& operator=(const Wait&) = delete;
    /// Call while waiting; cheap until kQuiet has passed, then once per
    /// kProbe: this rank's record written when it changed, and the records
    /// that following the wait-for graph from this rank needs read (each at
    /// most once, so at most one per rank of the World). Returns the error's
    /// text when a cycle through this rank is seen twice in a row with the
    /// same records (or another rank of it reported one), "" otherwise.
    std::string probe();

   private:
    std::shared_ptr<WaitBoard> board_;
    int comm_;
    int64_t seq_;
    const std::string& description_;
    std::chrono::steady_clock::time_point next_;
    std::string written_;   // this rank's record as last written, "" before
    bool crossed_ = false;  // probe() returned an error
    std::string suspect_;   // the cycle and its records seen at the last probe
  };

 private:
  struct Comm {
    std::string name;
    std::vector<int> members;
    int64_t issued = 0;
  };
  std::string record(int comm, int64_t seq, const std::string& description) const;
  std::string prefixed(const std::string& text) const;  // "shardtorch: rank R: " + text
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  mutable std::mutex mu_;
  std::vector<Comm> comms_;
};

struct CheckerShared;  // what the checker's thread uses: it may outlive the checker

/// One collective waiting for its check: filled by the checker's thread, or
/// by the thread that waits for it when that thread comes first.
struct CheckedLaunch {
  std::vector<int64_t> fingerprint;
  std::string description;  // in words, for the error
  std::function<c10::intrusive_ptr<c10d::Work>()> start;
  std::chrono::milliseconds timeout{0};
  int64_t seq = 0;  // its number on its communicator (WaitBoard::issue)

  /// Blocks until the check is done; returns the launched collective, or
  /// throws the check's error (CollectivesDiverged, or the failure of the
  /// fingerprint exchange or of the launch). When this launch is next in its
  /// checker's order and no exchange is running, the calling thread runs the
  /// check itself (it would wait for it anyway): no thread hand-off.
  /// `probe`: compare a long wait with the peers' (WaitBoard); false for
  /// the library's own background waits, which block no program thread (a
  /// thread that gave up on them goes on and issues what the peer waits for).
  c10::intrusive_ptr<c10d::Work> launched(bool probe = true);
  /// The first call decides; later ones are ignored.
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
  /// `board`: where long waits are compared across communicators (may be
  /// null); `comm`: this communicator's number on it.
  CollectiveChecker(c10::intrusive_ptr<c10d::Backend> backend, int rank, int size,
                    std::shared_ptr<WaitBoard> board = nullptr, int comm = -1);
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
