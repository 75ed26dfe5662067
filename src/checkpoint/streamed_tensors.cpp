#include "checkpoint/streamed_tensors.h"

#include <set>

#include "base/check.h"
#include "checkpoint/model_part.h"
#include "checkpoint/tp_slices.h"
#include "runtime/flat_param.h"
#include "runtime/shard_state.h"

namespace shardtorch::checkpoint {

StreamedTensors::StreamedTensors(torch::nn::Module& root, detail::ShardState& state, std::string purpose,
                                 bool tied_once, bool buffers, const ModelPart* part)
    : state_(state), purpose_(std::move(purpose)) {
  if (state.path().replicated()) {
    std::set<const void*> seen;
    for (const auto& item : root.named_parameters()) {
      if (!seen.insert(item.value().unsafeGetTensorImpl()).second && tied_once) continue;
      at::Tensor v = state.path().record_of(item.value()).detach();
      items_.push_back(
          {item.key(), v.scalar_type(), v.sizes().vec(), [v] { return v; }, -1, detail::placement_of(item.value())});
    }
  } else {
    for (auto& u : state.units().all())
      for (auto& f : u->flats()) flats_.push_back(f.get()), labels_.push_back(u->label());
    auto names = detail::parameter_names(root);
    for (size_t k = 0; k < flats_.size(); ++k) {
      FlatParam* f = flats_[k];
      for (size_t i = 0; i < f->params().size(); ++i) {
        const auto& all = names[f->params()[i].unsafeGetTensorImpl()];
        for (size_t j = 0; j < all.size() && (j == 0 || !tied_once); ++j)
          items_.push_back(
              {all[j], f->dtype(), f->layout().shape(i),
               [this, k, f, i] {
                 if (gathered_ != k + 1) gather_through(k);
                 return current_.narrow(0, f->layout().offset(i), f->layout().numel(i)).view(f->layout().shape(i));
               },
               static_cast<int64_t>(k), detail::placement_of(f->params()[i])});
      }
    }
  }
  for (const auto& item : root.named_buffers()) {
    if (!buffers) break;
    at::Tensor b = item.value();
    if (b.defined())
      items_.push_back({item.key(), b.scalar_type(), b.sizes().vec(), [b] { return b; }, -1, std::nullopt});
  }
  if (part) split_items(*part);
}

// Items left to tp rank 0 go; a split one becomes the whole tensor, which
// the part's leader (the rank that produces) assembles at tp rank 0.
void StreamedTensors::split_items(const ModelPart& part) {
  std::vector<Item> kept;
  const bool leader = state_.world().rank() == 0;
  int split_count = 0;
  for (auto& item : items_) {
    if (part.left_to_tp_rank_0(item.name)) continue;
    split_tags_.push_back(item.placement ? split_count++ : -1);
    if (item.placement && part.tp_rank == 0) {
      item.shape = item.placement->full_shape;
      assembles_ = leader;
      if (leader) item.produce = [this, k = kept.size(), produce = item.produce] { return assemble(k, produce()); };
    }
    kept.push_back(std::move(item));
  }
  items_ = std::move(kept);
}

at::Tensor StreamedTensors::assemble(size_t k, const at::Tensor& mine) {
  const Item& item = items_.at(k);
  SHARDTORCH_CHECK(k >= assembled_, "shardtorch: internal: ", purpose_, " went back to an earlier split tensor");
  assembled_ = k + 1;
  detail::Placement p = *item.placement;
  World& tp = *p.group;
  at::Tensor whole = at::empty(p.full_shape, mine.options());
  put_slice(whole, mine, p);
  for (int r = 1; r < tp.size(); ++r) {
    p.rank = r;
    at::Tensor slice = at::empty({mine.numel()}, mine.options().device(tp.comm().device()));
    PendingWork w = tp.comm().recv_async(
        slice, r, split_tags_[k], "tp rank " + std::to_string(r) + "'s slice of '" + item.name + "' for " + purpose_);
    tp.comm().wait(w);
    put_slice(whole, slice.to(whole.device()), p);
  }
  return whole;
}

void StreamedTensors::feed_tp_rank_0() {
  for (size_t k = 0; k < items_.size(); ++k) {
    if (!kept_.empty() && !kept_[k]) continue;  // tp rank 0 leaves it out too
    const Item& item = items_[k];
    SHARDTORCH_CHECK(item.placement, "shardtorch: internal: ", purpose_, " at a tp rank other than 0 has a tensor '",
                     item.name, "' that is not split");
    World& tp = *item.placement->group;
    at::Tensor slice = item.produce().to(tp.comm().device()).contiguous().reshape({-1});
    PendingWork w =
        tp.comm().send_async(slice, 0, split_tags_[k], "this rank's slice of '" + item.name + "' for " + purpose_);
    tp.comm().wait(w);
  }
}

void StreamedTensors::keep_only(const std::vector<size_t>& items) {
  needed_.assign(flats_.size(), false);
  kept_.assign(items_.size(), false);
  for (size_t i : items) kept_.at(i) = true;
  for (size_t i : items)
    if (items_.at(i).flat >= 0) needed_[static_cast<size_t>(items_[i].flat)] = true;
}

void StreamedTensors::gather_through(size_t k) {
  // The writer may skip flats (none of their tensors kept): the gathers
  // still follow the one order every rank's finish() follows.
  SHARDTORCH_CHECK(k + 1 >= gathered_, "shardtorch: internal: ", purpose_, " went back to an earlier flat parameter");
  for (size_t j = gathered_; j <= k; ++j)
    if (needed_.empty() || needed_[j]) gather(j);
  gathered_ = k + 1;
}

void StreamedTensors::gather(size_t k) {
  World& world = state_.world();
  FlatParam* f = flats_[k];
  at::Tensor mine = f->shard().to(world.comm().device());  // no copy on the device already: current_ is new
  current_ = at::Tensor();  // the previous one is written: free it before the next is allocated
  current_ = at::empty({f->layout().padded_numel()}, mine.options());
  state_.topology().shard_comm().all_gather_into(current_, mine,
                                                 "master parameters of unit '" + labels_[k] + "' for " + purpose_);
}

void StreamedTensors::finish() {
  // The slices the other tp ranks send for what a failed writer did not reach.
  for (size_t k = assembled_; assembles_ && k < items_.size(); ++k)
    if (items_[k].placement && (kept_.empty() || kept_[k])) items_[k].produce();
  if (gathered_ < flats_.size()) gather_through(flats_.size() - 1);
  current_ = at::Tensor();
}

}  // namespace shardtorch::checkpoint
