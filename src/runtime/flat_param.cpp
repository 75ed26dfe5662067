#include "runtime/flat_param.h"
#include "base/check.h"

#include "base/storage_access.h"
#include "shardtorch/deferred.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <sstream>

namespace shardtorch {

namespace {
std::atomic<int64_t> low_copy_refreshes_{0};
}  // namespace

int64_t testing::low_copy_refreshes() { return low_copy_refreshes_.load(); }

FlatParamLayout::FlatParamLayout(std::vector<std::vector<int64_t>> shapes, int world_size)
    : shapes_(std::move(shapes)), world_size_(world_size) {
  SHARDTORCH_CHECK(world_size >= 1, "FlatParamLayout: world size ", world_size, " must be at least 1");
  for (const auto& s : shapes_) {
    int64_t n = 1;
    for (int64_t d : s) {
      SHARDTORCH_CHECK(d >= 0, "FlatParamLayout: negative dimension in shape ", c10::IntArrayRef(s));
      n *= d;
    }
    offsets_.push_back(total_);
    numels_.push_back(n);
    total_ += n;
  }
  shard_numel_ = (total_ + world_size - 1) / world_size;
}

std::pair<int64_t, int64_t> FlatParamLayout::shard_range(int rank) const {
  SHARDTORCH_CHECK(rank >= 0 && rank < world_size_, "FlatParamLayout: rank ", rank, " not in [0, ", world_size_, ")");
  return {rank * shard_numel_, (rank + 1) * shard_numel_};
}

std::optional<FlatParamLayout::Piece> FlatParamLayout::piece(size_t i, int rank) const {
  auto [lo, hi] = shard_range(rank);
  int64_t begin = std::max(lo, offsets_.at(i));
  int64_t end = std::min(hi, offsets_[i] + numels_[i]);
  if (begin >= end) return std::nullopt;
  return Piece{begin - offsets_[i], begin - lo, end - begin};
}

namespace {
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> st(shape.size());
  int64_t s = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    st[d] = s;
    s *= std::max<int64_t>(shape[d], 1);
  }
  return st;
}
}  // namespace

FlatParam::FlatParam(std::vector<at::Tensor> params, std::vector<std::string> names, int world_size, int rank,
                     MemoryTracker* mem, bool persistent, std::optional<c10::Device> device)
    : params_(std::move(params)),
      names_(std::move(names)),
      rank_(rank),
      mem_(mem),
      buffer_(*this, persistent),
      grads_(*this),
      host_(*this) {
  SHARDTORCH_CHECK(!params_.empty(), "FlatParam: no parameters");
  dtype_ = params_[0].scalar_type();
  grads_.reduce_dtype_ = dtype_;
  requires_grad_ = params_[0].requires_grad();
  // A deferred parameter is on the meta device until it is given values here.
  auto device_of = [&](const at::Tensor& p) { return device && is_deferred(p) ? *device : p.device(); };
  const c10::Device target = device.value_or(device_of(params_[0]));
  std::vector<std::vector<int64_t>> shapes;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    SHARDTORCH_CHECK(p.scalar_type() == dtype_ && device_of(p) == target && p.requires_grad() == requires_grad_,
                     "FlatParam: parameter '", names_[i], "' (", p.scalar_type(), ", ", device_of(p),
                     ") does not match '", names_[0], "'");
    shapes.push_back(p.sizes().vec());
  }
  layout_ = FlatParamLayout(std::move(shapes), world_size);
  buffer_.access_error_ = "shardtorch: the parameters of " + describe() + " are sharded: their memory is freed";
  c10::NoGradGuard no_grad;
  buffer_.full_ = at::zeros({layout_.padded_numel()}, params_[0].options().device(target).requires_grad(false));
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    at::Tensor dst = buffer_.full_.narrow(0, layout_.offset(i), layout_.numel(i));
    if (is_deferred(p))
      detail::materialize_into(p, names_[i], dst.view(layout_.shape(i)), rank_);
    else
      dst.copy_(p.detach().reshape({-1}));
    p.set_(buffer_.full_.storage(), layout_.offset(i), layout_.shape(i), contiguous_strides(layout_.shape(i)));
  }
  buffer_.gathered_ = true;
  auto [lo, hi] = layout_.shard_range(rank_);
  if (buffer_.persistent_) {
    shard_ = buffer_.full_.narrow(0, lo, hi - lo);
    shard_is_view_ = true;
    if (mem_) mem_->add(Mem::ReplicatedParams, buffer_.full_.nbytes());
  } else {
    shard_ = buffer_.full_.narrow(0, lo, hi - lo).clone();
    if (mem_) {
      mem_->add(Mem::ShardedParams, shard_.nbytes());
      mem_->add(Mem::GatheredParams, buffer_.full_.nbytes());
    }
  }
}

