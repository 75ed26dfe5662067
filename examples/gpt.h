#pragma once
// A small GPT for examples and tests: token and position embeddings, blocks of
// causal self-attention and MLP with pre-layer-norms, a final layer norm and an
// LM head tied to the token embedding. Every block is a shardtorch unit, the
// LM head is a unit that shares its weight with the embedding, and the root is
// a unit (it owns the embeddings and the final norm).
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <limits>

#include "shardtorch/pipeline.h"
#include "shardtorch/plan.h"
#include "shardtorch/sharded.h"
#include "shardtorch/tensor_parallel.h"

namespace gpt {

struct Config {
  int64_t vocab = 64;
  int64_t seq_len = 16;
  int64_t d_model = 32;
  int64_t n_head = 4;
  int64_t n_layer = 2;
};

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const Config& c)
      : head_dim(c.d_model / c.n_head),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})))),
        // No bias on qkv: the key part of such a bias has an exactly zero
        // gradient (softmax ignores a per-query constant), and Adam turns the
        // rounding noise of a zero gradient into full-size steps, which no
        // data-parallel run can reproduce bit for bit.
        qkv(register_module(
            "qkv", shardtorch::ParallelLinear(torch::nn::LinearOptions(c.d_model, 3 * c.d_model).bias(false)))),
        proj(register_module("proj", shardtorch::ParallelLinear(c.d_model, c.d_model))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})))),
        fc1(register_module("fc1", shardtorch::ParallelLinear(c.d_model, 4 * c.d_model))),
        fc2(register_module("fc2", shardtorch::ParallelLinear(4 * c.d_model, c.d_model))) {}

  // The heads and the sequence come from qkv's output: under tensor
  // parallelism it holds this rank's heads (and, with sequence parallelism,
  // the whole sequence while `x` holds a slice of it).
  torch::Tensor forward(torch::Tensor x) {
    auto parts = qkv(ln1(x)).chunk(3, -1);
    const auto B = parts[0].size(0), T = parts[0].size(1), D = head_dim;
    auto q = parts[0].view({B, T, -1, D}).transpose(1, 2);
    auto k = parts[1].view({B, T, -1, D}).transpose(1, 2);
    auto v = parts[2].view({B, T, -1, D}).transpose(1, 2);
    auto att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(D));
    auto mask = torch::ones({T, T}, x.options().dtype(torch::kBool)).triu(1);
    att = torch::softmax(att.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
    auto y = torch::matmul(att, v).transpose(1, 2).reshape({B, T, -1});
    x = x + proj(y);
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }

  int64_t head_dim;
  torch::nn::LayerNorm ln1;
  shardtorch::ParallelLinear qkv, proj;
  torch::nn::LayerNorm ln2;
  shardtorch::ParallelLinear fc1, fc2;
};
SHARDTORCH_MODULE(Block);

/// The LM head: holds the token embedding's weight (shared, not copied).
struct TiedHeadImpl : shardtorch::TiedLinearImpl {
  using shardtorch::TiedLinearImpl::TiedLinearImpl;
};
SHARDTORCH_MODULE(TiedHead);

struct GPTImpl : torch::nn::Module {
  explicit GPTImpl(const Config& c)
      : cfg(c),
        tok_emb(register_module("tok_emb", shardtorch::ParallelEmbedding(c.vocab, c.d_model))),
        pos_emb(register_module("pos_emb", shardtorch::ParallelEmbedding(c.seq_len, c.d_model))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})))),
        head(register_module("head", TiedHead(tok_emb->weight))) {
    torch::NoGradGuard no_grad;  // GPT-2's init: small embeddings (the head is tied to them)
    tok_emb->weight.normal_(0.0, 0.02);
    pos_emb->weight.normal_(0.0, 0.02);
    for (int64_t i = 0; i < c.n_layer; ++i) {
      block_list.emplace_back(c);
      blocks->push_back(block_list.back());
    }
  }

  /// tokens [B, T] (int64) -> logits [B, T, vocab]
  torch::Tensor forward(torch::Tensor tokens) {
    auto T = tokens.size(1);
    auto pos = torch::arange(T, tokens.options());
    auto x = tok_emb(tokens) + pos_emb(pos).unsqueeze(0);
    for (auto& b : block_list) x = b(x);
    return head(ln_f(x));
  }

  Config cfg;
  shardtorch::ParallelEmbedding tok_emb, pos_emb;
  torch::nn::ModuleList blocks;
  std::vector<Block> block_list;
  torch::nn::LayerNorm ln_f;
  TiedHead head;
};
SHARDTORCH_MODULE(GPT);

