// unit_specs: the planner's view of a constructed (or deferred, or sharded)
// model: the units shard() would build and their flat parameters.
#include "shardtorch/plan.h"

#include <unordered_map>

#include "runtime/shard_state.h"
#include "shard/model_walk.h"

namespace shardtorch {

using detail::batch_norm_tensors;
using detail::DtypeOf;
using detail::flat_groups;
using detail::ModelWalk;
using detail::walk_model;

std::vector<UnitSpec> unit_specs(torch::nn::Module& root) {
  // A sharded model plans too: its parameters keep their shapes, and under
  // mixed precision the dtype planned from is the masters' (the parameters
  // now compute in param_dtype).
  ModelWalk found = walk_model(root, /*allow_sharded=*/true);
  const auto& units = found.units;
  const auto& params = found.params;
  DtypeOf dtype_of = [](const at::Tensor& t) { return t.scalar_type(); };
  if (auto state = detail::lookup_model(root)) {
    std::unordered_map<const void*, at::ScalarType> masters;  // sharded strategies: the flat's dtype
    for (const auto& u : state->units().all())
      for (const auto& f : u->flats())
        for (const auto& p : f->params()) masters[p.unsafeGetTensorImpl()] = f->dtype();
    dtype_of = [state, masters = std::move(masters)](const at::Tensor& t) {
      auto it = masters.find(t.unsafeGetTensorImpl());
      return it != masters.end() ? it->second : state->path().record_of(t).scalar_type();  // NoShard: its master's
    };
  }
  // Batch norm's parameters in flats of their own (FlatSpec::batch_norm):
  // plan_memory joins them to the others where shard() does.
  const auto batch_norm = batch_norm_tensors(root);
  std::vector<UnitSpec> out;
  auto spec = [&](const std::string& name, int unit) {
    UnitSpec s{name, {}};
    for (const auto& members : flat_groups(params, unit, dtype_of, batch_norm)) {
      const at::Tensor& first = members.front()->tensor;
      FlatSpec f{0, dtype_of(first), first.requires_grad(), batch_norm.count(first.unsafeGetTensorImpl()) > 0};
      for (const auto* p : members) f.numel += p->tensor.numel();
      s.flats.push_back(f);
    }
    return s;
  };
  for (size_t u = 0; u < units.size(); ++u) out.push_back(spec(units[u].name, static_cast<int>(u)));
  UnitSpec orphans = spec("<none>", -1);  // no unit encloses them: only NoShard can take them
  if (!orphans.flats.empty()) out.push_back(std::move(orphans));
  return out;
}

}  // namespace shardtorch
