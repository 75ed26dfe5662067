#pragma once
// Optimizers over this rank's shards. Each of the model's parameters owns a
// contiguous piece (possibly empty) of its flat parameter's shard on every
// rank; the optimizer is LibTorch's own (torch::optim::Adam, AdamW, SGD) run
// over those pieces, so numerics, options and parameter groups are exactly
// torch::optim's, and state exists only for the elements this rank owns.
// One difference: under the sharded strategies a parameter that no rank used
// in a backward its unit took part in has a zero gradient, not none (its
// flat parameter's gradient is reduced whole), so the optimizer steps it
// (AdamW decays it, the moments decay), as FSDP's flat parameters do. Under
// NoShard such a parameter's gradient is undefined and it is skipped, as in
// torch::optim.
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "shardtorch/export.h"

namespace shardtorch {

namespace detail {
class ShardState;

/// An optimizer that writes a bf16 copy of a parameter in the same pass as
/// the parameter (shardtorch::FusedAdam(W)). ShardedOptimizer hands it CPU
/// offload's bf16 copies of the masters, which then stay fresh without being
/// made again before each copy to the device (docs/offload.md).
class SHARDTORCH_API LowCopyWriter {
 public:
  virtual ~LowCopyWriter() = default;
  /// From now on step() also writes `param`'s updated values into `low`
  /// (contiguous bf16 in host memory, as many elements as `param`).
  virtual void write_low_copy(const at::Tensor& param, at::Tensor low) = 0;
};

/// An optimizer that can update some of its parameters at a time
/// (shardtorch::FusedAdam(W)): ShardedOptimizer::overlap_with_backward.
class SHARDTORCH_API PartialStepper {
 public:
  virtual ~PartialStepper() = default;
  /// Throws what step() would refuse, before anything is updated.
  virtual void check_step() const = 0;
  /// What step() does to `params` (those of them with a gradient), unchecked.
  virtual void step_params(const std::vector<at::Tensor>& params) = 0;
  /// What step_params does to each `params[i]` were its gradient
  /// `grads[i].to(fp32) / divisor` (`grads[i]`: contiguous fp32 or bf16, the
  /// parameter's size and device), without any gradient tensor being made or
  /// set. False, with nothing updated: this optimizer cannot.
  virtual bool step_params_with(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                                double divisor) {
    (void)params, (void)grads, (void)divisor;
    return false;
  }
};

class StepInBackward;

/// Maps the model's parameters to their pieces of this rank's shards.
class SHARDTORCH_API ShardViews {
 public:
  explicit ShardViews(torch::nn::Module& root);
  ~ShardViews();
  ShardViews(const ShardViews&) = delete;
  ShardViews& operator=(const ShardViews&) = delete;
  /// Pieces of `params` (the model's own parameter tensors); frozen ones and
  /// ones with no piece on this rank are left out. Each parameter may be asked
  /// for once.
  std::vector<at::Tensor> take(const std::vector<at::Tensor>& params);
  /// Pieces of every trainable parameter not taken yet.
  std::vector<at::Tensor> take_rest();
  /// Whether some trainable parameter of the model is in no group yet: the
  /// same answer on every rank (take_rest() may be empty on a rank that owns
  /// none of those parameters' elements).
  bool rest_exists() const;
  /// Points each piece's grad at its part of the flat gradient shard.
  void bind_grads();
  void zero_grad();
  /// Offload: lets `opt`, if it is a LowCopyWriter, write the masters' bf16
  /// copies during its step; if it is not, after_step marks them stale.
  void attach_low_copies(torch::optim::Optimizer& opt);
  void after_step(const torch::optim::Optimizer& opt);
  /// ShardedOptimizer::overlap_with_backward.
  void overlap_with_backward(torch::optim::Optimizer& opt, bool on);
  /// Under the overlap: steps what the backward did not, and returns true;
  /// otherwise false (the caller steps everything).
  bool step_rest();
  /// Sets the memory tracker's optimizer-state figure from `opt`'s state
  /// (after a step, and after a checkpoint replaced the state).
  void count_optimizer_state(const torch::optim::Optimizer& opt) const;
  /// Throws, on every rank alike, naming the first trainable parameter whose
  /// optimized tensor (master shard, or NoShard's parameter or master) is not
  /// fp32 in host memory (or on CUDA, with fused_adam_cuda_available()). Decided from the flat parameters every rank
  /// has, not from this rank's pieces (a rank may own none of a parameter).
  void require_fp32_cpu(const std::string& who) const;

  struct SHARDTORCH_API Piece {
    at::Tensor view;       // what the optimizer updates
    void* flat;            // FlatParam*, or null under NoShard
    int64_t shard_offset;  // in the flat shard
    int64_t length;
    std::string name;      // the parameter's name
    int64_t param_offset;  // first element of the piece in the flattened parameter
    bool taken = false;
  };
  const std::vector<Piece>& pieces() const { return pieces_; }
  /// The sharded model's state these pieces belong to.
  const ShardState* state() const { return state_.get(); }

