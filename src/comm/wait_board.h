#pragma once
// Internal: the records of long waits for checked collectives, and the
// wait-for graph over them (docs/reliability.md, "Ranks that diverge after
// shard()").
//
// A program thread that waits for a checked collective longer than
// WaitBoard::quiet() writes its wait to the World's store: which collective
// (or which exchange) of which communicator, that communicator's members,
// and how many collectives and exchanges each communicator of the rank has
// launched and entered. Waiting rank r waits for rank p when p is a member
// of r's communicator, waits too, and has not launched r's collective (not
// entered r's exchange) there; a cycle of such edges through r, seen twice
// in a row with the same records, makes every rank of the cycle throw
// CollectivesDiverged naming each of them. A rank whose checked collectives
// come from two or more threads (in this optimizer step or the previous
// one) is left out of that search.
#include "comm/bounded_store.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace shardtorch::detail {

/// What every divergence error tells the user to do.
extern const char* const kSameOrder;

/// One rank's checked communicators and, for its long waits, their records
/// in the store (see the top of this file). Shared by a World's checkers;
/// thread-safe.
class WaitBoard {
 public:
  /// What a thread waits for: a launched collective, or an exchange of fingerprints.
  enum class Kind { Collective, Exchange };

  /// `rank` of `size` in the World. `store`: the connection the World's
  /// Progress uses (its keys start "shardtorch-waits/"). `probe`: see probe().
  WaitBoard(c10::intrusive_ptr<BoundedStore> store, int rank, int size, std::chrono::milliseconds probe);
  /// A wait this long is written to the store and compared with the peers' (twice probe()).
  std::chrono::milliseconds quiet() const { return 2 * probe_; }
  /// Then compared again this often (check_probe_interval()); a cycle of
  /// waits seen twice in a row is an error.
  std::chrono::milliseconds probe() const { return probe_; }
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
    /// that writes a record (a wait past quiet()), never for a short wait.
    Wait(std::shared_ptr<WaitBoard> board, int comm, Kind kind, int64_t seq, std::function<std::string()> describe);
    ~Wait();
    Wait(const Wait&) = delete;
    Wait& operator=(const Wait&) = delete;
    /// How often probe() compares (the board's probe()).
    std::chrono::milliseconds interval() const { return board_->probe(); }
    /// What is waited for from now on (the launch came, or another exchange runs).
    void set(Kind kind, int64_t seq) {
      kind_ = kind;
      seq_ = seq;
    }
    /// Call while waiting; cheap until quiet() has passed, then once per
    /// probe(): this rank's record written when it changed, and the records
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
  std::chrono::milliseconds probe_;
  mutable std::mutex mu_;
  std::vector<Comm> comms_;
  int64_t issue_step_ = -1;                     // the step of the last issued()
  std::vector<std::thread::id> issuers_;        // the threads that issued in it
  std::vector<std::thread::id> issued_before_;  // and in the step before it
  std::vector<std::thread::id> waiting_;        // one entry per Wait alive, by its thread
};

}  // namespace shardtorch::detail
