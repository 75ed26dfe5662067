// Shards a two-layer model on one rank, trains a step, and checks the
// parameters moved: proves the installed headers, library and package work.
#include <shardtorch/shardtorch.h>
#ifdef CONSUMER_HAS_FT
#include <shardtorch/ft.h>  // shardtorch_HAS_FT: the install has the fault-tolerance header
#endif

#include <iostream>

#include "net.h"

int main() {
  auto world = shardtorch::World::from_env();
  Net net;
  net->to(world->device());  // cuda:LOCAL_RANK where the world runs NCCL
  auto sharded = shardtorch::shard(net, world);
  auto opt = shardtorch::SGD(*net, torch::optim::SGDOptions(0.1));
  at::Tensor before;
  {
    shardtorch::FullParams full(*net);
    before = net->a->lin->weight.detach().clone();
  }
  net(at::ones({2, 4}, at::TensorOptions().device(world->device()))).sum().backward();
  opt->step();
  shardtorch::FullParams full(*net);
  bool moved = !at::equal(before, net->a->lin->weight);
  std::cout << "consumer: " << sharded.units().size() << " units, parameters " << (moved ? "moved" : "DID NOT MOVE")
            << std::endl;
  return moved ? 0 : 1;
}
