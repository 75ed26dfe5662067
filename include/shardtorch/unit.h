#pragma once
// Units: a module declared as shardtorch::Sharded<Impl> (usually through
// SHARDTORCH_MODULE(Name)) is an Impl whose forward wraps the original.
// Before shard() it is a plain pass-through; shard() gives it its
// parameters, and its forward then gathers them, hooks its outputs for
// backward and frees them again (docs/design.md, "States").
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <c10/util/OptionalArrayRef.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "shardtorch/export.h"

namespace shardtorch {

namespace detail {
class Unit;
class ShardState;
struct Checkpointing;
/// A checkpointed unit's forward, replayable: given its tensor inputs, runs
/// the Impl's forward and returns its tensor outputs (`first`: the forward
/// itself, not the recomputation in backward).
using RecomputeFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs, bool first)>;
}  // namespace detail

/// The handle every Sharded<Impl> carries.
class SHARDTORCH_API UnitBase {
 public:
  virtual ~UnitBase();
  /// True once shard() has taken this module as a unit.
  bool is_sharded_unit() const { return static_cast<bool>(unit_); }
  const std::shared_ptr<detail::Unit>& unit_handle() const { return unit_; }
  /// The unit's name if shard() made it checkpointed (activation_checkpointing).
  std::string checkpoint_label() const;

 protected:
  /// `inputs`: the forward's tensor arguments (the root's are part of the
  /// collectives' fingerprint: WorldOptions::check_collectives).
  void before_forward(const std::vector<at::Tensor>& inputs);
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
  /// A module of this kind that shard() did not take ran its forward: inside
  /// the forward of a sharded model's unit (on this thread), that is an
  /// error naming the rank, the unit and `impl_type` (the module is not part
  /// of the model: shard() never saw it, and its parameters would be neither
  /// reduced nor trained). Elsewhere (before shard(), a model never
  /// sharded), nothing.
  void check_part_of_the_model(const char* impl_type) const;
  /// Until dismissed, gives the unit's memory back when its forward throws
  /// (docs/design.md, "A forward that fails").
  class SHARDTORCH_API ForwardGuard {
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
  std::weak_ptr<detail::ShardState> no_shard_state_;      // NoShard: set by shard() for every module like this
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
[[noreturn]] SHARDTORCH_API void checkpointed_forward_returns_non_tensors(const UnitBase& unit);

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
constexpr bool keepable_arg = !(std::is_lvalue_reference_v<A> &&
                                !std::is_const_v<std::remove_reference_t<A>>)&&!is_view_type<std::decay_t<A>>::value;
[[noreturn]] SHARDTORCH_API void checkpointed_forward_takes_unkeepable_arguments(const UnitBase& unit);
[[noreturn]] SHARDTORCH_API void checkpointed_unit_destroyed();

// Casts a floating-point tensor argument; passes anything else through.
template <class T>
decltype(auto) cast_input(T&& arg, const std::optional<at::ScalarType>& dtype) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, at::Tensor> &&
                !(std::is_lvalue_reference_v<T> && !std::is_const_v<std::remove_reference_t<T>>)) {
    if (dtype && arg.defined() && arg.is_floating_point() && arg.scalar_type() != *dtype)
      return at::Tensor(arg.to(*dtype));
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
    if (!is_sharded_unit() && !checkpoint) {
      check_part_of_the_model(typeid(Impl).name());
      return Impl::forward(std::forward<A>(args)...);
    }
    std::vector<at::Tensor> inputs;  // to tell an input passed through
    if (is_sharded_unit() && !checkpoint) (detail::collect_tensors(inputs, args), ...);
    ForwardGuard guard(is_sharded_unit() ? this : nullptr);
    if (is_sharded_unit()) before_forward(inputs);
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

}  // namespace shardtorch
