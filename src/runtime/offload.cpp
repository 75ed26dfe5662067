#include "runtime/offload.h"

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdlib>
#include <utility>

#include "base/env.h"
#include "base/log.h"

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
  HostCopyWorker::Pending p;
  p.host = at::empty(device_tensor.sizes(), device_tensor.options().device(at::kCPU).pinned_memory(pin_));
  bytes_to_host_ += device_tensor.nbytes();
  p.done = std::move(done);
  if (!accelerator()) {
    p.host.copy_(device_tensor);
  } else {
    // A tensor someone else may reuse (a bucket's output) is first copied on
    // the current stream; one handed over (`owned`) is kept as it is.
    p.device_copy = owned ? device_tensor : device_tensor.clone();
    p.device_bytes = p.device_copy.nbytes();
    c10::impl::VirtualGuardImpl impl(device_.type());
    c10::Event cloned(device_.type());
    cloned.record(impl.getStream(device_));
    cloned.block(*side_);
    c10::StreamGuard on_side(*side_);
    p.host.copy_(p.device_copy, /*non_blocking=*/pin_);
    p.copied.emplace(device_.type());
    p.copied->record(*side_);
  }
  worker_.push(std::move(p));
}

void HostCopyWorker::push(Pending p) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!thread_.joinable()) thread_ = std::thread([this] { work(); });
  in_flight_bytes_ += p.device_bytes;
  queue_.push_back(std::move(p));
  cv_.notify_all();
  // Bound the device memory held by copies in flight.
  cv_.wait(lock, [&] { return in_flight_bytes_ <= kMaxInFlightBytes; });
}

void set_thread_parallelism(int threads);  // src/optim/cpu_adam.cpp

void HostCopyWorker::work() {
  at::init_num_threads();  // ATen's thread count (set_num_threads) holds here too
  if (auto v = env("SHARDTORCH_OFFLOAD_THREADS")) {
    char* end = nullptr;
    const long threads = std::strtol(v->c_str(), &end, 10);
    if (*end == '\0' && threads > 0 && threads <= 4096)
      set_thread_parallelism(static_cast<int>(threads));
    else  // this thread cannot fail the program: said once, not silently
      SHARDTORCH_WARN_ONCE("shardtorch: SHARDTORCH_OFFLOAD_THREADS='", *v,
                           "' is not a positive thread count; the offload thread uses ATen's");
  }
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping
    Pending p = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    std::exception_ptr failed;
    try {
      if (p.copied) p.copied->synchronize();
    } catch (...) {
      failed = std::current_exception();
    }
    p.device_copy = at::Tensor();
    lock.lock();
    in_flight_bytes_ -= p.device_bytes;
    const bool run = !failed && !error_ && !dropping_;
    if (failed && !error_ && !dropping_) error_ = failed;
    cv_.notify_all();
    lock.unlock();
    if (run) {
      try {
        c10::NoGradGuard no_grad;
        p.done(p.host);
      } catch (...) {
        failed = std::current_exception();
      }
    }
    p = Pending();  // the host copy and the callback's captures go before the worker says idle
    lock.lock();
    if (failed && !error_ && !dropping_) error_ = failed;
    busy_ = false;
    cv_.notify_all();
  }
}

HostCopyWorker::~HostCopyWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    dropping_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

int64_t HostCopyWorker::in_flight_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_bytes_;
}

void HostCopyWorker::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

void Offloader::wait_idle() {
  worker_.wait();
  if (accelerator()) side_->synchronize();
}

void Offloader::discard() {
  worker_.drop([&] {
    if (accelerator()) side_->synchronize();
  });
}

void HostCopyWorker::drop(const std::function<void()>& then) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropping_ = true;
  }
  wait();
  then();
  std::lock_guard<std::mutex> lock(mu_);
  dropping_ = false;
  error_ = nullptr;
}

void HostCopyWorker::drain() {
  wait();
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    e = std::exchange(error_, nullptr);
  }
  if (e) std::rethrow_exception(e);
}

}  // namespace shardtorch::detail
