#include "shard/replica_model.h"

#include "runtime/shard_state.h"

namespace shardtorch::detail {

ReplicaModel::ReplicaModel(torch::nn::Module& root, const std::string& what)
    : root_(root), state_(require_state(root, what)) {}

ReplicaModel::~ReplicaModel() = default;

const ShardOptions& ReplicaModel::options() const { return state_->options(); }

std::vector<at::Tensor> ReplicaModel::state_tensors() const {
  std::vector<at::Tensor> out;
  if (state_->path().replicated()) {
    for (const auto& p : state_->path().replicated()->params()) out.push_back(state_->path().record_of(p));
  } else {
    for (auto& u : state_->units().all())
      for (auto& f : u->flats()) out.push_back(f->shard());
  }
  for (const auto& b : root_.buffers())
    if (b.defined()) out.push_back(b);
  return out;
}

void ReplicaModel::replace_begin() {
  state_->optimizer().before_update();
  state_->copies().wait_for_offload_copies();
}

void ReplicaModel::replace_end() { state_->optimizer().after_shards_replaced(); }

bool ReplicaModel::optimizer_steps_in_backward() const { return state_->copies().gradient_listener() != nullptr; }

void ReplicaModel::unregister_comm_hook(const c10d::CommHookInterface* hook) {
  if (hook && state_->path().reducer().comm_hook() == hook) state_->path().reducer().set_comm_hook(nullptr);
}

}  // namespace shardtorch::detail