 private:
  std::shared_ptr<ShardState> state_;
  std::vector<Piece> pieces_;
  std::vector<std::pair<const void*, std::vector<size_t>>> by_param_;  // TensorImpl* -> pieces
  std::vector<std::string> param_names_;                               // of by_param_'s, in its order
  std::vector<const void*> asked_;
  std::vector<const void*> trainable_;
  int listener_ = -1;                // the state's zero_grad listener dropping the pieces' gradients
  bool low_copies_written_ = false;  // the optimizer writes the masters' bf16 copies
  std::unique_ptr<StepInBackward> overlap_;
};

/// Optimizers that update only contiguous fp32 host tensors (FusedAdam)
/// declare `static constexpr bool kNeedsFp32Cpu = true`.
template <class T, class = void>
struct needs_fp32_cpu : std::false_type {};
template <class T>
struct needs_fp32_cpu<T, std::void_t<decltype(T::kNeedsFp32Cpu)>> : std::bool_constant<T::kNeedsFp32Cpu> {};
}  // namespace detail

/// A parameter group: some of the model's parameters and their options.
template <class Options>
struct ParamGroup {
  std::vector<at::Tensor> params;
  Options options;
};

class SHARDTORCH_API ShardedOptimizer {
 public:
  /// Builds TorchOptim over the shards of `root` (which must be sharded).
  /// Groups come first, in order; the parameters in no group form a last
  /// group with `defaults`.
  template <class TorchOptim, class Options>
  static std::unique_ptr<ShardedOptimizer> make(torch::nn::Module& root, Options defaults,
                                                std::vector<ParamGroup<Options>> groups = {}) {
    auto views = std::make_unique<detail::ShardViews>(root);
    if constexpr (detail::needs_fp32_cpu<TorchOptim>::value) views->require_fp32_cpu("shardtorch FusedAdam");
    std::vector<torch::optim::OptimizerParamGroup> pgs;
    for (auto& g : groups) pgs.emplace_back(views->take(g.params), std::make_unique<Options>(g.options));
    auto rest = views->take_rest();
    if (groups.empty() || views->rest_exists()) pgs.emplace_back(std::move(rest), std::make_unique<Options>(defaults));
    auto inner = std::make_unique<TorchOptim>(std::move(pgs), defaults);
    views->attach_low_copies(*inner);
    return std::unique_ptr<ShardedOptimizer>(new ShardedOptimizer(std::move(views), std::move(inner)));
  }

  /// One update of this rank's shards from their reduced gradients.
  void step();
  /// CPU offload with FusedAdam(W): from now on (`on`), each flat parameter's
  /// shard is updated on the host as soon as its reduced gradient arrived
  /// there during a backward, overlapping the CPU update with the rest of
  /// that backward on the device; step() then updates whatever the backward
  /// did not and finishes the step. The result is bitwise the same as without
  /// the overlap. Every backward that synchronizes gradients must be followed
  /// by step() (accumulate micro-batches with set_requires_gradient_sync(
  /// false)); set the learning rate before the backward; no clip_grad_norm or
  /// GradScaler (each refused with an error saying so). See docs/offload.md.
  void overlap_with_backward(bool on = true);
  /// Drops the gradient shards (set to none).
  void zero_grad();
  size_t num_groups() const { return inner_->param_groups().size(); }
  double lr(size_t group = 0) const;
  /// Sets the learning rate of every group (schedules), or of one.
  void set_lr(double lr);
  void set_lr(size_t group, double lr);
  torch::optim::Optimizer& inner() { return *inner_; }
  const detail::ShardViews& views() const { return *views_; }

 private:
  ShardedOptimizer(std::unique_ptr<detail::ShardViews> views, std::unique_ptr<torch::optim::Optimizer> inner)
      : views_(std::move(views)), inner_(std::move(inner)) {}
  std::unique_ptr<detail::ShardViews> views_;
  std::unique_ptr<torch::optim::Optimizer> inner_;
};

/// torch::optim::Adam / AdamW over the shards; where every optimized tensor
/// is an fp32 CUDA tensor, the library has its CUDA kernel
/// (fused_adam_cuda_available()) and no group uses amsgrad, FusedAdam /
/// FusedAdamW instead (same options and state, one kernel per piece; the
/// update is the same within a few ulp). The choice is the same on every
/// rank. For torch::optim's exactly, use ShardedOptimizer::make<torch::optim::AdamW>.
SHARDTORCH_API std::unique_ptr<ShardedOptimizer> Adam(torch::nn::Module& root, torch::optim::AdamOptions defaults,
                                                      std::vector<ParamGroup<torch::optim::AdamOptions>> groups = {});
SHARDTORCH_API std::unique_ptr<ShardedOptimizer> AdamW(torch::nn::Module& root, torch::optim::AdamWOptions defaults,
                                                       std::vector<ParamGroup<torch::optim::AdamWOptions>> groups = {});
inline std::unique_ptr<ShardedOptimizer> SGD(torch::nn::Module& root, torch::optim::SGDOptions defaults,
                                             std::vector<ParamGroup<torch::optim::SGDOptions>> groups = {}) {
  return ShardedOptimizer::make<torch::optim::SGD>(root, defaults, std::move(groups));
}

}  // namespace shardtorch
