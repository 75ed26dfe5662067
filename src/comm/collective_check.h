#pragma once
// Internal: the check that ranks are at the same collective before it runs
// (docs/reliability.md, "Ranks that diverge after shard()"; the state
// machine and why it is sound: docs/design.md, "Checking that ranks are at
// the same collective").
//
// Every collective of a checked Comm goes through its CollectiveChecker. A
// collective whose pattern (its fingerprint without the step) equals the one
// at the same place of the previous optimizer step is launched at once;
// the step's first collective, and any that differs from the previous
// step's, is first exchanged with the peers on a Gloo group of its own (the
// check group) and launched only where every rank's fingerprint is the
// same. A rank that differs therefore never launches: either every rank
// exchanged and every rank throws the same CollectivesDiverged, naming two
// ranks and where each is; or the others launched and wait for it while it
// waits in the exchange, a cycle of waits that the WaitBoard finds. Launches
// stay asynchronous: the exchanges run on the Comm's own thread, or on the
// thread that waits for the collective when it comes first.
//
// A program thread that waits for a checked collective longer than
// WaitBoard::kQuiet writes its wait to the World's store: which collective
// (or which exchange) of which communicator, that communicator's members,
// and how many collectives and exchanges each communicator of the rank has
// launched and entered. Waiting rank r waits for rank p when p is a member
// of r's communicator, waits too, and has not launched r's collective (not
// entered r's exchange) there; a cycle of such edges through r, seen twice
// in a row with the same records, makes every rank of the cycle throw
// CollectivesDiverged naming each of them. A rank whose checked collectives
// come from two or more threads (in this optimizer step or the previous
// one) is left out of that search.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "comm/bounded_store.h"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace shardtorch::detail {

struct CheckerShared;  // what a checker's thread uses: it may outlive the checker

/// A collective's pattern: its fingerprint without the step (see Comm::launch).
constexpr size_t kPatternSize = 8;
/// A step's collectives past this many are exchanged in the next step too
/// (their patterns are not kept).
constexpr size_t kMaxPatternsPerStep = 1 << 17;
/// Replaces kMaxPatternsPerStep in this process from now on (for tests: the
/// bound is otherwise reached only after 131072 collectives in one step).
void set_max_patterns_per_step(size_t n);

/// Where this rank is in training, shared by a World's communicators and
/// written by its sharded models: part of every collective's fingerprint, so
/// that ranks at the same unit's collective in different micro-batches,
/// steps or with gradient sync differing are told apart. Thread-safe.
class CollectiveContext {
 public:
  void backward_begins(bool sync);
  void backward_ends();
  /// Counts the step; each checker that follows the steps queues the new
  /// step's marker exchange (CollectiveChecker::follow_steps).
  void step_done();
  /// shard() ended: each checker that follows the steps takes what it has
  /// issued since the last step as its reference and queues a marker, so
  /// that the first step's collectives, not shard()'s, are the second's.
  void setup_done();
  /// Adds a checker to those told of each step.
  void follow(std::weak_ptr<CheckerShared> checker);
  /// The inputs of the root unit's forward in grad mode: the first since the
  /// last step is kept (a different batch size per rank is then caught at
  /// the step's next collective).
  void root_inputs(const std::vector<at::Tensor>& inputs);

  /// Numbers only: the words are built when an error or a wait record needs them.
  struct Snapshot {
    int64_t step = 0, backwards = 0, phase = 0, inputs_hash = 0;  // phase: 0 none, 1 backward without sync, 2 with
    std::shared_ptr<const std::string> inputs;                    // the step's first forward's, null before it
    /// "step 2, after 1 backward since the last optimizer step; the step's first forward took ..."
    std::string words() const;
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
  std::shared_ptr<const std::string> inputs_;
  std::vector<std::weak_ptr<CheckerShared>> checkers_;
  void mark(bool setup);  // step_done (a new step) or setup_done: each followed checker queues its marker
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

  /// What a thread waits for: a launched collective, or an exchange of fingerprints.
  enum class Kind { Collective, Exchange };

