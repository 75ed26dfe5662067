#include "runtime/placement.h"

#include <mutex>
#include <unordered_map>

namespace shardtorch::detail {
namespace {

struct PlacementEntry {
  c10::weak_intrusive_ptr<c10::TensorImpl> tensor;  // a dead entry is not its address's next tensor's
  Placement placement;
};

struct PlacementRegistry {
  std::mutex mu;
  std::unordered_map<const void*, PlacementEntry> entries;
};

PlacementRegistry& placement_registry() {
  static PlacementRegistry r;
  return r;
}

}  // namespace

void set_placement(const at::Tensor& t, Placement p) {
  auto& r = placement_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto it = r.entries.begin(); it != r.entries.end();)  // the dead ones go as new ones come
    it = it->second.tensor.expired() ? r.entries.erase(it) : std::next(it);
  r.entries.insert_or_assign(
      t.unsafeGetTensorImpl(),
      PlacementEntry{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), std::move(p)});
}

std::optional<Placement> placement_of(const at::Tensor& t) {
  if (!t.defined()) return std::nullopt;
  auto& r = placement_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.entries.find(t.unsafeGetTensorImpl());
  if (it == r.entries.end()) return std::nullopt;
  auto alive = it->second.tensor.lock();
  if (!alive || alive.get() != t.unsafeGetTensorImpl()) return std::nullopt;
  return it->second.placement;
}

}  // namespace shardtorch::detail
