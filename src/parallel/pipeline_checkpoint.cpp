// Checkpoints of a pipelined model: this rank's stages are one part of the
// unsplit model (checkpoint/model_part.h), described from the pipeline's
// layers, which every rank holds (the other stages' deferred).
#include "shardtorch/pipeline_checkpoint.h"

#include <sstream>

#include "base/check.h"
#include "checkpoint/model_part.h"
#include "checkpoint/tp_slices.h"
#include "parallel/pipeline_runtime.h"

namespace shardtorch {
namespace detail {

struct PipelineAccess {
  static const PipelineRuntime& runtime(const Pipeline& pipe) { return *pipe.rt_; }
};

}  // namespace detail

namespace {

// The whole model's names and shapes, this rank's tied parameters' names on
// the other stages, over the mesh's World.
checkpoint::ModelPart part_of(const Pipeline& pipe, const char* who) {
  const auto& rt = detail::PipelineAccess::runtime(pipe);
  checkpoint::ModelPart part;
  part.world = rt.mesh->world();
  for (const auto& layer : rt.layers)
    for (const auto& [path, module] : layer.modules) {
      for (const auto& item : module->named_parameters(/*recurse=*/true)) {
        part.shapes[path + "." + item.key()] = checkpoint::saved_shape(item.value());
        part.order.push_back(path + "." + item.key());
      }
      for (const auto& item : module->named_buffers(/*recurse=*/true))
        if (item.value().defined()) part.shapes[path + "." + item.key()] = item.value().sizes().vec();
    }
  std::shared_ptr<World> tp = checkpoint::describe_tensor_parallel(pipe.module(), part, who);
  // This rank's stages have no split parameter but others do: its tensors
  // are whole on every rank of the tensor-parallel group, saved at its rank 0.
  for (const auto& layer : rt.layers)
    for (const auto& [path, module] : layer.modules)
      for (const auto& item : module->named_parameters(/*recurse=*/true))
        if (auto p = detail::placement_of(item.value()); p && !tp) {
          tp = p->group;
          part.tp_rank = tp->rank();
        }
  // Ranks that differ in another dimension would hold the same stages: they
  // would each save them (the mesh is the same on every rank: every rank throws).
  for (const auto& [dim, size] : rt.mesh->dims())
    SHARDTORCH_CHECK(
        size == 1 || dim == rt.options.pp_dim() || dim == rt.options.dp_dim() || (tp && rt.mesh->group(dim) == tp),
        "shardtorch::", who, ": the pipeline's mesh (", rt.mesh->describe(), ") has a dimension '", dim,
        "' besides the pipeline's, the data-parallel one and the one parallelize() split the model "
        "over; checkpoints of such a pipeline are not supported");
  for (const auto& t : rt.tied) part.ties[t.name] = t.all;
  std::ostringstream layout;
  layout << "pipeline over " << rt.mesh->describe() << ", " << rt.stages() << " stages:";
  for (const auto& stage : rt.stage_layers) {
    layout << " [";
    for (size_t i = 0; i < stage.size(); ++i) layout << (i ? " " : "") << rt.layers[stage[i]].name;
    layout << "]";
  }
  part.layout = layout.str();
  return part;
}

}  // namespace

void save_full_state_dict(Pipeline& pipe, const std::string& path, const std::map<std::string, std::string>& metadata) {
  checkpoint::save_full_state_dict(pipe.module(), path, metadata, part_of(pipe, "save_full_state_dict"));
}

void load_full_state_dict(Pipeline& pipe, const std::string& path, const LoadOptions& options) {
  checkpoint::load_full_state_dict(pipe.module(), path, options, part_of(pipe, "load_full_state_dict"));
}

void save_sharded_checkpoint(Pipeline& pipe, ShardedOptimizer* optimizer, const std::string& dir, int64_t step,
                             const std::map<std::string, std::string>& user_state) {
  checkpoint::save_sharded_checkpoint(pipe.module(), optimizer, dir, step, user_state,
                                      part_of(pipe, "save_sharded_checkpoint"));
}

int64_t load_sharded_checkpoint(Pipeline& pipe, ShardedOptimizer* optimizer, const std::string& dir,
                                std::map<std::string, std::string>* user_state, const LoadOptions& options) {
  return checkpoint::load_sharded_checkpoint(pipe.module(), optimizer, dir, user_state, options,
                                             part_of(pipe, "load_sharded_checkpoint"));
}

HfSaveReport save_hf_checkpoint(Pipeline& pipe, const std::string& dir, const HfSaveOptions& options) {
  return checkpoint::save_hf_checkpoint(pipe.module(), dir, options, part_of(pipe, "save_hf_checkpoint"));
}

HfLoadReport load_hf_checkpoint(Pipeline& pipe, const std::string& path, const HfLoadOptions& options) {
  return checkpoint::load_hf_checkpoint(pipe.module(), path, options, part_of(pipe, "load_hf_checkpoint"));
}

DcpSaveReport save_dcp_checkpoint(Pipeline& pipe, ShardedOptimizer* optimizer, const std::string& dir,
                                  const DcpSaveOptions& options) {
  return checkpoint::save_dcp_checkpoint(pipe.module(), optimizer, dir, options, part_of(pipe, "save_dcp_checkpoint"));
}

DcpLoadReport load_dcp_checkpoint(Pipeline& pipe, ShardedOptimizer* optimizer, const std::string& dir,
                                  const DcpLoadOptions& options) {
  return checkpoint::load_dcp_checkpoint(pipe.module(), optimizer, dir, options, part_of(pipe, "load_dcp_checkpoint"));
}

}  // namespace shardtorch
