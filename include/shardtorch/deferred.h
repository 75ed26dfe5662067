#pragma once
// Deferred construction: build a model without allocating its parameters.
//
//   torch::manual_seed(0);
//   GPT gpt = shardtorch::deferred([&] { return GPT(cfg); });  // no parameter data anywhere
//   auto sharded = shardtorch::shard(gpt, world);                // each rank makes its shards only
//
// While a DeferredInit lives (on its thread), every tensor factory (empty,
// zeros, randn, scalar_tensor, ...) returns a *deferred* tensor: a meta tensor
// (shape, dtype and strides, no data) that remembers the device it was asked
// for, and every operation on deferred tensors (the modules' in-place
// initialisers: uniform_, normal_, fill_, zero_, copy_, views of them) is run
// on the meta device and recorded. shard() (or materialize()) replays the
// recorded operations of one unit at a time on the device asked for, with the
// random generator in the state each random operation saw in eager
// construction, so the values are bitwise those of eager construction from
// the same seed (docs/large-models.md says exactly when).
//
// Contracts:
// - The modules' code is unchanged; only the tensors they create are deferred.
// - Deferred construction draws nothing from any random generator: after the
//   guard, the generators are where they were before it (eager construction
//   would have advanced them). Seed again after construction if later code
//   must see the same random stream as an eager program.
// - Reading a deferred tensor's values (.item(), an op mixing it with a real
//   tensor: a forward before shard()) throws, naming the parameter where it is
//   known (deferred() and shard() name them; a bare guard does not).
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "shardtorch/export.h"

namespace shardtorch {

namespace detail {
class DeferredSession;
}

/// RAII: while it lives, tensor factories on this thread produce deferred
/// tensors and operations on deferred tensors are recorded. Guards nest (an
/// inner one records into the outer one's session).
class SHARDTORCH_API DeferredInit {
 public:
  DeferredInit();
  ~DeferredInit();
  DeferredInit(const DeferredInit&) = delete;
  DeferredInit& operator=(const DeferredInit&) = delete;
  /// Operations recorded so far in this guard's session.
  int64_t recorded_ops() const;

 private:
  std::shared_ptr<detail::DeferredSession> session_;
  std::shared_ptr<detail::DeferredSession> previous_;
  struct KeyGuard;
  std::unique_ptr<KeyGuard> keys_;
};

/// Whether `t` is deferred (has no data yet).
SHARDTORCH_API bool is_deferred(const at::Tensor& t);

/// Gives the deferred parameters and buffers of `module` their names (as
/// named_parameters() says them, after `prefix`), so that errors name them.
SHARDTORCH_API void name_deferred(torch::nn::Module& module, const std::string& prefix = "");

/// Deferred parameters and buffers of `module` (each tensor once).
SHARDTORCH_API int64_t count_deferred(torch::nn::Module& module);

/// Gives every deferred parameter and buffer of `module` its values, on
/// `device` (default: the device each was asked for at construction). The
/// whole module is then allocated: for a model that fits (a test, one
/// device); shard() materialises one unit at a time instead. The tensors keep
/// their identity (the module's members and any optimizer see the values).
SHARDTORCH_API void materialize(torch::nn::Module& module, std::optional<c10::Device> device = std::nullopt);
template <class M>
void materialize(torch::nn::ModuleHolder<M>& module, std::optional<c10::Device> device = std::nullopt) {
  materialize(*module, device);
}

namespace detail {
template <class R, class = void>
struct derefs_to_module : std::false_type {};
template <class R>
struct derefs_to_module<R, std::void_t<decltype(*std::declval<R&>())>>
    : std::is_base_of<torch::nn::Module, std::decay_t<decltype(*std::declval<R&>())>> {};
}  // namespace detail

/// Marks the deferred parameters and buffers of `module` to become zeros
/// when materialised (by shard() or materialize()) instead of replaying their
/// construction: for a model whose values come from a checkpoint loaded right
/// after shard() (load_full_state_dict, load_sharded_checkpoint), which then
/// skips the replay's compute. Returns how many it marked.
SHARDTORCH_API int64_t skip_deferred_init(torch::nn::Module& module);
template <class M>
int64_t skip_deferred_init(torch::nn::ModuleHolder<M>& module) {
  return skip_deferred_init(*module);
}

/// Calls `make()` under a DeferredInit and names the deferred tensors of what
/// it returns (a module holder or a module), so that errors name them.
template <class F>
auto deferred(F&& make) -> std::invoke_result_t<F&&> {
  std::optional<std::invoke_result_t<F&&>> out;
  {
    DeferredInit guard;
    out.emplace(std::forward<F>(make)());
  }
  using R = std::invoke_result_t<F&&>;
  if constexpr (std::is_base_of_v<torch::nn::Module, R>) {
    name_deferred(*out);
  } else if constexpr (detail::derefs_to_module<R>::value) {
    name_deferred(**out);
  }
  return std::move(*out);
}

namespace detail {
/// shard()'s entry: materialises `tensors` (deferred, named `names`) on
/// `device`, replaying their recorded construction together (zeros for
/// those skip_deferred_init marked); the tensors keep their identity.
/// Non-deferred tensors are skipped. `rank` names the rank in errors (-1: none).
SHARDTORCH_API void materialize_tensors(const std::vector<at::Tensor>& tensors, const std::vector<std::string>& names,
                                        std::optional<c10::Device> device, int rank);
/// shard()'s entry for one deferred tensor `t` (named `name`): writes its
/// values (replayed, or zeros if skip_deferred_init marked it) into `dst`
/// (t's shape and dtype, contiguous, on the target device), and `t` then
/// shares `dst`'s storage; the replayed copy is freed on return.
SHARDTORCH_API void materialize_into(const at::Tensor& t, const std::string& name, const at::Tensor& dst, int rank);
}  // namespace detail

}  // namespace shardtorch
