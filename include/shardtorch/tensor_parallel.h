#pragma once
// Tensor parallelism: a model's large matrices split across the ranks of a
// tensor-parallel group, each rank computing its slice (Megatron-LM's
// column- and row-parallel layers), composed with shard() over the other
// mesh dimensions (docs/parallelism.md, "Tensor parallelism").
//
//   auto mesh = shardtorch::DeviceMesh::create(world, {{"dp", 2}, {"tp", 2}});
//   shardtorch::parallelize(*model, (*mesh)["tp"], shardtorch::TpPlan()
//       .add("blocks.*.qkv", shardtorch::TpStyle::colwise().parts(3).heads(cfg.n_head))
//       .add("blocks.*.proj", shardtorch::TpStyle::rowwise())
//       .add("blocks.*.fc1", shardtorch::TpStyle::colwise())
//       .add("blocks.*.fc2", shardtorch::TpStyle::rowwise()));
//   shardtorch::shard(model, (*mesh)["dp"]);   // each rank's flat parameters hold its TP slices
//
// C++ modules have no forward hooks, so the layers a plan splits are
// declared with shardtorch's drop-in types, ParallelLinear and
// ParallelEmbedding (torch::nn::Linear and Embedding until a plan splits
// them: same options, parameters and names).
#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardtorch/export.h"
#include "shardtorch/world.h"

namespace shardtorch {

namespace detail {
struct TpLayer;
}

/// How parallelize() splits one module.
struct SHARDTORCH_API TpStyle {
  enum class Kind {
    Colwise,           // ParallelLinear: output features split (weight and bias rows)
    Rowwise,           // ParallelLinear: input features split (weight columns); partial outputs summed
    VocabEmbedding,    // ParallelEmbedding: rows (the vocabulary) split; lookups outside the slice give zeros
    SequenceParallel,  // any module between parallel layers (norms): its input is sharded on the sequence
                       // under sequence parallelism; its parameters' gradients are summed over the group
    ShardOutput,       // any module: its output is split along `dim` (a replicated position embedding
                       // feeding sequence-sharded activations)
  };
  /// Column-parallel Linear: each rank computes its slice of the output
  /// features from the whole input (its input's gradient summed over the
  /// group). The output stays sharded on its last dimension, the layout a
  /// row-parallel layer takes, unless gather_output.
  static TpStyle colwise() { return TpStyle(Kind::Colwise); }
  /// Row-parallel Linear: each rank multiplies its slice of the input
  /// features (a column layer's output) by its columns of the weight; the
  /// partial outputs are summed (all-reduce, or reduce-scatter along the
  /// sequence under sequence parallelism) and the bias added once.
  static TpStyle rowwise() { return TpStyle(Kind::Rowwise); }
  /// Vocabulary-parallel Embedding: each rank holds a slice of the rows.
  static TpStyle vocab_embedding() { return TpStyle(Kind::VocabEmbedding); }
  static TpStyle sequence_parallel() { return TpStyle(Kind::SequenceParallel); }
  static TpStyle shard_output(int64_t dim) { return TpStyle(Kind::ShardOutput).dim(dim); }

  TORCH_ARG(Kind, kind) = Kind::Colwise;
  /// Colwise: the output features are `parts` blocks laid end to end (a fused
  /// Q/K/V projection: 3), each split across the group, so that every rank
  /// gets its slice of each.
  TORCH_ARG(int, parts) = 1;
  /// Colwise: attention heads per part; the group's size must divide them
  /// (checked when the plan is applied, naming the module).
  TORCH_ARG(int64_t, heads) = 0;
  /// Colwise: all-gather the output (the whole output features on every rank).
  TORCH_ARG(bool, gather_output) = false;
  /// ShardOutput: the dimension split.
  TORCH_ARG(int64_t, dim) = 0;

 public:
  explicit TpStyle(Kind k = Kind::Colwise) : kind_(k) {}
};

/// Module names (exact, or with `*` standing for one name segment:
/// "blocks.*.attn.qkv") and the style of each.
struct SHARDTORCH_API TpPlan {
  /// Sequence parallelism (Megatron-LM's): the activations between a
  /// row-parallel layer and the next column-parallel one are sharded along
  /// `sequence_dim` (norms and residual adds then run on a slice of the
  /// sequence): a column layer all-gathers its input along it, a row layer
  /// reduce-scatters its output along it, a vocabulary-parallel embedding
  /// reduce-scatters its output along it.
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(int64_t, sequence_dim) = 1;

