#include "runtime/placement.h"

#include <mutex>
#include <unordered_map>

#include "base/check.h"
#include "shardtorch/collectives.h"

namespace shardtorch::detail {
namespace {

// The group is held weakly: the registry forgets dead tensors only as new
// ones come, and must not keep their World alive meanwhile (its destruction
// tells the peers whether this rank ended on an error).
struct PlacementEntry {
  c10::weak_intrusive_ptr<c10::TensorImpl> tensor;  // a dead entry is not its address's next tensor's
  Placement placement;                              // its group reset, held here instead:
  std::weak_ptr<World> group;
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
  std::weak_ptr<World> group = p.group;
  p.group.reset();
  r.entries.insert_or_assign(
      t.unsafeGetTensorImpl(),
      PlacementEntry{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), std::move(p), std::move(group)});
}

std::optional<Placement> placement_of(const at::Tensor& t) {
  if (!t.defined()) return std::nullopt;
  auto& r = placement_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.entries.find(t.unsafeGetTensorImpl());
  if (it == r.entries.end()) return std::nullopt;
  auto alive = it->second.tensor.lock();
  if (!alive || alive.get() != t.unsafeGetTensorImpl()) return std::nullopt;
  Placement p = it->second.placement;
  p.group = it->second.group.lock();
  SHARDTORCH_CHECK(p.group, "shardtorch: a parameter split by parallelize() (", c10::IntArrayRef(p.full_shape),
                   " along dimension ", p.dim, ") outlived its tensor-parallel group's World: keep the DeviceMesh ",
                   "(or the World) alive as long as the model is used");
  return p;
}

std::optional<std::pair<std::string, Placement>> first_split(torch::nn::Module& root) {
  for (const auto& item : root.named_parameters())
    if (auto p = placement_of(item.value()); p && p->size > 1) return std::make_pair(item.key(), *p);
  return std::nullopt;
}

Blocks blocks_of(const Placement& p) {
  Blocks b;
  const auto& s = p.full_shape;
  SHARDTORCH_CHECK(p.dim >= 0 && p.dim < static_cast<int64_t>(s.size()) && p.parts >= 1 && p.size >= 1,
                   "shardtorch: internal: a tensor-parallel placement along dimension ", p.dim, " of ",
                   c10::IntArrayRef(s));
  for (int64_t d = 0; d < p.dim; ++d) b.prefix *= s[d];
  for (size_t d = p.dim + 1; d < s.size(); ++d) b.suffix *= s[d];
  b.parts = p.parts;
  b.block = s[p.dim] / p.parts;
  b.count = b.block / p.size;
  b.start = p.rank * b.count;
  return b;
}

namespace {
at::Tensor whole_view(const at::Tensor& whole, const Placement& p, const Blocks& b) {
  SHARDTORCH_CHECK(whole.sizes() == c10::IntArrayRef(p.full_shape), "shardtorch: internal: a whole tensor of ",
                   whole.sizes(), " for a placement of ", c10::IntArrayRef(p.full_shape));
  return whole.view({b.prefix, b.parts, b.block, b.suffix}).narrow(2, b.start, b.count);
}
}  // namespace

void put_slice(at::Tensor& whole, const at::Tensor& slice, const Placement& p) {
  const Blocks b = blocks_of(p);
  whole_view(whole, p, b).copy_(slice.reshape({b.prefix, b.parts, b.count, b.suffix}));
}

at::Tensor take_slice(const at::Tensor& whole, const Placement& p) {
  const Blocks b = blocks_of(p);
  std::vector<int64_t> shape = p.full_shape;
  shape[p.dim] = b.parts * b.count;
  return whole_view(whole, p, b).contiguous().view(shape);
}

at::Tensor gather_whole(const at::Tensor& slice, const Placement& p, const std::string& what) {
  Comm& comm = p.group->comm();
  at::Tensor mine = slice.detach().contiguous().reshape({-1}).to(comm.device());
  at::Tensor all = at::empty({p.size * mine.numel()}, mine.options());
  comm.all_gather_into(all, mine, what);
  at::Tensor whole = at::empty(p.full_shape, slice.options());
  Placement of = p;
  for (of.rank = 0; of.rank < p.size; ++of.rank)
    put_slice(whole, all.narrow(0, of.rank * mine.numel(), mine.numel()).to(whole.device()), of);
  return whole;
}

}  // namespace shardtorch::detail
