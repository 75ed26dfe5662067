#include "shardtorch/optim.h"
#include "base/check.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <mutex>
#include <unordered_set>

#include "base/log.h"
#include "comm/world_access.h"
#include "runtime/flat_param.h"
#include "runtime/shard_state.h"
#include "shardtorch/optim/cpu_adam.h"

namespace shardtorch {
namespace detail {

ShardViews::ShardViews(torch::nn::Module& root) : state_(require_state(root, "cannot build a sharded optimizer")) {
  SHARDTORCH_CHECK(state_->options().mixed_precision().param_dtype() != at::kHalf || state_->optimizer().has_scaler(),
                   rank_prefix(state_->world().global_rank()),
                   ": fp16 mixed precision needs a loss scaler: construct a shardtorch::GradScaler for this "
                   "model before its optimizer, and step through scaler.step(*opt)");
  state_->optimizer().optimizer_built();
  if (state_->path().replicated()) {  // NoShard: the optimizer runs over the parameters themselves
    const auto& params = state_->path().replicated()->params();
    const auto& optimized = state_->path().replicated()->optimized();
    for (size_t i = 0; i < params.size(); ++i) {
      by_param_.emplace_back(params[i].unsafeGetTensorImpl(), std::vector<size_t>{pieces_.size()});
      param_names_.push_back(state_->path().replicated()->names()[i]);
      trainable_.push_back(params[i].unsafeGetTensorImpl());
      pieces_.push_back({optimized[i], nullptr, 0, optimized[i].numel(), state_->path().replicated()->names()[i], 0});
    }
    return;
  }
  const int rank = state_->topology().shard_comm().rank();
  for (auto& u : state_->units().all()) {
    for (auto& f : u->flats()) {
      for (size_t i = 0; i < f->params().size(); ++i) {
        const void* key = f->params()[i].unsafeGetTensorImpl();
        std::vector<size_t> idx;
        if (f->requires_grad()) {
          if (auto piece = f->layout().piece(i, rank)) {
            idx.push_back(pieces_.size());
            pieces_.push_back({f->shard().narrow(0, piece->shard_offset, piece->length), f.get(), piece->shard_offset,
                               piece->length, f->names()[i], piece->param_offset});
          }
        }
        by_param_.emplace_back(key, std::move(idx));
        param_names_.push_back(f->names()[i]);
        if (f->requires_grad()) trainable_.push_back(key);
      }
    }
  }
  // Module::zero_grad reaches the flats, not these views: without this their
  // gradients would keep the dropped shards' memory alive until the next step.
  listener_ = state_->optimizer().add_zero_grad_listener([this] {
    for (auto& piece : pieces_) piece.view.mutable_grad().reset();
  });
}

std::vector<at::Tensor> ShardViews::take(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) {
    const void* key = p.unsafeGetTensorImpl();
    auto it = std::find_if(by_param_.begin(), by_param_.end(), [&](const auto& e) { return e.first == key; });
    if (it == by_param_.end() && !p.requires_grad()) continue;  // frozen: nothing to optimize
    SHARDTORCH_CHECK(it != by_param_.end(), "shardtorch optimizer: rank ", state_->world().global_rank(),
                     ": a tensor of shape ", p.sizes(),
                     " given in a parameter group is not a parameter of the sharded model");
    SHARDTORCH_CHECK(std::find(asked_.begin(), asked_.end(), key) == asked_.end(), "shardtorch optimizer: rank ",
                     state_->world().global_rank(), ": parameter '", param_names_[it - by_param_.begin()], "' ",
                     p.sizes(), " is given twice (in two parameter groups, or twice in one)");
    asked_.push_back(key);
    for (size_t i : it->second) {
      pieces_[i].taken = true;
      out.push_back(pieces_[i].view);
    }
  }
  return out;
}

bool ShardViews::rest_exists() const {
  return std::any_of(trainable_.begin(), trainable_.end(),
                     [&](const void* k) { return std::find(asked_.begin(), asked_.end(), k) == asked_.end(); });
}

std::vector<at::Tensor> ShardViews::take_rest() {
  std::vector<at::Tensor> out;
  for (auto& piece : pieces_) {
    if (piece.taken) continue;
    piece.taken = true;
    out.push_back(piece.view);
  }
  return out;
}

void ShardViews::bind_grads() {
  state_->summons().check_outside();  // before the step changes anything: the scope would write it over
  state_->backward().check_finished("an optimizer step");
  if (!state_->backward().sync())
    SHARDTORCH_WARN_ONCE(rank_prefix(state_->world().global_rank()),
                         ": an optimizer step while gradient synchronisation is off (inside no_sync(), or after "
                         "set_requires_gradient_sync(false)): the gradients accumulated since are not reduced yet "
                         "and the step does not use them; end the no_sync() scope before the last micro-batch's "
                         "backward, which reduces them, and step after it");
  else if (!state_->optimizer().reduced_since_zero_grad())
    SHARDTORCH_WARN_ONCE(rank_prefix(state_->world().global_rank()),
                         ": an optimizer step with no backward since zero_grad() (or since shard()): no backward's "
                         "gradient reached the optimizer. Under the sharded strategies the step changes nothing; "
                         "under NoShard it steps on zeros, so momentum and weight decay still move the parameters. "
                         "Step after the backward");
  state_->optimizer().check_requires_grad_unchanged();
  // The step writes host master shards that a prefetch's copy to the device
  // may still read (a unit backward never reached).
  state_->copies().wait_for_offload_copies(/*step=*/true);
  state_->optimizer().before_update();
  // An optimizer that does not write the masters' bf16 copies may write the
  // masters through raw pointers, which their version counters do not show:
  // stale from here, even if its step throws half-way.
  if (!low_copies_written_) state_->copies().low_copies_stale();
  if (state_->path().replicated()) {
    state_->path().replicated()->bucketer().bind_grads();  // master grads were bound at the end of backward
    return;
  }
  for (auto& piece : pieces_) {
    auto* f = static_cast<FlatParam*>(piece.flat);
    if (f->grads().shard_grad().defined()) {
      piece.view.mutable_grad() = f->grads().shard_grad().narrow(0, piece.shard_offset, piece.length);
    } else {
      piece.view.mutable_grad().reset();
    }
  }
}

void ShardViews::zero_grad() { state_->optimizer().zero_grads(); }

namespace {
// Calls fn(tensor, name) for each tensor the optimizer updates, one per
// trainable flat parameter (named by its first parameter) or NoShard
// parameter: from what every rank holds, not from this rank's pieces.
template <class Fn>
void for_each_optimized(ShardState& state, Fn fn) {
  if (state.path().replicated()) {
    const detail::ReplicatedPath& r = *state.path().replicated();
    for (size_t i = 0; i < r.params().size(); ++i) fn(r.optimized()[i], r.names()[i]);
    return;
  }
  for (auto& u : state.units().all())
    for (auto& f : u->flats())
      if (f->requires_grad() && !f->names().empty()) fn(f->shard(), f->names().front());
}

// Whether every optimized tensor is an fp32 CUDA tensor (and there is one).
bool all_fp32_cuda(ShardState& state) {
  bool any = false, all = true;
  for_each_optimized(state, [&](const at::Tensor& t, const std::string&) {
    any = true;
    all = all && t.scalar_type() == at::kFloat && t.is_cuda();
  });
  return any && all;
}
}  // namespace

void ShardViews::require_fp32_cpu(const std::string& who) const {
  for_each_optimized(*state_, [&](const at::Tensor& t, const std::string& name) {
    SHARDTORCH_CHECK(
        t.scalar_type() == at::kFloat && (t.device().is_cpu() || (t.is_cuda() && fused_adam_cuda_available())), who,
        ": rank ", state_->world().global_rank(), ": parameter '", name, "' is optimized as a ", t.scalar_type(),
        " tensor on ", t.device(),
        "; it updates fp32 tensors (fp32 parameters or masters) in "
        "host memory, or on a CUDA device in a build with CUDA kernels (fused_adam_cuda_available() is ",
        fused_adam_cuda_available() ? "true" : "false",
        " here). Use torch::optim::Adam(W) through "
        "shardtorch::Adam(W) otherwise");
  });
}

// ShardedOptimizer::overlap_with_backward: steps each flat parameter's pieces
// on the offload thread as soon as its gradient reached its host shard.
class StepInBackward final : public GradientListener {
 public:
  StepInBackward(ShardViews& views, ShardState& state, PartialStepper& stepper)
      : views_(views), state_(state), stepper_(stepper) {}

