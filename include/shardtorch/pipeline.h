#pragma once
// Pipeline parallelism: a model cut into stages, each on its own ranks,
// micro-batches flowing through them (docs/parallelism.md).
//
//   auto mesh = shardtorch::DeviceMesh::create(world, {{"pp", 2}, {"dp", 2}});
//   gpt::GPT model = shardtorch::deferred([&] { return gpt::GPT(cfg); });  // nothing allocated
//   shardtorch::Pipeline pipe(gpt::pipeline_layers(model), mesh,
//                             shardtorch::PipelineOptions().microbatches(8));
//   auto opt = shardtorch::AdamW(pipe.module(), torch::optim::AdamWOptions(1e-3));
//   for (...) {
//     opt->zero_grad();
//     auto loss = pipe.step(tokens, targets, loss_fn);  // tokens read on the first stage, targets on the last
//     opt->step();
//   }
//
// The model is given as layers in order, each with the modules it holds under
// their names in the unsplit model; each rank keeps the layers of its stages
// (built deferred, the others never allocate), shards them as one model over
// the mesh's data-parallel dimension with any strategy, and runs the
// schedule's actions (shardtorch/schedule.h). Parameters keep the unsplit
// model's names, so checkpoints move between layouts.
#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardtorch/export.h"
#include "shardtorch/mesh.h"
#include "shardtorch/plan.h"
#include "shardtorch/schedule.h"
#include "shardtorch/shard_options.h"
#include "shardtorch/sharded_model.h"

namespace shardtorch {

/// One layer of a pipelined model: what it computes (one tensor in, one
/// out) and the modules it holds, each under its name in the unsplit model
/// ("blocks.3", "tok_emb"), which its parameters' names begin with.
struct SHARDTORCH_API PipelineLayer {
  std::string name;  // for split points and messages
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> modules;
  std::function<at::Tensor(const at::Tensor&)> forward;

  /// A module (holder) with a forward taking and returning one tensor, at
  /// `path` in the unsplit model.
  template <class Holder>
  static PipelineLayer of(const std::string& path, Holder module) {
    return PipelineLayer{path, {{path, module.ptr()}}, [module](const at::Tensor& x) mutable { return module(x); }};
  }
};

struct SHARDTORCH_API PipelineOptions {
  TORCH_ARG(Schedule, schedule) = Schedule::OneFOneB;
  /// Micro-batches per step: the step's batch is split into this many along
  /// its first dimension (sizes differing by at most one).
  TORCH_ARG(int, microbatches) = 4;
  /// Chunks (virtual stages) per pipeline rank: 1 for GPipe and OneFOneB,
  /// two or more for Interleaved1F1B.
  TORCH_ARG(int, chunks_per_rank) = 1;
  /// How each chunk is sharded over the data-parallel dimension.
  TORCH_ARG(ShardOptions, shard) = {};
  /// The mesh's dimension the stages lie along, and the data-parallel one
  /// ("" or a dimension the mesh lacks: no data parallelism).
  TORCH_ARG(std::string, pp_dim) = "pp";
  TORCH_ARG(std::string, dp_dim) = "dp";
  /// Record each action's start and end (Pipeline::timeline()).
  TORCH_ARG(bool, record_timeline) = false;

 public:
  /// The layers that begin stages 1, 2, ... by name (stages x chunks - 1 of
  /// them, in order). Unset: the layers are split as evenly as their
  /// parameter counts allow.
  PipelineOptions& split_at(std::vector<std::string> names) {
    split_at_ = std::move(names);
    return *this;
  }
  const std::vector<std::string>& split_at() const { return split_at_; }

