#pragma once
// Internal: flat parameters, the tensors behind a FlatParamLayout.
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shardtorch/flat_param_layout.h"
#include "base/memory_tracker.h"

namespace shardtorch {

class FlatParam;

/// A flat parameter's full buffer: the parameters laid out flat (full,
/// padded), its bytes given back to gather into and freed again, the
/// module's parameter tensors staying views of its storage.
class FullBuffer {
 public:
  /// `persistent`: never freed (ZeRO-1/2); the shard is then a view of this
  /// rank's slice of it.
  FullBuffer(FlatParam& flat, bool persistent) : flat_(flat), persistent_(persistent) {}
  FullBuffer(const FullBuffer&) = delete;
  FullBuffer& operator=(const FullBuffer&) = delete;

  /// The buffer, as it is now (its data freed while not gathered).
  at::Tensor& tensor() { return full_; }
  /// Its (and the module parameters') dtype: the compute dtype.
  at::ScalarType dtype() const { return full_.scalar_type(); }
  bool persistent() const { return persistent_; }
  bool gathered() const { return gathered_; }
  /// Gives the buffer its bytes back (contents undefined until filled).
  void alloc();
  /// Frees its bytes; the parameters stay views of its storage, whose
  /// data, if touched, throws the access error (see freed_access_is_an_error).
  /// `abandon`: a collective that failed (timed out) may still write into
  /// them, so they are let go of without being freed (leaked for good).
  void free(bool abandon = false);
  /// What touching the freed parameters' data throws (shard() sets one naming
  /// the rank and the unit; by default it names this flat parameter).
  void set_access_error(std::string message) { access_error_ = std::move(message); }
  /// Whether this LibTorch lets free() make a freed parameter's data access
  /// an error (c10::Error); without it such an access reads a null pointer.
  static bool freed_access_is_an_error();

 private:
  friend class FlatParam;
  FlatParam& flat_;
  at::Tensor full_;
  std::string access_error_;
  bool persistent_;
  bool gathered_ = false;
};

/// A flat parameter's gradients: the padded full-size staging buffer a
/// backward fills (in the reduce dtype), and the reduced gradient shard (under ZeRO-1 a view of
/// the whole gradient) the optimizer reads.
class FlatGrads {
 public:
  explicit FlatGrads(FlatParam& flat) : flat_(flat) {}
  FlatGrads(const FlatGrads&) = delete;
  FlatGrads& operator=(const FlatGrads&) = delete;

  /// This rank's gradient shard; undefined until a backward delivers one.
  at::Tensor& shard_grad() { return shard_grad_; }
  /// The whole gradient (ZeRO-1), else undefined.
  at::Tensor& full_grad() { return full_grad_; }
  /// The padded full-size gradient buffer a backward fills, zeroed on first use.
  at::Tensor& staging_grad();
  /// Adds parameter i's gradient into the staging buffer and drops it.
  void stage_grad(size_t i);
  bool has_staging_grad() const { return staging_.defined(); }
  /// Releases the staging buffer (after the bucketer has taken its contents).
  at::Tensor take_staging_grad();
  /// Drops the staging buffer and what it holds (a failed backward).
  void drop_staging_grad();
  /// Adds a reduced gradient shard, divided by `divisor`, into shard_grad.
  void accumulate_shard_grad(const at::Tensor& reduced, double divisor);
  /// Adds an all-reduced full gradient, divided by `divisor`, into the full
  /// gradient kept whole (ZeRO-1); shard_grad is a view of its slice.
  void accumulate_full_grad(const at::Tensor& reduced, double divisor);
  void zero_grad();

 private:
  friend class FlatParam;
  /// Gradients of an offloaded flat are counted as host memory.
  Mem category() const;
  /// A new gradient in the master dtype: reduced / divisor.
  at::Tensor new_grad(const at::Tensor& reduced, double divisor) const;

  FlatParam& flat_;
  at::Tensor shard_grad_, staging_, full_grad_;
  at::ScalarType reduce_dtype_;  // the staging buffer's: gradients are reduced in it
};

/// CPU offload of a flat parameter: the shard (the master) in host memory,
/// and the bf16 copy of it that the copy to the device reads.
class HostShard {
 public:
  explicit HostShard(FlatParam& flat) : flat_(flat) {}
  HostShard(const HostShard&) = delete;
  HostShard& operator=(const HostShard&) = delete;

