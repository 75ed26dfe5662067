#pragma once
// A small Llama-shaped decoder for examples and tests of tensor parallelism:
// RMSNorm, rotary position embeddings, grouped-query attention (fewer key and
// value heads than query heads) and a SwiGLU MLP, with Hugging Face's module
// names (model.layers.N.self_attn.q_proj, ..., lm_head), so that the plan
// below reads like one for a Hugging Face Llama. Every decoder layer is a
// shardtorch unit; the LM head is not tied to the embedding.
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <limits>

#include "shardtorch/sharded.h"
#include "shardtorch/tensor_parallel.h"

namespace llama {

struct Config {
  int64_t vocab = 64;
  int64_t seq_len = 16;
  int64_t d_model = 32;
  int64_t n_head = 4;
  int64_t n_kv_head = 2;  // grouped-query attention: n_head / n_kv_head query heads share a key and value head
  int64_t d_ff = 48;      // the MLP's intermediate size
  int64_t n_layer = 2;
  double eps = 1e-5;
  double rope_theta = 10000.0;
};

struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t d, double eps) : eps(eps), weight(register_parameter("weight", torch::ones({d}))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x * torch::rsqrt(x.square().mean(-1, /*keepdim=*/true) + eps) * weight;
  }
  double eps;
  torch::Tensor weight;
};
TORCH_MODULE(RMSNorm);

/// Rotary position embedding of x [B, T, H, D] (the halves rotated, as
/// Hugging Face's Llama does), positions 0 .. T-1.
inline torch::Tensor rope(const torch::Tensor& x, double theta) {
  const int64_t T = x.size(1), D = x.size(3), half = D / 2;
  auto inv = torch::pow(theta, -torch::arange(0, half, x.options()) * 2.0 / static_cast<double>(D));
  auto angles = torch::outer(torch::arange(T, x.options()), inv);  // [T, D/2]
  auto cos = torch::cat({angles.cos(), angles.cos()}, -1).view({1, T, 1, D});
  auto sin = torch::cat({angles.sin(), angles.sin()}, -1).view({1, T, 1, D});
  auto rotated = torch::cat({-x.narrow(3, half, half), x.narrow(3, 0, half)}, -1);
  return x * cos + rotated * sin;
}

struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const Config& c)
      : head_dim(c.d_model / c.n_head),
        theta(c.rope_theta),
        q_proj(register_module("q_proj", linear(c.d_model, c.n_head * head_dim))),
        k_proj(register_module("k_proj", linear(c.d_model, c.n_kv_head * head_dim))),
        v_proj(register_module("v_proj", linear(c.d_model, c.n_kv_head * head_dim))),
        o_proj(register_module("o_proj", linear(c.n_head * head_dim, c.d_model))) {}

  static shardtorch::ParallelLinear linear(int64_t in, int64_t out) {
    return shardtorch::ParallelLinear(torch::nn::LinearOptions(in, out).bias(false));
  }

  // The heads come from the projections' outputs: under tensor parallelism
  // they hold this rank's query heads and its key and value heads.
  torch::Tensor forward(const torch::Tensor& x) {
    auto q = q_proj(x), k = k_proj(x), v = v_proj(x);
    const int64_t B = q.size(0), T = q.size(1), D = head_dim;
    q = rope(q.view({B, T, -1, D}), theta);
    k = rope(k.view({B, T, -1, D}), theta);
    v = v.view({B, T, -1, D});
    const int64_t group = q.size(2) / k.size(2);
    k = k.repeat_interleave(group, 2);
    v = v.repeat_interleave(group, 2);
    q = q.transpose(1, 2), k = k.transpose(1, 2), v = v.transpose(1, 2);
    auto att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(D));
    auto mask = torch::ones({T, T}, x.options().dtype(torch::kBool)).triu(1);
    att = torch::softmax(att.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
    return o_proj(torch::matmul(att, v).transpose(1, 2).reshape({B, T, -1}));
  }

  int64_t head_dim;
  double theta;
  shardtorch::ParallelLinear q_proj, k_proj, v_proj, o_proj;
};
TORCH_MODULE(Attention);

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(const Config& c)
      : gate_proj(register_module("gate_proj", AttentionImpl::linear(c.d_model, c.d_ff))),
        up_proj(register_module("up_proj", AttentionImpl::linear(c.d_model, c.d_ff))),
        down_proj(register_module("down_proj", AttentionImpl::linear(c.d_ff, c.d_model))) {}
  torch::Tensor forward(const torch::Tensor& x) { return down_proj(torch::silu(gate_proj(x)) * up_proj(x)); }
  shardtorch::ParallelLinear gate_proj, up_proj, down_proj;
};
TORCH_MODULE(MLP);

