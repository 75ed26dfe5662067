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

#include <c10/util/OptionalArrayRef.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "shardtorch/flat_param.h"
#include "shardtorch/memory.h"
#include "shardtorch/world.h"

namespace shardtorch {

/// Where parameters, gradients and optimizer state live (docs/design.md).
enum class Strategy {
  FullShard,      // ZeRO-3: all three sharded
  ShardGradOp,    // ZeRO-2: gradients and optimizer state sharded
  OptimizerOnly,  // ZeRO-1: optimizer state sharded
  NoShard,        // DDP: bucketed, overlapped all-reduce
  HybridShard,    // FullShard within groups of hybrid_shard_size ranks, replicated across groups
};
/// "full_shard"/"zero3", "shard_grad_op"/"zero2", "optimizer_only"/"zero1",
/// "no_shard"/"ddp", "hybrid_shard"/"hybrid" (any case); throws on others.
Strategy parse_strategy(const std::string& name);
const char* strategy_name(Strategy s);

/// Mixed precision: fp32 master shards (owned by the optimizer), parameters
/// gathered and computed in param_dtype, gradients reduced in reduce_dtype.
struct MixedPrecision {
  /// Gathering and compute dtype (kBFloat16 or kHalf); unset: no mixed precision.
  TORCH_ARG(std::optional<at::ScalarType>, param_dtype) = std::nullopt;
  /// Gradient reduction dtype; unset: param_dtype. kFloat reduces in fp32.
  TORCH_ARG(std::optional<at::ScalarType>, reduce_dtype) = std::nullopt;
  /// The root unit's tensor output is cast to this (e.g. kFloat for the loss).
  TORCH_ARG(std::optional<at::ScalarType>, output_dtype) = std::nullopt;
  /// Floating-point buffers are cast to this at shard().
  TORCH_ARG(std::optional<at::ScalarType>, buffer_dtype) = std::nullopt;
  /// Floating-point tensor arguments of the root's forward are cast to param_dtype.
  TORCH_ARG(bool, cast_root_inputs) = true;
  /// Parameters and buffers of batch-norm layers (BatchNorm1d/2d/3d) stay in
  /// their own dtype (fp32), as under FSDP: they normalise low-precision
  /// inputs with full-precision statistics. false: cast like the others.
  TORCH_ARG(bool, keep_batch_norm_fp32) = true;
};

struct ShardOptions {
  TORCH_ARG(Strategy, strategy) = Strategy::FullShard;
  /// Mixed precision (every strategy; NoShard keeps fp32 master copies).
  TORCH_ARG(MixedPrecision, mixed_precision) = {};
  /// Free a unit's full parameters after its forward (FullShard and
  /// HybridShard); when false they stay until the end of backward. The root
  /// unit stays gathered after a forward in grad mode either way.
  TORCH_ARG(bool, reshard_after_forward) = true;
  /// Size of one reduce-scatter (or, for NoShard, all-reduce) bucket in MiB;
  /// 0 disables coalescing of reduce-scatters.
  TORCH_ARG(double, bucket_mb) = 25.0;
  /// Broadcast parameters and buffers from rank 0 at shard().
  TORCH_ARG(bool, sync_module_states) = true;
  /// After each optimizer step (of a shardtorch optimizer), broadcast the
  /// module's buffers (batch-norm running statistics, ...) from rank 0, so
  /// every rank's next forward uses rank 0's, as DDP's broadcast_buffers
  /// does. One broadcast per buffer dtype; nothing for a model without
  /// buffers. false: each rank keeps its own (FSDP's behaviour).
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// HybridShard: ranks per shard group (must divide the world size).
  TORCH_ARG(int, hybrid_shard_size) = 0;
  /// NoShard: launch each bucket's all-reduce as soon as its gradients are in
  /// (overlapping backward); false waits for the end of backward.
  TORCH_ARG(bool, ddp_async) = true;
  /// NoShard: a trainable parameter that gets no gradient in a backward on
  /// some rank is an error on every rank naming it (default: reduced as zero
  /// there; one no rank gave a gradient since it was zeroed gets none).
  TORCH_ARG(bool, error_on_unused_parameters) = false;
  /// FullShard and HybridShard: launch the next unit's all-gather (in the
  /// order the previous step ran them) while the current unit computes, in
  /// forward and in backward; one more unit's full parameters alive at a time
  /// (docs/design.md, "Prefetch").
  TORCH_ARG(bool, prefetch) = false;
  /// CPU offload (every strategy but NoShard; docs/offload.md): the fp32
  /// master shards, the gradient shards and the optimizer state live in host
  /// memory (pinned when units compute on an accelerator); a unit's shard is
  /// copied to the device before its all-gather, reduced gradient shards are
  /// copied back, and the optimizer steps on the CPU.
  TORCH_ARG(bool, cpu_offload) = false;
  /// Activation checkpointing (every strategy; docs/api.md, docs/design.md):
  /// every unit that has no unit inside it and shares no parameter with
  /// another unit, the root excepted, keeps only its inputs from the forward
  /// and recomputes its activations in backward, without a second all-gather.
  TORCH_ARG(bool, activation_checkpointing) = false;