  /// `rank` of `size` in the World. `store`: the connection the World's
  /// Progress uses (its keys start "shardtorch-waits/").
  WaitBoard(c10::intrusive_ptr<BoundedStore> store, int rank, int size);
  /// A communicator: its name, the same on every member, and its members'
  /// ranks in the World (by index in the communicator). Returns its number.
  int add(std::string name, std::vector<int> members);
  /// Counts a collective launched (an exchange entered) on communicator `comm`.
  void launched(int comm);
  void entered(int comm);
  /// The error another rank (or this one) found for a cycle of waits through this rank, "" if none. Never throws.
  std::string cycle_reported() const;
  /// Counts the calling thread as one that issues this rank's checked
  /// collectives in optimizer step `step` (CollectiveChecker::submit). While
  /// two or more threads issued some in this step or the last earlier one
  /// that issued any, or wait now, the rank's record says so instead of what
  /// it waits for: it is no node of the wait-for graph (one of its threads
  /// may launch what a peer waits for while another waits).
  void issued(int64_t step);
  /// Whether two or more threads issued in this step or the previous one (as above).
  bool issued_from_several_threads() const;

  /// One wait for collective (or exchange) number `seq` of communicator
  /// `comm`: probe() as it lasts, then the destructor clears its record
  /// (kept after a cycle, for the other ranks' probes). Never throws.
  class Wait {
   public:
    /// `describe` gives what is waited for in words; called at the first probe
    /// that writes a record (a wait past kQuiet), never for a short wait.
    Wait(std::shared_ptr<WaitBoard> board, int comm, Kind kind, int64_t seq, std::function<std::string()> describe);
    ~Wait();
    Wait(const Wait&) = delete;
    Wait& operator=(const Wait&) = delete;
    /// What is waited for from now on (the launch came, or another exchange runs).
    void set(Kind kind, int64_t seq) {
      kind_ = kind;
      seq_ = seq;
    }
    /// Call while waiting; cheap until kQuiet has passed, then once per
    /// kProbe: this rank's record written when it changed, and the records
    /// that following the wait-for graph from this rank needs read (each at
    /// most once, so at most one per rank of the World). Returns the error's
    /// text when a cycle through this rank is seen twice in a row with the
    /// same records (or another rank of it reported one), "" otherwise. The
    /// store is waited for until `until` at most (and 2 s), and not asked
    /// while it does not answer ("" then).
    std::string probe(std::optional<std::chrono::steady_clock::time_point> until = std::nullopt);

   private:
    std::shared_ptr<WaitBoard> board_;
    int comm_;
    Kind kind_;
    int64_t seq_;
    std::function<std::string()> describe_;
    std::string description_;  // built at the first record
    std::chrono::steady_clock::time_point next_;
    std::string written_;   // this rank's record as last written, "" before
    bool crossed_ = false;  // probe() returned an error
    std::string suspect_;   // the cycle and its records seen at the last probe
  };

 private:
  struct Comm {
    std::string name;
    std::vector<int> members;
    int64_t launched = 0, entered = 0;
  };
  std::string record(int comm, Kind kind, int64_t seq, const std::string& description) const;
  bool several_threads() const;                         // under mu_
  std::string prefixed(const std::string& text) const;  // "shardtorch: rank R/N: " + text
  c10::intrusive_ptr<BoundedStore> store_;
  int rank_, size_;
  mutable std::mutex mu_;
  std::vector<Comm> comms_;
  int64_t issue_step_ = -1;                     // the step of the last issued()
  std::vector<std::thread::id> issuers_;        // the threads that issued in it
  std::vector<std::thread::id> issued_before_;  // and in the step before it
  std::vector<std::thread::id> waiting_;        // one entry per Wait alive, by its thread
};

/// One checked collective: launched at once, or waiting in its checker's
/// FIFO for the launches before it or for its exchange.
struct CheckedLaunch {
  std::vector<int64_t> fingerprint;       // exchanged: the pattern, the step, seq
  std::function<std::string()> describe;  // in words, for an error or a wait record (built then only)
  /// describe()'s text, built at the first call; thread-safe.
  const std::string& description() const;
  std::function<c10::intrusive_ptr<c10d::Work>()> start;
  std::chrono::milliseconds timeout{0};
  int64_t seq = 0;        // its number on its communicator (1, 2, ...)
  bool exchange = false;  // exchanged before it is launched
  bool marker = false;    // a step's marker (step_began): exchanged, launches nothing

