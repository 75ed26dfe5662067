#pragma once
// A CPU allocator for tests that counts the bytes held through it.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace testmodels {

// Counts the bytes the CPU allocator holds while installed, and their peak:
// what the process really allocates, not what the library says it does. The
// counters outlive the object: a tensor allocated through it may be freed
// after it is gone (by Gloo's thread, say).
class CountingCPUAllocator final : public c10::Allocator {
 public:
  CountingCPUAllocator() : base_(c10::GetCPUAllocator()) {
    counters().peak = counters().current.load();
    c10::SetCPUAllocator(this);
  }
  ~CountingCPUAllocator() override {
    if (c10::GetCPUAllocator() == this) c10::SetCPUAllocator(base_);
  }
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return base_->allocate(0);  // nothing to count (and no address of its own)
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    auto& c = counters();
    {
      std::lock_guard<std::mutex> lock(c.mu);
      c.held[data] = Held{std::move(inner), n};
    }
    const int64_t now = c.current += static_cast<int64_t>(n);
    for (int64_t p = c.peak.load(); now > p && !c.peak.compare_exchange_weak(p, now);) {
    }
    // The context is the data (raw_allocate, which some kernels use, requires it).
    return {data, data, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
  /// Bytes held now through this allocator (or an earlier one).
  int64_t current() const { return counters().current; }
  /// The most bytes held at once since this object was made (or reset_peak),
  /// counting what was held then through an earlier one.
  int64_t peak() const { return counters().peak; }
  /// The peak restarts from what is held now.
  void reset_peak() { counters().peak = counters().current.load(); }

 private:
  struct Held {
    c10::DataPtr inner;
    size_t bytes = 0;
  };
  struct Counters {
    std::atomic<int64_t> current{0}, peak{0};
    std::mutex mu;
    std::unordered_map<void*, Held> held;  // by data pointer
  };
  static Counters& counters() {
    static Counters c;
    return c;
  }
  static void release(void* data) {
    auto& c = counters();
    Held h;
    {
      std::lock_guard<std::mutex> lock(c.mu);
      auto it = c.held.find(data);
      if (it == c.held.end()) return;
      h = std::move(it->second);
      c.held.erase(it);
    }
    c.current -= static_cast<int64_t>(h.bytes);
  }  // h.inner frees the bytes
  c10::Allocator* base_;
};

}  // namespace testmodels
