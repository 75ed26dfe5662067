#pragma once
// Helpers of the DCP checkpoint tests: the model of tests/data/dcp's FSDP2
// samples, written in C++ with the same names, and access to the samples.
#include <torch/torch.h>

#include <map>
#include <string>

#include "models.h"
#include "shardtorch/dcp_checkpoint.h"

namespace testmodels {

/// tests/data/dcp/<name>.
inline std::string dcp_sample(const std::string& name) {
  return std::string(SHARDTORCH_SOURCE_DIR) + "/tests/data/dcp/" + name;
}

/// A unit holding a linear layer's weight and bias itself (so that they are
/// "l0.weight" and "l0.bias", as in the Python model).
struct DcpLinearImpl : torch::nn::Module {
  DcpLinearImpl(int64_t in, int64_t out) {
    torch::nn::Linear init(in, out);
    weight = register_parameter("weight", init->weight.detach().clone());
    bias = register_parameter("bias", init->bias.detach().clone());
  }
  torch::Tensor forward(torch::Tensor x) { return torch::nn::functional::linear(x, weight, bias); }
  torch::Tensor weight, bias;
};
SHARDTORCH_MODULE(DcpLinear);

/// tests/python/dcp/make_fsdp2.py's MLP: l0 Linear(4, 5) (a unit, as
/// fully_shard(model.l0) makes it), norm LayerNorm(5), l1 Linear(5, 1), and
/// the buffer scale = [2, 3]; the root is a unit too. `last`: the name of
/// l1 (another one: a model with a module renamed).
struct DcpMlpImpl : torch::nn::Module {
  explicit DcpMlpImpl(int64_t hidden = 5, const std::string& last = "l1")
      : l0(register_module("l0", DcpLinear(4, hidden))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})))),
        l1(register_module(last, torch::nn::Linear(hidden, 1))) {
    scale = register_buffer("scale", torch::tensor({2.0, 3.0}));
  }
  torch::Tensor forward(torch::Tensor x) { return l1(torch::relu(norm(l0(x)))) * scale.sum(); }
  DcpLinear l0;
  torch::nn::LayerNorm norm;
  torch::nn::Linear l1;
  torch::Tensor scale;
};
SHARDTORCH_MODULE(DcpMlp);

/// The model's parameters and buffers, whole (a collective).
inline std::map<std::string, torch::Tensor> dcp_full_values(torch::nn::Module& m) {
  auto summon = shardtorch::summon_full_params(m);
  std::map<std::string, torch::Tensor> out;
  for (auto& item : m.named_parameters()) out[item.key()] = item.value().detach().clone();
  for (auto& item : m.named_buffers()) out[item.key()] = item.value().clone();
  return out;
}

}  // namespace testmodels
