#include "runtime/execution_order.h"

#include <c10/core/GradMode.h>

#include <algorithm>

#include "runtime/backward_tracker.h"
#include "runtime/unit.h"
#include "runtime/unit_list.h"

namespace shardtorch::detail {

void ExecutionOrder::on_zero_grad() {
  // The next forward starts a new recording; until then the last one stays:
  // a zero_grad between a forward and its backward (out = model(x);
  // opt->zero_grad(); loss.backward()) must not lose the order the backward
  // learns for prefetch (clearing it here turned prefetch off for good).
  recording_stale_ = true;
  // Forwards never differentiated (an evaluation in grad mode, on some ranks
  // only, say) do not define the next reduction order.
  reduction_order_closed_ = true;
}

void ExecutionOrder::on_backward_finished() {
  if (!reduction_order_.empty()) order_head_ = reduction_order_.front();  // an order a backward used
  backward_cursor_ = SIZE_MAX;
  reduction_order_closed_ = true;  // the next forward records a new one
}

void ExecutionOrder::adopt_recording() {
  if (!recording_.empty()) forward_order_ = std::move(recording_);
  recording_.clear();
}

void ExecutionOrder::on_backward_abandoned() {
  recording_.clear();
  backward_cursor_ = SIZE_MAX;
  reduction_order_closed_ = true;
}

void ExecutionOrder::forget() {
  for (const auto& w : reduction_order_)
    if (auto x = w.lock()) x->grads().set_in_reduction_order(false);
  recording_.clear();
  forward_order_.clear();
  recording_stale_ = false;
  following_ = false;
  backward_cursor_ = SIZE_MAX;
  reduction_order_.clear();
  order_head_.reset();
  reduction_order_closed_ = false;
  issue_cursor_ = 0;
}

void ExecutionOrder::count_deferred_reduction() {
  if (!backward_.finishing()) ++reductions_deferred_;
}

void ExecutionOrder::note_forward_for_reduction(Unit& u) {
  // Not inside a backward: a checkpointed unit's recomputation runs forwards there.
  if (!c10::GradMode::is_enabled() || backward_.running()) return;
  if (u.is_root()) reduction_order_closed_ = true;  // a new forward starts at the root
  if (!u.grads().reduces()) return;
  auto restart = [&] {
    for (const auto& w : reduction_order_)
      if (auto x = w.lock()) x->grads().set_in_reduction_order(false);
    reduction_order_.clear();
    reduction_order_closed_ = false;
  };
  if (reduction_order_closed_) {
    restart();
  } else if (!reduction_order_.empty() && order_head_.lock().get() == &u &&
             reduction_order_.front().lock().get() != &u) {
    // Under a plain root nothing marks where a forward starts: the unit that
    // began the last differentiated order beginning again marks it, so that a forward run
    // after zero_grad and never differentiated (a look at one unit, on some
    // ranks only) does not head this step's order on those ranks alone.
    restart();
  }
  if (u.grads().in_reduction_order()) return;
  u.grads().set_in_reduction_order(true);
  reduction_order_.push_back(u.weak_from_this());
}

void ExecutionOrder::issue_reductions(bool at_end) {
  while (issue_cursor_ > 0) {
    auto u = reduction_order_[issue_cursor_ - 1].lock();
    if (u && !u->grads().issued()) {
      if (u->grads().reduced()) {
        u->issue_reduction();
      } else if (!at_end) {
        return;  // not final yet: the units after it wait, on every rank alike
      }          // at the end: not final means it took no part in this backward
    }
    --issue_cursor_;
  }
  if (!at_end) return;  // units outside the order wait for the end
  auto all = units_.all();
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if ((*it)->grads().reduces() && (*it)->grads().reduced() && !(*it)->grads().issued()) (*it)->issue_reduction();
}

std::shared_ptr<Unit> ExecutionOrder::note_forward_and_next(Unit& u) {
  if (!options_.prefetches() || !c10::GradMode::is_enabled()) return nullptr;
  if (u.is_root() || recording_stale_) recording_.clear();  // a new forward starts at the root, or after zero_grad
  recording_stale_ = false;
  if (recording_.empty()) following_ = true;
  recording_.push_back(u.weak_from_this());
  const size_t pos = recording_.size() - 1;
  const bool in_order = pos < forward_order_.size() && forward_order_[pos].lock().get() == &u;
  following_ = following_ && in_order;
  // Prefetch only along the order the last complete step ran, while this
  // forward follows it.
  if (!in_order || pos + 1 >= forward_order_.size()) return nullptr;
  auto next = forward_order_[pos + 1].lock();
  return next && next->gather().state() == ParamState::Sharded ? next : nullptr;
}

bool ExecutionOrder::needed_again_at_once(const Unit& u) const {
  if (!options_.prefetches() || !c10::GradMode::is_enabled() || !following_) return false;
  size_t last = forward_order_.size();  // one past the last unit with parameters
  while (last > 0) {
    auto unit = forward_order_[last - 1].lock();
    if (unit && unit->has_params()) break;
    --last;
  }
  const size_t next = recording_.size();                            // the position the next pre-forward takes
  if (next < last) return forward_order_[next].lock().get() == &u;  // u runs again at once
  return next == last && last > 0 && forward_order_[last - 1].lock().get() == &u;  // backward starts with u
}

std::shared_ptr<Unit> ExecutionOrder::next_in_backward(Unit& u) {
  // The root stays gathered through backward, and its outputs' hooks can fire
  // late in it: it neither moves the cursor nor is a prefetch target.
  if (!options_.prefetches() || u.is_root()) return nullptr;
  const size_t n = forward_order_.size();
  auto at = [&](size_t i) { return forward_order_[i].lock().get(); };
  auto one_past_u_below = [&](size_t i) {  // one past u's last position below i; 0 if none
    while (i > 0 && at(i - 1) != &u) --i;
    return i;
  };
  // u's nearest position below the cursor; else (the backward left the order) its last one.
  size_t i = one_past_u_below(std::min(backward_cursor_, n));
  if (i == 0) i = one_past_u_below(n);
  if (i == 0) return nullptr;
  backward_cursor_ = i;  // u is at i - 1; positions below are still ahead of this backward
  // A unit that ran several times in a row finds the last of those positions
  // at each of its hooks: what backward needs after it is below the run.
  size_t j = i - 1;
  while (j > 0 && at(j - 1) == &u) --j;
  if (j == 0) return nullptr;
  auto prev = forward_order_[j - 1].lock();
  // The order is the last step's: this step's forward may have run prev after
  // u, so that prev has reduced already and is not needed again. A unit none
  // of whose outputs this step needs a gradient (a frozen backbone fed by
  // data under a trainable head) has no backward to gather for.
  return prev && prev->gather().state() == ParamState::Sharded && !prev->grads().reduced() &&
                 prev->forwards().may_take_part_in_backward()
             ? prev
             : nullptr;
}

}  // namespace shardtorch::detail