 private:
  std::vector<std::string> split_at_;
};

/// What one action of a step did on this rank (PipelineOptions::record_timeline).
struct SHARDTORCH_API PipelineEvent {
  pipeline::Action action;
  double start = 0, end = 0;  // seconds since the step began
};

namespace detail {
class PipelineRuntime;
struct PipelineAccess;  // the pipeline's checkpoints (shardtorch/pipeline_checkpoint.h) read its runtime
}  // namespace detail

class SHARDTORCH_API Pipeline {
 public:
  /// Collective over the mesh's World: every rank passes the same layers
  /// (names and parameter shapes) and options; a rank that differs is an
  /// error on every rank before any transfer. Keeps this rank's chunks and
  /// shards each over the data-parallel dimension (materialising deferred
  /// parameters of those chunks only).
  Pipeline(std::vector<PipelineLayer> layers, std::shared_ptr<DeviceMesh> mesh, PipelineOptions options = {});
  ~Pipeline();
  Pipeline(Pipeline&&) noexcept;
  Pipeline& operator=(Pipeline&&) noexcept;

  /// The loss of a micro-batch: its output on the last stage and its targets.
  using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets)>;
  /// One training step's forwards and backwards over the schedule. `inputs`
  /// is read on the first stage and `targets` on the last (elsewhere they
  /// may be undefined); both are split into micro-batches along dimension 0.
  /// Each micro-batch's loss is weighted by its share of the batch, so the
  /// gradients are those of the loss over the whole batch when `loss` is a
  /// mean. Returns that loss on every rank of this pipeline (the same value
  /// on each of its stages). The optimizer step follows, as usual.
  at::Tensor step(const at::Tensor& inputs, const at::Tensor& targets, const LossFn& loss);
  /// The same loss without gradients (evaluation): every micro-batch's
  /// forward through the stages in order (pipeline::make_forward_plan), no
  /// backward, no reduction; gradients are untouched.
  at::Tensor evaluate(const at::Tensor& inputs, const at::Tensor& targets, const LossFn& loss);

  /// Collective over the mesh's World: clip_grad_norm (shardtorch/clip.h)
  /// over the whole pipeline, every stage's gradients (a parameter tied
  /// across stages counted once), after step() and before the optimizer.
  /// Returns the norm on every rank.
  double clip_grad_norm(double max_norm, double norm_type = 2.0);

  /// This rank's stages as one module (every module of its layers at its
  /// path in the unsplit model), sharded over the data-parallel dimension:
  /// give it to an optimizer, clip_grad_norm and the checkpoint functions.
  torch::nn::Module& module() const;
  ShardedModel sharded() const;
  /// The stages this rank runs (one per chunk), and the number of stages.
  std::vector<int> stages() const;
  int num_stages() const;
  bool is_first_stage() const;  // runs stage 0
  bool is_last_stage() const;   // runs the last stage
  /// The names of the layers of each stage.
  std::vector<std::vector<std::string>> stage_layers() const;
  /// Every rank's actions; this rank runs actions[its pipeline rank].
  const pipeline::Plan& plan() const;
  /// The last step()'s or evaluate()'s actions in the order this rank ran
  /// them (recorded when PipelineOptions::record_timeline is on).
  const std::vector<PipelineEvent>& timeline() const;
  /// Collective over the pipeline's World: every rank's timeline() as JSON
  /// ("schedule" "forward" after an evaluate()), written by rank 0 of the
  /// mesh's World to `path` (atomic).
  void write_timeline(const std::string& path) const;
  /// Parameters tied across stages on different ranks (their names at each
  /// end); their gradients are summed after the step's reductions.
  std::vector<std::pair<std::string, std::string>> tied_parameters() const;

 private:
  friend struct detail::PipelineAccess;
  std::unique_ptr<detail::PipelineRuntime> rt_;
};

/// The units shard() builds for the stages that pipeline rank `pp_rank` of
/// `pp_size` holds, computed from the layers alone (deferred layers too):
/// plan_memory's input for that rank, with PlanOptions::pipelined set and
/// the data-parallel size as world_size. No communication, nothing
/// allocated; an error if the layers cannot be split as `options` asks.
SHARDTORCH_API std::vector<UnitSpec> pipeline_unit_specs(const std::vector<PipelineLayer>& layers,
                                                         const PipelineOptions& options, int pp_size, int pp_rank);

}  // namespace shardtorch
