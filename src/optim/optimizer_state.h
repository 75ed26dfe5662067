#pragma once
// Internal: the per-parameter state of the optimizers whose state shardtorch
// moves (sharded checkpoints, fault-tolerant heals): Adam, AdamW, SGD and the
// fused CPU Adam(W), which keep torch::optim's state classes.
#include <torch/optim/optimizer.h>

#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace shardtorch {
class ShardedOptimizer;
namespace detail {

enum class OptimizerKind { Adam, AdamW, SGD };

/// nullopt for an optimizer whose state is none of those.
std::optional<OptimizerKind> optimizer_kind(ShardedOptimizer& opt);
const char* optimizer_kind_name(OptimizerKind k);
/// The optimizer and every hyperparameter of each of its parameter groups,
/// as they are now, in words ("AdamW; param group 0: lr=0.01, betas=(0.9,
/// 0.999), ..."): equal strings, equal options (numbers in their shortest
/// exact form). Options of a kind torch::optim does not define: lr alone.
std::string describe_optimizer(ShardedOptimizer& opt);
/// The state's tensors by name: exp_avg, exp_avg_sq (max_exp_avg_sq) for
/// Adam(W), momentum_buffer for SGD; undefined ones left out.
std::vector<std::pair<std::string, at::Tensor>> optimizer_state_tensors(const torch::optim::OptimizerParamState* st);
/// Adam(W)'s step count, else 0.
int64_t optimizer_state_step(const torch::optim::OptimizerParamState* st);
/// The parameters (their TensorImpls) of `opt`'s groups with amsgrad on.
std::set<const void*> amsgrad_params(ShardedOptimizer& opt);
/// A parameter's state from its tensors, in optimizer_state_tensors' order.
std::unique_ptr<torch::optim::OptimizerParamState> make_optimizer_state(OptimizerKind kind, int64_t step,
                                                                        const std::vector<at::Tensor>& t);

}  // namespace detail
}  // namespace shardtorch
