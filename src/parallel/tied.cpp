// Parameters tied across pipeline stages on different ranks (a GPT's token
// embedding and its LM head): each holding stage keeps a copy, sharded over
// its data-parallel group like any parameter; after the step's reductions the
// copies' gradients are summed, so that every copy takes the same update and
// they stay equal (docs/parallelism.md, "Tied parameters").
//
// One all-reduce per tie over every data-parallel rank of every holding
// stage: each rank contributes its pieces of the parameter at their offsets
// (divided by the ranks of its side that hold the same elements), so the sum
// is the sum of the sides' whole gradients.
#include <limits>

#include "base/check.h"
#include "parallel/pipeline_runtime.h"
#include "runtime/shard_state.h"

namespace shardtorch::detail {

void PipelineRuntime::check_tied_equal() {
  c10::NoGradGuard no_grad;
  for (const auto& t : tied) {
    // Elementwise max and min over every holder: equal copies give max == min.
    auto opts = at::TensorOptions().dtype(at::kDouble).device(t.group->device());
    at::Tensor hi = at::full({t.tensor.numel()}, -std::numeric_limits<double>::infinity(), opts);
    at::Tensor lo = at::full({t.tensor.numel()}, std::numeric_limits<double>::infinity(), opts);
    for (const auto& p : pieces_of(*state, t.tensor)) {
      if (!p.value.defined() || p.value.numel() != p.length) continue;  // OptimizerOnly: values are owned pieces
      hi.narrow(0, p.offset, p.length).copy_(p.value);
      lo.narrow(0, p.offset, p.length).copy_(p.value);
    }
    t.group->all_reduce(hi, c10d::ReduceOp::MAX, "the values of tied parameter '" + t.all.front() + "'");
    t.group->all_reduce(lo, c10d::ReduceOp::MIN, "the values of tied parameter '" + t.all.front() + "'");
    const double worst = (hi - lo).abs().max().item<double>();
    std::string names;
    for (const auto& n : t.all) names += (names.empty() ? "'" : ", '") + n + "'";
    SHARDTORCH_CHECK(worst == 0, rank_prefix(mesh->world()->global_rank()),
                     ": shardtorch::Pipeline: the parameter tied as ", names,
                     " has different values on the stages that hold it (largest difference ", worst,
                     "); build the model the same way on every rank (the same seed, or deferred construction)");
  }
}

void PipelineRuntime::sync_tied() {
  c10::NoGradGuard no_grad;
  for (const auto& t : tied) {
    if (!t.tensor.requires_grad()) continue;
    auto pieces = pieces_of(*state, t.tensor);
    at::ScalarType dtype = at::kFloat;
    for (const auto& p : pieces)
      if (p.grad.defined()) dtype = p.grad.scalar_type();
    at::Tensor sum = at::zeros({t.tensor.numel()}, at::TensorOptions().dtype(dtype).device(t.group->device()));
    for (const auto& p : pieces)
      if (p.grad.defined()) sum.narrow(0, p.offset, p.length).copy_(p.grad).div_(t.copies);
    t.group->all_reduce(sum, c10d::ReduceOp::SUM, "the gradients of tied parameter '" + t.all.front() + "'");
    for (auto& p : pieces) {
      at::Tensor mine = sum.narrow(0, p.offset, p.length);
      if (p.grad.defined()) {
        p.grad.copy_(mine);
      } else if (state->path().replicated()) {  // NoShard: no gradient of its own this step, the other copies' sum
        at::Tensor(state->path().record_of(t.tensor)).mutable_grad() =
            mine.view(t.tensor.sizes()).to(p.value.device()).clone();
      }
    }
  }
}

}  // namespace shardtorch::detail
