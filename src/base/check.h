#pragma once
// Internal: SHARDTORCH_CHECK(condition, message pieces...) throws
// shardtorch::Error with the pieces joined (as c10::str joins them) when the
// condition is false; with no pieces the message names the condition.
#include <c10/macros/Macros.h>
#include <c10/util/StringUtil.h>

#include <string>

#include "shardtorch/error.h"

namespace shardtorch::detail {
/// Throws shardtorch::Error(message, or one naming `condition` if empty),
/// with a C++ backtrace appended under SHARDTORCH_SHOW_CPP_STACKTRACES=1.
[[noreturn]] SHARDTORCH_API void throw_error(const char* condition, const std::string& message);
/// "shardtorch: rank N", the start of every message about one rank (N: its
/// rank in the job). Message pieces are built only on failure, so this costs
/// nothing in a SHARDTORCH_CHECK that holds.
inline std::string rank_prefix(int rank) { return "shardtorch: rank " + std::to_string(rank); }
}  // namespace shardtorch::detail

#define SHARDTORCH_CHECK(cond, ...)                                                               \
  do {                                                                                            \
    if (C10_UNLIKELY(!(cond))) ::shardtorch::detail::throw_error(#cond, ::c10::str(__VA_ARGS__)); \
  } while (false)