FlatParam::~FlatParam() {
  if (!mem_) return;
  if (buffer_.persistent_) {
    mem_->sub(Mem::ReplicatedParams, buffer_.full_.nbytes());
    if (!shard_is_view_) mem_->sub(host_.shard_category(), shard_.nbytes());
  } else {
    mem_->sub(host_.shard_category(), shard_.nbytes());
    if (buffer_.gathered_) mem_->sub(Mem::GatheredParams, buffer_.full_.nbytes());
  }
  if (grads_.full_grad_.defined()) {
    mem_->sub(grads_.category(), grads_.full_grad_.nbytes());
  } else if (grads_.shard_grad_.defined()) {
    mem_->sub(grads_.category(), grads_.shard_grad_.nbytes());
  }
  if (grads_.staging_.defined()) mem_->sub(Mem::GradStaging, grads_.staging_.nbytes());
  if (host_.low_.defined()) mem_->sub(Mem::HostParams, host_.low_.nbytes());
}

void FlatParam::set_mixed_precision(at::ScalarType compute, at::ScalarType reduce) {
  grads_.reduce_dtype_ = reduce;
  if (compute == buffer_.dtype()) return;
  SHARDTORCH_CHECK(buffer_.gathered_, "FlatParam: set_mixed_precision of ", describe(), " while it is sharded");
  c10::NoGradGuard no_grad;
  if (buffer_.persistent_) {  // the shard was a view of the full buffer: the master needs its own memory
    shard_ = shard_.clone();
    shard_is_view_ = false;
    if (mem_) {
      mem_->add(Mem::ShardedParams, shard_.nbytes());
      mem_->sub(Mem::ReplicatedParams, buffer_.full_.nbytes());
    }
  } else if (mem_) {
    mem_->sub(Mem::GatheredParams, buffer_.full_.nbytes());
  }
  at::Tensor low = buffer_.full_.to(compute);
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].set_data(low.narrow(0, layout_.offset(i), layout_.numel(i)).view(layout_.shape(i)));
  }
  buffer_.full_ = low;
  if (mem_) mem_->add(buffer_.persistent_ ? Mem::ReplicatedParams : Mem::GatheredParams, buffer_.full_.nbytes());
}

void HostShard::offload_shard(bool pin) {
  if (offloaded_) return;
  auto& f = flat_;
  SHARDTORCH_CHECK(!f.grads_.shard_grad().defined() && !f.grads_.has_staging_grad(), "FlatParam: offload_shard of ",
                   f.describe(), " after gradients exist");
  c10::NoGradGuard no_grad;
  at::Tensor host = at::empty({f.shard_.numel()}, f.shard_.options().device(at::kCPU).pinned_memory(pin));
  host.copy_(f.shard_);
  if (f.mem_) {
    if (!f.shard_is_view_) f.mem_->sub(Mem::ShardedParams, f.shard_.nbytes());
    f.mem_->add(Mem::HostParams, host.nbytes());
  }
  f.shard_ = host;
  f.shard_is_view_ = false;
  offloaded_ = true;
  pinned_ = pin;
  if (f.dtype_ == at::kFloat && f.buffer_.dtype() == at::kBFloat16) {
    low_ = at::empty({f.shard_.numel()}, f.shard_.options().dtype(at::kBFloat16).pinned_memory(pin));
    if (f.mem_) f.mem_->add(Mem::HostParams, low_.nbytes());
  }
}

bool HostShard::low_copy_stale() const {
  return low_.defined() && low_version_ != static_cast<int64_t>(flat_.shard_._version());
}

void HostShard::refresh_low_copy() {
  if (!low_copy_stale()) return;
  c10::NoGradGuard no_grad;
  low_.copy_(flat_.shard_);
  low_version_ = static_cast<int64_t>(flat_.shard_._version());
  low_copy_refreshes_.fetch_add(1);
}

const at::Tensor& HostShard::upload_source() {
  refresh_low_copy();
  return low_.defined() ? low_ : flat_.shard_;
}

void FullBuffer::alloc() {
  if (gathered_ || persistent_) return;
  auto* impl = full_.storage().unsafeGetStorageImpl();
  size_t nbytes = static_cast<size_t>(flat_.layout_.padded_numel()) * c10::elementSize(dtype());
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
  storage_access::allow(impl);
  gathered_ = true;
  if (flat_.mem_) flat_.mem_->add(Mem::GatheredParams, nbytes);
}

bool FullBuffer::freed_access_is_an_error() { return storage_access::support() != storage_access::Support::None; }

void FullBuffer::free(bool abandon) {
  if (!gathered_ || persistent_) return;
  auto* impl = full_.storage().unsafeGetStorageImpl();
  size_t nbytes = impl->nbytes();
  if (abandon) {  // never freed: the failed collective may still write here
    at::DataPtr old = impl->set_data_ptr(at::DataPtr(nullptr, full_.device()));
    (void)old.release_context();
  }
  // The error first: it may allocate (and throw) while the buffer is still whole.
  // The storage then keeps its size, so that views of a freed parameter
  // (w.t(), narrow) still succeed and the op that reads them throws this error
  // rather than a bounds check's about a storage of size 0.
  const bool guarded = storage_access::forbid(impl, access_error_);
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, full_.device()));
  if (!guarded) impl->set_nbytes(0);  // views of the parameters then fail their bounds check at least
  gathered_ = false;
  if (flat_.mem_) flat_.mem_->sub(Mem::GatheredParams, nbytes);
}

