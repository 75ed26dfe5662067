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

LineDifference first_line_difference(const std::string& a, const std::string& b) {
  std::istringstream sa(a), sb(b);
  LineDifference d;
  for (;;) {
    ++d.line;
    const bool has_a = static_cast<bool>(std::getline(sa, d.a)), has_b = static_cast<bool>(std::getline(sb, d.b));
    if (!has_a) d.a = "(none)";
    if (!has_b) d.b = "(none)";
    if (!has_a || !has_b || d.a != d.b) return d;
  }
}

}  // namespace shardtorch::detail
