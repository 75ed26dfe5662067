#pragma once
// The single-process reference that parity tests compare a distributed run
// with (docs/testing.md, "Parity with one process"): the loss of every step,
// the gradients after the first backward, and the parameters at the end.
// Gradients are always compared: AdamW and Adam divide a gradient by its own
// running scale, so a gradient reduced with a wrong divisor moves the
// parameters by almost nothing, and a comparison of parameters alone passes.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "models.h"

namespace testref {

struct Run {
  std::vector<double> losses;                        // per step
  std::map<std::string, torch::Tensor> first_grads;  // after the first backward, by parameter name
  std::map<std::string, torch::Tensor> final_params;
};

/// The reference: `steps` times zero_grad, `loss(step)`.backward(), step, in
/// this process, recording what Run holds. Each distinct parameter is named
/// by its first name (as unique_params names it).
inline Run train_reference(torch::nn::Module& model, torch::optim::Optimizer& opt, int steps,
                           const std::function<torch::Tensor(int step)>& loss) {
  Run run;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto l = loss(s);
    l.backward();
    run.losses.push_back(l.item<double>());
    if (s == 0)
      for (auto& [n, p] : testmodels::unique_params(model))
        if (p.grad().defined()) run.first_grads[n] = p.grad().detach().clone();
    opt.step();
  }
  run.final_params = testmodels::snapshot(model);
  return run;
}

/// Collective over the model's world: the full, reduced gradients of a
/// sharded model now (after a backward, before the step), by name; frozen
/// parameters are left out.
inline std::map<std::string, torch::Tensor> full_gradients(torch::nn::Module& root) {
  shardtorch::FullParams full(root, shardtorch::SummonOptions().with_grads(true).writeback(false));
  std::map<std::string, torch::Tensor> out;
  for (auto& [n, p] : testmodels::unique_params(root))
    if (p.requires_grad() && p.grad().defined()) out[n] = p.grad().detach().to(at::kFloat).clone();
  return out;
}

/// Collective: the full parameters of a sharded model, by name.
inline std::map<std::string, torch::Tensor> full_parameters(torch::nn::Module& root) {
  shardtorch::FullParams full(root);
  return testmodels::snapshot(root);
}

namespace detail {
inline std::map<std::string, torch::Tensor> pick(const std::map<std::string, torch::Tensor>& from,
                                                 const std::map<std::string, torch::Tensor>& names,
                                                 const std::string& what) {
  std::map<std::string, torch::Tensor> out;
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
/// the loss), the first gradients and the final parameters within `tol`
/// relative to each tensor's scale. `subset`: `got` holds some of the
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
  auto want_params = subset ? detail::pick(want.final_params, got.final_params, what) : want.final_params;
  worst =
      std::max(worst, testmodels::expect_close_map(got.final_params, want_params, tol, what + ": final parameters"));
  return worst;
}

}  // namespace testref
