#pragma once
// The error every checkpoint reader and writer throws, naming the file and
// the problem (plain C++, no ATen).
#include <stdexcept>

#include "shardtorch/export.h"

namespace shardtorch::checkpoint {

class SHARDTORCH_API SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace shardtorch::checkpoint
