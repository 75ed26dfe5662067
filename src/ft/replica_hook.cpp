#include "ft/replica_hook.h"

#include "base/errors.h"

namespace shardtorch::ft::detail {

using shardtorch::completed_future;

c10::intrusive_ptr<c10::ivalue::Future> ReplicaHook::runHook(c10d::GradBucket& bucket) {
  at::Tensor buffer = bucket.getBuffer();
  StepLink* step = step_;
  if (!inner_ || inner_->getSize() <= 1) return across(step, buffer);
  // NoShard with several ranks per group: the group's own mean first, then
  // across the groups when it completes (the backward goes on meanwhile).
  try {
    buffer.div_(inner_->getSize());
    std::vector<at::Tensor> v{buffer};
    return inner_->allreduce(v)->getFuture()->thenAsync(
        [step, buffer](c10::ivalue::Future& f) {
          if (f.hasError()) {
            step->fail_step("the all-reduce inside the group failed: " + f.tryRetrieveErrorMessage());
            return completed_future(buffer);
          }
          return across(step, buffer);
        },
        c10::TensorType::get());
  } catch (const std::exception& e) {
    step->fail_step(std::string("the all-reduce inside the group failed: ") + shardtorch::detail::message_of(e));
    return completed_future(buffer);
  }
}

c10::intrusive_ptr<c10::ivalue::Future> ReplicaHook::across(StepLink* step, at::Tensor buffer) {
  try {
    const Quorum& q = step->wait_quorum();
    if (!q.error.empty()) return completed_future(buffer);
    if (heals_me(q)) buffer.zero_();
    const double counted = static_cast<double>(q.counted.size());
    c10d::Backend* pg = step->cross_group();
    if (!pg) {
      buffer.div_(counted);
      return completed_future(buffer);
    }
    std::vector<at::Tensor> v{buffer};
    return pg->allreduce(v)->getFuture()->then(
        [step, buffer, counted](c10::ivalue::Future& f) {
          if (f.hasError()) {
            step->fail_step("a cross-replica all-reduce failed: " + f.tryRetrieveErrorMessage());
          } else {
            buffer.div_(counted);
          }
          return c10::IValue(buffer);
        },
        c10::TensorType::get());
  } catch (const std::exception& e) {
    step->fail_step(std::string("the cross-replica reduction failed: ") + shardtorch::detail::message_of(e));
    return completed_future(buffer);
  }
}

}  // namespace shardtorch::ft::detail
