#pragma once
// Test models and helpers shared by the test files.
#include <torch/torch.h>

#include <stdlib.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "../examples/gpt.h"
#include "../src/base/files.h"
#include "shardtorch/shardtorch.h"
#include "shardtorch/testing.h"
#include "temp_dir.h"

namespace testmodels {

// An MLP with odd sizes: every layer a unit, the middle one with a frozen
// bias (a unit mixing frozen and trainable parameters), a buffer on the root.
struct LayerImpl : torch::nn::Module {
  LayerImpl(int64_t in, int64_t out, bool act) : lin(register_module("lin", torch::nn::Linear(in, out))), act(act) {}
  torch::Tensor forward(torch::Tensor x) {
    auto y = lin(x);
    return act ? torch::tanh(y) : y;
  }
  torch::nn::Linear lin;
  bool act;
};
SHARDTORCH_MODULE(Layer);

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(int64_t hidden = 13, bool extra = false)
      : l1(register_module("l1", Layer(7, hidden, true))),
        l2(register_module("l2", Layer(hidden, 5, true))),
        l3(register_module("l3", Layer(5, 3, false))) {
    l2->lin->bias.set_requires_grad(false);
    scale = register_buffer("scale", torch::full({7}, 1.0));
    if (extra) register_module("extra", torch::nn::Linear(3, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return l3(l2(l1(x * scale))); }
  Layer l1, l2, l3;
  torch::Tensor scale;
};
SHARDTORCH_MODULE(MLP);

/// Two units; forward runs the second only while `use_b`: a unit that sits
/// out some micro-batches, or every step.
struct SometimesImpl : torch::nn::Module {
  SometimesImpl() : a(register_module("a", Layer(6, 6, true))), b(register_module("b", Layer(6, 6, true))) {}
  torch::Tensor forward(torch::Tensor x) { return use_b ? b(a(x)) : a(x); }
  Layer a, b;
  bool use_b = true;
};
SHARDTORCH_MODULE(Sometimes);

// A unit holding a parameter with no elements (a zero-width projection, an
// empty bias some configurations produce) next to ordinary ones.
struct EmptyHoldingLayerImpl : torch::nn::Module {
  EmptyHoldingLayerImpl() : lin(register_module("lin", torch::nn::Linear(5, 3))) {
    none = register_parameter("none", torch::zeros({0, 3}));
  }
  torch::Tensor forward(torch::Tensor x) { return lin(x) + none.sum(0); }
  torch::nn::Linear lin;
  torch::Tensor none;
};
SHARDTORCH_MODULE(EmptyHoldingLayer);

/// Two units: a Layer (7 -> 5, tanh) then a B (5 -> 3), for models built
/// around one unusual layer.
template <class B>
struct LayerThenImpl : torch::nn::Module {
  LayerThenImpl() : a(register_module("a", Layer(7, 5, true))), b(register_module("b", B())) {}
  torch::Tensor forward(torch::Tensor x) { return b(a(x)); }
  Layer a;
  B b;
};

using WithEmptyImpl = LayerThenImpl<EmptyHoldingLayer>;
SHARDTORCH_MODULE(WithEmpty);

/// The same with b's Linear frozen: b's only trainable flat parameter is empty.
struct OnlyEmptyTrainsImpl : WithEmptyImpl {
  OnlyEmptyTrainsImpl() {
    for (auto& p : b->lin->parameters()) p.set_requires_grad(false);
  }
};
SHARDTORCH_MODULE(OnlyEmptyTrains);

/// A root that is not a unit: shard() makes units of its layers only.
struct PlainRoot : torch::nn::Module {
  PlainRoot()
      : l1(register_module("l1", Layer(7, 5, true))),
        l2(register_module("l2", Layer(5, 5, true))),
        l3(register_module("l3", Layer(5, 3, false))) {}
  torch::Tensor forward(torch::Tensor x) { return l3(l2(l1(x))); }
  Layer l1, l2, l3;
};

/// A root unit with parameters of its own (the head) after two Layers; while
/// `fail` is set its forward throws after the layers have run (the LM head
/// running out of memory).
struct FailingRootImpl : torch::nn::Module {
  FailingRootImpl()
      : l1(register_module("l1", Layer(7, 5, true))),
        l2(register_module("l2", Layer(5, 5, true))),
        head(register_module("head", torch::nn::Linear(5, 3))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto h = l2(l1(x));
    if (fail) throw std::runtime_error("out of memory in the head (simulated)");
    return head(h);
  }
  Layer l1, l2;
  torch::nn::Linear head;
  bool fail = false;
};
SHARDTORCH_MODULE(FailingRoot);

/// An embedding and a head under the names of a tied pair ("emb.weight",
/// "head.weight"): one parameter when `tied`, two (the head's random) when
/// not, as a model that did not tie them would save.
struct TwinsImpl : torch::nn::Module {
  explicit TwinsImpl(bool tied)
      : emb(register_module("emb", torch::nn::Embedding(8, 4))),
        head(register_module("head", gpt::TiedHead(tied ? emb->weight : torch::randn({8, 4})))) {}
  torch::Tensor forward(torch::Tensor x) { return head(emb(x)); }
  torch::nn::Embedding emb;
  gpt::TiedHead head;
};
SHARDTORCH_MODULE(Twins);

/// name -> tensor, each distinct tensor once (tied parameters appear under their first name).
inline std::vector<std::pair<std::string, torch::Tensor>> unique_params(torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::set<const void*> seen;
  for (auto& item : m.named_parameters())
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  return out;
}

inline std::vector<torch::Tensor> unique_tensors(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& [n, t] : unique_params(m)) out.push_back(t);
  return out;
}

/// max|a - b| / max|b|: the error relative to the tensor's scale.
inline double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  if (b.numel() == 0) return a.numel() == 0 ? 0.0 : INFINITY;
  const auto ad = a.to(at::kDouble), bd = b.to(at::kDouble);  // integer and bool tensors too
  double scale = bd.abs().max().item<double>();
  double err = (ad - bd).abs().max().item<double>();
  return scale == 0 ? err : err / scale;
}

