#pragma once
// The consumers' model: a root unit of two Linear units.
#include <shardtorch/sharded.h>
#include <torch/nn/modules/linear.h>

struct LayerImpl : torch::nn::Module {
  LayerImpl() : lin(register_module("lin", torch::nn::Linear(4, 4))) {}
  at::Tensor forward(at::Tensor x) { return lin(x); }
  torch::nn::Linear lin;
};
SHARDTORCH_MODULE(Layer);

struct NetImpl : torch::nn::Module {
  NetImpl() : a(register_module("a", Layer())), b(register_module("b", Layer())) {}
  at::Tensor forward(at::Tensor x) { return b(a(x)); }
  Layer a, b;
};
SHARDTORCH_MODULE(Net);
