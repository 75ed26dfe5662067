#pragma once
// ReduceScatterBucketer: coalesces small gradient reduce-scatters.
//
// Inputs are flat tensors of world × shard elements (chunk r goes to rank r).
// Per key (dtype, device, process group) one bucket holds a [world, cols]
// buffer; an input is copied into the next free column range, and when it does
// not fit within the bucket's capacity (bucket_mb) the bucket is flushed first
// (one reduce-scatter for everything in it). An input whose shard exceeds the
// capacity goes out on its own. Buffers are allocated on first use, grow (by
// doubling, up to the capacity) only as far as the inputs need, start at the
// previous backward's high-water mark, and are freed by free(), which the
// sharded module calls at the end of each backward: buckets exist only during
// backward and never hold more than the gradients need. Callbacks receive
// views of the reduced shard, in submission order per key, when their bucket
// is flushed.
#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "shardtorch/collectives.h"
#include "shardtorch/memory.h"

namespace shardtorch {

class ReduceScatterBucketer {
 public:
  using Callback = std::function<void(const at::Tensor& reduced_shard)>;

  /// bucket_mb: size of one bucket's [world, cap] input buffer in MiB; 0
  /// disables coalescing (every input is reduced on its own).
  explicit ReduceScatterBucketer(double bucket_mb = 25.0, MemoryTracker* mem = nullptr);
  ~ReduceScatterBucketer();

  /// Queues `input` (1-D, numel divisible by the group size) for a summing
  /// reduce-scatter over `group`; `callback` gets this rank's reduced shard.
  void reduce_scatter(const at::Tensor& input, Comm& group, Callback callback, const std::string& what);
  /// Reduces everything queued, then runs the callbacks.
  void flush();
  /// Frees every bucket's buffers (call after flush()).
  void free();

  /// Bytes held by bucket buffers now.
  int64_t allocated_bytes() const;
  /// Collectives launched so far (coalesced buckets and bypasses).
  int64_t launched() const { return launched_; }

 private:
  struct Bucket {
    Comm* group = nullptr;
    at::Tensor buffer;  // [world, cols]; undefined between backwards
    at::Tensor output;  // [cols]
    int64_t cap = 0;         // most columns allowed (bucket_mb)
    int64_t high_water = 0;  // most columns used at a flush so far
    int64_t offset = 0;      // columns used
    std::vector<std::pair<std::pair<int64_t, int64_t>, Callback>> callbacks;  // (start, len)
    std::vector<std::string> whats;
  };
  using Key = std::tuple<int /*dtype*/, std::string /*device*/, const void* /*group*/>;

  Bucket& bucket_for(const at::Tensor& input, Comm& group);
  /// Makes room for `cols` columns (<= cap), keeping the columns in use.
  void reserve(Bucket& b, int64_t cols, const at::TensorOptions& opts);
  void release(Bucket& b);
  void flush_bucket(Bucket& b);

  int64_t bucket_bytes_;
  MemoryTracker* mem_;
  std::map<Key, Bucket> buckets_;
  int64_t launched_ = 0;
};

}  // namespace shardtorch
