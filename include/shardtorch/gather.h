#pragma once
// summon_full_params: the full parameters (and optionally gradients) of a
// sharded model, for evaluation, export and tests. RAII: on exit, edits made
// to the parameters are written back into the shards (writeback) and the full
// buffers are freed.
#include <torch/arg.h>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardtorch/export.h"

namespace shardtorch {

namespace detail {
class ShardState;
class Unit;
}  // namespace detail

struct SHARDTORCH_API SummonOptions {
  /// Only rank 0 keeps the full parameters; the other ranks free each unit as
  /// soon as it is gathered, so their memory stays at one unit.
  TORCH_ARG(bool, rank0_only) = false;
  /// Copy edits of the full parameters back into the shards on exit. Unset:
  /// yes, except under mixed precision, where the parameters are in the
  /// compute dtype and writing them back would round the fp32 masters
  /// (asking for it explicitly then is an error).
  TORCH_ARG(std::optional<bool>, writeback) = std::nullopt;
  /// Also set param.grad() to the full (reduced, averaged) gradients, in the
  /// parameters' dtype.
  TORCH_ARG(bool, with_grads) = false;
};

class SHARDTORCH_API FullParams {
 public:
  /// Collective: every rank must enter it.
  FullParams(torch::nn::Module& root, SummonOptions options = {});
  ~FullParams();
  FullParams(const FullParams&) = delete;
  FullParams& operator=(const FullParams&) = delete;

 private:
  void gather_all(bool keep);
  void gather_grads(detail::Unit& u, bool keep);

  std::shared_ptr<detail::ShardState> state_;
  SummonOptions options_;
  bool writeback_ = true;
  std::vector<std::shared_ptr<detail::Unit>> units_;      // every unit, gathered while we live
  std::vector<std::shared_ptr<detail::Unit>> summoned_;   // the ones we gathered
  std::vector<at::Tensor> grads_set_;                     // parameters whose grad we set
  int64_t grad_bytes_ = 0;                                // what their gradients hold (Mem::SummonedGrads)
  std::vector<std::pair<at::Tensor, at::Tensor>> views_;  // NoShard: a parameter, its bucket view of a gradient
  /// Without writeback: shards that are views of a full buffer the scope
  /// found gathered (ZeRO-1/2 in fp32 on the device), with their values at
  /// entry, put back on exit (an edit of the full parameters edits them).
  std::vector<std::pair<at::Tensor, at::Tensor>> restore_;
};

/// `auto full = shardtorch::summon_full_params(*model);`
inline std::unique_ptr<FullParams> summon_full_params(torch::nn::Module& root, SummonOptions options = {}) {
  return std::make_unique<FullParams>(root, options);
}

/// Collective: every parameter's full value in the master dtype (fp32 under
/// mixed precision), by name (tied parameters under each name), gathered one
/// flat parameter at a time. With rank0_only the other ranks get an empty map.
SHARDTORCH_API std::map<std::string, at::Tensor> full_parameters(torch::nn::Module& root, bool rank0_only = false);

/// Collective: every trainable parameter's gradient now, reduced over the
/// data-parallel ranks (after a backward, before the step), whole, as fp32
/// tensors of the values the optimizer reads (the fp32 masters' gradients
/// under mixed precision, never rounded to the parameter's dtype), by name
/// (tied parameters under each name); frozen parameters are left out, one
/// the backward did not reach has zeros. A parameter parallelize() split is whole under its
/// unsplit name, as in full_parameters. With rank0_only the other ranks get
/// an empty map.
SHARDTORCH_API std::map<std::string, at::Tensor> full_gradients(torch::nn::Module& root, bool rank0_only = false);

}  // namespace shardtorch
