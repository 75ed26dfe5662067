#include "base/text.h"

#include <sstream>

namespace shardtorch::detail {

std::string shape_text(c10::IntArrayRef shape) {
  std::ostringstream os;
  os << shape;
  return os.str();
}

std::string quoted_names(const std::vector<std::string>& names, size_t shown, size_t total) {
  total = std::max(total, names.size());
  std::string out;
  for (size_t i = 0; i < names.size() && i < shown; ++i) out += (i ? ", '" : "'") + names[i] + "'";
  return out + (total > shown && !out.empty() ? ", ..." : "");
}

std::string and_more(const std::vector<std::string>& others, const std::string& what) {
  if (others.empty()) return "";
  return ", and " + std::to_string(others.size()) + " more " + what + " (" + quoted_names(others) + ")";
}

}  // namespace shardtorch::detail