struct DecoderLayerImpl : torch::nn::Module {
  explicit DecoderLayerImpl(const Config& c)
      : input_layernorm(register_module("input_layernorm", RMSNorm(c.d_model, c.eps))),
        self_attn(register_module("self_attn", Attention(c))),
        post_attention_layernorm(register_module("post_attention_layernorm", RMSNorm(c.d_model, c.eps))),
        mlp(register_module("mlp", MLP(c))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = x + self_attn(input_layernorm(x));
    return x + mlp(post_attention_layernorm(x));
  }
  RMSNorm input_layernorm;
  Attention self_attn;
  RMSNorm post_attention_layernorm;
  MLP mlp;
};
SHARDTORCH_MODULE(DecoderLayer);

struct ModelImpl : torch::nn::Module {
  explicit ModelImpl(const Config& c)
      : embed_tokens(register_module("embed_tokens", shardtorch::ParallelEmbedding(c.vocab, c.d_model))),
        layers(register_module("layers", torch::nn::ModuleList())),
        norm(register_module("norm", RMSNorm(c.d_model, c.eps))) {
    torch::NoGradGuard no_grad;
    embed_tokens->weight.normal_(0.0, 0.02);
    for (int64_t i = 0; i < c.n_layer; ++i) {
      layer_list.emplace_back(c);
      layers->push_back(layer_list.back());
    }
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto x = embed_tokens(tokens);
    for (auto& l : layer_list) x = l(x);
    return norm(x);
  }
  shardtorch::ParallelEmbedding embed_tokens;
  torch::nn::ModuleList layers;
  std::vector<DecoderLayer> layer_list;
  RMSNorm norm;
};
TORCH_MODULE(Model);

struct LlamaImpl : torch::nn::Module {
  explicit LlamaImpl(const Config& c)
      : cfg(c),
        model(register_module("model", Model(c))),
        lm_head(register_module("lm_head", AttentionImpl::linear(c.d_model, c.vocab))) {}
  /// tokens [B, T] (int64) -> logits [B, T, vocab] (this rank's slice of the
  /// vocabulary when a plan split lm_head)
  torch::Tensor forward(const torch::Tensor& tokens) { return lm_head(model(tokens)); }
  Config cfg;
  Model model;
  shardtorch::ParallelLinear lm_head;
};
SHARDTORCH_MODULE(Llama);

/// The tensor-parallel plan of a Llama (shardtorch/tensor_parallel.h), with
/// Hugging Face's module names: the query heads and the key and value heads
/// split across the group (the group's size must divide n_kv_head), the
/// MLP's intermediate features split, the vocabulary split in the embedding
/// and the LM head (whose logits stay split: vocab_parallel_cross_entropy).
/// With sequence parallelism the RMSNorms and residual adds run on a slice of
/// the sequence.
inline shardtorch::TpPlan tp_plan(const Config& c, bool sequence_parallel = false) {
  using shardtorch::TpStyle;
  auto plan = shardtorch::TpPlan()
                  .sequence_parallel(sequence_parallel)
                  .add("model.embed_tokens", TpStyle::vocab_embedding())
                  .add("model.layers.*.self_attn.q_proj", TpStyle::colwise().heads(c.n_head))
                  .add("model.layers.*.self_attn.k_proj", TpStyle::colwise().heads(c.n_kv_head))
                  .add("model.layers.*.self_attn.v_proj", TpStyle::colwise().heads(c.n_kv_head))
                  .add("model.layers.*.self_attn.o_proj", TpStyle::rowwise())
                  .add("model.layers.*.mlp.gate_proj", TpStyle::colwise())
                  .add("model.layers.*.mlp.up_proj", TpStyle::colwise())
                  .add("model.layers.*.mlp.down_proj", TpStyle::rowwise())
                  .add("lm_head", TpStyle::colwise());
  if (sequence_parallel)
    plan.add("model.layers.*.input_layernorm", TpStyle::sequence_parallel())
        .add("model.layers.*.post_attention_layernorm", TpStyle::sequence_parallel())
        .add("model.norm", TpStyle::sequence_parallel());
  return plan;
}

/// Mean next-token cross entropy of logits [B, T, V] against tokens [B, T];
/// `tp`: logits split by vocabulary over that group.
inline torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& tokens,
                             const std::shared_ptr<shardtorch::World>& tp = nullptr) {
  auto V = logits.size(-1);
  auto pred = logits.narrow(1, 0, logits.size(1) - 1).reshape({-1, V});
  auto target = tokens.narrow(1, 1, tokens.size(1) - 1).reshape({-1});
  return tp ? shardtorch::vocab_parallel_cross_entropy(pred, target, tp)
            : torch::nn::functional::cross_entropy(pred, target);
}

}  // namespace llama
