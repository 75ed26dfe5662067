#pragma once
// Internal: what the library reaches of a World beyond its public interface.
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

}  // namespace shardtorch::detail
