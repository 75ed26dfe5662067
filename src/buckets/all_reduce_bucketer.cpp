#include "buckets/all_reduce_bucketer.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>

#include <sstream>

namespace shardtorch {

AllReduceBucketer::AllReduceBucketer(std::vector<at::Tensor> params, std::vector<std::string> names, double bucket_mb,
                                     Comm& comm, MemoryTracker* mem, bool async,
                                     std::optional<at::ScalarType> reduce_dtype)
    : params_(std::move(params)), names_(std::move(names)), missing_(params_.size()), comm_(comm), async_(async) {
  const int64_t cap_bytes = static_cast<int64_t>(bucket_mb * 1024 * 1024);
  where_.resize(params_.size());
  is_view_.assign(params_.size(), false);
  for (size_t k = 0; k < params_.size(); ++k) index_[params_[k].unsafeGetTensorImpl()] = k;
  // Reverse registration order; a new bucket when the dtype changes or the
  // current one would pass the cap.
  std::vector<std::pair<at::ScalarType, std::vector<size_t>>> groups;
  int64_t bytes = 0;
  for (size_t k = params_.size(); k-- > 0;) {
    const auto& p = params_[k];
    int64_t nb = p.numel() * p.element_size();
    if (groups.empty() || groups.back().first != p.scalar_type() || (bytes > 0 && bytes + nb > cap_bytes)) {
      groups.push_back({p.scalar_type(), {}});
      bytes = 0;
    }
    groups.back().second.push_back(k);
    bytes += nb;
  }
  for (auto& [dtype, members] : groups) {
    const int64_t flag = &members == &groups.back().second ? 1 : 0;  // the last bucket's flag (header comment)
    int64_t numel = flag;
    for (size_t k : members) numel += params_[k].numel();
    Bucket b;
    b.buffer =
        at::zeros({numel}, params_[members[0]].options().requires_grad(false).dtype(reduce_dtype.value_or(dtype)));
    b.params = members;
    int64_t off = 0;
    for (size_t k : members) {
      where_[k] = {buckets_.size(), off};
      is_view_[k] = b.buffer.scalar_type() == params_[k].scalar_type();
      off += params_[k].numel();
    }
    if (mem) mem->add(Mem::Gradients, (numel - flag) * b.buffer.element_size());
    buckets_.push_back(std::move(b));
  }
  bind_grads();
}

at::Tensor AllReduceBucketer::grad_view(size_t i) const {
  auto [b, off] = where_.at(i);
  return buckets_[b].buffer.narrow(0, off, params_[i].numel()).view(params_[i].sizes());
}

std::vector<size_t> AllReduceBucketer::bucket_of_params() const {
  std::vector<size_t> out;
  for (const auto& w : where_) out.push_back(w.first);
  return out;
}

void AllReduceBucketer::bind_grads() {
  c10::NoGradGuard no_grad;
  for (size_t k = 0; k < params_.size(); ++k) {
    if (!is_view_[k] || missing_.absent(k)) continue;  // absent: none on purpose, its slice zero
    at::Tensor view = grad_view(k);
    at::Tensor& g = params_[k].mutable_grad();
    if (g.defined() && g.data_ptr() == view.data_ptr()) continue;
    // Autograd or the user replaced it: keep the values. Set to none (by
    // Module::zero_grad): the bucket's slice still holds the last step's.
    if (g.defined()) {
      view.copy_(g);
    } else {
      view.zero_();
      missing_.zeroed(k);
    }
    g = view;
  }
}

std::string AllReduceBucketer::describe_bucket(size_t index) const {
  const Bucket& b = buckets_[index];
  std::ostringstream what;
  what << "gradient bucket " << index << " (" << b.params.size() << " params, first '" << names_[b.params.front()]
       << "')";
  return what.str();
}

at::Tensor AllReduceBucketer::gradients_of(size_t b) const {
  const at::Tensor& buffer = buckets_[b].buffer;
  return b + 1 == buckets_.size() ? buffer.narrow(0, 0, buffer.numel() - 1) : buffer;
}

void AllReduceBucketer::launch(Bucket& b, size_t index) {
  b.launched = true;
  ++launched_;
  const bool last = index + 1 == buckets_.size();
  bool missing = false;
  if (last) {  // every parameter's backward is over by now, on this rank
    missing = missing_.any_missing_here();
    if (!hook_.hook()) b.buffer.narrow(0, b.buffer.numel() - 1, 1).fill_(missing ? 1 : 0);
  }
  if (hook_.hook()) {
    std::vector<size_t> offsets, lengths;
    std::vector<c10::IntArrayRef> sizes;
    std::vector<at::Tensor> params;
    for (size_t k : b.params) {
      offsets.push_back(static_cast<size_t>(where_[k].second));
      lengths.push_back(static_cast<size_t>(params_[k].numel()));
      sizes.push_back(params_[k].sizes());
      params.push_back(params_[k]);
    }
    c10d::GradBucket bucket(index, buckets_.size(), gradients_of(index), std::move(offsets), std::move(lengths),
                            std::move(sizes), std::move(params), std::nullopt);
    comm_.flush_launches();  // the hook's collectives run on the backend itself
    b.call = detail::call_hook(*hook_.hook(), bucket, comm_.rank(), describe_bucket(index), hook_.counter());
    if (last) missing_.launch_flag(comm_, missing);
    return;
  }
  // fp16 sums of N gradients can overflow where their mean does not: divide
  // first (as the sharded strategies do); other dtypes divide after.
  if (b.buffer.scalar_type() == at::kHalf && comm_.size() > 1) b.buffer.div_(static_cast<double>(comm_.size()));
  b.pending = comm_.all_reduce_async(b.buffer, describe_bucket(index));
}

void AllReduceBucketer::mark_ready(size_t i, bool sync) {
  // Autograd may have stolen the incoming gradient instead of accumulating
  // into our view (e.g. after the user set grads to none): move it in.
  auto [b, off] = where_[i];
  const bool first = missing_.arrive(i);
  if (is_view_[i]) {
    const at::Tensor& g = params_[i].grad();
    const char* expect =
        static_cast<const char*>(buckets_[b].buffer.data_ptr()) + off * buckets_[b].buffer.element_size();
    if (!g.defined() || g.data_ptr() != expect) bind_grads();
  } else if (params_[i].grad().defined()) {  // another dtype: add it in (cast) and drop it
    c10::NoGradGuard no_grad;
    grad_view(i).add_(params_[i].grad());
    params_[i].mutable_grad().reset();
  }
  if (!first) return;
  ++buckets_[b].ready;
  if (!sync || !async_) return;
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready == buckets_[next_launch_].params.size()) {
    launch(buckets_[next_launch_], next_launch_);
    ++next_launch_;
    ++launched_during_backward_;
  }
}

