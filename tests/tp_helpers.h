#pragma once
// The example GPT split over a tensor-parallel group, for the tests of
// tensor parallelism and its checkpoints: its configuration, its data, and a
// split model's tensors made whole again.
#include <map>
#include <memory>
#include <string>

#include "../src/parallel/tp_comm.h"
#include "../src/runtime/placement.h"
#include "models.h"

namespace tptest {

using namespace testmodels;

inline gpt::Config tp_config() {
  gpt::Config c;
  c.vocab = 32;
  c.seq_len = 8;
  c.d_model = 16;
  c.n_head = 4;
  c.n_layer = 2;
  return c;
}

// Norm biases away from zero (parameters are compared relative to their
// largest magnitude; see tests/test_pipeline.cpp's prepare()).
inline void prepare(gpt::GPT& m) {
  torch::NoGradGuard no_grad;
  m->ln_f->bias.normal_(0.0, 0.1);
  for (auto& b : m->block_list)
    for (auto* ln : {&b->ln1, &b->ln2}) (*ln)->bias.normal_(0.0, 0.1);
}

// The prepared tp_config() GPT, built alike on every rank (seed 0) and split
// over the "tp" dimension of a {dp, tp} mesh of `w`; not sharded yet.
struct SplitGpt {
  std::shared_ptr<shardtorch::DeviceMesh> mesh;
  std::shared_ptr<shardtorch::World> tp;
  gpt::GPT model{nullptr};
  shardtorch::TpReport report;
};
inline SplitGpt split_gpt(shardtorch::World& w, int dp, int tp, bool sequence_parallel) {
  SplitGpt s;
  s.mesh = shardtorch::DeviceMesh::create(w.shared_from_this(), {{"dp", dp}, {"tp", tp}});
  s.tp = (*s.mesh)["tp"];
  torch::manual_seed(0);
  s.model = gpt::GPT(tp_config());
  prepare(s.model);
  s.report = shardtorch::parallelize(*s.model, s.tp, gpt::tp_plan(tp_config(), sequence_parallel));
  return s;
}

inline torch::Tensor tokens() {
  torch::manual_seed(321);
  return torch::randint(0, tp_config().vocab, {kBatch, tp_config().seq_len}, torch::kLong);
}

// Collective over `tp`: every tensor of `m` whole again (the split ones
// gathered across the group), under the names it had; `params` are the
// model's own tensors by those names, for their placements.
inline std::map<std::string, torch::Tensor> whole(const std::map<std::string, torch::Tensor>& m,
                                                  const std::map<std::string, torch::Tensor>& params,
                                                  shardtorch::World& tp) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : m) {
    auto placement = shardtorch::detail::placement_of(params.at(name));
    if (!placement) {
      out[name] = t;
      continue;
    }
    const int64_t dim = placement->dim, parts = placement->parts, n = placement->size;
    auto g = shardtorch::detail::tp::all_gather_along(t.contiguous(), dim, tp.comm(), "test: a split tensor");
    // [r0: p0 p1 | r1: p0 p1] along dim -> [p0: r0 r1 | p1: r0 r1]
    auto shape = g.sizes().vec();
    const int64_t k = shape[dim] / (n * parts);
    std::vector<int64_t> split(shape.begin(), shape.begin() + dim);
    split.insert(split.end(), {n, parts, k});
    split.insert(split.end(), shape.begin() + dim + 1, shape.end());
    out[name] = g.reshape(split).transpose(dim, dim + 1).reshape(shape).contiguous();
  }
  return out;
}

// The model's own tensors by the names unique_params gives them.
inline std::map<std::string, torch::Tensor> own_params(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [n, p] : unique_params(m)) out[n] = p;
  return out;
}

}  // namespace tptest
