#pragma once
// Internal: AllReduceBucketer's bookkeeping of parameters without a gradient
// (the header comment of buckets/all_reduce_bucketer.h): which parameters
// got one in this backward and since their slice was last zeroed, the flag
// that tells every rank whether some rank missed one, and what follows.
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "shardtorch/collectives.h"

namespace shardtorch::detail {

class MissingGrads {
 public:
  explicit MissingGrads(size_t count);

  /// Parameter i's gradient is in; false when it already was in this backward.
  bool arrive(size_t i);
  /// Parameter i's slice was zeroed: no gradient since.
  void zeroed(size_t i) { touched_[i] = false; }
  /// Every slice was zeroed: none absent, none with a gradient since.
  void zeroed_all();
  /// Parameter i ended the last syncing backward with no gradient on any rank
  /// since it was zeroed: its grad is none (the optimizer skips it).
  bool absent(size_t i) const { return absent_.at(i); }
  /// Some parameter got no gradient in this backward on this rank (the flag).
  bool any_missing_here() const;

  /// With a hook: the flag, all-reduced on its own.
  void launch_flag(Comm& comm, bool missing);
  void wait_flag(Comm& comm);
  /// After a failed backward: waits for the flag's all-reduce, errors ignored.
  void abandon_flag(Comm& comm);
  /// No gradient in yet, no flag: the state a backward starts from.
  void new_backward();

  /// After the buckets are reduced (`last_bucket` ends with the summed flag
  /// unless a hook reduced it): if some rank had a parameter without a
  /// gradient, the counts (one small all-reduce), the error, the absences.
  /// Returns the parameters now absent, whose grads the caller sets to none.
  std::vector<size_t> settle(Comm& comm, const std::vector<std::string>& names, bool error_on_unused,
                             const at::Tensor& last_bucket);

 private:
  /// Whether some rank had a parameter without a gradient (the summed flag).
  bool any_rank_missing(const at::Tensor& last_bucket) const;

  std::vector<bool> ready_;    // a gradient in this backward
  std::vector<bool> touched_;  // a gradient since the slice was last zeroed
  std::vector<bool> absent_;   // none on any rank at the last syncing finish(): grad set to none
  at::Tensor flag_;            // with a hook: the flag, all-reduced on its own
  PendingWork flag_pending_;
};

}  // namespace shardtorch::detail
