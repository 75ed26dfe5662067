#pragma once
// Internal (tests and benchmarks include it from src/).
// AllReduceBucketer: DDP's gradient reduction (the NoShard strategy).
//
// The trainable parameters are laid in buckets in reverse registration order
// (the order backward produces their gradients), one dtype per bucket, each
// at most bucket_mb (a parameter larger than that gets a bucket of its own).
// Every param.grad is a view of its slice of a bucket, so autograd
// accumulates straight into the bucket. Buckets are launched in their index
// order on every rank (collectives pair up by order): when the last gradient
// of a bucket is in (mark_ready), that bucket and the full ones after it are
// launched asynchronously while backward goes on, once every bucket before
// them has been; finish() launches the rest, waits for everything and
// divides by the world size. (A parameter unused on some ranks only keeps
// its bucket, and those after it, back until finish() there; launched as
// ready, the ranks' all-reduces would pair different buckets, summing one
// bucket's gradients into another's where their sizes happen to agree.)
//
//   state per bucket:  filling --last gradient in--> launched --finish()--> reduced
//   (with sync off nothing is launched: gradients accumulate in the buckets)
//
// Parameters without a gradient. The last bucket carries one more element:
// 1 on a rank where some parameter got no gradient in this backward. Summed
// with the gradients, it tells every rank alike, without a collective of its
// own, whether any rank had one; only then do the ranks all-reduce, after
// every bucket, each parameter's counts of ranks that gave it a gradient in
// this backward and since its gradient was last zeroed. From those, on every
// rank alike:
//   - error_on_unused: a parameter without a gradient on some rank is an
//     error naming it and how many ranks had one, on every rank (a check
//     per rank would throw on one while the others waited in its all-reduce);
//   - a parameter no rank gave a gradient since it was zeroed ends the
//     backward with its gradient set to none, as under DDP and in one process
//     (LibTorch's zero_grad sets to none), so the optimizer skips it: no
//     weight decay, no moments, no optimizer state. Its slice stays zero and
//     is bound again once it gets a gradient (or at zero_grads()).
//
// With a communication hook (hook().set) each bucket's gradients, without the
// flag, go to the hook instead of the all-reduce, and what its future holds
// (their mean over the ranks: the hook divides) is copied back into the
// bucket; the flag is then summed by an all-reduce of its own, launched with
// the last bucket.
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "buckets/missing_grads.h"
#include "comm/hook_call.h"
#include "shardtorch/collectives.h"
#include "shardtorch/comm_hooks.h"
#include "base/memory_tracker.h"

namespace shardtorch {

class AllReduceBucketer {
 public:
  /// `params` in registration order (each once), all trainable. Buckets hold
  /// `reduce_dtype` (default: each parameter's dtype); when that differs from
  /// a parameter's dtype its gradient is added into the bucket (cast) and
  /// dropped instead of being a view.
  AllReduceBucketer(std::vector<at::Tensor> params, std::vector<std::string> names, double bucket_mb, Comm& comm,
                    MemoryTracker* mem, bool async = true, std::optional<at::ScalarType> reduce_dtype = std::nullopt);

  /// Parameter i's reduced gradient: its slice of a bucket, in the bucket's dtype.
  at::Tensor grad_view(size_t i) const;

  size_t num_buckets() const { return buckets_.size(); }
  /// The bucket of each parameter (registration order), for tests and docs.
  std::vector<size_t> bucket_of_params() const;

  /// Points every param.grad at its slice of a bucket (again, if something
  /// replaced it). Keeps values already there.
  void bind_grads();
  /// A hook set here reduces every bucket instead of the built-in all-reduce
  /// and division; it outlives this. Not set during a backward.
  detail::HookSlot& hook() { return hook_; }

  /// Called when autograd has accumulated param i's gradient.
  void mark_ready(size_t i, bool sync);
  /// End of backward: launch what is left (unused parameters count as zero,
  /// or throw naming them), wait, average. With sync off: only resets counts.
  void finish(bool sync, bool error_on_unused);
  /// Zeroes every bucket (gradients stay bound as views).
  void zero_grads();
  /// Zeroes the slices of those of `params` this bucketer holds (a
  /// submodule's zero_grad) and drops their own gradients where those are
  /// not views. The others are left as they are.
  void zero_grads_of(const std::vector<at::Tensor>& params);
  /// After a failed backward: waits for the all-reduces in flight (errors
  /// ignored) and resets the counts, so the next backward starts clean. The
  /// buckets' contents are whatever the failure left: zero_grads() them.
  void discard();

  /// Which parameters got no gradient (absent(i): its grad is none).
  const detail::MissingGrads& missing() const { return missing_; }

  /// Buckets launched from a gradient hook, i.e. before backward ended.
  int64_t launched_during_backward() const { return launched_during_backward_; }
  int64_t launched() const { return launched_; }

 private:
  struct Bucket {
    at::Tensor buffer;
    std::vector<size_t> params;  // indices into params_
    size_t ready = 0;
    bool launched = false;
    PendingWork pending;
    detail::HookCall call;  // with a hook: its reduction in flight
  };
  void launch(Bucket& b, size_t index);
  /// What the hook gets of bucket b: its gradients, without the flag.
  at::Tensor gradients_of(size_t b) const;
  /// Bucket `index`'s description in collectives' and hooks' errors.
  std::string describe_bucket(size_t index) const;
  /// No parameter ready, no bucket launched: the state a backward starts from.
  void reset_counts();

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<std::pair<size_t, int64_t>> where_;             // param -> (bucket, offset)
  std::unordered_map<const c10::TensorImpl*, size_t> index_;  // param -> its index
  detail::MissingGrads missing_;
  std::vector<Bucket> buckets_;
  std::vector<bool> is_view_;  // param.grad is a view of its bucket slice
  Comm& comm_;
  detail::HookSlot hook_;
  bool async_;
  int64_t launched_during_backward_ = 0, launched_ = 0;
  size_t next_launch_ = 0;  // buckets below it are launched
};

}  // namespace shardtorch
