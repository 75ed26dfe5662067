#include "buckets/missing_grads.h"
#include "base/check.h"

#include <algorithm>
#include <sstream>

namespace shardtorch::detail {

MissingGrads::MissingGrads(size_t count) {
  ready_.assign(count, false);
  touched_.assign(count, false);
  absent_.assign(count, false);
}

bool MissingGrads::arrive(size_t i) {
  absent_[i] = false;
  touched_[i] = true;
  if (ready_[i]) return false;
  ready_[i] = true;
  return true;
}

void MissingGrads::zeroed_all() {
  std::fill(absent_.begin(), absent_.end(), false);
  std::fill(touched_.begin(), touched_.end(), false);
}

bool MissingGrads::any_missing_here() const { return std::find(ready_.begin(), ready_.end(), false) != ready_.end(); }

void MissingGrads::launch_flag(Comm& comm, bool missing) {
  flag_ = at::full({1}, missing ? 1 : 0, at::TensorOptions().dtype(at::kInt).device(comm.device()));
  flag_pending_ = comm.all_reduce_async(flag_, "parameters without a gradient (flag)");
}

void MissingGrads::wait_flag(Comm& comm) {
  if (flag_pending_.work) comm.wait(flag_pending_);
}

void MissingGrads::abandon_flag(Comm& comm) {
  if (flag_pending_.work) {
    try {
      comm.wait(flag_pending_);
    } catch (...) {
    }
  }
}

void MissingGrads::new_backward() {
  std::fill(ready_.begin(), ready_.end(), false);
  flag_ = at::Tensor();
  flag_pending_ = PendingWork{};
}

bool MissingGrads::any_rank_missing(const at::Tensor& last_bucket) const {
  if (flag_.defined()) return flag_.item<int>() > 0;  // summed on its own (a hook reduced the buckets)
  // A sum of 0s and 1s (or of 0s and 1/n under fp16): positive exactly when
  // some rank set its flag, in any dtype.
  return last_bucket.narrow(0, last_bucket.numel() - 1, 1).item<double>() > 0;
}

std::vector<size_t> MissingGrads::settle(Comm& comm, const std::vector<std::string>& names, bool error_on_unused,
                                         const at::Tensor& last_bucket) {
  std::vector<size_t> none;
  if (!any_rank_missing(last_bucket)) return none;
  const int64_t count = static_cast<int64_t>(ready_.size());
  at::Tensor counts = at::empty({2 * count}, at::kInt);
  auto* c = counts.data_ptr<int32_t>();
  for (int64_t k = 0; k < count; ++k) {
    c[k] = ready_[k] ? 1 : 0;
    c[count + k] = touched_[k] ? 1 : 0;
  }
  at::Tensor on_device = counts.to(comm.device());
  comm.all_reduce(on_device, c10d::ReduceOp::SUM, "parameters without a gradient (NoShard)");
  counts = on_device.cpu();
  c = counts.data_ptr<int32_t>();
  const int n = comm.size();
  if (error_on_unused) {
    std::ostringstream missing;
    int listed = 0;
    for (int64_t k = 0; k < count; ++k) {
      if (c[k] == n) continue;
      if (listed++ < 5) {
        missing << (listed > 1 ? ", " : "") << "'" << names[k] << "' (on " << c[k] << " of " << n << " ranks"
                << (ready_[k] ? "" : ", not this one") << ")";
      }
    }
    SHARDTORCH_CHECK(listed == 0, "shardtorch (NoShard): rank ", comm.rank(), ": ", listed,
                     " parameter(s) received no "
                     "gradient in this backward on some ranks: ",
                     missing.str(), listed > 5 ? ", ..." : "",
                     ". Without ShardOptions::error_on_unused_parameters (set now) such a gradient is reduced as zero, "
                     "and a parameter no rank gave one is left without a gradient");
  }
  for (int64_t k = 0; k < count; ++k) {
    if (c[count + k] != 0) continue;
    absent_[k] = true;
    none.push_back(static_cast<size_t>(k));
  }
  return none;
}

}  // namespace shardtorch::detail