void AllReduceBucketer::finish(bool sync, bool error_on_unused) {
  if (sync) {
    // A parameter with no gradient in this backward and none bound (set to
    // none, unused here) is reduced as zero, not as what its slice held.
    bind_grads();
    for (size_t b = 0; b < buckets_.size(); ++b)
      if (!buckets_[b].launched) launch(buckets_[b], b);
    const double n = comm_.size();
    for (size_t b = 0; b < buckets_.size(); ++b) {
      Bucket& bucket = buckets_[b];
      if (bucket.call.active()) {  // the hook's mean: into the bucket, unless it reduced in place
        at::Tensor mean = detail::finish_hook(*hook_.hook(), bucket.call, comm_.rank(), comm_.timeout());
        at::Tensor grads = gradients_of(b);
        if (mean.data_ptr() != grads.data_ptr()) grads.copy_(mean);
        continue;
      }
      comm_.wait(bucket.pending);
      if (n > 1 && bucket.buffer.scalar_type() != at::kHalf) bucket.buffer.div_(n);
    }
    missing_.wait_flag(comm_);
    try {
      const std::vector<size_t> none = missing_.settle(comm_, names_, error_on_unused, buckets_.back().buffer);
      c10::NoGradGuard no_grad;
      // Its slice is zero, and stays bound to nothing until it has a gradient.
      for (size_t k : none) params_[k].mutable_grad().reset();
    } catch (...) {
      reset_counts();
      throw;
    }
  }
  reset_counts();
}

void AllReduceBucketer::discard() {
  for (auto& bucket : buckets_) {
    if (bucket.launched && bucket.pending.pending()) {
      try {
        comm_.wait(bucket.pending);  // the buffer must outlive the collective
      } catch (...) {
      }
    }
    bucket.pending = PendingWork{};
    detail::abandon_hook(bucket.call, comm_.timeout());
  }
  missing_.abandon_flag(comm_);
  reset_counts();
}

void AllReduceBucketer::reset_counts() {
  for (auto& bucket : buckets_) {
    bucket.ready = 0;
    bucket.launched = false;
  }
  next_launch_ = 0;
  missing_.new_backward();
}

void AllReduceBucketer::zero_grads() {
  for (auto& bucket : buckets_) bucket.buffer.zero_();
  missing_.zeroed_all();
  bind_grads();
}

void AllReduceBucketer::zero_grads_of(const std::vector<at::Tensor>& params) {
  c10::NoGradGuard no_grad;
  for (const auto& p : params) {
    auto it = index_.find(p.unsafeGetTensorImpl());
    if (it == index_.end()) continue;
    grad_view(it->second).zero_();
    missing_.zeroed(it->second);
    if (!is_view_[it->second]) params_[it->second].mutable_grad().reset();
  }
}

}  // namespace shardtorch
