#pragma once
// Sharded modules: units marked in the model's definition, and shard().
//
// A unit is a module declared as shardtorch::Sharded<Impl>: an Impl whose
// forward wraps the original. Before shard() it is a plain pass-through.
// shard(root, world, options) gives every parameter to its innermost unit (a
// parameter shared by several units to their lowest common ancestor unit; the
// rest to the root, which must then be a unit), lays each unit's parameters of
// one dtype (and one requires_grad) end to end in a FlatParam, keeps this
// rank's shard and frees the rest.
//
// The life of a unit in one training step (docs/design.md has the long form):
//
//   Sharded --pre-forward: all-gather--> Unsharded
//   Unsharded --post-forward, reshard_after_forward--> Sharded
//     (hooks on the outputs are registered first)
//   Sharded --pre-backward (a hook on an output fires): all-gather--> Unsharded
//   Unsharded --all its gradients accumulated: staged flat gradient handed
//     to the ReduceScatterBucketer--> Reducing --full buffer freed--> Sharded
//   end of backward (autograd engine callback): units touched but not yet
//     reduced are reduced (missing gradients as zeros), buckets flushed (the
//     callbacks add the reduced shards into each FlatParam's shard_grad) and
//     freed; every unit still gathered (the root) is resharded.
//
// The root unit stays gathered from its forward to the end of backward (its
// parameters are needed again at once); the other units follow
// reshard_after_forward.
#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "shardtorch/flat_param.h"
#include "shardtorch/memory.h"
#include "shardtorch/world.h"

namespace shardtorch {

struct ShardOptions {
  /// Free a unit's full parameters after its forward (ZeRO-3); when false they
  /// stay until the end of backward. The root unit always stays.
  TORCH_ARG(bool, reshard_after_forward) = true;
  /// Size of one reduce-scatter bucket in MiB; 0 disables coalescing.
  TORCH_ARG(double, bucket_mb) = 25.0;
  /// Broadcast parameters and buffers from rank 0 at shard().
  TORCH_ARG(bool, sync_module_states) = true;
};

namespace detail {
class Unit;
class ShardState;
std::shared_ptr<ShardState> state_of(torch::nn::Module& root);
}  // namespace detail

/// The handle every Sharded<Impl> carries.
class UnitBase {
 public:
  virtual ~UnitBase();
  /// True once shard() has taken this module as a unit.
  bool is_sharded_unit() const { return static_cast<bool>(unit_); }
  const std::shared_ptr<detail::Unit>& unit_handle() const { return unit_; }

 protected:
  void before_forward();
  void after_forward(const std::vector<at::Tensor>& outputs);

 private:
  friend class detail::ShardState;
  std::shared_ptr<detail::Unit> unit_;
};

namespace detail {
inline void collect_tensors(std::vector<at::Tensor>& out, const at::Tensor& t) { out.push_back(t); }
inline void collect_tensors(std::vector<at::Tensor>& out, const std::vector<at::Tensor>& v) {
  out.insert(out.end(), v.begin(), v.end());
}
template <class... T>
void collect_tensors(std::vector<at::Tensor>& out, const std::tuple<T...>& t) {
  std::apply([&](const auto&... x) { (collect_tensors(out, x), ...); }, t);
}
template <class T>
void collect_tensors(std::vector<at::Tensor>&, const T&) {}  // carries no tensor we can hook
}  // namespace detail

/// Marks a module as a unit: `TORCH_MODULE_IMPL(Block, shardtorch::Sharded<BlockImpl>)`.
/// Impl must have one (non-template, non-overloaded) forward.
template <class Impl, class Sig = decltype(&Impl::forward)>
class Sharded;

template <class Impl, class R, class C, class... A>
class Sharded<Impl, R (C::*)(A...)> : public Impl, public UnitBase {
 public:
  using Impl::Impl;
  R forward(A... args) {
    if (!is_sharded_unit()) return Impl::forward(std::forward<A>(args)...);
    before_forward();
    R out = Impl::forward(std::forward<A>(args)...);
    std::vector<at::Tensor> outputs;
    detail::collect_tensors(outputs, out);
    after_forward(outputs);
    return out;
  }
};

/// `SHARDTORCH_MODULE(Block)` declares the holder `Block` for `Sharded<BlockImpl>`.
#define SHARDTORCH_MODULE(Name) TORCH_MODULE_IMPL(Name, ::shardtorch::Sharded<Name##Impl>)

struct UnitInfo {
  std::string name;  // "" for the root
  std::vector<FlatParamLayout> layouts;
  std::vector<std::vector<std::string>> param_names;  // per flat parameter
  std::vector<bool> frozen;                           // per flat parameter
};

/// What shard() returns: a handle on the sharded model's state.
class ShardedModel {
 public:
  explicit ShardedModel(std::shared_ptr<detail::ShardState> state) : state_(std::move(state)) {}
  const World& world() const;
  /// This rank's bytes by category.
  MemorySnapshot memory() const;
  void reset_peak_memory();
  /// Collectives this rank ran.
  const CommStats& comm_stats() const;
  std::vector<UnitInfo> units() const;
  const std::shared_ptr<detail::ShardState>& state() const { return state_; }

 private:
  std::shared_ptr<detail::ShardState> state_;
};

/// Shards `root` over `world`. Collective: every rank must call it with the
/// same model; models that differ fail on every rank, naming the first
/// differing parameter and the ranks.
ShardedModel shard(torch::nn::Module& root, std::shared_ptr<World> world, ShardOptions options = {});
inline ShardedModel shard(torch::nn::Module& root, World& world, ShardOptions options = {}) {
  return shard(root, world.shared_from_this(), options);
}
template <class M, class W>
ShardedModel shard(torch::nn::ModuleHolder<M>& root, W&& world, ShardOptions options = {}) {
  return shard(*root, std::forward<W>(world), options);
}
/// The handle of a model shard() was called on; throws if it never was.
ShardedModel sharded_model(torch::nn::Module& root);

}  // namespace shardtorch
