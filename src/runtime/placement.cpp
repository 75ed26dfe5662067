#include "runtime/placement.h"

#include <mutex>
#include <unordered_map>

#include "shardtorch/collectives.h"

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

std::optional<std::pair<std::string, Placement>> first_split(torch::nn::Module& root) {
  for (const auto& item : root.named_parameters())
    if (auto p = placement_of(item.value()); p && p->size > 1) return std::make_pair(item.key(), *p);
  return std::nullopt;
}

at::Tensor gather_whole(const at::Tensor& slice, const Placement& p, const std::string& what) {
  Comm& comm = p.group->comm();
  int64_t prefix = 1, suffix = 1;
  for (int64_t d = 0; d < p.dim; ++d) prefix *= p.full_shape[static_cast<size_t>(d)];
  for (size_t d = static_cast<size_t>(p.dim) + 1; d < p.full_shape.size(); ++d) suffix *= p.full_shape[d];
  const int64_t count = p.full_shape[static_cast<size_t>(p.dim)] / p.parts / p.size;  // one slice's run per block
  at::Tensor mine = slice.detach().contiguous().reshape({-1}).to(comm.device());
  at::Tensor all = at::empty({p.size * mine.numel()}, mine.options());
  comm.all_gather_into(all, mine, what);
  // Rank r's slice holds run r of each block: [size, prefix, parts, count,
  // suffix] -> [prefix, parts, size, count, suffix] is the whole, in order.
  return all.view({p.size, prefix, p.parts, count, suffix})
      .permute({1, 2, 0, 3, 4})
      .contiguous()
      .view(p.full_shape)
      .to(slice.device());
}

}  // namespace shardtorch::detail
