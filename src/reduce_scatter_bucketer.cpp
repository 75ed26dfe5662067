#include "shardtorch/reduce_scatter_bucketer.h"

#include <c10/core/GradMode.h>

namespace shardtorch {

ReduceScatterBucketer::ReduceScatterBucketer(double bucket_mb, MemoryTracker* mem)
    : bucket_bytes_(static_cast<int64_t>(bucket_mb * 1024.0 * 1024.0)), mem_(mem) {
  TORCH_CHECK(bucket_mb >= 0, "ReduceScatterBucketer: bucket_mb ", bucket_mb, " must not be negative");
}

ReduceScatterBucketer::~ReduceScatterBucketer() {
  for (auto& [k, b] : buckets_) release(b);
}

void ReduceScatterBucketer::release(Bucket& b) {
  if (!b.buffer.defined()) return;
  if (mem_) mem_->sub(Mem::Buckets, b.buffer.nbytes() + b.output.nbytes());
  b.buffer = at::Tensor();
  b.output = at::Tensor();
}

void ReduceScatterBucketer::reserve(Bucket& b, int64_t cols, const at::TensorOptions& opts) {
  int64_t have = b.buffer.defined() ? b.buffer.size(1) : 0;
  if (cols <= have) return;
  int64_t want = std::min(b.cap, std::max({cols, 2 * have, b.high_water}));
  at::Tensor buffer = at::empty({b.group->size(), want}, opts);
  at::Tensor output = at::empty({want}, opts);
  if (b.offset > 0) buffer.narrow(1, 0, b.offset).copy_(b.buffer.narrow(1, 0, b.offset));
  release(b);
  b.buffer = std::move(buffer);
  b.output = std::move(output);
  if (mem_) mem_->add(Mem::Buckets, b.buffer.nbytes() + b.output.nbytes());
}

ReduceScatterBucketer::Bucket& ReduceScatterBucketer::bucket_for(const at::Tensor& input, Comm& group) {
  Key key{static_cast<int>(input.scalar_type()), input.device().str(), static_cast<const void*>(&group)};
  auto it = buckets_.find(key);
  if (it != buckets_.end()) return it->second;
  Bucket b;
  b.group = &group;
  b.cap = bucket_bytes_ / (input.element_size() * group.size());
  return buckets_.emplace(key, std::move(b)).first->second;
}

void ReduceScatterBucketer::reduce_scatter(const at::Tensor& input, Comm& group, Callback callback,
                                           const std::string& what) {
  const int world = group.size();
  TORCH_CHECK(input.dim() == 1 && input.numel() % world == 0, "shardtorch: rank ", group.rank(),
              ": reduce_scatter for ", what, ": input ", describe(input), " is not 1-D with a multiple of ",
              world, " elements");
  c10::NoGradGuard no_grad;
  const int64_t shard = input.numel() / world;
  Bucket& b = bucket_for(input, group);
  if (shard > b.cap) {  // too big to coalesce: flush what is queued (order), then go alone
    flush_bucket(b);
    at::Tensor in = input.contiguous();
    at::Tensor out = at::empty({shard}, input.options());
    group.reduce_scatter_into(out, in, what);
    ++launched_;
    callback(out);
    return;
  }
  if (b.offset + shard > b.cap) flush_bucket(b);
  reserve(b, b.offset + shard, input.options());
  b.buffer.narrow(1, b.offset, shard).copy_(input.view({world, shard}));
  b.callbacks.push_back({{b.offset, shard}, std::move(callback)});
  b.whats.push_back(what);
  b.offset += shard;
}

void ReduceScatterBucketer::flush_bucket(Bucket& b) {
  if (b.offset == 0) return;
  c10::NoGradGuard no_grad;
  b.high_water = std::max(b.high_water, b.offset);
  at::Tensor in = b.offset == b.buffer.size(1) ? b.buffer.view({-1}) : b.buffer.narrow(1, 0, b.offset).contiguous();
  at::Tensor out = b.output.narrow(0, 0, b.offset);
  std::string what = b.whats.size() == 1 ? b.whats[0] : "bucket of " + std::to_string(b.whats.size()) + " (" +
                                                            b.whats.front() + " .. " + b.whats.back() + ")";
  b.group->reduce_scatter_into(out, in, what);
  ++launched_;
  auto callbacks = std::move(b.callbacks);
  b.callbacks.clear();
  b.whats.clear();
  b.offset = 0;
  for (auto& [range, cb] : callbacks) cb(out.narrow(0, range.first, range.second));
}

void ReduceScatterBucketer::flush() {
  for (auto& [k, b] : buckets_) flush_bucket(b);
}

void ReduceScatterBucketer::free() {
  for (auto& [k, b] : buckets_) {
    TORCH_CHECK(b.offset == 0, "ReduceScatterBucketer::free() with ", b.callbacks.size(),
                " reductions still queued; call flush() first");
    release(b);
  }
}

int64_t ReduceScatterBucketer::allocated_bytes() const {
  int64_t n = 0;
  for (const auto& [k, b] : buckets_) {
    if (b.buffer.defined()) n += b.buffer.nbytes() + b.output.nbytes();
  }
  return n;
}

}  // namespace shardtorch
