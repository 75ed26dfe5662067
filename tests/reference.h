#pragma once
// The single-process reference that parity tests compare a distributed run
// with (docs/testing.md, "Parity with one process"): the loss of every step,
// the gradients after the first backward, and the parameters at the end.
// Gradients are always compared: AdamW and Adam divide a gradient by its own
// running scale, so a gradient reduced with a wrong divisor moves the
// parameters by almost nothing, and a comparison of parameters alone passes.
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "models.h"

namespace testref {

using Tensors = std::map<std::string, torch::Tensor>;

struct Run {
  std::vector<double> losses;  // per step
  Tensors first_grads;         // after the first backward, by parameter name
  // After the backward of later steps, where a test asks for them (steps
  // whose ranks take different branches): step -> gradients.
  std::map<int, Tensors> later_grads;
  Tensors final_params;
};

/// The gradients `model`'s parameters hold now, by name (those with none left out).
inline Tensors gradients_of(torch::nn::Module& model) {
  Tensors out;
  for (auto& [n, p] : testmodels::unique_params(model))
    if (p.grad().defined()) out[n] = p.grad().detach().to(at::kFloat).clone();
  return out;
}

/// The reference: `steps` times zero_grad, `loss(step)`.backward(), step, in
/// this process, recording what Run holds (the gradients also after the
/// steps in `later`). Each distinct parameter is named by its first name (as
/// unique_params names it).
inline Run train_reference(torch::nn::Module& model, torch::optim::Optimizer& opt, int steps,
                           const std::function<torch::Tensor(int step)>& loss, const std::set<int>& later = {}) {
  Run run;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto l = loss(s);
    l.backward();
    run.losses.push_back(l.item<double>());
    if (s == 0) run.first_grads = gradients_of(model);
    if (later.count(s) && s > 0) run.later_grads[s] = gradients_of(model);
    opt.step();
  }
  run.final_params = testmodels::snapshot(model);
  return run;
}

/// Collective over the model's world: the full, reduced gradients of a
/// sharded model now (after a backward, before the step), by name; frozen
/// parameters are left out.
inline Tensors full_gradients(torch::nn::Module& root) {
  shardtorch::FullParams full(root, shardtorch::SummonOptions().with_grads(true).writeback(false));
  Tensors out;
  for (auto& [n, p] : testmodels::unique_params(root))
    if (p.requires_grad() && p.grad().defined()) out[n] = p.grad().detach().to(at::kFloat).clone();
  return out;
}

/// Collective: the full parameters of a sharded model, by name.
inline Tensors full_parameters(torch::nn::Module& root) {
  shardtorch::FullParams full(root);
  return testmodels::snapshot(root);
}

/// In a rank, the counterpart of train_reference: `steps` times
/// opt.zero_grad(), `backward(step)` (this rank's forwards and backwards, and
/// whatever the test checks after them), opt.step(); records the full
/// gradients after the first backward (and after the steps in `later`) and
/// the full parameters at the end. No losses: each rank sees its own.
/// Collective over the model's world.
inline Run train_ranks(torch::nn::Module& root, shardtorch::ShardedOptimizer& opt, int steps,
                       const std::function<void(int step)>& backward, const std::set<int>& later = {}) {
  Run run;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    backward(s);
    if (s == 0) run.first_grads = full_gradients(root);
    if (later.count(s) && s > 0) run.later_grads[s] = full_gradients(root);
    opt.step();
  }
  run.final_params = full_parameters(root);
  return run;
}

namespace detail {
inline Tensors pick(const Tensors& from, const Tensors& names, const std::string& what) {
  Tensors out;
  for (const auto& [n, t] : names) {
    auto it = from.find(n);
    testmodels::require(it != from.end(), what + ": '" + n + "' is not in the reference");
    out[n] = it->second;
  }
  return out;
}
}  // namespace detail

/// Throws (in a rank, failing the run) naming the first difference between
/// `got` and the reference `want`: each step's loss within `tol` (relative to
/// the loss), the first gradients (and those of the later steps both
/// recorded, which must be the same steps) and the final parameters within
/// `tol` relative to each tensor's scale. `subset`: `got` holds some of the
/// reference's parameters (a pipeline stage's); they are compared, and none
/// may be missing from the reference. An empty `got.losses` skips the losses
/// (a rank that does not see them). Returns the largest relative error.
inline double expect_same_run(const Run& got, const Run& want, double tol, const std::string& what,
                              bool subset = false) {
  double worst = 0;
  if (!got.losses.empty()) {
    testmodels::require(got.losses.size() == want.losses.size(), what + ": " + std::to_string(got.losses.size()) +
                                                                     " losses, the reference has " +
                                                                     std::to_string(want.losses.size()));
    for (size_t s = 0; s < want.losses.size(); ++s) {
      const double e = std::abs(got.losses[s] - want.losses[s]) / std::max(1.0, std::abs(want.losses[s]));
      testmodels::require(e <= tol, what + ": loss of step " + std::to_string(s) + " is " +
                                        std::to_string(got.losses[s]) + ", the reference's " +
                                        std::to_string(want.losses[s]));
      worst = std::max(worst, e);
    }
  }
  testmodels::require(!got.first_grads.empty(), what + ": no gradients to compare (the comparison would be vacuous)");
  auto want_grads = subset ? detail::pick(want.first_grads, got.first_grads, what) : want.first_grads;
  worst = std::max(worst, testmodels::expect_close_map(got.first_grads, want_grads, tol, what + ": first gradients"));
  testmodels::require(got.later_grads.size() == want.later_grads.size(),
                      what + ": gradients of " + std::to_string(got.later_grads.size()) +
                          " later steps, the reference has " + std::to_string(want.later_grads.size()));
  for (const auto& [s, grads] : got.later_grads) {
    const std::string step = what + ": gradients of step " + std::to_string(s);
    auto it = want.later_grads.find(s);
    testmodels::require(it != want.later_grads.end(), step + " are not in the reference");
    auto want_later = subset ? detail::pick(it->second, grads, step) : it->second;
    worst = std::max(worst, testmodels::expect_close_map(grads, want_later, tol, step));
  }
  auto want_params = subset ? detail::pick(want.final_params, got.final_params, what) : want.final_params;
  worst =
      std::max(worst, testmodels::expect_close_map(got.final_params, want_params, tol, what + ": final parameters"));
  return worst;
}

}  // namespace testref