  /// Blocks until launched; returns the launched collective, or throws the
  /// check's error (CollectivesDiverged, or the failure of the exchange or
  /// of the launch). When this launch is first in its checker's FIFO and
  /// nothing runs there, the calling thread runs it itself (it would wait
  /// for it anyway): no thread hand-off. `probe`: compare a long wait with
  /// the peers' (WaitBoard), and run the launch here when it is next; false
  /// for the library's own background waits, which block no program thread
  /// (a thread that gave up on them goes on and issues what the peer waits
  /// for) and leave exchanges to the checker's thread, whose wait for a
  /// peer that never comes does not hold up teardown (see abandon()).
  c10::intrusive_ptr<c10d::Work> launched(bool probe = true);
  /// A program thread's wait for the collective itself (its launch first,
  /// where the launch is not done): `done_within(slice)` waits at most
  /// `slice` and says whether it completed or failed. Long waits are
  /// compared with the peers' (WaitBoard). Returns false when `timeout`
  /// passed first; throws CollectivesDiverged for a cycle of waits through
  /// this rank, or the checker's error when it broke meanwhile (the ranks are
  /// out of step: this collective would never complete).
  bool await(const std::function<bool(std::chrono::milliseconds)>& done_within, std::chrono::milliseconds timeout);
  /// What a program thread's failed wait for the collective throws: a
  /// CollectivesDiverged when a rank reported a cycle of waits through this
  /// one (it may have left first, failing the collective here), else `e`.
  std::exception_ptr explain(std::exception_ptr e) const;
  /// The first call decides; later ones are ignored.
  void settle(c10::intrusive_ptr<c10d::Work> work, std::exception_ptr error);
  /// Its waiters stop waiting for the launch: launched() throws `why` (a
  /// launch that comes later runs with no one waiting; the collective holds
  /// its tensors). No effect once it is settled. For teardown.
  void abandon(const std::string& why);

  std::weak_ptr<CheckerShared> checker;  // set by submit()
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  c10::intrusive_ptr<c10d::Work> work;
  std::exception_ptr error;

 private:
  mutable std::once_flag described_;
  mutable std::string description_;
};

class CollectiveChecker {
 public:
  static constexpr std::chrono::milliseconds kMarkerDrain{2000};
  /// `check`: a group of the same members as the checked communicator, for
  /// the exchanges alone. `board`: where long waits are compared across
  /// communicators (may be null); `comm`: this communicator's number on it.
  CollectiveChecker(c10::intrusive_ptr<c10d::Backend> check, int rank, int size,
                    std::shared_ptr<WaitBoard> board = nullptr, int comm = -1);
  /// Stops the thread. Step markers still queued or running get up to
  /// kMarkerDrain to pair with the peers' (every rank queued the same ones);
  /// then queued ones are dropped, and a thread still inside an exchange (a
  /// peer that never comes) is left to finish on its own (it holds what it uses).
  ~CollectiveChecker();
  CollectiveChecker(const CollectiveChecker&) = delete;
  CollectiveChecker& operator=(const CollectiveChecker&) = delete;

  /// A collective, in the order the rank issues them: `start` runs at once
  /// when `pattern` (its fingerprint but the step) equals the one at the same
  /// place of the previous step and nothing is queued before it; otherwise
  /// in order, after the exchange of (pattern, step, its number) where it
  /// needs one (the step's first; one that differs from the previous step's).
  /// `describe`: the collective in words, called only for an error or a wait record.
  std::shared_ptr<CheckedLaunch> submit(std::vector<int64_t> pattern, int64_t step,
                                        std::function<std::string()> describe,
                                        std::function<c10::intrusive_ptr<c10d::Work>()> start,
                                        std::chrono::milliseconds timeout);
  /// From now on, each step of `context` queues a marker exchange (the step,
  /// the collectives issued so far) at once, on the checker's thread, so that
  /// the step's first collective need not wait for one.
  /// `timeout`: the markers' until a collective brings its own.
  void follow_steps(CollectiveContext& context, std::chrono::milliseconds timeout);
  /// Exchanges entered so far, step markers included.
  int64_t exchanges() const;
  /// Blocks until every collective submitted so far is launched (or failed:
  /// throws the error of the last one); a long wait is compared with the
  /// peers' as the launch's own would be.
  void flush();

 private:
  std::shared_ptr<CheckerShared> s_;
  std::thread thread_;
};

/// Whether `work` completed or failed within `slice` (false: it goes on).
/// Never throws; `work.wait()` then gives its outcome.
bool work_done_within(c10d::Work& work, std::chrono::milliseconds slice);

/// WorldOptions::check_collectives as it applies to a world (world.h says
/// how): `option` as set, `env` SHARDTORCH_CHECK_COLLECTIVES (null when
/// unset; anything but "0" or "1" is an Error), `cuda`: the world computes
/// on a CUDA device (either backend). `refused_on_cuda`: asked for there,
/// where it stays off.
struct CheckChoice {
  bool on = false;
  bool refused_on_cuda = false;
};
CheckChoice check_collectives_choice(std::optional<bool> option, const char* env, bool cuda, int world_size);

/// FNV-1a, 64 bits (as an int64): the same on every rank for the same text.
int64_t text_hash(const std::string& s);

}  // namespace shardtorch::detail
