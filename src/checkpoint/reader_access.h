#pragma once
// Internal: the parsed header of an open checkpoint::Reader, for the
// library's own readers (offsets, data start) beyond what TensorInfo says.
#include "checkpoint/safetensors_format.h"
#include "shardtorch/checkpoint/safetensors.h"

namespace shardtorch::checkpoint {

struct ReaderAccess {
  static const SafetensorsHeader& header(const Reader& r) { return *r.header_; }
};

}  // namespace shardtorch::checkpoint