 public:
  TpPlan& add(std::string pattern, TpStyle style) {
    rules_.emplace_back(std::move(pattern), style);
    return *this;
  }
  const std::vector<std::pair<std::string, TpStyle>>& rules() const { return rules_; }

 private:
  std::vector<std::pair<std::string, TpStyle>> rules_;
};

/// A Linear a tensor-parallel plan can split; torch::nn::Linear until then.
class SHARDTORCH_API ParallelLinearImpl : public torch::nn::LinearImpl {
 public:
  using torch::nn::LinearImpl::LinearImpl;
  at::Tensor forward(const at::Tensor& input);
  /// Set by parallelize(); null: a plain Linear.
  std::shared_ptr<detail::TpLayer> tp;
};
TORCH_MODULE(ParallelLinear);

/// An Embedding a tensor-parallel plan can split by vocabulary.
class SHARDTORCH_API ParallelEmbeddingImpl : public torch::nn::EmbeddingImpl {
 public:
  using torch::nn::EmbeddingImpl::EmbeddingImpl;
  at::Tensor forward(const at::Tensor& indices);
  std::shared_ptr<detail::TpLayer> tp;
};
TORCH_MODULE(ParallelEmbedding);

/// An output projection that reuses another module's weight (an LM head
/// tied to the token embedding): x W^T with that very tensor. A colwise
/// style splits it along the vocabulary with the embedding's split.
class SHARDTORCH_API TiedLinearImpl : public torch::nn::Module {
 public:
  /// `shared_weight` [out, in]: registered here as "weight", the same tensor.
  explicit TiedLinearImpl(at::Tensor shared_weight);
  at::Tensor forward(const at::Tensor& input);
  at::Tensor weight;
  std::shared_ptr<detail::TpLayer> tp;
};
TORCH_MODULE(TiedLinear);

/// What parallelize() did.
struct SHARDTORCH_API TpReport {
  /// Module name and the style applied, in module order.
  std::vector<std::pair<std::string, TpStyle::Kind>> applied;
  /// Parameters split, with their full shapes.
  std::vector<std::pair<std::string, std::vector<int64_t>>> split;
};

/// Collective over `tp`: applies `plan` to `model`'s modules, in place:
/// each split parameter keeps its identity (the module's member, its name)
/// and becomes this rank's slice. Call it before shard() (which then shards
/// the slices over its own World) and before an optimizer is made. A rule
/// that matches no module, a style on a module of the wrong type, a size
/// the group does not divide (features, heads, vocabulary), a plan or group
/// size that differs across the group's ranks, or a parameter whose values
/// differ across them (a model built from another seed) is an error on every
/// rank, before anything changes. Parameters tied to a split one (an LM head
/// sharing the token embedding) are split with it, once.
SHARDTORCH_API TpReport parallelize(torch::nn::Module& model, std::shared_ptr<World> tp, const TpPlan& plan);

/// Collective over `tp`: checks that the parameters parallelize() left whole
/// (norms, position embeddings, biases added after a reduction) hold the
/// same values on every rank of the group, as the split layers' math
/// assumes; a rank that changed its own (an edit, another learning rate)
/// makes them differ. Of a sharded model, each rank's shard of them is
/// compared with its peers'. Throws on every rank naming the first that
/// differs and two ranks that disagree; returns how many were compared.
/// (parallelize() itself checks every constructed parameter, split or not,
/// before it splits.)
SHARDTORCH_API int64_t check_replicated(torch::nn::Module& root, const std::shared_ptr<World>& tp);

/// clip_grad_norm (shardtorch/clip.h) of a sharded model whose parameters
/// parallelize() split over `tp`: the norm of the whole model's gradients
/// (the slices of a split parameter summed over the group, a parameter whole
/// on every rank counted once), every gradient scaled by max_norm / (norm +
/// 1e-6) when that is below 1. Collective over the model's World and `tp`.
SHARDTORCH_API double clip_grad_norm(torch::nn::Module& root, const std::shared_ptr<World>& tp, double max_norm,
                                     double norm_type = 2.0);

/// Collective over `tp`: the mean cross entropy of `local_logits` [..., V/n]
/// (this rank's slice of the vocabulary, rank r holding rows [r V/n, (r+1)
/// V/n), as a column-parallel LM head gives them) against `targets` [...]
/// (ids in the whole vocabulary), without gathering the logits: the maximum,
/// the sum of exponentials and the target's logit are each all-reduced.
/// Equal to cross_entropy over the gathered logits (mean over `targets`).
SHARDTORCH_API at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                                       const std::shared_ptr<World>& tp);

}  // namespace shardtorch
