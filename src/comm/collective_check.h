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
// The waits themselves are recorded by the WaitBoard (wait_board.h).
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "comm/wait_board.h"

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
/// A tensor's dtype, shape and device, kept for words built later.
struct TensorShape {
  bool defined = false;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes;
  c10::Device device = c10::kCPU;

  static TensorShape of(const at::Tensor& t);
  /// "Float[2, 7]", " on cuda:0" after it off the CPU; "undefined".
  std::string text() const;
};

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
  /// A forward of the root unit without grad mode (an evaluation): counted
  /// since the last step, the last one's inputs kept for the words.
  void root_forward_without_grad(const std::vector<at::Tensor>& inputs);

  using Shapes = std::vector<TensorShape>;

  /// Numbers only: the words are built when an error or a wait record needs them.
  struct Snapshot {
    int64_t step = 0, backwards = 0, phase = 0, inputs_hash = 0;  // phase: 0 none, 1 backward without sync, 2 with
    std::shared_ptr<const std::string> inputs;                    // the step's first forward's, null before it
    int64_t forwards_without_grad = 0;                            // since the last step
    std::shared_ptr<const Shapes> last_without_grad;              // the last one's inputs
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
  int64_t forwards_without_grad_ = 0;
  std::shared_ptr<const Shapes> last_without_grad_;
  std::vector<std::weak_ptr<CheckerShared>> checkers_;
  void mark(bool setup);  // step_done (a new step) or setup_done: each followed checker queues its marker
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
  /// From now on nothing is launched (unlike CheckedLaunch::abandon, which
  /// lets the launch come): the collectives queued fail at once
  /// with `why`, and one whose exchange is running when this is called (a
  /// peer that never comes, or comes later) fails with it when the exchange
  /// ends. Returns once no launch is running. For a rank that closes this
  /// communicator's connection and opens a new one (World::rejoin): nothing
  /// meant for the old connection is launched on the new one.
  void cancel_launches(const std::string& why);

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
