// UnitBase: what every Sharded<Impl> runs around its forward, and its zero_grad.
#include <c10/core/GradMode.h>
#include <c10/util/Type.h>

#include <algorithm>
#include <exception>
#include <vector>

#include "base/log.h"
#include "base/check.h"
#include "runtime/shard_state.h"

namespace shardtorch {

namespace {
// The units whose forward runs on this thread, innermost last: pushed before
// a unit's pre-forward, popped when its post-forward has run or its forward
// failed.
thread_local std::vector<detail::Unit*> t_running;
}  // namespace

UnitBase::~UnitBase() = default;

void UnitBase::before_forward(const std::vector<at::Tensor>& inputs) {
  t_running.push_back(unit_.get());
  unit_->pre_forward(inputs);
}

void UnitBase::check_part_of_the_model(const char* impl_type) const {
  if (t_running.empty() || !no_shard_state_.expired()) return;  // no sharded forward here, or NoShard's module
  // A frozen module kept out of the model on purpose (a teacher, a frozen
  // encoder) computes the same on every rank: nothing is lost.
  const auto* self = dynamic_cast<const torch::nn::Module*>(this);
  bool trains = false;
  if (self != nullptr)
    for (const auto& p : self->parameters()) trains = trains || p.requires_grad();
  if (!trains) return;
  detail::Unit& in = *t_running.back();
  SHARDTORCH_CHECK(false, detail::rank_prefix(in.owner().world().global_rank()), ": a module of type ",
                   c10::demangle(impl_type), " declared shardtorch::Sharded, with trainable parameters, ran inside ",
                   "the forward of unit '", in.label(),
                   "' of a sharded model but is not part of that model: shard() never saw it (it is not registered, "
                   "or it was put in place after shard()), so its parameters would be neither reduced across ranks "
                   "nor trained. Register it in its parent before shard() (register_module); for a model of its "
                   "own, shard() that model too, or freeze it");
}

void UnitBase::forward_failed() noexcept {
  // after_forward may have popped this unit already (a failure after it).
  if (!t_running.empty() && t_running.back() == unit_.get()) t_running.pop_back();
  try {
    unit_->abandon_forward();
  } catch (const std::exception& e) {  // runs while the forward's exception unwinds: warn, never throw
    SHARDTORCH_WARN("shardtorch: unit '", unit_->label(),
                    "' could not be resharded after its forward failed: ", e.what());
  } catch (...) {
    SHARDTORCH_WARN("shardtorch: unit '", unit_->label(),
                    "' could not be resharded after its forward failed (an exception of unknown type)");
  }
}

void UnitBase::zero_shard_grads(torch::nn::Module& self) {
  // Module::zero_grad calls the zero_grad of every module inside, so each
  // unit clears its own flats. Under NoShard the gradients are the
  // parameters' own (bucket views) except where the buckets hold another
  // dtype (mixed precision); either way the slices keep their values until
  // cleared: each module clears those of its parameters, the root every
  // bucket (and the masters' gradients), as the optimizer's zero_grad does.
  auto state = unit_ ? unit_->owner().shared_from_this() : no_shard_state_.lock();
  if (!state) return;                         // not sharded yet
  if (state->path().replicated() && unit_) {  // NoShard's root unit (the only unit NoShard makes)
    state->optimizer().zero_grads();
    return;
  }
  state->optimizer().on_zero_grad();
  // The root's zero_grad clears every gradient (a unit's, only its own).
  if (unit_ && unit_->is_root()) state->optimizer().all_gradients_cleared();
  if (unit_)
    for (auto& f : unit_->flats()) f->grads().zero_grad();
  else if (auto* replicated = state->path().replicated())
    replicated->bucketer().zero_grads_of(self.parameters());  // plain modules inside have no hook of their own
}

bool UnitBase::after_forward(std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs) {
  // An input returned as it is (a gate routing around the unit on this rank)
  // would carry the hook of the unit that made it, and this unit's hook
  // would fire after that one's on this rank only: the two units' backward
  // all-gathers would swap places. A leaf returned as it is (a parameter)
  // would collect one more hook at every forward (and, under FullShard, lose
  // its memory when the unit reshards). A copy gives this unit a node of its
  // own; not a view, whose node an in-place change of the output would drop
  // from the graph, hook and all (checkpointed units copy such outputs too).
  bool replaced = false;
  if (c10::GradMode::is_enabled()) {
    for (auto& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      auto same = [&](const at::Tensor& in) {
        return in.defined() && in.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
      };
      if (t.is_leaf() || std::any_of(inputs.begin(), inputs.end(), same)) {
        t = t.clone();
        replaced = true;
      }
    }
  }
  unit_->post_forward(outputs);
  t_running.pop_back();
  return replaced;
}

std::optional<at::ScalarType> UnitBase::input_dtype() const {
  const auto& mp = unit_->owner().options().mixed_precision();
  if (!unit_->is_root() || !mp.cast_root_inputs()) return std::nullopt;
  return mp.param_dtype();
}

std::optional<at::ScalarType> UnitBase::output_dtype() const {
  return unit_->is_root() ? unit_->owner().options().mixed_precision().output_dtype() : std::nullopt;
}

}  // namespace shardtorch
