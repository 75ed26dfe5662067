#pragma once
// The error every checkpoint reader and writer throws, naming the file and
// the problem (plain C++, no ATen).
#include "shardtorch/error.h"
#include "shardtorch/export.h"

namespace shardtorch::checkpoint {

class SHARDTORCH_API SafetensorsError : public Error {
 public:
  using Error::Error;
};

}  // namespace shardtorch::checkpoint
