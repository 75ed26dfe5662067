#pragma once
// The single-process reference that parity tests compare a distributed run
// with: the library's own shardtorch/parity.h (docs/testing.md, "Parity with
// one process"), under the names the suites use.
#include "models.h"
#include "shardtorch/gather.h"
#include "shardtorch/parity.h"

namespace testref {

using Tensors = shardtorch::testing::NamedTensors;
using shardtorch::testing::expect_same_run;
using shardtorch::testing::gradients_of;
using shardtorch::testing::Run;
using shardtorch::testing::train_ranks;
using shardtorch::testing::train_reference;

/// Collective: the full, reduced gradients of a sharded model now, in the
/// parameters' dtype made fp32; a parameter parallelize() split as this
/// rank's slice (tptest::whole makes it whole, independently of the
/// library's own gather).
inline Tensors full_gradients(torch::nn::Module& root) {
  shardtorch::FullParams full(root, shardtorch::SummonOptions().with_grads(true).writeback(false));
  return shardtorch::testing::gradients_of(root);
}

/// Collective: the full parameters of a sharded model now, in the parameters'
/// dtype; a parameter parallelize() split as this rank's slice.
inline Tensors full_parameters(torch::nn::Module& root) {
  shardtorch::FullParams full(root);
  return shardtorch::testing::parameters_of(root);
}

}  // namespace testref
