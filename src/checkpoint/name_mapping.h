#pragma once
// Internal: how the loaders of other frameworks' checkpoints (Hugging Face,
// DCP) turn a checkpoint's tensor names into the model's.
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shardtorch::checkpoint {

inline bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

/// The model's name for `name`: the first of `rules` (from, to) whose
/// `from` starts it has that part replaced by `to`, then `map_name`
/// applies; nullopt (or "" from map_name): the tensor is skipped.
inline std::optional<std::string> map_checkpoint_name(
    const std::string& name, const std::vector<std::pair<std::string, std::string>>& rules,
    const std::function<std::optional<std::string>(const std::string&)>& map_name) {
  std::string m = name;
  for (const auto& [from, to] : rules) {
    if (m.rfind(from, 0) == 0) {
      m = to + m.substr(from.size());
      break;
    }
  }
  if (map_name) {
    auto mapped = map_name(m);
    if (!mapped || mapped->empty()) return std::nullopt;
    m = *mapped;
  }
  return m;
}

}  // namespace shardtorch::checkpoint
