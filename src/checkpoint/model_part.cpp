#include "checkpoint/model_part.h"

#include <algorithm>

namespace shardtorch::checkpoint {

std::vector<std::string> ModelPart::names_of(const std::string& name) const {
  auto it = ties.find(name);
  if (it == ties.end() || it->second.empty()) return {name};
  std::vector<std::string> out = it->second;
  if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  return out;
}

bool ModelPart::saved_by_another_part(const std::string& name) const {
  auto it = ties.find(name);
  return it != ties.end() && !it->second.empty() && it->second.front() != name;
}

}  // namespace shardtorch::checkpoint
