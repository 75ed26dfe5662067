#pragma once
// Internal: the counters behind ShardedModel::memory() (shardtorch/memory.h).
#include <cstdint>
#include <mutex>

#include "shardtorch/memory.h"

namespace shardtorch {

/// Thread-safe: CPU offload's host thread counts the host gradients it makes.
class MemoryTracker {
 public:
  void add(Mem m, int64_t bytes);
  void sub(Mem m, int64_t bytes) { add(m, -bytes); }
  void set(Mem m, int64_t bytes);
  void unit_gathered();
  void unit_released();
  /// Peaks restart from the current values (e.g. at each step).
  void reset_peaks();
  MemorySnapshot snapshot() const;

 private:
  mutable std::mutex mu_;
  MemorySnapshot snap_;
};

}  // namespace shardtorch
