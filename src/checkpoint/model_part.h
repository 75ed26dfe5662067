#pragma once
// Internal: checkpoints of a model that several groups of ranks hold in parts
// (a pipeline's stages: shardtorch/pipeline_checkpoint.h). Each part is a
// sharded model over its own World; the checkpoint is the whole model's, with
// the whole model's names, and every function is collective over the World
// of every rank holding a part (docs/checkpoints.md, "Pipelines").
//
// The formats are those of the whole model: a part's parameters and buffers
// are saved under their names, a parameter tied across parts once (under its
// first part's name) where the format saves tied parameters once, and
// loading finds a part's tied parameter under any of its names.
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/tied_names.h"
#include "shardtorch/checkpoint.h"
#include "shardtorch/dcp_checkpoint.h"
#include "shardtorch/hf_checkpoint.h"
#include "shardtorch/optim.h"
#include "shardtorch/world.h"

namespace shardtorch::checkpoint {

struct ModelPart {
  /// Every rank of every part. Its rank 0 is rank 0 of its own part's World.
  std::shared_ptr<World> world;
  /// Every parameter (under each of its names) and buffer of the whole model,
  /// with its shape: what a checkpoint of it holds.
  std::map<std::string, std::vector<int64_t>> shapes;
  /// This part's parameters that other parts hold too, by their name here:
  /// their names on every part holding one, the first part's first (the name
  /// a tied parameter is saved under once).
  std::map<std::string, std::vector<std::string>> ties;
  /// How the model is laid out (recorded by sharded checkpoints, informational).
  std::string layout;
  /// Tensor parallelism (checkpoint/tp_slices.h): this part's rank in its
  /// tensor-parallel group, and the names of its parameters that are slices
  /// of the whole model's (detail::placement_of). A slice is saved into the
  /// whole tensor with the other ranks' slices; the parameters whole on every
  /// rank of the group, and the buffers, are saved by the parts at tp rank 0.
  int tp_rank = 0;
  std::set<std::string> split;
  /// The whole model's parameter names in its order (where a format lists
  /// them: a DCP checkpoint's optimizer groups).
  std::vector<std::string> order;

  /// The names a parameter named `name` here may be saved under, in the
  /// order a load takes the first present: a tie's names in the parts'
  /// order (so that every part holding it reads the same tensor), or `name`.
  std::vector<std::string> names_of(const std::string& name) const;
  /// Whether a save leaves `name` to another part: a tie's name other than
  /// the first (where the format writes each tied parameter once), or a
  /// tensor whole on every rank of the tensor-parallel group, here at a tp
  /// rank other than 0.
  bool saved_by_another_part(const std::string& name) const;
  /// Whether a save leaves `name` to the part at tp rank 0 (a buffer, or a
  /// parameter parallelize() did not split), whatever the format.
  bool left_to_tp_rank_0(const std::string& name) const { return tp_rank != 0 && !split.count(name); }
};

/// The names of `root`'s parameters (detail::parameter_names), with `part`
/// each tied parameter's names on the other parts too (names_of, in order).
ParameterNames parameter_names(torch::nn::Module& root, const ModelPart* part);
/// The names a load into `root` matches a checkpoint's against: its
/// parameters and defined buffers, with `part` every other part's too.
std::set<std::string> model_names(torch::nn::Module& root, const ModelPart* part);

// The checkpoint functions of shardtorch/checkpoint.h and hf_checkpoint.h for
// a part: collective over part.world, with `root` this rank's part (sharded).
void save_full_state_dict(torch::nn::Module& root, const std::string& path,
                          const std::map<std::string, std::string>& metadata, const ModelPart& part);
void load_full_state_dict(torch::nn::Module& root, const std::string& path, const LoadOptions& options,
                          const ModelPart& part);
void save_sharded_checkpoint(torch::nn::Module& root, ShardedOptimizer* optimizer, const std::string& dir, int64_t step,
                             const std::map<std::string, std::string>& user_state, const ModelPart& part);
int64_t load_sharded_checkpoint(torch::nn::Module& root, ShardedOptimizer* optimizer, const std::string& dir,
                                std::map<std::string, std::string>* user_state, const LoadOptions& options,
                                const ModelPart& part);
HfSaveReport save_hf_checkpoint(torch::nn::Module& root, const std::string& dir, const HfSaveOptions& options,
                                const ModelPart& part);
HfLoadReport load_hf_checkpoint(torch::nn::Module& root, const std::string& path, const HfLoadOptions& options,
                                const ModelPart& part);
DcpSaveReport save_dcp_checkpoint(torch::nn::Module& root, ShardedOptimizer* optimizer, const std::string& dir,
                                  const DcpSaveOptions& options, const ModelPart& part);
DcpLoadReport load_dcp_checkpoint(torch::nn::Module& root, ShardedOptimizer* optimizer, const std::string& dir,
                                  const DcpLoadOptions& options, const ModelPart& part);

}  // namespace shardtorch::checkpoint