 public:  // (TORCH_ARG leaves the access private)
  /// activation_checkpointing for one unit, by name; true for the root, a
  /// unit with units inside or one with a parameter shared with another unit
  /// (tied) is an error at shard().
  ShardOptions& activation_checkpointing_for(const std::string& unit, bool value) {
    per_unit_checkpointing_[unit] = value;
    return *this;
  }
  const std::map<std::string, bool>& per_unit_checkpointing() const { return per_unit_checkpointing_; }
  /// reshard_after_forward for one unit, by name ("" is the root).
  ShardOptions& reshard_after_forward_for(const std::string& unit, bool value) {
    per_unit_reshard_[unit] = value;
    return *this;
  }
  bool reshard_after_forward_of(const std::string& unit) const {
    auto it = per_unit_reshard_.find(unit);
    return it == per_unit_reshard_.end() ? reshard_after_forward_ : it->second;
  }
  const std::map<std::string, bool>& per_unit_reshard() const { return per_unit_reshard_; }
  /// Whether prefetch takes effect: on, under a strategy that gathers units.
  bool prefetches() const {
    return prefetch() && (strategy() == Strategy::FullShard || strategy() == Strategy::HybridShard);
  }

 private:
  std::map<std::string, bool> per_unit_reshard_;
  std::map<std::string, bool> per_unit_checkpointing_;
};

namespace detail {
class Unit;
class ShardState;
struct Checkpointing;
std::shared_ptr<ShardState> state_of(torch::nn::Module& root);
/// A checkpointed unit's forward, replayable: given its tensor inputs, runs
/// the Impl's forward and returns its tensor outputs (`first`: the forward
/// itself, not the recomputation in backward).
using RecomputeFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs, bool first)>;
}  // namespace detail

/// The handle every Sharded<Impl> carries.
class UnitBase {
 public:
  virtual ~UnitBase();
  /// True once shard() has taken this module as a unit.
  bool is_sharded_unit() const { return static_cast<bool>(unit_); }
  const std::shared_ptr<detail::Unit>& unit_handle() const { return unit_; }
  /// The unit's name if shard() made it checkpointed (activation_checkpointing).
  std::string checkpoint_label() const;

 protected:
  void before_forward();
  /// Returns true if it replaced an output: an input or a leaf returned as it
  /// is becomes a copy, so that the unit's backward hook is its own
  /// (docs/design.md, "Ordering and consistency across ranks").
  bool after_forward(std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs);
  /// Mixed precision at the root: the dtype floating inputs are cast to, and
  /// the dtype a tensor output is cast to.
  std::optional<at::ScalarType> input_dtype() const;
  std::optional<at::ScalarType> output_dtype() const;
  /// Activation checkpointing is on for this unit and grad mode is enabled.
  bool checkpointing_now() const;
  /// After Module::zero_grad on `self` (this unit): drops the gradients its
  /// shards hold, as the optimizer's zero_grad does. NoShard: clears the
  /// bucket slices of `self`'s parameters (the root: every bucket).
  void zero_shard_grads(torch::nn::Module& self);
  /// Runs `run(inputs, true)` without keeping activations and returns its
  /// outputs attached to one autograd node that recomputes them in backward.
  std::vector<at::Tensor> checkpointed_forward(std::vector<at::Tensor> inputs, detail::RecomputeFn run);
  /// Until dismissed, gives the unit's memory back when its forward throws
  /// (docs/design.md, "A forward that fails").
  class ForwardGuard {
   public:
    explicit ForwardGuard(UnitBase* unit) : unit_(unit) {}
    ~ForwardGuard() {
      if (unit_) unit_->forward_failed();
    }
    ForwardGuard(const ForwardGuard&) = delete;
    ForwardGuard& operator=(const ForwardGuard&) = delete;
    void dismiss() { unit_ = nullptr; }

