// ReplicaSampler: a data set's indices split by replica group and rank.
#include "shardtorch/ft.h"

#include "base/check.h"

namespace shardtorch::ft {

ReplicaSampler::ReplicaSampler(int64_t dataset_size, int64_t groups, int64_t group_index, int rank, int world_size,
                               int64_t batch_size)
    : batch_(batch_size) {
  SHARDTORCH_CHECK(groups > 0 && group_index >= 0 && group_index < groups && world_size > 0 && rank >= 0 &&
                       rank < world_size && batch_size > 0,
                   "shardtorch::ft::ReplicaSampler: group ", group_index, " of ", groups, ", rank ", rank, " of ",
                   world_size, ", batch ", batch_size, ": out of range");
  const int64_t part = dataset_size / groups, sub = part / world_size;
  SHARDTORCH_CHECK(sub > 0, "shardtorch::ft::ReplicaSampler: ", dataset_size, " samples are too few for ", groups,
                   " groups of ", world_size, " ranks");
  begin_ = group_index * part + rank * sub;
  length_ = sub;
}

std::vector<int64_t> ReplicaSampler::batch(int64_t step) const {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < batch_; ++i) out.push_back(begin_ + (step * batch_ + i) % length_);
  return out;
}

}  // namespace shardtorch::ft
