#include "runtime/buffer_sync.h"
#include "base/check.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <sstream>

#include "shardtorch/shard_options.h"
#include "shardtorch/world.h"

namespace shardtorch::detail {

void broadcast_coalesced(Comm& comm, NamedTensors& tensors, const std::string& what, const std::string& when) {
  c10::NoGradGuard no_grad;
  std::vector<at::ScalarType> dtypes;
  for (const auto& [name, t] : tensors)
    if (std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) == dtypes.end()) dtypes.push_back(t.scalar_type());
  for (at::ScalarType dtype : dtypes) {
    std::vector<at::Tensor> parts;
    std::vector<const std::string*> names;
    for (const auto& [name, t] : tensors) {
      if (t.scalar_type() != dtype) continue;
      parts.push_back(t.reshape({-1}));
      names.push_back(&name);
    }
    at::Tensor flat = at::cat(parts);
    std::ostringstream label;
    label << what << " of dtype " << dtype << " ('" << *names.front() << "'"
          << (names.size() > 1 ? " and " + std::to_string(names.size() - 1) + " more" : std::string()) << ") " << when;
    comm.broadcast(flat, 0, label.str());
    int64_t offset = 0;
    for (auto& [name, t] : tensors) {
      if (t.scalar_type() != dtype) continue;
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

void BufferSync::setup(World& world, const ShardOptions& o, NamedTensors& buffers,
                       const std::unordered_set<const void*>& keep) {
  if (const auto& dtype = o.mixed_precision().buffer_dtype()) {
    c10::NoGradGuard no_grad;
    for (auto& [name, b] : buffers)
      if (b.is_floating_point() && !keep.count(b.unsafeGetTensorImpl())) b.set_data(b.to(*dtype));
  }
  if (world.size() == 1 || buffers.empty() || !(o.sync_module_states() || o.broadcast_buffers())) return;
  const c10::Device comm_device = world.comm().device();
  for (auto& [name, b] : buffers) {
    SHARDTORCH_CHECK(b.device() == comm_device, "shardtorch::shard: buffer '", name, "' is on ", b.device(),
                     ", expected ", comm_device);
  }
  if (o.sync_module_states()) broadcast_coalesced(world.comm(), buffers, "buffers", "at shard()");
  if (o.broadcast_buffers()) buffers_ = buffers;
}

void BufferSync::broadcast_after_step(World& world) {
  if (!buffers_.empty()) broadcast_coalesced(world.comm(), buffers_, "buffers", "after a step");
}

}  // namespace shardtorch::detail