   private:
    UnitBase* unit_;
  };

 private:
  void forward_failed() noexcept;
  friend class detail::ShardState;
  std::shared_ptr<detail::Unit> unit_;
  std::shared_ptr<detail::Checkpointing> checkpointing_;  // set by shard() for checkpointed units
  std::weak_ptr<detail::ShardState> no_shard_state_;       // NoShard: set by shard() for every module like this
};

namespace detail {
// Declared first, so that tuples and pairs of each other (and of anything)
// find them all.
template <class T>
void collect_tensors(std::vector<at::Tensor>&, const T&);
template <class T>
void replace_tensors(T&, const std::vector<at::Tensor>&, size_t&);
template <class... T>
void collect_tensors(std::vector<at::Tensor>& out, const std::tuple<T...>& t);
template <class A, class B>
void collect_tensors(std::vector<at::Tensor>& out, const std::pair<A, B>& p);
template <class... T>
void replace_tensors(std::tuple<T...>& t, const std::vector<at::Tensor>& v, size_t& i);
template <class A, class B>
void replace_tensors(std::pair<A, B>& p, const std::vector<at::Tensor>& v, size_t& i);

inline void collect_tensors(std::vector<at::Tensor>& out, const at::Tensor& t) { out.push_back(t); }
inline void collect_tensors(std::vector<at::Tensor>& out, const std::optional<at::Tensor>& t) {
  if (t) out.push_back(*t);
}
inline void collect_tensors(std::vector<at::Tensor>& out, const std::vector<at::Tensor>& v) {
  out.insert(out.end(), v.begin(), v.end());
}
template <class... T>
void collect_tensors(std::vector<at::Tensor>& out, const std::tuple<T...>& t) {
  std::apply([&](const auto&... x) { (collect_tensors(out, x), ...); }, t);
}
template <class A, class B>
void collect_tensors(std::vector<at::Tensor>& out, const std::pair<A, B>& p) {
  collect_tensors(out, p.first);
  collect_tensors(out, p.second);
}
template <class T>
void collect_tensors(std::vector<at::Tensor>&, const T&) {}  // carries no tensor we can hook

// The inverse of collect_tensors: puts tensors back, in the same order.
inline void replace_tensors(at::Tensor& t, const std::vector<at::Tensor>& v, size_t& i) { t = v.at(i++); }
inline void replace_tensors(std::optional<at::Tensor>& t, const std::vector<at::Tensor>& v, size_t& i) {
  if (t) *t = v.at(i++);
}
inline void replace_tensors(std::vector<at::Tensor>& x, const std::vector<at::Tensor>& v, size_t& i) {
  for (auto& t : x) t = v.at(i++);
}
template <class... T>
void replace_tensors(std::tuple<T...>& t, const std::vector<at::Tensor>& v, size_t& i) {
  std::apply([&](auto&... x) { (replace_tensors(x, v, i), ...); }, t);
}
template <class A, class B>
void replace_tensors(std::pair<A, B>& p, const std::vector<at::Tensor>& v, size_t& i) {
  replace_tensors(p.first, v, i);
  replace_tensors(p.second, v, i);
}
template <class T>
void replace_tensors(T&, const std::vector<at::Tensor>&, size_t&) {}

// What a checkpointed forward may return: tensors only.
template <class T>
struct all_tensors : std::false_type {};
template <>
struct all_tensors<at::Tensor> : std::true_type {};
template <>
struct all_tensors<std::vector<at::Tensor>> : std::true_type {};
template <class... T>
struct all_tensors<std::tuple<T...>> : std::bool_constant<(all_tensors<std::decay_t<T>>::value && ...)> {};
template <class A, class B>
struct all_tensors<std::pair<A, B>> : std::bool_constant<all_tensors<A>::value && all_tensors<B>::value> {};
[[noreturn]] void checkpointed_forward_returns_non_tensors(const UnitBase& unit);

// What a checkpointed forward may take: arguments that can be kept until
// backward and passed again. Views (ArrayRef, string_view) would dangle, and a
// non-const reference would be written to a copy.
template <class T>
struct is_view_type : std::false_type {};
template <class T>
struct is_view_type<c10::ArrayRef<T>> : std::true_type {};
template <class T>
struct is_view_type<c10::OptionalArrayRef<T>> : std::true_type {};
template <>
struct is_view_type<std::string_view> : std::true_type {};
template <class A>
constexpr bool keepable_arg = !(std::is_lvalue_reference_v<A> && !std::is_const_v<std::remove_reference_t<A>>) &&
                              !is_view_type<std::decay_t<A>>::value;
[[noreturn]] void checkpointed_forward_takes_unkeepable_arguments(const UnitBase& unit);
[[noreturn]] void checkpointed_unit_destroyed();

// Casts a floating-point tensor argument; passes anything else through.
template <class T>
decltype(auto) cast_input(T&& arg, const std::optional<at::ScalarType>& dtype) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, at::Tensor> && !(std::is_lvalue_reference_v<T> && !std::is_const_v<std::remove_reference_t<T>>)) {
    if (dtype && arg.defined() && arg.is_floating_point() && arg.scalar_type() != *dtype) return at::Tensor(arg.to(*dtype));
    return at::Tensor(std::forward<T>(arg));
  } else {
    return std::forward<T>(arg);
  }
}
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
    const bool checkpoint = checkpointing_now();
    if (!is_sharded_unit() && !checkpoint) return Impl::forward(std::forward<A>(args)...);
    std::vector<at::Tensor> inputs;  // to tell an input passed through
    if (is_sharded_unit() && !checkpoint) (detail::collect_tensors(inputs, args), ...);
    ForwardGuard guard(is_sharded_unit() ? this : nullptr);
    if (is_sharded_unit()) before_forward();
    const auto in_dtype = is_sharded_unit() ? input_dtype() : std::nullopt;
    R out = checkpoint ? checkpointed(detail::cast_input(std::forward<A>(args), in_dtype)...)
                       : Impl::forward(detail::cast_input(std::forward<A>(args), in_dtype)...);
    if (!is_sharded_unit()) return out;  // NoShard: checkpointing without a unit (no guard)
    if constexpr (std::is_same_v<R, at::Tensor>) {
      if (auto od = output_dtype(); od && out.is_floating_point() && out.scalar_type() != *od) out = out.to(*od);
    }
    std::vector<at::Tensor> outputs;
    detail::collect_tensors(outputs, out);
    if (after_forward(outputs, inputs)) {
      size_t k = 0;
      detail::replace_tensors(out, outputs, k);
    }
    guard.dismiss();  // post-forward has run: the unit is where it should be
    return out;
  }

  /// LibTorch's Module::zero_grad (gradients set to none by default) reaches
  /// the gradients the shards hold too (it calls the zero_grad of every
  /// module inside, so a plain root reaches every unit).
  void zero_grad(bool set_to_none = true) override {
    Impl::zero_grad(set_to_none);
    zero_shard_grads(*this);
  }

 private:
  // Activation checkpointing (docs/design.md): the arguments are kept with
  // their tensors taken out; the recomputation puts the (detached) inputs back.
  template <class... B>
  R checkpointed(B&&... args) {
    if constexpr (!detail::all_tensors<std::decay_t<R>>::value) {
      detail::checkpointed_forward_returns_non_tensors(*this);
    } else if constexpr (!(detail::keepable_arg<A> && ...)) {
      detail::checkpointed_forward_takes_unkeepable_arguments(*this);
    } else {
      using Args = std::tuple<std::decay_t<A>...>;
      auto saved = std::make_shared<Args>(std::forward<B>(args)...);
      std::vector<at::Tensor> inputs;
      detail::collect_tensors(inputs, *saved);
      size_t i = 0;
      detail::replace_tensors(*saved, std::vector<at::Tensor>(inputs.size()), i);
      auto first = std::make_shared<std::optional<R>>();
      // The node keeps `run` until its graph dies: it must not keep the module alive, nor call a dead one.
      std::weak_ptr<torch::nn::Module> alive = this->weak_from_this();
      const bool owned = !alive.expired();  // held by a shared_ptr (a holder), as modules usually are
      detail::RecomputeFn run = [this, alive, owned, saved, first](const std::vector<at::Tensor>& in, bool is_first) {
        if (!is_first && owned && alive.expired()) detail::checkpointed_unit_destroyed();
        Args a = *saved;
        size_t k = 0;
        detail::replace_tensors(a, in, k);
        R r = std::apply([this](auto&... x) -> R { return Impl::forward(x...); }, a);
        std::vector<at::Tensor> outs;
        detail::collect_tensors(outs, r);
        if (is_first) *first = std::move(r);
        return outs;
      };
      std::vector<at::Tensor> wrapped = checkpointed_forward(std::move(inputs), std::move(run));
      R out = std::move(**first);
      first->reset();  // the node keeps `run`, not the outputs
      size_t k = 0;
      detail::replace_tensors(out, wrapped, k);
      return out;
    }
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
  /// This rank's collectives so far, summed over the world and (HybridShard)
  /// the shard and replica groups.
  CommStats comm_stats() const;
  std::vector<UnitInfo> units() const;
  Strategy strategy() const;

  /// With false, backwards accumulate gradients locally and reduce nothing;
  /// the first backward with true reduces the sum (gradient accumulation).
  void set_requires_gradient_sync(bool sync);
  bool requires_gradient_sync() const;
  /// RAII: no synchronisation while it lives.
  class NoSync {
   public:
    explicit NoSync(std::shared_ptr<detail::ShardState> s);
    ~NoSync();
    NoSync(NoSync&&) = default;

   private:
    std::shared_ptr<detail::ShardState> state_;
    bool previous_;
  };
  NoSync no_sync();

  /// NoShard: buckets whose all-reduce was launched from a gradient hook,
  /// i.e. while backward was still running (overlap), since shard().
  int64_t buckets_launched_during_backward() const;
  /// Sharded strategies: gradient reduce-scatters (OptimizerOnly: its
  /// gradient all-reduces) launched while an earlier one was still in
  /// flight, since shard() (they overlap each other and the rest of
  /// backward; 0 when every bucket is reduced at the end of backward).
  int64_t reduce_scatters_overlapped() const;
  /// Sharded strategies: gradient reduce-scatters launched past the limit of
  /// kMaxReduceScattersInFlight, since shard(), because the oldest had not
  /// completed within kReduceScatterLimitWait: this rank finished units
  /// before a peer did (data-dependent routing). Each holds one more bucket
  /// for a while; 0 in models whose units finish in the same order everywhere.
  int64_t reduce_scatters_past_the_limit() const;
  /// Gradient reductions started since shard(): flat gradients handed to a
  /// reduce-scatter or all-reduce, and NoShard buckets launched.
  int64_t gradient_reductions() const;
  /// Sharded strategies: units whose gradients were final before their turn
  /// in the reduction order, since shard(). They wait (holding their staged
  /// gradient) so that every rank issues its collectives in one order; 0 when
  /// units finish in that order (docs/design.md, "Ordering and consistency
  /// across ranks").
  int64_t reductions_deferred() const;
  /// CPU offload: bytes copied from host memory to the compute device (master
  /// shards, or their bf16 copies, before all-gathers) and back (reduced
  /// gradient shards), since shard(); both 0 without offload.
  struct OffloadTraffic {
    int64_t to_device_bytes = 0, to_host_bytes = 0;
  };
  OffloadTraffic offload_traffic() const;
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
