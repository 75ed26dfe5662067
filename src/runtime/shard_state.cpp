// A sharded model's runtime state and its small parts: the summon_full_params
// scopes, the units' gathers taken together, the model as its optimizers see it.
#include "runtime/shard_state.h"
#include "base/check.h"

#include <c10/core/GradMode.h>

namespace shardtorch::detail {

ShardState::ShardState(std::shared_ptr<World> world, ShardOptions options)
    : options_(std::move(options)),
      topology_(std::move(world)),
      units_(topology_.world().global_rank()),
      path_(topology_, options_.strategy(), copies_, options_.bucket_mb(), &mem_),
      order_(options_, backward_, units_),
      backward_(*this),
      copies_(topology_.world(), units_),
      summons_(topology_.world()),
      gathers_(units_, topology_, copies_),
      optimizer_(*this) {}

ReplicatedPath& ShardState::enable_replicated() {
  return path_.set_replicated(std::make_unique<ReplicatedPath>(topology_.world(), mem_, options_, weak_from_this()));
}

void UnitGathers::release_held() {
  for (auto& u : units_.live()) u->gather().release();  // nothing for a unit not held
}

void UnitGathers::gather_for_step() {
  if (step_gather_) return;
  auto all = units_.all();
  size_t pinned = 0;
  try {
    for (auto& u : all) u->gather().unshard_async();  // every all-gather in flight, then each waited for
    for (; pinned < all.size(); ++pinned) {
      all[pinned]->gather().unshard();
      all[pinned]->gather().pin();
    }
  } catch (...) {
    for (size_t i = 0; i < pinned; ++i) all[i]->gather().unpin();
    for (auto& u : all) u->gather().reshard();
    throw;
  }
  step_gather_ = true;
}

void UnitGathers::release_step_gather() {
  if (!step_gather_) return;
  step_gather_ = false;
  for (auto& u : units_.live()) {
    u->gather().unpin();
    u->gather().reshard();
  }
}

void SummonScopes::refuse_backward(const char* kind, const std::string& name) const {
  // The scope set param.grad to the reduced gradients: this backward would
  // add its own to them, and reduce both into gradients that already hold the
  // first (counted twice). Every rank is in the scope, so every rank refuses;
  // called first in every hook of a backward, before anything is queued or
  // gathered, so the refused backward leaves nothing to clean up.
  SHARDTORCH_CHECK(
      grad_summons_ == 0, detail::rank_prefix(world_.global_rank()), ": a backward reached ", kind, " '", name,
      "' inside a summon_full_params(with_grads) scope, whose param.grad are the reduced gradients (a "
      "backward would count them twice); leave the scope before the backward, or summon without with_grads");
}

void SummonScopes::check_outside() const {
  // Symmetric: every rank holds a FullParams for the scope, kept or not.
  SHARDTORCH_CHECK(summons_ == 0, detail::rank_prefix(world_.global_rank()),
                   ": an optimizer step or a checkpoint load inside a "
                   "summon_full_params scope: the scope's full parameters would be stale (and written back over the "
                   "new values on exit); leave the scope first");
}

void UnitGathers::regather(Unit& u, FlatParam& f, const std::string& what) {
  at::Tensor mine = copies_.gather_input(f);
  if (auto* off = copies_.offloader()) off->current_waits_for_copies();  // gathered on the compute stream
  topology_.shard_comm().all_gather_into(f.buffer().tensor(), mine, what + " of unit '" + u.label() + "'");
}

void UnitGathers::regather_unsharded() {
  c10::NoGradGuard no_grad;
  for (auto& u : units_.all())
    if (u->gather().state() == ParamState::Unsharded)
      for (auto& f : u->flats()) regather(*u, *f, "parameters after summon_full_params");
}

void OptimizerSide::on_zero_grad() {
  if (auto* replicated = model_.path().replicated()) replicated->on_zero_grad();
  BackwardTracker& backward = model_.backward();
  backward.recover_if_failed();  // reductions of a failed backward land before the zeroing
  backward.on_zero_grad();
  backward.gradients_changed();
  if (!backward.running()) model_.order().on_zero_grad();
  for (auto& [id, f] : listeners_) f();
}

void OptimizerSide::zero_grads() {
  on_zero_grad();
  reduced_since_zero_grad_ = false;
  if (auto* replicated = model_.path().replicated()) {
    replicated->zero_grads();
    return;
  }
  for (auto& u : model_.units().all())
    for (auto& f : u->flats()) f->grads().zero_grad();
}

void OptimizerSide::backward_reduced() {
  reduced_since_zero_grad_ = true;
  if (optimizers_built_ > 0 || warned_no_optimizer_) return;
  warned_no_optimizer_ = true;
  SHARDTORCH_WARN(detail::rank_prefix(model_.world().global_rank()),
                  ": a backward reduced the model's gradients and no shardtorch optimizer was built over the model. "
                  "A torch::optim optimizer over model->parameters() does not train a model after shard(): ",
                  model_.path().replicated()
                      ? "under NoShard their gradients are views of the reduction buckets, which torch::optim's "
                        "zero_grad cannot detach (\"Can't detach views in-place\"), and under mixed precision the "
                        "fp32 masters it should step are not those parameters"
                      : "their gradients go to the flat shards, not to those parameters, so its step changes nothing",
                  ". Build the optimizer over the model: shardtorch::AdamW(*model, options) (or Adam, SGD, "
                  "ShardedOptimizer::make<...>). If only the gradients are wanted, ignore this");
}

void OptimizerSide::check_requires_grad_unchanged() const {
  // Flat parameters, hooks and the optimizer's pieces were fixed by shard():
  // a parameter unfrozen since would never have its gradient reduced nor be
  // stepped, and one frozen since would still be stepped. Said, not silent.
  auto check = [&](const at::Tensor& p, bool was, const std::string& name) {
    SHARDTORCH_CHECK(p.requires_grad() == was, detail::rank_prefix(model_.world().global_rank()), ": parameter '", name,
                     "' was ", was ? "trainable" : "frozen", " at shard() and is ", was ? "frozen" : "trainable",
                     " now; which parameters train is fixed when the model is sharded (its flat parameters, gradient "
                     "hooks and optimizer pieces follow it). Set requires_grad before shard(), or shard a new model "
                     "(load_full_state_dict carries the weights) to change it");
  };
  if (const auto* replicated = model_.path().replicated())
    for (size_t i = 0; i < replicated->params().size(); ++i)
      check(replicated->params()[i], true, replicated->names()[i]);
  for (const auto& u : model_.units().live()) {
    for (const auto& f : u->flats())
      for (size_t i = 0; i < f->params().size(); ++i) check(f->params()[i], f->requires_grad(), f->names()[i]);
  }
}

void OptimizerSide::after_optimizer_step() {
  model_.world().note_step_done();
  after_shards_replaced();
}

void OptimizerSide::after_shards_replaced() {
  model_.summons().check_outside();
  UnitGathers& gathers = model_.gathers();
  gathers.release_held();  // the step makes the full copies a graph-building backward held stale
  if (auto* replicated = model_.path().replicated()) {
    replicated->after_optimizer_step();
    return;
  }
  for (auto& u : model_.units().all()) {
    for (auto& f : u->flats())
      if (f->buffer().persistent()) gathers.regather(*u, *f, "updated parameters");
    u->gather().reshard();  // non-persistent full copies are stale now
  }
}

std::vector<at::Tensor> OptimizerSide::local_gradients(bool& partial) {
  model_.backward().check_finished("reading the gradients (clip_grad_norm, GradScaler)");
  const auto* listener = model_.copies().gradient_listener();
  SHARDTORCH_CHECK(
      !listener || !listener->any_stepped(), detail::rank_prefix(model_.world().global_rank()),
      ": clip_grad_norm or "
      "GradScaler after a backward during which the optimizer already stepped (overlap_with_backward): the "
      "update used the unclipped, unscaled gradients. Turn the overlap off to clip or scale gradients");
  // The strategy is the same everywhere: decide on it, not on what this rank
  // happens to hold, so that every rank communicates or none does.
  const Strategy strategy = model_.options().strategy();
  partial = strategy != Strategy::NoShard && strategy != Strategy::OptimizerOnly;
  std::vector<at::Tensor> grads;
  if (auto* replicated = model_.path().replicated()) {
    for (const auto& p : replicated->optimized())
      if (p.grad().defined()) grads.push_back(p.grad());
    return grads;
  }
  for (auto& u : model_.units().all()) {
    for (auto& f : u->flats()) {
      if (f->grads().full_grad().defined()) {
        grads.push_back(f->grads().full_grad());  // OptimizerOnly: whole and identical on every rank
      } else if (f->grads().shard_grad().defined()) {
        grads.push_back(f->grads().shard_grad());
      }
    }
  }
  return grads;
}

}  // namespace shardtorch::detail
