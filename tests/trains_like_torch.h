#pragma once
// A model trained in one process against the same model trained on 2 ranks.
#include <gtest/gtest.h>

#include "models.h"

namespace testmodels {

/// The reference: `Model` from seed 0 trained in one process, 3 steps of SGD
/// (lr 0.1) whose forwards and backwards `step(model)` runs; its parameters.
template <class Model, class Step>
std::map<std::string, torch::Tensor> train_reference(Step step) {
  torch::manual_seed(0);
  Model ref;
  torch::optim::SGD opt(unique_tensors(*ref), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();
    step(ref);
    opt.step();
  }
  return snapshot(*ref);
}

/// The same training on 2 ranks under every strategy ends within 1e-5 of
/// `want`. `step(model, sharded, world)` runs one step's forwards and
/// backwards; the optimizer step follows, after which no unit may be gathered.
template <class Model, class Step>
void expect_every_strategy_trains_like(const std::map<std::string, torch::Tensor>& want, const std::string& what,
                                       Step step) {
  for (auto s : kAllStrategies) {
    auto r = shardtorch::testing::run_ranks(2, [&](shardtorch::World& w) {
      torch::manual_seed(0);
      Model m;
      auto sm = shardtorch::shard(m, w, strategy_options(s, 2));
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
      for (int i = 0; i < 3; ++i) {
        opt->zero_grad();
        step(m, sm, w);
        opt->step();
        require(sm.memory().gathered_units == 0, "units (held for a graph?) still gathered after the step");
      }
      shardtorch::FullParams full(*m);
      expect_close_map(snapshot(*m), want, 1e-5, what);
    });
    EXPECT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
}

}  // namespace testmodels
