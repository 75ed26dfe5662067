// The one file that sees Gloo's headers.
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "shardtorch/world.h"

namespace shardtorch::detail {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout,
                                                    const std::string& hostname) {
  auto opts = c10d::ProcessGroupGloo::Options::create();
  opts->timeout = timeout;
  opts->devices.push_back(hostname.empty() ? c10d::ProcessGroupGloo::createDefaultDevice()
                                           : c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
}

}  // namespace shardtorch::detail