/// Throws naming the first tensor whose relative error exceeds tol; returns
/// the largest relative error.
inline double expect_close_map(const std::map<std::string, torch::Tensor>& got,
                               const std::map<std::string, torch::Tensor>& want, double tol, const std::string& what) {
  double worst = 0;
  if (got.size() != want.size())
    throw std::runtime_error(what + ": " + std::to_string(got.size()) + " tensors, expected " +
                             std::to_string(want.size()));
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    if (it == got.end()) throw std::runtime_error(what + ": missing " + name);
    if (!it->second.defined() || it->second.sizes() != w.sizes())
      throw std::runtime_error(what + ": " + name + " undefined or wrong shape");
    double e = rel_err(it->second, w);
    if (!(e <= tol)) {
      std::ostringstream os;
      os << what << ": " << name << " relative error " << e << " > " << tol;
      throw std::runtime_error(os.str());
    }
    worst = std::max(worst, e);
  }
  return worst;
}

inline void require(bool ok, const std::string& msg) {
  if (!ok) throw std::runtime_error(msg);
}

/// Rows of the full batch in parity tests: divisible by 1, 2, 3 and 4.
constexpr int64_t kBatch = 12;

/// The GPT's full batch of token sequences (fixed seed).
inline torch::Tensor gpt_tokens() {
  torch::manual_seed(123);
  return torch::randint(0, gpt::Config{}.vocab, {kBatch, gpt::Config{}.seq_len}, torch::kLong);
}

/// name -> copy of every distinct parameter.
inline std::map<std::string, torch::Tensor> snapshot(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [n, p] : unique_params(m)) out[n] = p.detach().clone();
  return out;
}

/// Trains `model` in this process for `steps` steps of `opt` on `loss()` (the
/// single-process reference) and returns its parameters.
template <class Loss>
std::map<std::string, torch::Tensor> train_in_one_process(torch::nn::Module& model, torch::optim::Optimizer& opt,
                                                          int steps, Loss loss) {
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    loss().backward();
    opt.step();
  }
  return snapshot(model);
}

/// Gives `a` and `b` the same random gradients `steps` times and steps each of
/// their optimizers: for comparing an optimizer with torch::optim's.
inline void step_both(torch::optim::Optimizer& ref, torch::Tensor& a, torch::optim::Optimizer& other, torch::Tensor& b,
                      int steps, double grad_growth = 0.0) {
  for (int s = 0; s < steps; ++s) {
    auto g = torch::randn(a.sizes()) * (1.0 + grad_growth * s);
    a.mutable_grad() = g.clone();
    b.mutable_grad() = g.clone();
    ref.step();
    other.step();
  }
}

const shardtorch::Strategy kAllStrategies[] = {shardtorch::Strategy::FullShard, shardtorch::Strategy::ShardGradOp,
                                               shardtorch::Strategy::OptimizerOnly, shardtorch::Strategy::NoShard,
                                               shardtorch::Strategy::HybridShard};

/// The name of a test parameterised by a strategy: the strategy's
/// ("full_shard"), for INSTANTIATE_TEST_SUITE_P.
struct StrategyName {
  template <class ParamInfo>
  std::string operator()(const ParamInfo& info) const {
    return shardtorch::strategy_name(info.param);
  }
};

/// Options for a strategy at a world size (HybridShard: groups of 2 where 2 divides it, else 1).
inline shardtorch::ShardOptions strategy_options(shardtorch::Strategy s, int world) {
  auto o = shardtorch::ShardOptions().strategy(s);
  if (s == shardtorch::Strategy::HybridShard) o.hybrid_shard_size(world % 2 == 0 ? 2 : 1);
  return o;
}

}  // namespace testmodels