  /// The shard (the master) moves to host memory, pinned when `pin`; it is
  /// then never a view of the full buffer, and gradient shards accumulated
  /// from here on are host tensors too (counted as Host*). With an fp32
  /// master and a bf16 compute dtype it also keeps a bf16 copy of the master
  /// in host memory (`low_copy`, pinned alike), so that the copy to the
  /// device moves 2 bytes per element instead of 4.
  void offload_shard(bool pin);
  bool offloaded() const { return offloaded_; }
  /// Gradients are made in pinned host memory.
  bool pinned() const { return pinned_; }
  /// What the copy to the compute device reads. The bf16 copy of the master
  /// where there is one, first refreshed from the master if the master
  /// changed since the copy was last made or written (its version counter
  /// moved, or mark_low_copy_stale); else the master itself.
  const at::Tensor& upload_source();
  /// Makes the bf16 copy again from the master if it is stale (see
  /// upload_source); nothing without a copy.
  void refresh_low_copy();
  /// Whether upload_source() would make the bf16 copy again (it writes host
  /// memory that an earlier asynchronous copy to the device may still read).
  bool low_copy_stale() const;
  /// The bf16 copy of the master (undefined without one). The fused CPU Adam
  /// writes it in the same pass as the master, which keeps it fresh.
  const at::Tensor& low_copy() const { return low_; }
  /// The master was written in a way its version counter may not show (raw
  /// pointers: a checkpoint reader, an optimizer that does not write the bf16
  /// copy): upload_source() makes the copy again before it is next used.
  void mark_low_copy_stale() { low_version_ = -1; }

 private:
  friend class FlatParam;
  /// Where the shard's bytes are counted.
  Mem shard_category() const { return offloaded_ ? Mem::HostParams : Mem::ShardedParams; }

  FlatParam& flat_;
  at::Tensor low_;            // bf16 copy of the shard (the master)
  int64_t low_version_ = -1;  // the shard's version when low_ last matched it; -1: stale
  bool offloaded_ = false;
  bool pinned_ = false;  // offloaded to pinned host memory: gradients are made there too
};

/// One flat parameter of a unit: the module's own parameter tensors point into
/// its full buffer (Tensor::set_ onto its storage); the storage's bytes are
/// freed when sharded and reallocated in place when gathered (buffer()), so
/// the parameter tensors, their autograd metadata and saved tensors keep their
/// identity. Its gradients are grads(), its offloaded master host().
class FlatParam {
 public:
  /// `persistent`: the full buffer is never freed (ZeRO-1/2) and the shard is
  /// a view of this rank's slice of it. `device`: where the full buffer is
  /// made (default: the first parameter's device); required when parameters
  /// are deferred (shardtorch/deferred.h): each is then given its values
  /// straight into the full buffer, one at a time, so that no more than the
  /// buffer and one parameter's replayed values exist at once.
  FlatParam(std::vector<at::Tensor> params, std::vector<std::string> names, int world_size, int rank,
            MemoryTracker* mem, bool persistent = false, std::optional<c10::Device> device = std::nullopt);
  ~FlatParam();
  FlatParam(const FlatParam&) = delete;
  FlatParam& operator=(const FlatParam&) = delete;

  const FlatParamLayout& layout() const { return layout_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<std::string>& names() const { return names_; }
  /// The master dtype: the shard's and the gradient shard's.
  at::ScalarType dtype() const { return dtype_; }
  bool requires_grad() const { return requires_grad_; }
  /// Mixed precision: the full buffer and the module's parameters become
  /// `compute` (the parameters are re-pointed with set_data, so call this
  /// before any gradient accumulator exists); the shard stays the fp32
  /// master (a copy of its own if it was a view); gradients stage in `reduce`.
  void set_mixed_precision(at::ScalarType compute, at::ScalarType reduce);

  /// This rank's shard (persistent).
  at::Tensor& shard() { return shard_; }
  /// Copies this rank's part of the full buffer into the shard (after a user edit).
  void write_back_shard();
  FullBuffer& buffer() { return buffer_; }
  FlatGrads& grads() { return grads_; }
  HostShard& host() { return host_; }

  std::string describe() const;

 private:
  friend class FullBuffer;
  friend class FlatGrads;
  friend class HostShard;

  FlatParamLayout layout_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  at::ScalarType dtype_;
  bool requires_grad_;
  int rank_;
  MemoryTracker* mem_;
  at::Tensor shard_;
  bool shard_is_view_ = false;
  FullBuffer buffer_;
  FlatGrads grads_;
  HostShard host_;
};

namespace testing {
/// How often this process has remade an offloaded master's bf16 copy from the
/// master (HostShard::upload_source): after shard(), and when the master
/// changed other than through the fused CPU Adam. For tests.
int64_t low_copy_refreshes();
}  // namespace testing

}  // namespace shardtorch
