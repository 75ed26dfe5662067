#pragma once
// Internal: a sharded model's units in pre-order of the module tree, held
// weakly (the modules own them).
#include <memory>
#include <vector>

namespace shardtorch::detail {

class Unit;

class UnitList {
 public:
  /// `global_rank`: this rank, for the error when a unit is gone.
  explicit UnitList(int global_rank) : global_rank_(global_rank) {}
  /// Every unit; throws if one no longer exists (the model was destroyed, or
  /// a unit module replaced after shard()).
  std::vector<std::shared_ptr<Unit>> all() const;
  /// The units still alive (cleanup after a failure).
  std::vector<std::shared_ptr<Unit>> live() const;
  void add(const std::shared_ptr<Unit>& u) { units_.push_back(u); }

 private:
  int global_rank_;
  std::vector<std::weak_ptr<Unit>> units_;
};

}  // namespace shardtorch::detail
