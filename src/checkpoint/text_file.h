#pragma once
// Internal: a small text file a checkpoint reader takes whole (an index, DCP
// metadata).
#include <cstdint>
#include <string>

namespace shardtorch::checkpoint {

/// The contents of the regular file `path`, at most `max_bytes` of them. A
/// failure throws SafetensorsError "WHAT 'PATH': cannot open: ...", "...:
/// read failed: ..." or, past `max_bytes`, "WHAT 'PATH': TOO_LARGE".
std::string read_text_file(const std::string& path, const std::string& what, uint64_t max_bytes,
                           const std::string& too_large);

}  // namespace shardtorch::checkpoint
