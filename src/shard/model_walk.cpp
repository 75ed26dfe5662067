#include "shard/model_walk.h"
#include "base/check.h"

#include <torch/nn/modules/batchnorm.h>

#include <algorithm>
#include <set>
#include <tuple>
#include <unordered_map>

namespace shardtorch::detail {

namespace {

int common_ancestor(const std::vector<FoundUnit>& units, int a, int b) {
  std::set<int> chain;
  for (int u = a; u >= 0; u = units[u].parent) chain.insert(u);
  for (int u = b; u >= 0; u = units[u].parent)
    if (chain.count(u)) return u;
  return -1;
}

void walk(torch::nn::Module& m, const std::string& prefix, int current, std::vector<FoundUnit>& units,
          std::vector<FoundParam>& params, std::unordered_map<const void*, size_t>& seen,
          std::vector<std::pair<std::string, at::Tensor>>& buffers, std::set<const void*>& seen_buffers,
          bool allow_sharded) {
  if (auto* b = dynamic_cast<UnitBase*>(&m)) {
    // The same unit registered again under another name (weights shared by
    // layers, ALBERT-style): it is the first one, whose parameters, buffers
    // and hooks are already found; it runs as a unit called several times
    // per forward. (A second FoundUnit for it overwrote the first's state and
    // left both without parameters.)
    if (std::any_of(units.begin(), units.end(), [b](const FoundUnit& u) { return u.base == b; })) return;
    SHARDTORCH_CHECK(allow_sharded || !b->is_sharded_unit(), "shardtorch::shard: module '",
                     prefix.empty() ? "<root>" : prefix,
                     "' is already a unit of a sharded model (shard() was called on this model or on one holding "
                     "it, or a shardtorch::Pipeline was built from its layers); build a new model to shard it again, "
                     "or pass the sharded one (for a Pipeline, its module())");
    units.push_back({prefix, b, current});
    current = static_cast<int>(units.size()) - 1;
  }
  auto join = [&](const std::string& n) { return prefix.empty() ? n : prefix + "." + n; };
  for (const auto& item : m.named_parameters(/*recurse=*/false)) {
    const void* key = item.value().unsafeGetTensorImpl();
    auto it = seen.find(key);
    if (it == seen.end()) {
      seen.emplace(key, params.size());
      params.push_back({join(item.key()), item.value(), current});
    } else {
      auto& p = params[it->second];
      p.unit = (p.unit < 0 || current < 0) ? -1 : common_ancestor(units, p.unit, current);
    }
  }
  for (const auto& item : m.named_buffers(/*recurse=*/false)) {
    if (!item.value().defined()) continue;
    if (seen_buffers.insert(item.value().unsafeGetTensorImpl()).second)
      buffers.emplace_back(join(item.key()), item.value());
  }
  for (const auto& child : m.named_children()) {
    walk(*child.value(), join(child.key()), current, units, params, seen, buffers, seen_buffers, allow_sharded);
  }
}

}  // namespace

ModelWalk walk_model(torch::nn::Module& root, bool allow_sharded) {
  ModelWalk w;
  std::unordered_map<const void*, size_t> seen;
  std::set<const void*> seen_buffers;
  walk(root, "", -1, w.units, w.params, seen, w.buffers, seen_buffers, allow_sharded);
  return w;
}

std::unordered_set<const void*> batch_norm_tensors(torch::nn::Module& root) {
  std::unordered_set<const void*> out;
  for (const auto& m : root.modules()) {
    if (!m->as<torch::nn::BatchNorm1d>() && !m->as<torch::nn::BatchNorm2d>() && !m->as<torch::nn::BatchNorm3d>())
      continue;
    for (const auto& p : m->parameters(/*recurse=*/false)) out.insert(p.unsafeGetTensorImpl());
    for (const auto& b : m->buffers(/*recurse=*/false))
      if (b.defined()) out.insert(b.unsafeGetTensorImpl());
  }
  return out;
}

std::vector<std::vector<const FoundParam*>> flat_groups(const std::vector<FoundParam>& params, int unit,
                                                        const DtypeOf& dtype_of,
                                                        const std::unordered_set<const void*>& apart) {
  std::vector<std::pair<std::tuple<at::ScalarType, bool, bool>, std::vector<const FoundParam*>>> groups;
  for (const auto& p : params) {
    if (p.unit != unit) continue;
    auto key = std::make_tuple(dtype_of ? dtype_of(p.tensor) : p.tensor.scalar_type(), p.tensor.requires_grad(),
                               apart.count(p.tensor.unsafeGetTensorImpl()) > 0);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
    if (it == groups.end()) {
      groups.push_back({key, {}});
      it = groups.end() - 1;
    }
    it->second.push_back(&p);
  }
  std::vector<std::vector<const FoundParam*>> out;
  for (auto& g : groups) out.push_back(std::move(g.second));
  return out;
}

}  // namespace shardtorch::detail
