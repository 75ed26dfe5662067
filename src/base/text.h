#pragma once
// Pieces of error messages that several layers build the same way.
#include <c10/util/ArrayRef.h>

#include <string>
#include <vector>

namespace shardtorch::detail {

/// "[2, 3]".
std::string shape_text(c10::IntArrayRef shape);

/// "'a', 'b', 'c', ..." of the first `shown` names ("" when none); "..."
/// when `total` (names.size() by default) is larger than what is shown.
std::string quoted_names(const std::vector<std::string>& names, size_t shown = 3, size_t total = 0);

/// ", and N more <what> ('a', 'b', 'c', ...)" for the N `others`, or "" when
/// there are none.
std::string and_more(const std::vector<std::string>& others, const std::string& what);

/// The first line where two texts differ: its number (from 1) and each
/// text's line there ("(none)" past a text's end).
struct LineDifference {
  int line = 0;
  std::string a, b;
};
LineDifference first_line_difference(const std::string& a, const std::string& b);

}  // namespace shardtorch::detail
