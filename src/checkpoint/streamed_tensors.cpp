#include "checkpoint/streamed_tensors.h"

#include <set>

#include "base/check.h"
#include "runtime/flat_param.h"
#include "runtime/shard_state.h"

namespace shardtorch::checkpoint {

StreamedTensors::StreamedTensors(torch::nn::Module& root, detail::ShardState& state, std::string purpose,
                                 bool tied_once, bool buffers)
    : state_(state), purpose_(std::move(purpose)) {
  if (state.replicated()) {
    std::set<const void*> seen;
    for (const auto& item : root.named_parameters()) {
      if (!seen.insert(item.value().unsafeGetTensorImpl()).second && tied_once) continue;
      at::Tensor v = state.record_of(item.value()).detach();
      items_.push_back({item.key(), v.scalar_type(), v.sizes().vec(), [v] { return v; }});
    }
  } else {
    for (auto& u : state.units())
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
               static_cast<int64_t>(k)});
      }
    }
  }
  for (const auto& item : root.named_buffers()) {
    if (!buffers) break;
    at::Tensor b = item.value();
    if (b.defined()) items_.push_back({item.key(), b.scalar_type(), b.sizes().vec(), [b] { return b; }});
  }
}

void StreamedTensors::keep_only(const std::vector<size_t>& items) {
  needed_.assign(flats_.size(), false);
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
  if (gathered_ < flats_.size()) gather_through(flats_.size() - 1);
  current_ = at::Tensor();
}

}  // namespace shardtorch::checkpoint
