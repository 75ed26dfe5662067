#pragma once
// Internal: fault injection into collectives, for the testing library
// (shardtorch::testing::fail_collectives, shardtorch/testing.h).
#include <string>

#include "shardtorch/export.h"

namespace shardtorch::detail {

/// The next `count` collectives of this process whose description contains
/// `what` complete and then fail. Exported for the testing library only.
SHARDTORCH_API void arm_collective_failure(const std::string& what, int count);

}  // namespace shardtorch::detail
