#include "parallel/stage_module.h"

#include "base/check.h"

namespace shardtorch::detail {

void PipelineStageImpl::place(const std::string& path, const std::shared_ptr<torch::nn::Module>& module) {
  SHARDTORCH_CHECK(!path.empty() && path.front() != '.' && path.back() != '.' && path.find("..") == std::string::npos,
                   "shardtorch: pipeline layer module path '", path, "' is not a dotted module name (\"blocks.3\")");
  SHARDTORCH_CHECK(module, "shardtorch: pipeline layer module at '", path, "' is null");
  for (const auto& [other, _] : placed_) {
    const bool inside = path.rfind(other + ".", 0) == 0, holds = other.rfind(path + ".", 0) == 0;
    SHARDTORCH_CHECK(other != path && !inside && !holds, "shardtorch: pipeline layers place modules at '", other,
                     "' and '", path, "' on one stage: ", other == path ? "the same path" : "one inside the other",
                     "; give each module of the unsplit model to one layer");
  }
  torch::nn::Module* parent = this;
  std::string prefix;
  size_t begin = 0;
  for (size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', begin)) {
    const std::string name = path.substr(begin, dot - begin);
    prefix += (prefix.empty() ? "" : ".") + name;
    auto it = containers_.find(prefix);
    if (it == containers_.end()) {
      auto c = std::make_shared<torch::nn::Module>("shardtorch::PipelineContainer");
      parent->register_module(name, c);
      it = containers_.emplace(prefix, c).first;
    }
    parent = it->second.get();
    begin = dot + 1;
  }
  parent->register_module(path.substr(begin), module);
  placed_[path] = path;
}

at::Tensor PipelineStageImpl::forward(at::Tensor) {
  SHARDTORCH_CHECK(false, "shardtorch: a pipeline stage's module is run by shardtorch::Pipeline::step, not called");
}

}  // namespace shardtorch::detail
