#include "runtime/shard_copies.h"
#include "base/check.h"

#include "runtime/flat_param.h"
#include "runtime/unit.h"
#include "runtime/unit_list.h"

namespace shardtorch::detail {

void ShardCopies::enable_offload(c10::Device device) {
  offloader_ = std::make_unique<Offloader>(device, /*pin=*/!device.is_cpu());
}

std::string ShardCopies::unit_of(const FlatParam& f) const {
  for (auto& u : units_.all())
    for (auto& g : u->flats())
      if (g.get() == &f) return u->label();
  return "?";
}

at::Tensor ShardCopies::gather_input(FlatParam& f) {
  if (offloader_) {
    SHARDTORCH_CHECK(!listener_ || !listener_->stepped(f), detail::rank_prefix(world_.global_rank()), ": unit '",
                     unit_of(f), "': ", f.describe(),
                     " is gathered again (by a forward or summon_full_params) after the optimizer updated it during "
                     "the last backward (overlap_with_backward): call opt->step() first, and let only the last "
                     "micro-batch's backward synchronize gradients (set_requires_gradient_sync)");
    if (f.host().low_copy_stale()) offloader_->wait_idle();  // no copy may still read the bf16 copy it remakes
    return offloader_->to_device(f.host().upload_source(), f.buffer().dtype());  // always a new tensor
  }
  const at::Tensor& full = f.buffer().tensor();
  at::Tensor src = f.shard().scalar_type() == full.scalar_type() ? f.shard() : f.shard().to(full.scalar_type());
  // With the shard a view of a persistent full buffer, the input would alias the output.
  // (Compared by storage: Tensor::is_alias_of would read the freed buffer's data pointer.)
  const bool alias = src.storage().unsafeGetStorageImpl() == full.storage().unsafeGetStorageImpl();
  return alias ? src.clone() : src;
}

void ShardCopies::low_copies_stale() {
  for (auto& u : units_.all())
    for (auto& f : u->flats()) f->host().mark_low_copy_stale();
}

void ShardCopies::remake_low_copies() {
  for (auto& u : units_.all())
    for (auto& f : u->flats()) f->host().refresh_low_copy();
}

void ShardCopies::launch_gathers(const std::function<void()>& launch) {
  if (offloader_) {
    offloader_->on_side_stream(launch);
  } else {
    launch();
  }
}

at::Tensor ShardCopies::on_comm_device(const at::Tensor& t) {
  return t.to(world_.comm().device(), t.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
}

void ShardCopies::deliver_gradient(FlatParam& flat, const at::Tensor& reduced, bool owned, double divisor, bool full) {
  auto add = [f = &flat, divisor, full](const at::Tensor& r) {
    full ? f->grads().accumulate_full_grad(r, divisor) : f->grads().accumulate_shard_grad(r, divisor);
  };
  if (offloader_ && listener_) {
    listener_->before(flat);
    offloader_->to_host(reduced, owned, [add, l = listener_, f = &flat, divisor, full](const at::Tensor& h) {
      if (!full && !f->grads().shard_grad().defined() && l->consume(*f, h, divisor)) return;
      add(h);
      l->arrived(*f);
    });
  } else if (offloader_) {
    offloader_->to_host(reduced, owned, add);
  } else {
    add(reduced);
  }
}

void ShardCopies::set_gradient_listener(GradientListener* listener) {
  if (offloader_) offloader_->wait_idle();
  listener_ = listener;
}

}  // namespace shardtorch::detail
