// Parity with one process (shardtorch/parity.h).
#include "shardtorch/parity.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include "shardtorch/gather.h"

namespace shardtorch::testing {

namespace {

// Every distinct parameter under its first name.
std::vector<std::pair<std::string, at::Tensor>> named_distinct(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::set<const void*> seen;
  for (auto& item : m.named_parameters())
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  return out;
}

void require(bool ok, const std::string& message) {
  if (!ok) throw std::runtime_error(message);
}

std::string shape_of(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

// Throws naming the first tensor of `want` whose counterpart in `got` is
// missing, of another shape or off by more than `tol` (or NaN where the
// reference is not), and the first of `got` that the reference lacks.
double expect_close(const NamedTensors& got, const NamedTensors& want, double tol, const std::string& what) {
  double worst = 0;
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    require(it != got.end(), what + ": '" + name + "' is missing (the reference has it, of shape " + shape_of(w) + ")");
    require(it->second.defined() && it->second.sizes() == w.sizes(),
            what + ": '" + name + "' is of shape " + shape_of(it->second) + ", the reference's " + shape_of(w));
    const double e = relative_error(it->second, w);
    if (!(e <= tol)) {
      std::ostringstream os;
      os << what << ": '" << name << "' ";
      if (std::isnan(e))
        os << "has a NaN or infinite element where the reference has none, or the other way round";
      else
        os << "differs from the reference by " << e << " (relative to its largest element) > " << tol;
      throw std::runtime_error(os.str());
    }
    worst = std::max(worst, e);
  }
  for (const auto& [name, g] : got)
    require(want.count(name) != 0, what + ": '" + name + "' (of shape " + shape_of(g) + ") is not in the reference");
  return worst;
}

// The tensors of `from` named in `names`, each required.
NamedTensors pick(const NamedTensors& from, const NamedTensors& names, const std::string& what) {
  NamedTensors out;
  for (const auto& [n, t] : names) {
    auto it = from.find(n);
    require(it != from.end(), what + ": '" + n + "' is not in the reference");
    out[n] = it->second;
  }
  return out;
}

}  // namespace

std::vector<at::Tensor> distinct_parameters(torch::nn::Module& model) {
  std::vector<at::Tensor> out;
  for (auto& [n, p] : named_distinct(model)) out.push_back(p);
  return out;
}

NamedTensors gradients_of(torch::nn::Module& model) {
  NamedTensors out;
  for (auto& [n, p] : named_distinct(model))
    if (p.grad().defined()) out[n] = p.grad().detach().to(at::kFloat).clone();
  return out;
}

NamedTensors parameters_of(torch::nn::Module& model) {
  NamedTensors out;
  for (auto& [n, p] : named_distinct(model)) out[n] = p.detach().clone();
  return out;
}

Run train_reference(torch::nn::Module& model, torch::optim::Optimizer& opt, int steps,
                    const std::function<at::Tensor(int step)>& loss, const std::set<int>& later) {
  Run run;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    at::Tensor l = loss(s);
    l.backward();
    run.losses.push_back(l.item<double>());
    if (s == 0) run.first_grads = gradients_of(model);
    if (later.count(s) && s > 0) run.later_grads[s] = gradients_of(model);
    opt.step();
  }
  run.final_params = parameters_of(model);
  return run;
}

namespace {
// `all` (by every name) under each distinct parameter's first name.
NamedTensors distinct_of(torch::nn::Module& root, std::map<std::string, at::Tensor> all) {
  NamedTensors out;
  for (auto& [n, p] : named_distinct(root)) {
    auto it = all.find(n);
    if (it != all.end()) out[n] = std::move(it->second);
  }
  return out;
}
}  // namespace

NamedTensors gathered_gradients(torch::nn::Module& root) { return distinct_of(root, full_gradients(root)); }

NamedTensors gathered_parameters(torch::nn::Module& root) { return distinct_of(root, full_parameters(root)); }

Run train_ranks(torch::nn::Module& root, ShardedOptimizer& opt, int steps,
                const std::function<void(int step)>& backward, const std::set<int>& later) {
  Run run;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    backward(s);
    if (s == 0) run.first_grads = gathered_gradients(root);
    if (later.count(s) && s > 0) run.later_grads[s] = gathered_gradients(root);
    opt.step();
  }
  run.final_params = gathered_parameters(root);
  return run;
}

double relative_error(const at::Tensor& a, const at::Tensor& b) {
  if (b.numel() == 0) return a.numel() == 0 ? 0.0 : INFINITY;
  c10::NoGradGuard no_grad;
  const at::Tensor ad = a.detach().cpu().to(at::kDouble), bd = b.detach().cpu().to(at::kDouble);
  const double scale = bd.abs().max().item<double>();
  const double err = (ad - bd).abs().max().item<double>();
  return scale == 0 ? err : err / scale;
}

double expect_same_run(const Run& got, const Run& want, double tol, const std::string& what, bool subset) {
  double worst = 0;
  if (!got.losses.empty()) {
    require(got.losses.size() == want.losses.size(), what + ": " + std::to_string(got.losses.size()) +
                                                         " losses, the reference has " +
                                                         std::to_string(want.losses.size()));
    for (size_t s = 0; s < want.losses.size(); ++s) {
      const double e = std::abs(got.losses[s] - want.losses[s]) / std::max(1.0, std::abs(want.losses[s]));
      require(e <= tol, what + ": the loss of step " + std::to_string(s) + " is " + std::to_string(got.losses[s]) +
                            ", the reference's " + std::to_string(want.losses[s]));
      worst = std::max(worst, e);
    }
  }
  require(!got.first_grads.empty(), what + ": no gradients to compare (the comparison would be vacuous)");
  const NamedTensors want_grads = subset ? pick(want.first_grads, got.first_grads, what) : want.first_grads;
  worst = std::max(worst, expect_close(got.first_grads, want_grads, tol, what + ": first gradients"));
  require(got.later_grads.size() == want.later_grads.size(),
          what + ": gradients of " + std::to_string(got.later_grads.size()) + " later steps, the reference has " +
              std::to_string(want.later_grads.size()));
  for (const auto& [s, grads] : got.later_grads) {
    const std::string step = what + ": gradients of step " + std::to_string(s);
    auto it = want.later_grads.find(s);
    require(it != want.later_grads.end(), step + " are not in the reference");
    worst = std::max(worst, expect_close(grads, subset ? pick(it->second, grads, step) : it->second, tol, step));
  }
  const NamedTensors want_params = subset ? pick(want.final_params, got.final_params, what) : want.final_params;
  worst = std::max(worst, expect_close(got.final_params, want_params, tol, what + ": final parameters"));
  return worst;
}

}  // namespace shardtorch::testing
