#pragma once
// Internal: the orders a sharded model learns from its forwards: the forward
// order, which prefetch follows, and the reduction order, in which every rank
// hands final units' gradients on (docs/design.md, "Prefetch" and "Ordering
// and consistency across ranks").
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "shardtorch/shard_options.h"

namespace shardtorch::detail {

class BackwardTracker;
class Unit;
class UnitList;

class ExecutionOrder {
 public:
  ExecutionOrder(const ShardOptions& options, const BackwardTracker& backward, const UnitList& units)
      : options_(options), backward_(backward), units_(units) {}

  /// Prefetch: records the forward order of units in grad mode and returns
  /// the unit to gather next after `u`, forward or backward (null: none
  /// known, or prefetch off).
  std::shared_ptr<Unit> note_forward_and_next(Unit& u);
  std::shared_ptr<Unit> next_in_backward(Unit& u);
  /// With prefetch, while this forward has followed the learned order up to
  /// u (at its post-forward): u runs again next (a repeated unit), or it is
  /// the last unit with parameters, which backward needs first. Either way
  /// it stays gathered: freeing it would only gather it again at once.
  bool needed_again_at_once(const Unit& u) const;

  /// The reduction order: records u's first forward in grad mode since the
  /// last backward ended (outside backward; units with trainable parameters).
  void note_forward_for_reduction(Unit& u);
  /// Hands on, in the reduction order, every final unit whose turn has come;
  /// stops at the first that is not final yet. `at_end`: the backward is
  /// ending, so the units not final take no part and are skipped, and the
  /// final ones outside the order follow in reverse pre-order.
  void issue_reductions(bool at_end = false);
  /// Units whose gradients were final before their turn in the reduction
  /// order, since shard() (they waited; 0 when units finish in that order).
  int64_t reductions_deferred() const { return reductions_deferred_; }
  /// A unit final before its turn (not counted while the backward finishes).
  void count_deferred_reduction();

  /// zero_grad outside a backward: the next forward starts a new forward
  /// recording and a new reduction order.
  void on_zero_grad();
  /// A backward starts: its reductions are issued from the end of the order.
  void on_backward_start() { issue_cursor_ = reduction_order_.size(); }
  /// The end-of-backward callback runs: the order it used heads the next
  /// comparison, and the next forward records a new reduction order.
  void on_backward_finished();
  /// A backward that reduces finished: its forward's recording becomes the
  /// order prefetch follows.
  void adopt_recording();
  /// A failed backward: this step's recording is dropped, and the next
  /// forward records a new reduction order.
  void on_backward_abandoned();
  /// Back to what shard() left: nothing learned. A rank that rejoins
  /// (Snapshots::rejoin) then issues a step's collectives in the order a new
  /// process, its replacement, does.
  void forget();

 private:
  const ShardOptions& options_;
  const BackwardTracker& backward_;
  const UnitList& units_;
  std::vector<std::weak_ptr<Unit>> recording_, forward_order_;  // this step's forward; the last complete one
  bool recording_stale_ = false;       // zero_grad since: the next forward starts a new recording
  bool following_ = false;             // this forward has run the units of forward_order_ in its order so far
  size_t backward_cursor_ = SIZE_MAX;  // this backward's place in forward_order_ (next_in_backward)
  // The reduction order, in first-forward order (issued from the back); a
  // backward's end closes it, and the next forward starts a new one.
  std::vector<std::weak_ptr<Unit>> reduction_order_;
  std::weak_ptr<Unit> order_head_;  // the first unit of the order the last backward used
  bool reduction_order_closed_ = false;
  size_t issue_cursor_ = 0;  // reduction_order_[0, issue_cursor_) are still to be issued
  int64_t reductions_deferred_ = 0;
};

}  // namespace shardtorch::detail
