// The registry that finds a sharded model's state from its root module.
#include <algorithm>
#include <mutex>

#include "base/check.h"
#include "base/log.h"
#include "runtime/placement.h"
#include "runtime/shard_state.h"
#include "shardtorch/unit.h"

namespace shardtorch::detail {

namespace {
struct ModelRegistry {
  struct Entry {
    std::weak_ptr<torch::nn::Module> root;
    std::weak_ptr<ShardState> state;
    std::shared_ptr<ShardState> kept;  // a state no unit owns
  };
  std::mutex mu;
  std::vector<Entry> entries;
  void prune() {
    entries.erase(std::remove_if(entries.begin(), entries.end(),
                                 [](const Entry& e) { return e.root.expired() || e.state.expired(); }),
                  entries.end());
  }
};
ModelRegistry& model_registry() {
  static ModelRegistry r;
  return r;
}
}  // namespace

void register_model(torch::nn::Module& root, const std::shared_ptr<ShardState>& state, bool owned) {
  std::weak_ptr<torch::nn::Module> weak = root.weak_from_this();
  SHARDTORCH_CHECK(!weak.expired(),
                   "shardtorch::shard: the root module must be owned by a std::shared_ptr (declare "
                   "it through its holder, e.g. `Net net;` after SHARDTORCH_MODULE(Net) or "
                   "TORCH_MODULE(Net), or create it with std::make_shared)");
  auto& r = model_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.prune();
  r.entries.push_back({weak, state, owned ? nullptr : state});
}

std::shared_ptr<ShardState> lookup_model(torch::nn::Module& root) {
  auto& r = model_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.prune();
  for (const auto& e : r.entries) {
    auto m = e.root.lock();
    if (m.get() == &root) return e.state.lock();
  }
  return nullptr;
}

std::shared_ptr<ShardState> require_state(torch::nn::Module& root, const std::string& what) {
  auto s = lookup_model(root);
  if (s) return s;
  const int rank = log_rank();
  const std::string who = (rank >= 0 ? rank_prefix(rank) + ": " : std::string("shardtorch: ")) + what;
  for (const auto& item : root.named_modules("", /*include_self=*/false))
    if (auto* b = dynamic_cast<UnitBase*>(item.value().get()); b && b->is_sharded_unit())
      throw_error("", who + ": this module is not the root of a sharded model, but its submodule '" + item.key() +
                          "' is a unit of one (made by shard() on another root, or by a shardtorch::Pipeline from "
                          "its layers): pass that root, or for a Pipeline its module() or the overloads taking the "
                          "Pipeline");
  if (auto split = first_split(root))
    throw_error("", who + ": this model is split over tensor-parallel ranks (parallelize(); '" + split->first +
                        "' among its parameters) but was never sharded: shard it over the mesh's data-parallel "
                        "dimension (shard(model, (*mesh)[\"dp\"]); a mesh {dp 1, tp N} for tensor parallelism "
                        "alone), never over the World the tensor-parallel group was made from");
  throw_error("", who + ": this model was never sharded; call shardtorch::shard(model, world) first");
}

std::map<const void*, std::vector<std::string>> parameter_names(torch::nn::Module& root) {
  std::map<const void*, std::vector<std::string>> names;
  for (const auto& item : root.named_parameters()) names[item.value().unsafeGetTensorImpl()].push_back(item.key());
  return names;
}

}  // namespace shardtorch::detail