  void before(FlatParam& flat) override {
    std::lock_guard<std::mutex> lock(mu_);
    SHARDTORCH_CHECK(!stepped_.count(&flat), detail::rank_prefix(state_.world().global_rank()), ": the gradient of ",
                     flat.describe(),
                     " was reduced again before opt->step(), and the optimizer already stepped with the "
                     "first (overlap_with_backward): call step() after every backward that synchronizes gradients, and "
                     "accumulate micro-batches with set_requires_gradient_sync(false)");
    if (!window_open_) {
      stepper_.check_step();  // what step() would refuse, before anything changes
      state_.optimizer().before_update();
    }
    window_open_ = true;
  }

  void arrived(FlatParam& flat) override {
    std::vector<at::Tensor> params;
    for (const auto& piece : views_.pieces()) {
      if (piece.flat != &flat || !piece.taken || !flat.grads().shard_grad().defined()) continue;
      at::Tensor view = piece.view;
      view.mutable_grad() = flat.grads().shard_grad().narrow(0, piece.shard_offset, piece.length);
      params.push_back(view);
    }
    stepper_.step_params(params);
    std::lock_guard<std::mutex> lock(mu_);
    stepped_.insert(&flat);
  }

  bool consume(FlatParam& flat, const at::Tensor& host, double divisor) override {
    std::vector<at::Tensor> params, grads;
    for (const auto& piece : views_.pieces()) {
      if (piece.flat != &flat) continue;
      if (!piece.taken) return false;  // a parameter outside the optimizer keeps its gradient
      params.push_back(piece.view);
      grads.push_back(host.narrow(0, piece.shard_offset, piece.length));
    }
    if (!stepper_.step_params_with(params, grads, divisor)) return false;
    std::lock_guard<std::mutex> lock(mu_);
    stepped_.insert(&flat);
    return true;
  }

