#pragma once
// shardtorch::Error: what the library throws when something is wrong (plain
// C++, no ATen). Its message names the rank where one is involved and says
// what to do; it carries no C++ backtrace unless the environment variable
// SHARDTORCH_SHOW_CPP_STACKTRACES=1 is set. checkpoint::SafetensorsError
// (bad checkpoint files) is one. Errors from LibTorch itself in your own
// code (a shape mismatch in a forward) stay c10::Error.
#include <stdexcept>

#include "shardtorch/export.h"

namespace shardtorch {

class SHARDTORCH_API Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace shardtorch
