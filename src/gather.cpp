#include "shardtorch/gather.h"

#include <c10/core/GradMode.h>

#include "shard_state.h"

namespace shardtorch {

FullParams::FullParams(torch::nn::Module& root, SummonOptions options)
    : state_(detail::state_of(root)), options_(options) {
  TORCH_CHECK(state_, "shardtorch::summon_full_params: this model was never sharded");
  World& world = state_->world();
  const bool keep = !options_.rank0_only() || world.rank() == 0;
  c10::NoGradGuard no_grad;
  for (auto& u : state_->units()) {
    bool was_sharded = u->state() == detail::UnitState::Sharded;
    u->unshard();
    if (keep) units_.push_back(u);
    if (options_.with_grads()) {
      for (auto& f : u->flats()) {
        if (!f->requires_grad()) continue;
        at::Tensor shard = f->shard_grad().defined() ? f->shard_grad() : at::zeros_like(f->shard());
        at::Tensor full = at::empty({f->layout().padded_numel()}, shard.options());
        state_->shard_comm().all_gather_into(full, shard, "gradients of unit '" + u->label() + "' for summon_full_params");
        if (!keep) continue;
        for (size_t i = 0; i < f->params().size(); ++i) {
          at::Tensor p = f->params()[i];
          p.mutable_grad() = full.narrow(0, f->layout().offset(i), f->layout().numel(i)).view(p.sizes());
          grads_set_.push_back(p);
        }
      }
    }
    if (was_sharded) {
      if (keep) {
        summoned_.push_back(u);
      } else {
        u->reshard();
      }
    }
  }
}

FullParams::~FullParams() {
  for (auto& p : grads_set_) p.mutable_grad().reset();
  const bool write = options_.writeback() && !options_.rank0_only();
  if (write) {
    for (auto& u : units_)
      for (auto& f : u->flats()) f->write_back_shard();
  }
  for (auto& u : summoned_) u->reshard();
}

}  // namespace shardtorch
