#include "checkpoint/tp_slices.h"

#include <algorithm>
#include <sstream>

#include "base/check.h"
#include "runtime/shard_state.h"

namespace shardtorch::checkpoint {

std::vector<Run> runs_of(const detail::Placement& p, int64_t begin, int64_t length) {
  const detail::Blocks b = detail::blocks_of(p);
  const int64_t run = b.count * b.suffix;  // a slice's elements of one block, consecutive in the whole too
  std::vector<Run> out;
  for (int64_t e = begin, end = begin + length; e < end;) {
    const int64_t k = e / run, within = e % run, n = std::min(run - within, end - e);
    const int64_t whole = (k * b.block + b.start) * b.suffix + within;
    if (!out.empty() && out.back().whole + out.back().length == whole)
      out.back().length += n;  // the slice covers whole blocks here (a group of one): one run
    else
      out.push_back({whole, e, n});
    e += n;
  }
  return out;
}

std::vector<Rows> rows_of(const std::vector<Run>& runs) {
  std::vector<Rows> out;
  for (const Run& r : runs) {
    if (!out.empty()) {
      Rows& g = out.back();
      const bool joins = r.length == g.length && r.local == g.local + g.rows * g.length &&
                         (g.rows == 1 ? r.whole >= g.whole + g.length : r.whole == g.whole + g.rows * g.stride);
      if (joins && g.length > 0) {
        if (g.rows == 1) g.stride = r.whole - g.whole;
        ++g.rows;
        continue;
      }
    }
    out.push_back({r.whole, r.local, r.length, 1, 0});
  }
  return out;
}

at::Tensor read_slice(const detail::Placement& p, int64_t begin, int64_t length,
                      const std::function<at::Tensor(int64_t, int64_t)>& read) {
  std::vector<at::Tensor> pieces;
  for (const Run& r : runs_of(p, begin, length)) pieces.push_back(read(r.whole, r.length).reshape({-1}));
  if (pieces.size() == 1) return pieces.front();
  if (pieces.empty()) return read(0, 0).reshape({-1});
  return at::cat(pieces);
}

std::vector<Run> saved_runs(const at::Tensor& t, int64_t begin, int64_t length) {
  if (auto p = detail::placement_of(t)) return runs_of(*p, begin, length);
  if (length == 0) return {};
  return {Run{begin, begin, length}};
}

std::vector<int64_t> saved_shape(const at::Tensor& t) {
  if (auto p = detail::placement_of(t)) return p->full_shape;
  return t.sizes().vec();
}

std::shared_ptr<World> describe_tensor_parallel(torch::nn::Module& root, ModelPart& part, const char* who) {
  std::shared_ptr<World> group;
  for (const auto& item : root.named_parameters()) {
    auto p = detail::placement_of(item.value());
    if (!p) continue;
    SHARDTORCH_CHECK(!group || group == p->group, "shardtorch::", who, ": parameters of the model are split over ",
                     "two different tensor-parallel groups ('", item.key(),
                     "' among them); checkpoints take a model parallelize() split over one group");
    group = p->group;
    part.split.insert(item.key());
    part.shapes[item.key()] = p->full_shape;
    part.tp_rank = p->rank;
  }
  return group;
}

std::optional<ModelPart> tensor_parallel_part(torch::nn::Module& root, detail::ShardState& state, const char* who) {
  ModelPart part;
  const std::shared_ptr<World> tp = describe_tensor_parallel(root, part, who);
  if (!tp) return std::nullopt;
  World& dp = state.world();
  const std::shared_ptr<World>& mesh = tp->parent();
  SHARDTORCH_CHECK(mesh && dp.parent() == mesh && mesh->size() == dp.size() * tp->size(),
                   detail::rank_prefix(dp.global_rank()), ": shardtorch::", who, ": the model is split over a ",
                   "tensor-parallel group of ", tp->size(), " ranks and sharded over a World of ", dp.size(),
                   "; a checkpoint of it needs the two to be the only dimensions of one DeviceMesh (pipeline "
                   "stages take the functions of shardtorch/pipeline_checkpoint.h)");
  part.world = mesh;
  for (const auto& item : root.named_parameters()) {
    part.shapes.emplace(item.key(), item.value().sizes().vec());
    part.order.push_back(item.key());
  }
  for (const auto& item : root.named_buffers())
    if (item.value().defined()) part.shapes.emplace(item.key(), item.value().sizes().vec());
  std::ostringstream layout;
  layout << "tensor parallel over " << tp->size() << " ranks x " << dp.size() << " data-parallel ranks";
  part.layout = layout.str();
  return part;
}

}  // namespace shardtorch::checkpoint
