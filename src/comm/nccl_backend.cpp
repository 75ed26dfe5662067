// The one file that sees NCCL's headers; compiled with USE_C10D_NCCL only when
// the LibTorch build has NCCL (see CMakeLists.txt). Without it, NCCL is
// reported unavailable and "auto" picks Gloo.
#include "shardtorch/world.h"
#include "comm/backends.h"
#include "base/check.h"

#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace shardtorch::detail {

#ifdef USE_C10D_NCCL
bool nccl_available() { return true; }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
}
#else
bool nccl_available() { return false; }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                                    std::chrono::milliseconds) {
  SHARDTORCH_CHECK(false, "shardtorch: this build has no NCCL");
}
#endif

}  // namespace shardtorch::detail