  bool stepped(const FlatParam& flat) const override {
    std::lock_guard<std::mutex> lock(mu_);
    return stepped_.count(&flat) > 0;
  }
  bool any_stepped() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return !stepped_.empty();
  }

  PartialStepper& stepper() { return stepper_; }
  /// The pieces the backward did not step; the step is over.
  std::vector<at::Tensor> finish() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<at::Tensor> rest;
    for (const auto& piece : views_.pieces())
      if (piece.taken && !stepped_.count(static_cast<const FlatParam*>(piece.flat))) rest.push_back(piece.view);
    stepped_.clear();
    window_open_ = false;
    return rest;
  }

 private:
  ShardViews& views_;
  ShardState& state_;
  PartialStepper& stepper_;
  mutable std::mutex mu_;
  std::unordered_set<const FlatParam*> stepped_;  // since the last step()
  bool window_open_ = false;                      // a gradient arrived since the last step()
};

ShardViews::~ShardViews() {
  if (overlap_) state_->copies().set_gradient_listener(nullptr);
  if (listener_ >= 0) state_->optimizer().remove_zero_grad_listener(listener_);
}

void ShardViews::overlap_with_backward(torch::optim::Optimizer& opt, bool on) {
  const int rank = state_->world().global_rank();
  if (!on) {
    SHARDTORCH_CHECK(!overlap_ || !overlap_->any_stepped(), detail::rank_prefix(rank),
                     ": overlap_with_backward(false) "
                     "between a backward that stepped and opt->step(): call step() first");
    if (overlap_) state_->copies().set_gradient_listener(nullptr);
    overlap_.reset();
    return;
  }
  auto* stepper = dynamic_cast<PartialStepper*>(&opt);
  SHARDTORCH_CHECK(
      stepper, detail::rank_prefix(rank),
      ": overlap_with_backward needs an optimizer that can step part of "
      "its parameters: shardtorch::FusedAdam or FusedAdamW (ShardedOptimizer::make<shardtorch::FusedAdamW>)");
  SHARDTORCH_CHECK(state_->copies().offloader() && !state_->path().replicated(), detail::rank_prefix(rank),
                   ": overlap_with_backward overlaps "
                   "the host's optimizer step with the device's backward: it needs ShardOptions().cpu_offload(true) "
                   "(without offload the update runs on the device after backward)");
  SHARDTORCH_CHECK(!state_->optimizer().has_scaler(), detail::rank_prefix(rank),
                   ": overlap_with_backward cannot be used with a "
                   "GradScaler, which must see every gradient before any update");
  if (overlap_) return;
  overlap_ = std::make_unique<StepInBackward>(*this, *state_, *stepper);
  state_->copies().set_gradient_listener(overlap_.get());
}

