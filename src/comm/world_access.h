#pragma once
// Internal: what the library reaches of a World beyond its public interface.
#include "comm/collective_check.h"
#include "comm/progress.h"
#include "shardtorch/world.h"

namespace shardtorch::detail {

struct WorldAccess {
  /// Where this rank is (step, backward, the step's inputs), for the
  /// collectives' fingerprints; shardtorch's sharded models keep it.
  static CollectiveContext& context(const World& w) { return *w.context_; }
  /// The peers' records of where this rank is; null in a world of one rank.
  static Progress* progress(const World& w) { return w.progress_.get(); }
};

inline CollectiveContext& collective_context(const World& w) { return WorldAccess::context(w); }

}  // namespace shardtorch::detail
