#include "checkpoint/model_part.h"

#include <algorithm>

#include "runtime/shard_state.h"

namespace shardtorch::checkpoint {

std::vector<std::string> ModelPart::names_of(const std::string& name) const {
  auto it = ties.find(name);
  if (it == ties.end() || it->second.empty()) return {name};
  std::vector<std::string> out = it->second;
  if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  return out;
}

bool ModelPart::saved_by_another_part(const std::string& name) const {
  if (left_to_tp_rank_0(name)) return true;
  auto it = ties.find(name);
  return it != ties.end() && !it->second.empty() && it->second.front() != name;
}

ParameterNames parameter_names(torch::nn::Module& root, const ModelPart* part) {
  ParameterNames names = detail::parameter_names(root);
  if (part)
    for (auto& [impl, ns] : names) {
      std::vector<std::string> all;
      for (const auto& n : ns)
        for (const auto& m : part->names_of(n))
          if (std::find(all.begin(), all.end(), m) == all.end()) all.push_back(m);
      ns = std::move(all);
    }
  return names;
}

std::set<std::string> model_names(torch::nn::Module& root, const ModelPart* part) {
  std::set<std::string> names;
  for (const auto& item : root.named_parameters()) names.insert(item.key());
  for (const auto& item : root.named_buffers())
    if (item.value().defined()) names.insert(item.key());
  if (part)
    for (const auto& [name, shape] : part->shapes) names.insert(name);
  return names;
}

}  // namespace shardtorch::checkpoint
