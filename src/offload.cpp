#include "offload.h"

#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace shardtorch::detail {

Offloader::Offloader(c10::Device device, bool pin) : device_(device), pin_(pin) {
  if (accelerator()) {
    c10::impl::VirtualGuardImpl impl(device_.type());
    side_ = impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
  }
}

at::Tensor Offloader::to_device(const at::Tensor& host, at::ScalarType dtype) {
  c10::NoGradGuard no_grad;
  // Allocated on the current stream, which is the one that goes on to use it.
  at::Tensor out = at::empty(host.sizes(), host.options().device(device_).dtype(dtype).pinned_memory(false));
  bytes_to_device_ += host.nbytes();
  if (!accelerator()) {
    out.copy_(host);
    return out;
  }
  c10::impl::VirtualGuardImpl impl(device_.type());
  const c10::Stream current = impl.getStream(device_);
  {
    // `out` came from the caching allocator on the current stream, which may
    // hand back a block that kernels queued there still use: the side stream
    // must not write it before they are done.
    c10::Event free_to_write(device_.type());
    free_to_write.record(current);
    free_to_write.block(*side_);
    c10::StreamGuard on_side(*side_);
    // Copy in the host dtype (pinned, asynchronous), then cast on the device.
    at::Tensor staged = host.scalar_type() == dtype ? out : at::empty(host.sizes(), host.options().device(device_));
    staged.copy_(host, /*non_blocking=*/pin_);
    if (!staged.is_same(out)) out.copy_(staged);
  }
  return out;
}

void Offloader::on_side_stream(const std::function<void()>& launch) {
  if (!accelerator()) {
    launch();
    return;
  }
  c10::impl::VirtualGuardImpl impl(device_.type());
  c10::Event queued(device_.type());
  queued.record(impl.getStream(device_));
  queued.block(*side_);
  c10::StreamGuard on_side(*side_);
  launch();
}

void Offloader::current_waits_for_copies() {
  if (!accelerator()) return;
  c10::impl::VirtualGuardImpl impl(device_.type());
  c10::Event copied(device_.type());
  copied.record(*side_);
  copied.block(impl.getStream(device_));
}

void Offloader::to_host(const at::Tensor& device_tensor, bool owned, std::function<void(const at::Tensor&)> done) {
  c10::NoGradGuard no_grad;
  Pending p;
  p.host = at::empty(device_tensor.sizes(), device_tensor.options().device(at::kCPU).pinned_memory(pin_));
  bytes_to_host_ += device_tensor.nbytes();
  p.done = std::move(done);
  if (!accelerator()) {
    p.host.copy_(device_tensor);
  } else {
    release_finished();
    // A tensor someone else may reuse (a bucket's output) is first copied on
    // the current stream; one handed over (`owned`) is kept as it is.
    p.device_copy = owned ? device_tensor : device_tensor.clone();
    in_flight_bytes_ += p.device_copy.nbytes();
    c10::impl::VirtualGuardImpl impl(device_.type());
    c10::Event cloned(device_.type());
    cloned.record(impl.getStream(device_));
    cloned.block(*side_);
    c10::StreamGuard on_side(*side_);
    p.host.copy_(p.device_copy, /*non_blocking=*/pin_);
    p.copied.emplace(device_.type());
    p.copied->record(*side_);
  }
  pending_.push_back(std::move(p));
  // Bound the device memory held by copies in flight: wait for the oldest.
  for (auto& q : pending_) {
    if (in_flight_bytes_ <= kMaxInFlightBytes) break;
    if (!q.device_copy.defined()) continue;
    q.copied->synchronize();
    in_flight_bytes_ -= q.device_copy.nbytes();
    q.device_copy = at::Tensor();
  }
}

void Offloader::release_finished() {
  for (auto& p : pending_) {
    if (p.device_copy.defined() && p.copied && p.copied->query()) {
      in_flight_bytes_ -= p.device_copy.nbytes();
      p.device_copy = at::Tensor();
    }
  }
}

void Offloader::wait_idle() {
  if (accelerator()) side_->synchronize();
}

void Offloader::discard() {
  wait_idle();
  pending_.clear();
  in_flight_bytes_ = 0;
}

void Offloader::drain() {
  auto pending = std::move(pending_);
  pending_.clear();
  for (auto& p : pending) {
    if (p.copied) p.copied->synchronize();
    p.device_copy = at::Tensor();
  }
  in_flight_bytes_ = 0;
  for (auto& p : pending) p.done(p.host);
}

}  // namespace shardtorch::detail
