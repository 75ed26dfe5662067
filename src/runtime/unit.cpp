// The life of a unit: gather, free, hooks and gradient hand-off (docs/design.md).
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <exception>
#include <sstream>
#include <unordered_set>

#include "base/check.h"
#include "base/errors.h"
#include "base/log.h"
#include "comm/world_access.h"
#include "runtime/shard_state.h"

namespace shardtorch::detail {

const char* state_name(ParamState s) {
  switch (s) {
    case ParamState::Sharded:
      return "sharded";
    case ParamState::Gathering:
      return "gathering";
    case ParamState::Unsharded:
      return "unsharded";
  }
  return "?";
}

void UnitGather::start_gather() {
  TORCH_INTERNAL_ASSERT(state_ == ParamState::Sharded, "unit '", unit_.label(), "': start_gather while ",
                        state_name(state_));
  state_ = ParamState::Gathering;
}

void UnitGather::finish_gather() {
  TORCH_INTERNAL_ASSERT(state_ == ParamState::Gathering, "unit '", unit_.label(), "': finish_gather while ",
                        state_name(state_));
  state_ = ParamState::Unsharded;
}

void UnitGrads::finalize() {
  TORCH_INTERNAL_ASSERT(grad_ == GradState::Idle || grad_ == GradState::Reached, "unit '", unit_.label(),
                        "': finalize while already final");
  grad_ = GradState::Final;
}

void UnitGrads::issue() {
  TORCH_INTERNAL_ASSERT(grad_ == GradState::Final, "unit '", unit_.label(), "': issue while not final");
  grad_ = GradState::Issued;
}

Unit::Unit(std::shared_ptr<ShardState> owner, std::string name, bool is_root, bool reshard_after_forward,
           bool persistent)
    : owner_(std::move(owner)),
      name_(std::move(name)),
      is_root_(is_root),
      reshard_after_forward_(reshard_after_forward && !is_root),
      gather_(*this, persistent),
      grads_(*this),
      forwards_(*this) {}

void UnitGather::unshard_async() {
  if (state_ != ParamState::Sharded || persistent_) return;
  SHARDTORCH_DEBUG("unit '", unit_.label(), "': gather");
  start_gather();
  auto& flats = unit_.flats();
  auto& owner = unit_.owner();
  try {
    for (auto& f : flats) gather_inputs_.push_back(owner.copies().gather_input(*f));  // under offload, all copies first
    for (auto& f : flats) f->buffer().alloc();  // on the compute stream (offload.h)
    owner.copies().launch_gathers([&] {
      for (size_t i = 0; i < flats.size(); ++i)
        gathers_.push_back(owner.topology().shard_comm().all_gather_async(
            flats[i]->buffer().tensor(), gather_inputs_[i],
            "parameters of unit '" + unit_.label() + "' (" + flats[i]->describe() + ")"));
    });
  } catch (...) {
    // Out of memory, say (prefetch raises the peak), and caught by the user:
    // the unit must go back to sharded, not be taken later for gathered with
    // buffers no collective filled. (If some all-gathers did launch, the
    // ranks are out of step; those are waited for here.)
    free_full();
    throw;
  }
  if (!flats.empty()) owner.mem().unit_gathered();
}

void UnitGather::unshard() {
  if (state_ == ParamState::Unsharded) return;
  unshard_async();  // nothing if a prefetch launched it already
  auto& owner = unit_.owner();
  SHARDTORCH_CHECK(state_ == ParamState::Gathering, detail::rank_prefix(owner.world().global_rank()), ": unit '",
                   unit_.label(), "' asked to gather while ", state_name(state_));
  size_t i = 0;
  try {
    for (; i < gathers_.size(); ++i) owner.topology().shard_comm().wait(gathers_[i]);
  } catch (...) {
    // A failed (timed-out) all-gather: the unit goes back to sharded, so that
    // the cleanup after the error and the next forward do not wait for it again.
    free_full(i + 1, /*failed=*/i);  // the others fail alike: the error in flight says it
    if (unit_.has_params()) owner.mem().unit_released();
    throw;
  }
  gathers_.clear();
  gather_inputs_.clear();
  finish_gather();
  SHARDTORCH_DEBUG("unit '", unit_.label(), "': gathered");
}

void UnitGather::free_full(size_t wait_from, size_t failed) {
  // gathers_[i] fills flats[i]->buffer().tensor(). Memory a collective that failed may
  // still write into is never freed (FullBuffer::free's abandon).
  auto& flats = unit_.flats();
  std::vector<bool> abandon(flats.size(), false);
  if (failed < abandon.size()) abandon[failed] = true;
  for (size_t i = wait_from; i < gathers_.size(); ++i) {
    try {
      unit_.owner().topology().shard_comm().wait(gathers_[i]);  // never free memory a collective still writes
    } catch (const std::exception& e) {
      abandon[i] = true;
      // After another of these failed, or while an error unwinds: that error is on its way to the caller.
      if (failed < abandon.size() || std::uncaught_exceptions() > 0)
        SHARDTORCH_DEBUG("unit '", unit_.label(), "': another all-gather failed too: ", e.what());
      else
        SHARDTORCH_WARN("shardtorch: an all-gather of unit '", unit_.label(),
                        "' that nothing read failed; the ranks may be out of step: ", e.what());
    }
  }
  gathers_.clear();
  gather_inputs_.clear();
  for (size_t i = 0; i < flats.size(); ++i) flats[i]->buffer().free(abandon[i]);
  state_ = ParamState::Sharded;  // from Gathering or Unsharded
}

void UnitGather::reshard() {
  if (state_ == ParamState::Sharded || persistent_ || pins_ > 0) return;
  SHARDTORCH_DEBUG("unit '", unit_.label(), "': free");
  free_full();  // a gather in flight is waited for; nobody reads what it brings
  if (unit_.has_params()) unit_.owner().mem().unit_released();
}

std::string UnitGather::sharded_access_error(const FlatParam& flat) const {
  std::ostringstream os;
  os << detail::rank_prefix(unit_.owner().world().global_rank()) << ": unit '" << unit_.label()
     << "' is sharded, so its parameters (";
  const size_t shown = std::min<size_t>(flat.names().size(), 2);
  for (size_t i = 0; i < shown; ++i) {
    os << (i ? ", '" : "'") << flat.names()[i] << "' " << c10::IntArrayRef(flat.layout().shape(i));
  }
  if (flat.names().size() > shown) os << " and " << flat.names().size() - shown << " more";
  os << ") have no memory outside the unit's forward and backward. Read or change them inside a "
        "shardtorch::FullParams scope (summon_full_params), or get their values from full_parameters()";
  return os.str();
}

void Unit::pre_backward() {
  owner_->summons().refuse_backward("unit", label());
  owner_->world().note_progress("backward", label());
  owner_->backward().ensure_end_of_backward_callback();
  grads_.reach();
  // A unit already final in this backward reads no more of its trainable
  // parameters: an output hook firing after that (an output its parameters
  // did not touch) gathers nothing, whatever other ranks' data did.
  if (!grads_.reduced()) gather_.unshard();
  if (auto next = owner_->order().next_in_backward(*this)) next->gather().unshard_async();
  // None of its gradients will arrive in this backward (a gate routed around
  // its layers on this rank): they are final now.
  // It reshards unless its parameters are still read: trainable ones in the
  // graph (backward(inputs=...) that leaves them out) or frozen ones.
  if (grads_.expected_now_ == 0 && grads_.reduces() && !grads_.reduced() && owner_->backward().reduces())
    reduce_grads(/*reshard_now=*/grads_.in_graph_now_ == 0);
}

void Unit::on_grad_ready(size_t flat, size_t param) {
  owner_->summons().refuse_backward("parameter", flats_[flat]->names()[param]);
  try {
    failure_point("gradient hook");
    owner_->backward().ensure_end_of_backward_callback();
    owner_->backward().check_grad_arrival(flats_[flat]->params()[param], flats_[flat]->names()[param]);
    grads_.reach();
    SHARDTORCH_CHECK(!grads_.reduced(), detail::rank_prefix(owner_->world().global_rank()), ": gradient of '",
                     flats_[flat]->names()[param], "' arrived after unit '", label(),
                     "' had reduced its gradients in this backward (a parameter "
                     "accumulated twice in one backward?)");
    SHARDTORCH_CHECK(gather_.state() == ParamState::Unsharded, detail::rank_prefix(owner_->world().global_rank()),
                     ": gradient of '", flats_[flat]->names()[param], "' arrived while unit '", label(), "' is ",
                     state_name(gather_.state()));
  } catch (...) {
    // Refused: the gradient autograd has just accumulated into param.grad
    // (staged and cleared otherwise) would be added to the next backward's.
    at::Tensor(flats_[flat]->params()[param]).mutable_grad().reset();
    throw;
  }
  flats_[flat]->grads().stage_grad(param);
  if (++grads_.received_grads_ == grads_.expected_now_) reduce_grads();
}

void UnitGrads::expect_from_graph(const std::function<bool(const torch::autograd::Node*)>& runs,
                                  const std::function<bool(const torch::autograd::Node*)>& in_graph) {
  if (checkpointed_) {
    expected_now_ = in_graph_now_ = expected_grads_;
    return;
  }
  auto count = [&](const auto& pred) {
    return static_cast<int>(
        std::count_if(accumulators_.begin(), accumulators_.end(), [&](const auto& acc) { return pred(acc.get()); }));
  };
  expected_now_ = count(runs);
  in_graph_now_ = count(in_graph);
}

bool UnitGrads::needs_final_reduce() const {
  if (reduced() || expected_grads_ == 0) return false;
  if (reached()) return true;
  const auto& flats = unit_.flats();
  return std::any_of(flats.begin(), flats.end(), [](const auto& f) { return f->grads().has_staging_grad(); });
}

void Unit::reduce_grads(bool reshard_now) {
  if (grads_.reduced()) return;
  // A unit the backward did not run reduces what earlier micro-batches staged
  // without its parameters: it stays sharded (a prefetch that gathered it for
  // nothing, the learned order having said it came next, is undone first).
  const bool was_reached = grads_.reached();
  if (!was_reached && gather_.state() == ParamState::Gathering) gather_.reshard();
  const bool idle = !was_reached && gather_.state() == ParamState::Sharded;
  SHARDTORCH_CHECK(gather_.state() == ParamState::Unsharded || idle, detail::rank_prefix(owner_->world().global_rank()),
                   ": unit '", label(), "' reduces its gradients while ", state_name(gather_.state()));
  grads_.finalize();
  // Without sync (accumulation) the staged gradients wait for a synchronising
  // backward, which reduces the units holding some: every rank's unit that
  // took part holds them, zeros where no gradient of it arrived.
  if (!owner_->backward().sync() && was_reached)
    for (auto& f : flats_)
      if (f->requires_grad()) f->grads().staging_grad();
  if (owner_->backward().sync()) {
    owner_->order().issue_reductions();  // this unit, if its turn has come, and those that waited for it
    if (!grads_.issued()) owner_->order().count_deferred_reduction();
  }
  // A unit waiting for its turn holds only its staged gradients. Frozen
  // parameters stay while a backward may read them (pre_forward).
  if (reshard_now && (!forwards_.has_frozen() || forwards_.frozen_unread())) gather_.reshard();
}

void Unit::issue_reduction() {
  grads_.issue();
  // A reduction that throws (a timed-out collective) leaves the parameters
  // where they were: the failed backward's cleanup releases the unit.
  for (auto& f : flats_)
    if (f->requires_grad()) owner_->path().sharded().reduce(*f, label());
}

namespace {
// Runs after a parameter's gradient has been accumulated into param.grad.
class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(std::weak_ptr<Unit> unit, size_t flat, size_t param)
      : unit_(std::move(unit)), flat_(flat), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    auto u = unit_.lock();
    if (!u) return outputs;
    try {
      u->on_grad_ready(flat_, param_);
    } catch (...) {
      rethrow_naming(u->owner().world(), [&] {
        return "the gradient hook of parameter '" + u->flats()[flat_]->names()[param_] + "' of unit '" + u->label() +
               "'";
      });
    }
    return outputs;
  }

 private:
  std::weak_ptr<Unit> unit_;
  size_t flat_, param_;
};
}  // namespace

void Unit::register_grad_hooks() {
  for (size_t f = 0; f < flats_.size(); ++f) {
    if (!flats_[f]->requires_grad()) continue;
    const auto& params = flats_[f]->params();
    for (size_t i = 0; i < params.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(params[i]);
      SHARDTORCH_CHECK(acc, detail::rank_prefix(owner_->world().global_rank()), ": unit '", label(), "': parameter '",
                       flats_[f]->names()[i], "' has no gradient accumulator (is it a view or a non-leaf tensor?)");
      acc->add_post_hook(std::make_unique<GradReadyHook>(weak_from_this(), f, i));
      grads_.accumulators_.push_back(std::move(acc));  // the parameter holds it only weakly
      ++grads_.expected_grads_;
    }
  }
  forwards_.has_frozen_ = std::any_of(flats_.begin(), flats_.end(), [](const auto& f) { return !f->requires_grad(); });
}

}  // namespace shardtorch::detail
