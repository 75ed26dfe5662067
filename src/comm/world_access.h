#pragma once
// Internal: what the library reaches of a World beyond its public interface.
#include <functional>
#include <string>

#include "base/errors.h"
#include "comm/collective_check.h"
#include "comm/progress.h"
#include "comm/rejoin.h"
#include "shardtorch/world.h"

namespace shardtorch::detail {

struct WorldAccess {
  /// Where this rank is (step, backward, the step's inputs), for the
  /// collectives' fingerprints; shardtorch's sharded models keep it.
  static CollectiveContext& context(const World& w) { return *w.context_; }
  /// The peers' records of where this rank is; null in a world of one rank.
  static Progress* progress(const World& w) { return w.progress_.get(); }
  /// The set-up is over: World::rejoin() answers a replacement's set-up
  /// with the collectives recorded until now.
  static void end_setup(World& w) {
    if (auto& journal = w.root().journal_) journal->end_setup();
  }
};

inline CollectiveContext& collective_context(const World& w) { return WorldAccess::context(w); }

/// rethrow_naming over `w`'s rank, the error also kept in this rank's record
/// for its peers (Progress::raised): one whose collective fails next gives
/// it, even if this rank's program catches the error and ends. In a catch
/// block of a call into the library from the program's thread.
[[noreturn]] inline void rethrow_naming(const World& w, const std::function<std::string()>& operation) {
  try {
    rethrow_naming(w.global_rank(), operation);
  } catch (...) {
    if (auto* p = WorldAccess::progress(w)) p->raised();
    throw;
  }
}

/// run_naming over `w` (rethrow_naming(const World&, ...)).
template <class Body>
void run_naming(const World& w, const char* site, const std::function<std::string()>& operation, Body&& body) {
  try {
    failure_point(site);
    body();
  } catch (...) {
    rethrow_naming(w, operation);
  }
}

}  // namespace shardtorch::detail
