#include "optim/optimizer_state.h"

#include <c10/util/Type.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <charconv>
#include <sstream>
#include <typeinfo>

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

namespace {

// The shortest text that reads back as exactly `x`.
std::string number(double x) {
  char buf[32];
  auto r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

std::string boolean(bool b) { return b ? "true" : "false"; }

std::string describe_options(const torch::optim::OptimizerOptions& o) {
  std::ostringstream s;
  if (auto* a = dynamic_cast<const torch::optim::AdamWOptions*>(&o)) {
    s << "lr=" << number(a->lr()) << ", betas=(" << number(std::get<0>(a->betas())) << ", "
      << number(std::get<1>(a->betas())) << "), eps=" << number(a->eps())
      << ", weight_decay=" << number(a->weight_decay()) << ", amsgrad=" << boolean(a->amsgrad());
  } else if (auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&o)) {
    s << "lr=" << number(a->lr()) << ", betas=(" << number(std::get<0>(a->betas())) << ", "
      << number(std::get<1>(a->betas())) << "), eps=" << number(a->eps())
      << ", weight_decay=" << number(a->weight_decay()) << ", amsgrad=" << boolean(a->amsgrad());
  } else if (auto* g = dynamic_cast<const torch::optim::SGDOptions*>(&o)) {
    s << "lr=" << number(g->lr()) << ", momentum=" << number(g->momentum()) << ", dampening=" << number(g->dampening())
      << ", weight_decay=" << number(g->weight_decay()) << ", nesterov=" << boolean(g->nesterov());
  } else if (auto* g = dynamic_cast<const torch::optim::AdagradOptions*>(&o)) {
    s << "lr=" << number(g->lr()) << ", lr_decay=" << number(g->lr_decay())
      << ", weight_decay=" << number(g->weight_decay())
      << ", initial_accumulator_value=" << number(g->initial_accumulator_value()) << ", eps=" << number(g->eps());
  } else if (auto* r = dynamic_cast<const torch::optim::RMSpropOptions*>(&o)) {
    s << "lr=" << number(r->lr()) << ", alpha=" << number(r->alpha()) << ", eps=" << number(r->eps())
      << ", weight_decay=" << number(r->weight_decay()) << ", momentum=" << number(r->momentum())
      << ", centered=" << boolean(r->centered());
  } else if (auto* l = dynamic_cast<const torch::optim::LBFGSOptions*>(&o)) {
    s << "lr=" << number(l->lr()) << ", max_iter=" << l->max_iter() << ", max_eval=" << l->max_eval().value_or(0)
      << ", tolerance_grad=" << number(l->tolerance_grad()) << ", tolerance_change=" << number(l->tolerance_change())
      << ", history_size=" << l->history_size() << ", line_search_fn=" << l->line_search_fn().value_or("none");
  } else {
    s << "lr=" << number(o.get_lr());
  }
  return s.str();
}

}  // namespace

std::string describe_optimizer(ShardedOptimizer& opt) {
  std::ostringstream s;
  const auto kind = optimizer_kind(opt);
  s << (kind ? std::string(optimizer_kind_name(*kind)) : c10::demangle(typeid(opt.inner()).name()));
  const auto& groups = opt.inner().param_groups();
  for (size_t i = 0; i < groups.size(); ++i)
    s << "; param group " << i << ": " << (groups[i].has_options() ? describe_options(groups[i].options()) : "");
  return s.str();
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

std::set<const void*> amsgrad_params(ShardedOptimizer& opt) {
  std::set<const void*> amsgrad;
  for (auto& group : opt.inner().param_groups()) {
    auto& o = group.options();
    bool on = false;
    if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&o)) on = a->amsgrad();
    if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&o)) on = w->amsgrad();
    if (on)
      for (const auto& p : group.params()) amsgrad.insert(p.unsafeGetTensorImpl());
  }
  return amsgrad;
}

}  // namespace shardtorch::detail