void FlatParam::write_back_shard() {
  SHARDTORCH_CHECK(buffer_.gathered_, "FlatParam: write_back_shard of ", describe(), " while it is sharded");
  if (shard_is_view_) return;  // the shard is a view of the full buffer
  auto [lo, hi] = layout_.shard_range(rank_);
  c10::NoGradGuard no_grad;
  shard_.copy_(buffer_.full_.narrow(0, lo, hi - lo));
}

Mem FlatGrads::category() const { return flat_.host_.offloaded() ? Mem::HostGradients : Mem::Gradients; }

at::Tensor& FlatGrads::staging_grad() {
  if (!staging_.defined()) {
    staging_ = at::zeros({flat_.layout_.padded_numel()}, flat_.buffer_.tensor().options().dtype(reduce_dtype_));
    if (flat_.mem_) flat_.mem_->add(Mem::GradStaging, staging_.nbytes());
  }
  return staging_;
}

void FlatGrads::stage_grad(size_t i) {
  auto& p = flat_.params_.at(i);
  const auto& g = p.grad();
  if (!g.defined()) return;
  SHARDTORCH_CHECK(g.sizes() == p.sizes(), detail::rank_prefix(flat_.rank_), ": the gradient of '", flat_.names_[i],
                   "' has shape ", g.sizes(), " but the parameter has ", p.sizes(),
                   " (a hook or a custom autograd function returned a "
                   "gradient of the wrong shape?)");
  c10::NoGradGuard no_grad;
  staging_grad().narrow(0, flat_.layout_.offset(i), flat_.layout_.numel(i)).add_(g.reshape({-1}));
  p.mutable_grad().reset();
}

at::Tensor FlatGrads::take_staging_grad() {
  at::Tensor t = staging_grad();
  staging_ = at::Tensor();
  if (flat_.mem_) flat_.mem_->sub(Mem::GradStaging, t.nbytes());
  return t;
}

void FlatGrads::drop_staging_grad() {
  if (!staging_.defined()) return;
  if (flat_.mem_) flat_.mem_->sub(Mem::GradStaging, staging_.nbytes());
  staging_ = at::Tensor();
}

at::Tensor FlatGrads::new_grad(const at::Tensor& reduced, double divisor) const {
  // Host gradients of an offloaded flat come from the pinned caching
  // allocator: a fresh pageable tensor each step faulted in every page of it
  // (docs/offload.md). Cast and divide in place: the values of
  // at::div(reduced.to(dtype), divisor), and x / 1 is x.
  at::Tensor g = at::empty(
      reduced.sizes(), reduced.options().dtype(flat_.dtype_).pinned_memory(flat_.host_.pinned() && reduced.is_cpu()));
  g.copy_(reduced);
  if (divisor != 1.0) g.div_(divisor);
  return g;
}

void FlatGrads::accumulate_shard_grad(const at::Tensor& reduced, double divisor) {
  c10::NoGradGuard no_grad;
  if (!shard_grad_.defined()) {
    shard_grad_ = new_grad(reduced, divisor);  // gradient shards are in the master dtype
    if (flat_.mem_) flat_.mem_->add(category(), shard_grad_.nbytes());
  } else {
    shard_grad_.add_(at::div(reduced.to(flat_.dtype_), divisor));
  }
}

void FlatGrads::accumulate_full_grad(const at::Tensor& reduced, double divisor) {
  c10::NoGradGuard no_grad;
  if (!full_grad_.defined()) {
    full_grad_ = new_grad(reduced, divisor);
    auto [lo, hi] = flat_.layout_.shard_range(flat_.rank_);
    shard_grad_ = full_grad_.narrow(0, lo, hi - lo);
    if (flat_.mem_) flat_.mem_->add(category(), full_grad_.nbytes());
  } else {
    full_grad_.add_(at::div(reduced.to(flat_.dtype_), divisor));
  }
}

void FlatGrads::zero_grad() {
  if (full_grad_.defined()) {
    if (flat_.mem_) flat_.mem_->sub(category(), full_grad_.nbytes());
  } else if (shard_grad_.defined()) {
    if (flat_.mem_) flat_.mem_->sub(category(), shard_grad_.nbytes());
  }
  full_grad_ = at::Tensor();
  shard_grad_ = at::Tensor();
  drop_staging_grad();  // gradients accumulated without sync are gradients too
}

std::string FlatParam::describe() const {
  std::ostringstream os;
  os << "flat " << c10::toString(dtype_) << (requires_grad_ ? "" : " frozen") << " of " << params_.size() << " params, "
     << layout_.total_numel() << " elements padded to " << layout_.padded_numel() << ", shard "
     << layout_.shard_numel();
  return os.str();
}

}  // namespace shardtorch
