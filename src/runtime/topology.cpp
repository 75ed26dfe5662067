#include "runtime/topology.h"

#include <algorithm>
#include <string>
#include <utility>

#include "shardtorch/shard_options.h"

namespace shardtorch::detail {

void Topology::build(Strategy strategy, int shard_size) {
  const int r = world_->rank(), s = shard_size, n = world_->size();
  if (strategy == Strategy::HybridShard) {
    std::vector<int> shard_ranks, replica_ranks;
    for (int k = 0; k < s; ++k) shard_ranks.push_back((r / s) * s + k);
    for (int k = r % s; k < n; k += s) replica_ranks.push_back(k);
    shard_group_ = world_->new_group(shard_ranks, "hybrid-shard-" + std::to_string(r / s));
    replica_group_ = world_->new_group(replica_ranks, "hybrid-replica-" + std::to_string(r % s));
  }
  if (strategy == Strategy::FullShard || strategy == Strategy::HybridShard) {
    const int first = (r / s) * s;
    std::vector<int> ranks;
    for (int k = 0; k < s; ++k) ranks.push_back(first + k);
    reduce_group_ = world_->new_group(ranks, "reduce-scatter-" + std::to_string(first / s));
  }
}

std::vector<Comm*> Topology::comms() const {
  std::vector<Comm*> out;
  for (Comm* c : {&world_->comm(), &shard_comm(), replica_comm(), &reduce_comm()})
    if (c != nullptr && std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  return out;
}

CommStats Topology::stats() const {
  CommStats total = world_->comm().stats();
  auto add = [&](const Comm* c) {
    if (c == nullptr || c == &world_->comm()) return;
    const CommStats& s = c->stats();
    for (auto [to, from] :
         {std::pair{&total.all_gather, &s.all_gather}, std::pair{&total.reduce_scatter, &s.reduce_scatter},
          std::pair{&total.all_reduce, &s.all_reduce}, std::pair{&total.broadcast, &s.broadcast},
          std::pair{&total.send, &s.send}, std::pair{&total.recv, &s.recv}}) {
      to->calls += from->calls;
      to->bytes_sent += from->bytes_sent;
      to->seconds += from->seconds;
    }
  };
  add(&shard_comm());
  add(replica_comm());
  if (&reduce_comm() != &shard_comm()) add(&reduce_comm());
  return total;
}

}  // namespace shardtorch::detail
