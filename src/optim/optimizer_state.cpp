#include "optim/optimizer_state.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>

#include "shardtorch/optim.h"
#include "shardtorch/optim/cpu_adam.h"

namespace shardtorch::detail {

std::optional<OptimizerKind> optimizer_kind(ShardedOptimizer& opt) {
  torch::optim::Optimizer* inner = &opt.inner();
  if (dynamic_cast<torch::optim::AdamW*>(inner) || dynamic_cast<FusedAdamW*>(inner)) return OptimizerKind::AdamW;
  if (dynamic_cast<torch::optim::Adam*>(inner) || dynamic_cast<FusedAdam*>(inner)) return OptimizerKind::Adam;
  if (dynamic_cast<torch::optim::SGD*>(inner)) return OptimizerKind::SGD;
  return std::nullopt;
}

const char* optimizer_kind_name(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::Adam:
      return "Adam";
    case OptimizerKind::AdamW:
      return "AdamW";
    case OptimizerKind::SGD:
      return "SGD";
  }
  return "?";
}

std::vector<std::pair<std::string, at::Tensor>> optimizer_state_tensors(const torch::optim::OptimizerParamState* st) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(st)) {
    out = {{"exp_avg", a->exp_avg()}, {"exp_avg_sq", a->exp_avg_sq()}, {"max_exp_avg_sq", a->max_exp_avg_sq()}};
  } else if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(st)) {
    out = {{"exp_avg", w->exp_avg()}, {"exp_avg_sq", w->exp_avg_sq()}, {"max_exp_avg_sq", w->max_exp_avg_sq()}};
  } else if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(st)) {
    out = {{"momentum_buffer", s->momentum_buffer()}};
  }
  out.erase(std::remove_if(out.begin(), out.end(), [](const auto& kv) { return !kv.second.defined(); }), out.end());
  return out;
}

int64_t optimizer_state_step(const torch::optim::OptimizerParamState* st) {
  if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(st)) return a->step();
  if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(st)) return w->step();
  return 0;
}

std::unique_ptr<torch::optim::OptimizerParamState> make_optimizer_state(OptimizerKind kind, int64_t step,
                                                                        const std::vector<at::Tensor>& t) {
  const at::Tensor vmax = t.size() > 2 ? t[2] : at::Tensor();
  if (kind == OptimizerKind::AdamW) {
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(step).exp_avg(t[0]).exp_avg_sq(t[1]);
    if (vmax.defined()) s->max_exp_avg_sq(vmax);
    return s;
  }
  if (kind == OptimizerKind::Adam) {
    auto s = std::make_unique<torch::optim::AdamParamState>();
    s->step(step).exp_avg(t[0]).exp_avg_sq(t[1]);
    if (vmax.defined()) s->max_exp_avg_sq(vmax);
    return s;
  }
  auto s = std::make_unique<torch::optim::SGDParamState>();
  s->momentum_buffer(t[0]);
  return s;
}

}  // namespace shardtorch::detail
