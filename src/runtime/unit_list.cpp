#include "runtime/unit_list.h"

#include "base/check.h"

namespace shardtorch::detail {

std::vector<std::shared_ptr<Unit>> UnitList::all() const {
  std::vector<std::shared_ptr<Unit>> out;
  for (const auto& w : units_) {
    auto u = w.lock();
    SHARDTORCH_CHECK(u, rank_prefix(global_rank_),
                     ": a unit of this sharded model no longer exists (was the model "
                     "destroyed, or a unit module replaced after shard()?)");
    out.push_back(std::move(u));
  }
  return out;
}

std::vector<std::shared_ptr<Unit>> UnitList::live() const {
  std::vector<std::shared_ptr<Unit>> out;
  for (const auto& w : units_)
    if (auto u = w.lock()) out.push_back(std::move(u));
  return out;
}

}  // namespace shardtorch::detail
