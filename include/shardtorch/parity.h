#pragma once
// Parity with one process, for users' tests (library shardtorch::testing;
// docs/testing.md, "Parity with one process"): the single-process reference
// a distributed run is compared with, and the comparison. Gradients are
// always compared: Adam and AdamW divide a gradient by its own running
// scale, so a gradient reduced with a wrong divisor moves the parameters by
// almost nothing, and a comparison of parameters alone passes.
//
//   const auto want = shardtorch::testing::train_reference(*ref, ref_opt, 3, [&](int) { return loss(ref(x)); });
//   auto r = shardtorch::testing::run_ranks(2, [&](shardtorch::World& w) {
//     ...  // build, shard, optimizer
//     auto got = shardtorch::testing::train_ranks(*model, *opt, 3, [&](int) { loss(model(mine)).backward(); });
//     shardtorch::testing::expect_same_run(got, want, 1e-5, "full_shard at 2 ranks");
//   });
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "shardtorch/export.h"
#include "shardtorch/optim.h"

namespace shardtorch::testing {

/// Tensors by parameter name; a parameter registered under several names
/// (tied) under its first, as named_parameters() lists them.
using NamedTensors = std::map<std::string, at::Tensor>;

/// What a run is compared by.
struct Run {
  std::vector<double> losses;  // per step (empty on ranks that do not see them)
  NamedTensors first_grads;    // after the first backward
  /// After the backward of the later steps asked for (steps whose ranks take
  /// different branches): step -> gradients.
  std::map<int, NamedTensors> later_grads;
  NamedTensors final_params;  // after the last step
};

/// Every distinct parameter of `model` once: the reference optimizer's list.
/// model->parameters() lists a tied weight under each of its names, and
/// torch::optim then steps it once per name.
SHARDTORCH_API std::vector<at::Tensor> distinct_parameters(torch::nn::Module& model);

/// The gradients `model`'s parameters hold now (those with none left out),
/// as fp32 copies.
SHARDTORCH_API NamedTensors gradients_of(torch::nn::Module& model);

/// Copies of `model`'s parameters now.
SHARDTORCH_API NamedTensors parameters_of(torch::nn::Module& model);

/// The reference, in this process: `steps` times opt.zero_grad(),
/// `loss(step)`.backward(), opt.step(), recording the losses, the gradients
/// after the first backward (and after the steps in `later`) and the
/// parameters at the end.
SHARDTORCH_API Run train_reference(torch::nn::Module& model, torch::optim::Optimizer& opt, int steps,
                                   const std::function<at::Tensor(int step)>& loss, const std::set<int>& later = {});

/// Collective over the sharded model's World: its full, reduced gradients now
/// (after a backward, before the step), fp32, frozen parameters left out
/// (shardtorch::full_gradients). A parameter parallelize() split is whole.
SHARDTORCH_API NamedTensors gathered_gradients(torch::nn::Module& root);

/// Collective: the sharded model's full parameters now, fp32 masters under
/// mixed precision (shardtorch::full_parameters). A parameter parallelize()
/// split is whole.
SHARDTORCH_API NamedTensors gathered_parameters(torch::nn::Module& root);

/// In a rank, the counterpart of train_reference: `steps` times
/// opt.zero_grad(), `backward(step)` (this rank's forwards and backwards),
/// opt.step(); records the gathered gradients after the first backward (and
/// after the steps in `later`) and the gathered parameters at the end. No
/// losses: each rank sees its own. Collective over the model's World.
SHARDTORCH_API Run train_ranks(torch::nn::Module& root, ShardedOptimizer& opt, int steps,
                               const std::function<void(int step)>& backward, const std::set<int>& later = {});

/// max |a - b| / max |b|: the error relative to the tensor's scale (the
/// absolute error where `b` is all zeros).
SHARDTORCH_API double relative_error(const at::Tensor& a, const at::Tensor& b);

/// Throws std::runtime_error (in a rank: the run fails) naming the first
/// difference between `got` and the reference `want`: each step's loss
/// within `tol` (relative to max(1, |loss|)), the first gradients, the later
/// ones (the same steps recorded on both sides) and the final parameters
/// within `tol` of relative_error. A `got` with no gradients is refused (the
/// comparison would be vacuous); empty `got.losses` skips the losses.
/// `subset`: `got` holds some of the reference's parameters (a pipeline
/// stage's); those are compared. Returns the largest error seen.
SHARDTORCH_API double expect_same_run(const Run& got, const Run& want, double tol, const std::string& what,
                                      bool subset = false);

}  // namespace shardtorch::testing
