#pragma once
// Internal: the module a pipeline rank shards: every module of the rank's
// stages placed at its path in the unsplit model ("blocks.3" becomes a
// container "blocks" holding "3"), so that parameters keep their unsplit
// names. The root is a unit (it owns what no inner unit does); the pipeline
// runs the layers' forwards itself, never this module's.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>

#include "shardtorch/unit.h"

namespace shardtorch::detail {

struct PipelineStageImpl : torch::nn::Module {
  /// Registers `module` at `path`; a path that another placed module holds,
  /// lies inside, or contains is an error naming both.
  void place(const std::string& path, const std::shared_ptr<torch::nn::Module>& module);
  /// Throws: a pipeline's stages run through Pipeline::step.
  at::Tensor forward(at::Tensor x);

 private:
  std::map<std::string, std::shared_ptr<torch::nn::Module>> containers_;  // made here, by path
  std::map<std::string, std::string> placed_;                             // path -> layer path placed there
};
SHARDTORCH_MODULE(PipelineStage);

}  // namespace shardtorch::detail
