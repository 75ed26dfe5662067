#pragma once
// Internal: what a Pipeline holds on one rank (shardtorch/pipeline.h): its
// place in the mesh, its stages' layers, the sharded model of its chunks,
// the plan, the groups its tied parameters are summed over, and one step's
// state while the step runs (pipeline_step.cpp).
#include <ATen/ATen.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "parallel/param_pieces.h"
#include "parallel/stage_module.h"
#include "shardtorch/pipeline.h"

namespace shardtorch::detail {

class ShardState;

/// A parameter tied across stages on different pipeline ranks, as this rank
/// holds it.
struct TiedParam {
  std::string name;              // its name here
  std::vector<std::string> all;  // its name on each holding stage, by stage
  at::Tensor tensor;             // the module's parameter
  std::shared_ptr<Comm> group;   // every dp rank of every pipeline rank that holds it
  double copies = 1;             // ranks of this side's dp group holding each gradient element
  bool counted_here = false;     // this rank holds its first stage: the copy a gradient norm counts
};

class PipelineRuntime {
 public:
  std::shared_ptr<DeviceMesh> mesh;
  std::shared_ptr<World> pp, dp;  // this rank's groups along the pipeline and the data-parallel dimension
  PipelineOptions options;
  std::vector<PipelineLayer> layers;
  std::vector<std::vector<int>> stage_layers;  // layer indices, by stage
  int rank = 0;                                // along the pipeline
  pipeline::Plan plan;
  pipeline::Plan forward_plan;  // evaluate()'s
  PipelineStage module{nullptr};
  std::optional<ShardedModel> sharded;
  std::shared_ptr<ShardState> state;
  std::vector<TiedParam> tied;
  std::vector<PipelineEvent> timeline;
  bool timeline_of_evaluation = false;  // timeline is evaluate()'s (forward_plan), not a step's

  // Shapes of the activations crossing into each stage, per micro-batch, as
  // agreed in the last step that sent headers ("signature": the first
  // stage's inputs then).
  std::vector<int64_t> signature;
  std::map<std::pair<int, int>, std::pair<std::vector<int64_t>, at::ScalarType>> shapes;  // (stage, mb)

  int stages() const { return plan.stages(); }
  bool holds(int stage) const { return plan.rank_of(stage) == rank; }
  int chunk_of(int stage) const { return plan.chunk_of(stage); }
  /// This rank's pipeline-group rank of `stage`.
  int pp_rank_of(int stage) const { return plan.rank_of(stage); }
  std::string where(int stage, int mb) const;
  at::Tensor run_stage(int stage, const at::Tensor& x) const;
  /// The step, and evaluation (pipeline_step.cpp): both run a plan.
  at::Tensor step(const at::Tensor& inputs, const at::Tensor& targets, const Pipeline::LossFn& loss);
  at::Tensor evaluate(const at::Tensor& inputs, const at::Tensor& targets, const Pipeline::LossFn& loss);
  at::Tensor run(const pipeline::Plan& plan, bool training, const at::Tensor& inputs, const at::Tensor& targets,
                 const Pipeline::LossFn& loss);
  /// Pipeline::clip_grad_norm (pipeline_clip.cpp).
  double clip_grad_norm(double max_norm, double norm_type);
  /// Finds the parameters tied across stages on different pipeline ranks
  /// (`tied`), each with a group of every dp rank of every pipeline rank
  /// that holds it, and checks that their values agree (collective).
  void find_tied(bool has_dp);
  /// Sums the tied parameters' gradients across their stages (SyncTied).
  void sync_tied();
  /// Throws, on every rank of each tie's group, if a tied parameter's values
  /// differ between its stages (collective over the tie groups).
  void check_tied_equal();
};

}  // namespace shardtorch::detail
