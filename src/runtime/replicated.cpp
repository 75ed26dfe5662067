#include "runtime/replicated.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function_hook.h>

#include "base/errors.h"
#include "comm/world_access.h"
#include "base/log.h"
#include "runtime/shard_state.h"

namespace shardtorch::detail {

void ReplicatedPath::finish_backward(bool sync) {
  if (sync) check_hooks_agree(world_);  // a backward in which no gradient hook ran
  ddp_->finish(sync, options_.error_on_unused_parameters());
  if (sync) masters_.bind_grads(*ddp_);
}

void ReplicatedMasters::bind_grads(const AllReduceBucketer& ddp) {
  c10::NoGradGuard no_grad;
  int64_t converted = 0;  // fp32 copies of gradients reduced in a lower dtype
  for (size_t i = 0; i < masters_.size(); ++i) {
    if (ddp.missing().absent(i)) {  // no rank gave it a gradient: none, as the parameter's (the optimizer skips it)
      masters_[i].mutable_grad().reset();
      continue;
    }
    at::Tensor g = ddp.grad_view(i);
    if (!grad_is_copied(ddp, i)) {
      masters_[i].mutable_grad() = g;
    } else {
      masters_[i].mutable_grad() = g.to(masters_[i].scalar_type());
      converted += masters_[i].grad().nbytes();
    }
  }
  mem_.add(Mem::MasterGrads, converted - grad_bytes_);
  grad_bytes_ = converted;
}

void ReplicatedMasters::release_grads(const AllReduceBucketer& ddp, bool converted_only) {
  for (size_t i = 0; i < masters_.size(); ++i)
    if (!converted_only || grad_is_copied(ddp, i)) at::Tensor(masters_[i]).mutable_grad().reset();  // a handle
  mem_.sub(Mem::MasterGrads, grad_bytes_);
  grad_bytes_ = 0;
}

void ReplicatedPath::after_optimizer_step() {
  stepped_since_zero_ = true;
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < masters_.all().size(); ++i) params_[i].copy_(masters_.all()[i]);
  // The step has read the fp32 copies; views of fp32 buckets stay until
  // zero_grad, like the parameters' own gradients.
  masters_.release_grads(*ddp_, /*converted_only=*/true);
}

void ReplicatedPath::zero_grads() {  // gradients stay views of the buckets
  ddp_->zero_grads();
  masters_.release_grads(*ddp_);
}

void ReplicatedPath::note_gradient(size_t i) {
  if (!stepped_since_zero_) return;
  stepped_since_zero_ = false;  // once per step at most
  if (warned_unzeroed_ || ddp_->grad_view(i).scalar_type() == params_[i].scalar_type()) return;
  warned_unzeroed_ = true;
  // LibTorch's Module::zero_grad reaches our buckets only through a unit (the
  // root, if it is one); with fp32 buckets of bf16 gradients the parameters
  // hold no gradient it could clear.
  SHARDTORCH_WARN(
      "shardtorch (NoShard): a backward after an optimizer step with no zero_grad "
      "that reached the gradient buckets since: their ",
      ddp_->grad_view(i).scalar_type(),
      " gradients are not "
      "the parameters' own (",
      params_[i].scalar_type(),
      "), so this step's gradients add to the last "
      "step's. LibTorch's model->zero_grad() reaches them only through a unit; call opt->zero_grad(), or make "
      "the root a unit (SHARDTORCH_MODULE). If you accumulate across steps on purpose, ignore this.");
}

void ReplicatedPath::on_zero_grad() { stepped_since_zero_ = false; }

namespace {
class DdpGradHook : public torch::autograd::FunctionPostHook {
 public:
  DdpGradHook(std::weak_ptr<ShardState> state, size_t index) : state_(std::move(state)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    auto s = state_.lock();
    if (!s) return outputs;
    ReplicatedPath& r = *s->path().replicated();
    try {
      s->summons().refuse_backward("parameter", r.names()[index_]);
      failure_point("NoShard gradient hook");
      s->backward().ensure_end_of_backward_callback();
      s->backward().check_grad_arrival(r.params()[index_], r.names()[index_]);
      r.note_gradient(index_);
      if (s->backward().sync()) r.check_hooks_agree(s->world());  // before the first bucket can launch
      r.bucketer().mark_ready(index_, s->backward().sync());
    } catch (...) {
      rethrow_naming(s->world(),
                     [&] { return "the gradient hook of parameter '" + r.names()[index_] + "' (NoShard)"; });
    }
    return outputs;
  }

 private:
  std::weak_ptr<ShardState> state_;
  size_t index_;
};
}  // namespace

void ReplicatedMasters::add_frozen(const at::Tensor& param, at::Tensor master) {
  mem_.add(Mem::ReplicatedParams, master.nbytes());
  master_of_[param.unsafeGetTensorImpl()] = std::move(master);
}

void ReplicatedMasters::add(const at::Tensor& param) {
  masters_.push_back(param.detach().clone());
  master_of_[param.unsafeGetTensorImpl()] = masters_.back();
  mem_.add(Mem::ReplicatedParams, masters_.back().nbytes());
}

void ReplicatedPath::enable(std::vector<at::Tensor> params, std::vector<std::string> names,
                            const std::unordered_set<const void*>& keep) {
  params_ = params;
  names_ = names;
  const auto& options = options_;
  const auto& mp = options.mixed_precision();
  MemoryTracker& mem = mem_;
  if (mp.param_dtype()) {  // fp32 masters for the optimizer; the parameters compute in param_dtype
    c10::NoGradGuard no_grad;
    for (auto& p : params_) {
      masters_.add(p);
      if (!keep.count(p.unsafeGetTensorImpl()))
        p.set_data(p.detach().to(*mp.param_dtype()));  // before the accumulators exist (below)
    }
  }
  for (const auto& p : params_) mem.add(Mem::ReplicatedParams, p.nbytes());
  std::optional<at::ScalarType> reduce;
  if (mp.param_dtype()) reduce = mp.reduce_dtype().value_or(*mp.param_dtype());
  ddp_ = std::make_unique<AllReduceBucketer>(params_, std::move(names), options.bucket_mb(), world_.comm(), &mem,
                                             options.ddp_async(), reduce);
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    acc->add_post_hook(std::make_unique<DdpGradHook>(state_, i));
    accumulators_.push_back(std::move(acc));
  }
}

}  // namespace shardtorch::detail
