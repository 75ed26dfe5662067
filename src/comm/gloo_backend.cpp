// The one file that sees Gloo's headers.
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <csignal>

#include "shardtorch/world.h"
#include "comm/backends.h"

namespace shardtorch::detail {
namespace {
// Gloo writes to sockets; when a peer dies, a write raises SIGPIPE, whose
// default action kills this rank silently instead of letting the failed
// collective report which operation did not complete. Python ignores SIGPIPE
// at start-up, so PyTorch never sees this; a C++ program must do the same.
// A handler the program installed itself is left alone.
void ignore_sigpipe_unless_handled() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}
}  // namespace

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout, const std::string& hostname) {
  ignore_sigpipe_unless_handled();
  auto opts = c10d::ProcessGroupGloo::Options::create();
  opts->timeout = timeout;
  opts->devices.push_back(hostname.empty() ? c10d::ProcessGroupGloo::createDefaultDevice()
                                           : c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
}

}  // namespace shardtorch::detail