bool ShardViews::step_rest() {
  if (!overlap_) return false;
  overlap_->stepper().check_step();
  overlap_->stepper().step_params(overlap_->finish());
  return true;
}

void ShardViews::attach_low_copies(torch::optim::Optimizer& opt) {
  auto* writer = dynamic_cast<LowCopyWriter*>(&opt);
  low_copies_written_ = writer != nullptr;
  if (!writer) return;
  for (const auto& piece : pieces_) {
    auto* f = static_cast<FlatParam*>(piece.flat);
    if (piece.taken && f && f->host().low_copy().defined())
      writer->write_low_copy(piece.view, f->host().low_copy().narrow(0, piece.shard_offset, piece.length));
  }
}

void ShardViews::after_step(const torch::optim::Optimizer& opt) {
  // An optimizer that left the bf16 copies alone: they are made again now,
  // while no copy to the device reads them (bind_grads waited), rather than
  // at each unit's next gather, which would first wait for the copies then.
  if (!low_copies_written_) state_->copies().remake_low_copies();
  state_->optimizer().after_optimizer_step();
  detail::WorldAccess::end_setup(state_->world());  // the set-up that World::rejoin() answers with ends here
  state_->buffers().broadcast_after_step(state_->world());
  count_optimizer_state(opt);
}

void ShardViews::count_optimizer_state(const torch::optim::Optimizer& opt) const {
  int64_t bytes = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) bytes += t.nbytes();
  };
  for (const auto& [key, st] : opt.state()) {
    if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(st.get())) {
      add(a->exp_avg()), add(a->exp_avg_sq()), add(a->max_exp_avg_sq());
    } else if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(st.get())) {
      add(w->exp_avg()), add(w->exp_avg_sq()), add(w->max_exp_avg_sq());
    } else if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(st.get())) {
      add(s->momentum_buffer());
    }
  }
  state_->mem().set(state_->copies().offloader() ? Mem::HostOptimizerState : Mem::OptimizerState, bytes);
}

}  // namespace detail

void ShardedOptimizer::step() {
  views_->bind_grads();
  if (!views_->step_rest()) inner_->step();
  views_->after_step(*inner_);
}

void ShardedOptimizer::overlap_with_backward(bool on) { views_->overlap_with_backward(*inner_, on); }

void ShardedOptimizer::zero_grad() { views_->zero_grad(); }

double ShardedOptimizer::lr(size_t group) const {
  SHARDTORCH_CHECK(group < inner_->param_groups().size(), "shardtorch optimizer: no parameter group ", group);
  return inner_->param_groups()[group].options().get_lr();
}

void ShardedOptimizer::set_lr(double lr) {
  for (auto& g : inner_->param_groups()) g.options().set_lr(lr);
}

void ShardedOptimizer::set_lr(size_t group, double lr) {
  SHARDTORCH_CHECK(group < inner_->param_groups().size(), "shardtorch optimizer: no parameter group ", group);
  inner_->param_groups()[group].options().set_lr(lr);
}

namespace {
template <class Options>
bool fused_cuda_fits(torch::nn::Module& root, const Options& defaults, const std::vector<ParamGroup<Options>>& groups) {
  if (!fused_adam_cuda_available() || defaults.amsgrad()) return false;
  for (const auto& g : groups)
    if (g.options.amsgrad()) return false;
  return detail::all_fp32_cuda(*detail::require_state(root, "cannot build a sharded optimizer"));
}
}  // namespace

std::unique_ptr<ShardedOptimizer> Adam(torch::nn::Module& root, torch::optim::AdamOptions defaults,
                                       std::vector<ParamGroup<torch::optim::AdamOptions>> groups) {
  if (fused_cuda_fits(root, defaults, groups))
    return ShardedOptimizer::make<FusedAdam>(root, defaults, std::move(groups));
  return ShardedOptimizer::make<torch::optim::Adam>(root, defaults, std::move(groups));
}

std::unique_ptr<ShardedOptimizer> AdamW(torch::nn::Module& root, torch::optim::AdamWOptions defaults,
                                        std::vector<ParamGroup<torch::optim::AdamWOptions>> groups) {
  if (fused_cuda_fits(root, defaults, groups))
    return ShardedOptimizer::make<FusedAdamW>(root, defaults, std::move(groups));
  return ShardedOptimizer::make<torch::optim::AdamW>(root, defaults, std::move(groups));
}

}  // namespace shardtorch
