#include "shardtorch/gather.h"
#include "base/check.h"
#include "base/log.h"

#include <c10/core/GradMode.h>

#include <unordered_set>

#include "runtime/placement.h"
#include "runtime/shard_state.h"

namespace shardtorch {

namespace {
// Under overlap_with_backward the optimizer stepped on each gradient during
// the backward and dropped it: there is nothing to read.
void refuse_consumed_gradients(detail::ShardState& state, const char* what) {
  const auto* listener = state.copies().gradient_listener();
  SHARDTORCH_CHECK(!(listener && listener->any_stepped()), detail::rank_prefix(state.world().global_rank()),
                   ": shardtorch::", what,
                   " after a backward under overlap_with_backward: the optimizer consumed the gradients during "
                   "that backward and did not keep them. Read gradients with overlap_with_backward off (a parity "
                   "check), or inside a comm hook");
}

// Flat parameter `f`'s whole padded tensor from `mine` (this rank's shard of
// its values or its gradient), gathered over the shard group.
at::Tensor gather_flat(detail::ShardState& state, FlatParam& f, const at::Tensor& mine, const std::string& what) {
  at::Tensor shard = state.copies().on_comm_device(mine);
  at::Tensor full = at::empty({f.layout().padded_numel()}, shard.options());
  state.topology().shard_comm().all_gather_into(full, shard, what);
  return full;
}

// Flat parameter `f`'s whole padded gradient (zeros where this rank holds
// none), gathered over the shard group.
at::Tensor gather_flat_grad(detail::ShardState& state, FlatParam& f, const std::string& what) {
  const at::Tensor& held = f.grads().shard_grad();
  return gather_flat(state, f, held.defined() ? held : at::zeros_like(f.shard()), what);
}
}  // namespace

FullParams::FullParams(torch::nn::Module& root, SummonOptions options)
    : state_(detail::require_state(root, "summon_full_params")), options_(options) {
  const bool mixed = state_->options().mixed_precision().param_dtype().has_value();
  SHARDTORCH_CHECK(
      !(mixed && options_.writeback().value_or(false)),
      "shardtorch::summon_full_params: writeback under "
      "mixed precision would round the fp32 master parameters to the compute dtype; leave writeback unset");
  SHARDTORCH_CHECK(
      !(options_.rank0_only() && options_.writeback().value_or(false)),
      "shardtorch::summon_full_params: "
      "writeback with rank0_only: only rank 0 keeps the full parameters, so edits could not reach the other "
      "ranks' shards; leave writeback unset");
  if (options_.with_grads()) refuse_consumed_gradients(*state_, "summon_full_params(with_grads)");
  writeback_ = options_.writeback().value_or(!mixed) && !options_.rank0_only();
  World& world = state_->world();
  const bool keep = !options_.rank0_only() || world.rank() == 0;
  c10::NoGradGuard no_grad;
  try {
    gather_all(keep);
  } catch (...) {  // no destructor will run: undo the pins and free what we gathered
    for (auto& p : grads_set_) p.mutable_grad().reset();
    for (auto& [p, view] : views_) p.mutable_grad() = view;
    for (auto& u : units_) u->gather().unpin();
    for (auto& u : summoned_) u->gather().reshard();
    throw;
  }
  // The gradients set share storages (a unit's full gradient, when the
  // dtypes agree): each counted once.
  std::unordered_set<const void*> storages;
  for (const auto& p : grads_set_)
    if (storages.insert(p.grad().storage().unsafeGetStorageImpl()).second) grad_bytes_ += p.grad().storage().nbytes();
  state_->mem().add(Mem::SummonedGrads, grad_bytes_);
  state_->summons().enter(options_.with_grads());
}

void FullParams::gather_all(bool keep) {
  if (options_.with_grads() && keep && state_->path().replicated()) {
    // NoShard: the gradients are bucket views, or under mixed precision with
    // another reduce dtype the fp32 masters hold them. The parameters get a
    // copy in their dtype either way, as under the sharded strategies: an
    // edit in the scope (or autograd's accumulation, before the refusal of a
    // backward there) must not reach the buckets. The views come back on exit.
    const auto& params = state_->path().replicated()->params();
    const auto& masters = state_->path().replicated()->masters().all();
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor p = params[i];
      const bool own = p.grad().defined();
      if (!own && (masters.empty() || !masters[i].grad().defined())) continue;
      if (own) views_.emplace_back(p, p.grad());
      p.mutable_grad() =
          (own ? p.grad() : masters[i].grad()).to(p.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      grads_set_.push_back(p);
    }
  }
  for (auto& u : state_->units().all()) {
    bool was_sharded = u->gather().state() == detail::ParamState::Sharded;
    if (!was_sharded && !writeback_)
      for (auto& f : u->flats())
        if (f->shard().storage().unsafeGetStorageImpl() == f->buffer().tensor().storage().unsafeGetStorageImpl())
          restore_.emplace_back(f->shard(), f->shard().clone());
    u->gather().unshard();
    if (keep) {
      u->gather().pin();  // a forward or backward in the scope must not free it
      units_.push_back(u);
      if (was_sharded) summoned_.push_back(u);  // freed on exit, or by the constructor's catch
    }
    try {
      if (options_.with_grads()) gather_grads(*u, keep);
    } catch (...) {
      if (was_sharded && !keep) u->gather().reshard();
      throw;
    }
    if (was_sharded && !keep) u->gather().reshard();
  }
}

void FullParams::gather_grads(detail::Unit& u, bool keep) {
  for (auto& f : u.flats()) {
    if (!f->requires_grad()) continue;
    const at::Tensor full =
        gather_flat_grad(*state_, *f, "gradients of unit '" + u.label() + "' for summon_full_params");
    if (!keep) continue;
    for (size_t i = 0; i < f->params().size(); ++i) {
      at::Tensor p = f->params()[i];
      // In the parameter's dtype (a bf16 parameter's gradient is bf16, as
      // autograd requires), from the masters' gradients.
      p.mutable_grad() =
          full.narrow(0, f->layout().offset(i), f->layout().numel(i)).view(p.sizes()).to(p.scalar_type());
      grads_set_.push_back(p);
    }
  }
}

FullParams::~FullParams() {
  c10::NoGradGuard no_grad;
  // A destructor must not throw (that would terminate the program): a failure
  // here is reported, and the scope is still left.
  try {
    for (auto& p : grads_set_) p.mutable_grad().reset();
    state_->mem().sub(Mem::SummonedGrads, grad_bytes_);
    for (auto& [p, view] : views_) p.mutable_grad() = view;
    for (auto& [shard, saved] : restore_) shard.copy_(saved);
    if (writeback_) {
      state_->copies().wait_for_offload_copies();
      for (auto& u : units_)
        for (auto& f : u->flats()) f->write_back_shard();
    }
  } catch (const std::exception& e) {
    SHARDTORCH_WARN("shardtorch: leaving summon_full_params failed: ", e.what());
  }
  for (auto& u : units_) u->gather().unpin();
  state_->summons().leave(options_.with_grads());
  try {
    for (auto& u : summoned_) u->gather().reshard();
    // The units the scope found unsharded compute with their full buffers,
    // not the shards: gathered again, an edit without writeback is
    // discarded (as where the scope frees what it gathered), and after a
    // writeback every rank computes with the same values (each wrote back
    // only its own slice of its own edit).
    state_->gathers().regather_unsharded();
  } catch (const std::exception& e) {
    SHARDTORCH_WARN("shardtorch: freeing or regathering summoned parameters failed: ", e.what());
  }
}

namespace {
// `out` (the model's parameters by name, gathered over its World) with each
// parameter parallelize() split made whole from its tensor-parallel group's
// slices. Collective over those groups: the ranks that keep values (under
// rank0_only, those at the World's rank 0) call it, every member of a
// tensor-parallel group alike.
std::map<std::string, at::Tensor> whole_slices(torch::nn::Module& root,
                                               std::map<const void*, std::vector<std::string>>& names,
                                               std::map<std::string, at::Tensor> out) {
  std::unordered_set<const void*> done;
  for (const auto& item : root.named_parameters()) {
    auto p = detail::placement_of(item.value());
    auto it = out.find(item.key());  // full_gradients' has no frozen parameter
    if (!p || p->size == 1 || it == out.end() || !done.insert(item.value().unsafeGetTensorImpl()).second) continue;
    const at::Tensor whole = detail::gather_whole(it->second, *p, "the tensor-parallel slices of '" + item.key() + "'");
    for (const auto& n : names[item.value().unsafeGetTensorImpl()]) out[n] = whole;
  }
  return out;
}
}  // namespace

std::map<std::string, at::Tensor> full_parameters(torch::nn::Module& root, bool rank0_only) {
  auto state = detail::require_state(root, "full_parameters");
  const bool keep = !rank0_only || state->world().rank() == 0;
  std::map<std::string, at::Tensor> out;
  c10::NoGradGuard no_grad;
  // Tied parameters appear under every name the module gives them.
  auto names = detail::parameter_names(root);
  auto put = [&](const at::Tensor& param, const at::Tensor& value) {
    for (const auto& n : names[param.unsafeGetTensorImpl()]) out[n] = value;
  };
  if (state->path().replicated()) {  // NoShard: each rank copies its own, tensor by tensor
    const auto items = root.named_parameters();
    auto bytes_of = [&](const at::Tensor& p) {
      return keep ? static_cast<int64_t>(state->path().record_of(p).nbytes()) : int64_t{0};
    };
    int64_t bytes = 0;
    for (const auto& item : items) bytes += bytes_of(item.value());
    detail::ProgressReporter progress("full_parameters", "tensors", static_cast<int64_t>(items.size()), bytes);
    for (const auto& item : items) {
      if (keep) out[item.key()] = state->path().record_of(item.value()).detach().clone();
      progress.advance(1, bytes_of(item.value()));
    }
    progress.finish();
    return keep ? whole_slices(root, names, std::move(out)) : out;
  }
  int64_t bytes = 0;
  for (auto& u : state->units().all())
    for (auto& f : u->flats())
      bytes += f->layout().padded_numel() * static_cast<int64_t>(c10::elementSize(f->shard().scalar_type()));
  detail::ProgressReporter progress("full_parameters", "units", static_cast<int64_t>(state->units().all().size()),
                                    bytes);
  for (auto& u : state->units().all()) {
    int64_t unit_bytes = 0;
    for (auto& f : u->flats()) {
      unit_bytes += f->layout().padded_numel() * static_cast<int64_t>(c10::elementSize(f->shard().scalar_type()));
      const at::Tensor full = gather_flat(*state, *f, f->shard(), "master parameters of unit '" + u->label() + "'");
      if (!keep) continue;
      for (size_t i = 0; i < f->params().size(); ++i)
        put(f->params()[i],
            full.narrow(0, f->layout().offset(i), f->layout().numel(i)).view(f->layout().shape(i)).clone());
    }
    progress.advance(1, unit_bytes);
  }
  progress.finish();
  return keep ? whole_slices(root, names, std::move(out)) : out;
}

std::map<std::string, at::Tensor> full_gradients(torch::nn::Module& root, bool rank0_only) {
  auto state = detail::require_state(root, "full_gradients");
  refuse_consumed_gradients(*state, "full_gradients");
  const bool keep = !rank0_only || state->world().rank() == 0;
  auto names = detail::parameter_names(root);
  std::map<std::string, at::Tensor> out;
  c10::NoGradGuard no_grad;
  // fp32 copies of the reduced gradients as the optimizer reads them (the
  // masters' under mixed precision), never rounded to the parameters' dtype.
  auto put = [&](const at::Tensor& param, const at::Tensor& grad) {
    const at::Tensor value = grad.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).view(param.sizes());
    for (const auto& n : names[param.unsafeGetTensorImpl()]) out[n] = value;
  };
  if (const auto* path = state->path().replicated()) {  // NoShard: every rank holds them whole
    if (keep) {
      const auto& params = path->params();
      const auto& masters = path->masters().all();
      for (size_t i = 0; i < params.size(); ++i) {
        const at::Tensor& p = params[i];
        const at::Tensor g = !masters.empty() && masters[i].grad().defined() ? masters[i].grad() : p.grad();
        if (g.defined()) put(p, g);
      }
    }
  } else {
    for (auto& u : state->units().all()) {
      for (auto& f : u->flats()) {
        if (!f->requires_grad()) continue;
        const at::Tensor full = gather_flat_grad(*state, *f, "gradients of unit '" + u->label() + "'");
        if (!keep) continue;
        for (size_t i = 0; i < f->params().size(); ++i)
          put(f->params()[i], full.narrow(0, f->layout().offset(i), f->layout().numel(i)));
      }
    }
  }
  if (!keep) return out;
  // Every trainable parameter has an entry (the tensor-parallel gathers
  // below go by them): zeros where no gradient is held.
  for (const auto& item : root.named_parameters())
    if (item.value().requires_grad() && !out.count(item.key()))
      out[item.key()] = at::zeros(item.value().sizes(), item.value().options().dtype(at::kFloat));
  return whole_slices(root, names, std::move(out));
}

}  // namespace shardtorch