/// The tensor-parallel plan of the GPT (shardtorch/tensor_parallel.h):
/// attention heads and MLP columns split across the group, the vocabulary
/// split in the token embedding and the tied LM head (whose logits stay
/// split: use lm_loss_tp). With sequence parallelism the norms and residual
/// adds run on a slice of the sequence, the position embedding's output is
/// split along it.
inline shardtorch::TpPlan tp_plan(const Config& c, bool sequence_parallel = false) {
  auto plan = shardtorch::TpPlan()
                  .sequence_parallel(sequence_parallel)
                  .add("tok_emb", shardtorch::TpStyle::vocab_embedding())
                  .add("blocks.*.qkv", shardtorch::TpStyle::colwise().parts(3).heads(c.n_head))
                  .add("blocks.*.proj", shardtorch::TpStyle::rowwise())
                  .add("blocks.*.fc1", shardtorch::TpStyle::colwise())
                  .add("blocks.*.fc2", shardtorch::TpStyle::rowwise())
                  .add("head", shardtorch::TpStyle::colwise());
  if (sequence_parallel) {
    plan.add("pos_emb", shardtorch::TpStyle::shard_output(0))
        .add("blocks.*.ln1", shardtorch::TpStyle::sequence_parallel())
        .add("blocks.*.ln2", shardtorch::TpStyle::sequence_parallel())
        .add("ln_f", shardtorch::TpStyle::sequence_parallel());
  }
  return plan;
}

/// The GPT as pipeline layers (shardtorch/pipeline.h), in the order its
/// forward runs them: the embeddings, each block, the final norm with the LM
/// head. The modules keep their names, so a pipelined GPT's parameters have
/// the unsplit GPT's names; the head's weight, tied to the token embedding,
/// is a parameter tied across stages when the two land on different ranks.
inline std::vector<shardtorch::PipelineLayer> pipeline_layers(GPT& model) {
  auto m = model.ptr();
  std::vector<shardtorch::PipelineLayer> layers;
  layers.push_back(
      {"embed", {{"tok_emb", m->tok_emb.ptr()}, {"pos_emb", m->pos_emb.ptr()}}, [m](const at::Tensor& tokens) {
         auto pos = at::arange(tokens.size(1), tokens.options());
         return m->tok_emb(tokens) + m->pos_emb(pos).unsqueeze(0);
       }});
  for (size_t i = 0; i < m->block_list.size(); ++i)
    layers.push_back(shardtorch::PipelineLayer::of("blocks." + std::to_string(i), m->block_list[i]));
  layers.push_back({"head", {{"ln_f", m->ln_f.ptr()}, {"head", m->head.ptr()}}, [m](const at::Tensor& x) {
                      return m->head(m->ln_f(x));
                    }});
  return layers;
}

/// The units shard() builds from a GPT of this shape, computed from the shape
/// alone (for planning models too large to construct); tests check it equals
/// shardtorch::unit_specs of a constructed model. `tp` > 1: of one rank of a
/// model tp_plan() split over `tp` ranks (its slices), which
/// shardtorch::plan_memory plans like any model over the data-parallel ranks.
inline std::vector<shardtorch::UnitSpec> unit_specs(const Config& c, int64_t tp = 1) {
  const int64_t d = c.d_model;
  std::vector<shardtorch::UnitSpec> units;
  // The root: both embeddings (the head's tied weight is the token
  // embedding's, so it lands in the root; split by vocabulary) and the final
  // layer norm.
  units.push_back({"", {{c.vocab / tp * d + c.seq_len * d + 2 * d}}});
  // A block: ln1 2d, qkv 3d^2, proj d^2 + d, ln2 2d, fc1 4d^2 + 4d, fc2 4d^2 + d;
  // split: qkv, proj's weight, fc1, fc2's weight (the biases of proj and fc2
  // are added after the reduction, whole).
  for (int64_t i = 0; i < c.n_layer; ++i)
    units.push_back({"blocks." + std::to_string(i), {{12 * d * d / tp + 4 * d / tp + 6 * d}}});
  units.push_back({"head", {}});
  return units;
}

/// Mean next-token cross entropy of logits [B, T, V] against tokens [B, T].
inline torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& tokens) {
  auto V = logits.size(-1);
  auto pred = logits.narrow(1, 0, logits.size(1) - 1).reshape({-1, V});
  auto target = tokens.narrow(1, 1, tokens.size(1) - 1).reshape({-1});
  return torch::nn::functional::cross_entropy(pred, target);
}

/// lm_loss for a tensor-parallel GPT: its logits hold this rank's slice of
/// the vocabulary; the loss is computed without gathering them.
inline torch::Tensor lm_loss_tp(const torch::Tensor& local_logits, const torch::Tensor& tokens,
                                const std::shared_ptr<shardtorch::World>& tp) {
  auto V = local_logits.size(-1);
  auto pred = local_logits.narrow(1, 0, local_logits.size(1) - 1).reshape({-1, V});
  auto target = tokens.narrow(1, 1, tokens.size(1) - 1).reshape({-1});
  return shardtorch::vocab_parallel_cross_entropy(pred, target, tp);
}

}  // namespace gpt
