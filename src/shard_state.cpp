// Per-model state: end of backward, optimizer-step follow-up, NoShard hooks,
// and the registry that finds a model's state from its root module.
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <mutex>
#include <sstream>

#include "errors.h"
#include "shard_state.h"

namespace shardtorch::detail {

ShardState::ShardState(std::shared_ptr<World> world, ShardOptions options)
    : world_(std::move(world)), options_(std::move(options)), bucketer_(options_.bucket_mb(), &mem_) {}

std::vector<std::shared_ptr<Unit>> ShardState::units() const {
  std::vector<std::shared_ptr<Unit>> out;
  for (const auto& w : units_) {
    auto u = w.lock();
    TORCH_CHECK(u, "shardtorch: rank ", world_->rank(), ": a unit of this sharded model no longer exists (was the model "
                "destroyed, or a unit module replaced after shard()?)");
    out.push_back(std::move(u));
  }
  return out;
}

void ShardState::ensure_end_of_backward_callback() {
  if (nested_backward_ > 0 && callback_queued_) return;  // the recomputing node queued it on the outer task
  const int task = torch::autograd::get_current_graph_task_id();
  if (callback_queued_ && task == callback_task_) return;
  // Queued for a backward that is still running: this one runs inside it
  // (reentrant). Its gradients would be taken for the outer backward's, or
  // the outer one for failed; only the recomputation of shardtorch's own
  // checkpointing nests (NestedBackward above). Refused before anything changes.
  TORCH_CHECK(!callback_queued_ || callback_alive_.expired(), "shardtorch: rank ", world_->rank(), ": a backward "
              "inside another backward reached this sharded model (a checkpoint function of your own, or a backward "
              "or torch::autograd::grad run from a hook or from an autograd function's backward). shardtorch cannot "
              "tell its gradients from the outer backward's; the only nesting it supports is its own activation "
              "checkpointing: ShardOptions::activation_checkpointing (or activation_checkpointing_for)");
  // Queued for another backward that never reached its end: an exception escaped it.
  if (callback_queued_) abandon_backward(/*warn=*/true);
  if (ddp_) world_->note_progress("backward");  // units note it per unit
  callback_queued_ = true;
  callback_task_ = task;
  builds_graph_ = c10::GradMode::is_enabled();  // the engine runs a backward in grad mode iff create_graph
  // A backward restricted to some tensors (torch::autograd::grad, or
  // backward(inputs=...)) runs only the accumulators of the parameters among
  // them to accumulate; with none of ours it has no gradients to reduce.
  // Decided from the graph, so the same on every rank (unlike whether some
  // parameter's gradient happened to arrive here).
  inputs_only_ = false;
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  const bool restricted = exec_info && !exec_info->empty();
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  // Among the inputs of a restricted backward (rank-independent: the inputs
  // are the same everywhere, reachable or not)?
  auto needed = [&](const torch::autograd::Node* acc) {
    auto it = exec_info->find(const_cast<torch::autograd::Node*>(acc));
    return it != exec_info->end() && it->second.needed_;
  };
  // In this backward's graph at all? (Rank-local: a branch the data took
  // elsewhere may leave a parameter out of it.) And will the engine run it?
  auto in_graph = [&](const torch::autograd::Node* acc) {
    return nodes == nullptr || nodes->count(const_cast<torch::autograd::Node*>(acc)) > 0;
  };
  auto runs = [&](const torch::autograd::Node* acc) { return (!restricted || needed(acc)) && in_graph(acc); };
  if (restricted) {
    auto input = [&](const AccumulatorRef& acc) { return needed(acc.get()); };
    bool any = std::any_of(ddp_accumulators_.begin(), ddp_accumulators_.end(), input);
    for (const auto& w : units_) {
      auto u = w.lock();
      if (!any && u) any = std::any_of(u->accumulators().begin(), u->accumulators().end(), input);
    }
    inputs_only_ = !any;
  }
  for (const auto& w : units_)
    if (auto u = w.lock()) u->expect_from_graph(runs, in_graph);
  issue_cursor_ = reduction_order_.size();
  auto keep = shared_from_this();
  auto alive = std::make_shared<bool>(true);
  callback_alive_ = alive;
  torch::autograd::Engine::get_default_engine().queue_callback([keep, alive] { keep->finish_backward(); });
}

void ShardState::release_held() {
  for (auto& w : units_)
    if (auto u = w.lock()) u->release();  // nothing for a unit not held
}

void ShardState::refuse_backward_in_grad_summon(const char* kind, const std::string& name) const {
  // The scope set param.grad to the reduced gradients: this backward would
  // add its own to them, and reduce both into gradients that already hold the
  // first (counted twice). Every rank is in the scope, so every rank refuses;
  // called first in every hook of a backward, before anything is queued or
  // gathered, so the refused backward leaves nothing to clean up.
  TORCH_CHECK(grad_summons_ == 0, "shardtorch: rank ", world_->rank(), ": a backward reached ", kind, " '", name,
              "' inside a summon_full_params(with_grads) scope, whose param.grad are the reduced gradients (a "
              "backward would count them twice); leave the scope before the backward, or summon without with_grads");
}

void ShardState::check_grad_arrival(const at::Tensor& param, const std::string& name) const {
  if (!builds_graph_) return;
  at::Tensor(param).mutable_grad().reset();  // a handle: the parameter itself
  TORCH_CHECK(false, "shardtorch: rank ", world_->rank(), ": the gradient of parameter '", name,
              "' arrived in a backward with create_graph. Parameter gradients are flattened, reduced and detached, so "
              "their higher-order gradients are not supported. Differentiate with respect to inputs instead "
              "(torch::autograd::grad(outputs, inputs, {}, true, /*create_graph=*/true), a gradient penalty) and "
              "call backward() without create_graph");
}

void ShardState::on_zero_grad() {
  stepped_since_zero_ = false;
  recover_if_backward_failed();  // reductions of a failed backward land before the zeroing
  partial_grads_ = false;
  gradients_changed();
  // The next forward starts a new recording; until then the last one stays:
  // a zero_grad between a forward and its backward (out = model(x);
  // opt->zero_grad(); loss.backward()) must not lose the order the backward
  // learns for prefetch (clearing it here turned prefetch off for good).
  if (!callback_queued_) recording_stale_ = true;
  // Forwards never differentiated (an evaluation in grad mode, on some ranks
  // only, say) do not define the next reduction order.
  if (!callback_queued_) reduction_order_closed_ = true;
  for (auto& [id, f] : zero_grad_listeners_) f();
}

void ShardState::zero_grads() {
  on_zero_grad();
  if (ddp_) {  // gradients stay views of the buckets
    ddp_->zero_grads();
    release_master_grads();
    return;
  }
  for (auto& u : units())
    for (auto& f : u->flats()) f->zero_grad();
}

void ShardState::recover_if_backward_failed(bool warn) {
  if (callback_queued_ && torch::autograd::get_current_graph_task_id() == -1) abandon_backward(warn);
}

void ShardState::check_requires_grad_unchanged() const {
  // Flat parameters, hooks and the optimizer's pieces were fixed by shard():
  // a parameter unfrozen since would never have its gradient reduced nor be
  // stepped, and one frozen since would still be stepped. Said, not silent.
  auto check = [&](const at::Tensor& p, bool was, const std::string& name) {
    TORCH_CHECK(p.requires_grad() == was, "shardtorch: rank ", world_->rank(), ": parameter '", name, "' was ",
                was ? "trainable" : "frozen", " at shard() and is ", was ? "frozen" : "trainable",
                " now; which parameters train is fixed when the model is sharded (its flat parameters, gradient "
                "hooks and optimizer pieces follow it). Set requires_grad before shard(), or shard a new model "
                "(load_full_state_dict carries the weights) to change it");
  };
  for (size_t i = 0; i < ddp_params_.size(); ++i) check(ddp_params_[i], true, ddp_names_[i]);
  for (const auto& w : units_) {
    auto u = w.lock();
    if (!u) continue;
    for (const auto& f : u->flats())
      for (size_t i = 0; i < f->params().size(); ++i) check(f->params()[i], f->requires_grad(), f->names()[i]);
  }
}

void ShardState::check_backward_finished(const char* who) {
  recover_if_backward_failed(/*warn=*/false);  // the error below says it
  TORCH_CHECK(!partial_grads_, "shardtorch: rank ", world_->rank(), ": ", who, " after a backward that did not "
              "finish (an exception escaped it): the gradients are partial (its reductions in flight and staged "
              "gradients were dropped). Call zero_grad() and run the backward again");
}

void ShardState::abandon_backward(bool warn) {
  if (warn) {
    TORCH_WARN("shardtorch: rank ", world_->rank(), ": the previous backward did not finish (an exception escaped it); ",
               "its reductions in flight, its staged gradients and any gradients accumulated under no_sync were ",
               "dropped. Gradients reduced before the failure may be partial: call zero_grad() before the next step.");
  }
  callback_queued_ = false;
  partial_grads_ = true;  // until zero_grad
  recording_.clear();
  backward_cursor_ = SIZE_MAX;
  reduction_order_closed_ = true;
  finishing_ = false;
  gradients_changed();  // partly reduced, staged ones dropped
  release_held();
  if (ddp_) ddp_->discard();
  bucketer_.discard();
  if (offloader_) offloader_->discard();
  for (auto& w : units_) {
    auto u = w.lock();
    if (!u) continue;
    u->reshard();
    u->reset_backward();
    for (auto& f : u->flats()) f->drop_staging_grad();
  }
}

void ShardState::finish_backward() {
  if (!reduction_order_.empty()) order_head_ = reduction_order_.front();  // an order a backward used
  callback_queued_ = false;
  backward_cursor_ = SIZE_MAX;
  reduction_order_closed_ = true;  // the next forward records a new one
  // Nothing to reduce in a backward that builds a graph (a parameter gradient
  // there is an error) nor in one for tensors none of which is a parameter of
  // ours (torch::autograd::grad, backward(inputs=...): no accumulator runs).
  const bool no_gradients = builds_graph_ || inputs_only_;
  if (!no_gradients) gradients_changed();
  try {
    world_->note_progress("end of backward");
    failure_point("end of backward");
    if (ddp_) {
      if (no_gradients) return;
      ddp_->finish(sync_, options_.error_on_unused_parameters());
      if (sync_) bind_master_grads();
      return;
    }
    if (!recording_.empty()) forward_order_ = std::move(recording_);
    recording_.clear();
    auto all = units();
    if (builds_graph_) {  // the graph it built saved these full parameters
      for (auto& u : all)
        if (u->state() == UnitState::Unsharded) u->hold();
    }
    if (!no_gradients) {
      finishing_ = true;
      for (auto it = all.rbegin(); it != all.rend(); ++it) {
        if ((*it)->needs_final_reduce()) (*it)->reduce_grads();
      }
      if (sync_) issue_reductions(/*at_end=*/true);
      finishing_ = false;
      bucketer_.flush();
      bucketer_.free();
      if (offloader_) offloader_->drain();  // the gradient shards reach host memory
    }
    for (auto& u : all) {
      u->reshard();
      u->reset_backward();
    }
  } catch (...) {
    abandon_backward(/*warn=*/false);  // nothing of this backward survives into the next; the caller sees why
    rethrow_naming(world_->rank(), [] { return std::string("the end of backward (reducing the gradients)"); });
  }
}

void broadcast_coalesced(Comm& comm, std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& what,
                         const std::string& when) {
  c10::NoGradGuard no_grad;
  std::vector<at::ScalarType> dtypes;
  for (const auto& [name, t] : tensors)
    if (std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) == dtypes.end()) dtypes.push_back(t.scalar_type());
  for (at::ScalarType dtype : dtypes) {
    std::vector<at::Tensor> parts;
    std::vector<const std::string*> names;
    for (const auto& [name, t] : tensors) {
      if (t.scalar_type() != dtype) continue;
      parts.push_back(t.reshape({-1}));
      names.push_back(&name);
    }
    at::Tensor flat = at::cat(parts);
    std::ostringstream label;
    label << what << " of dtype " << dtype << " ('" << *names.front() << "'"
          << (names.size() > 1 ? " and " + std::to_string(names.size() - 1) + " more" : std::string()) << ") " << when;
    comm.broadcast(flat, 0, label.str());
    int64_t offset = 0;
    for (auto& [name, t] : tensors) {
      if (t.scalar_type() != dtype) continue;
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

void ShardState::bind_master_grads() {
  c10::NoGradGuard no_grad;
  int64_t converted = 0;  // fp32 copies of gradients reduced in a lower dtype
  for (size_t i = 0; i < ddp_masters_.size(); ++i) {
    if (ddp_->absent(i)) {  // no rank gave it a gradient: none, as the parameter's (the optimizer skips it)
      ddp_masters_[i].mutable_grad().reset();
      continue;
    }
    at::Tensor g = ddp_->grad_view(i);
    if (!grad_is_copied(i)) {
      ddp_masters_[i].mutable_grad() = g;
    } else {
      ddp_masters_[i].mutable_grad() = g.to(ddp_masters_[i].scalar_type());
      converted += ddp_masters_[i].grad().nbytes();
    }
  }
  mem_.add(Mem::MasterGrads, converted - master_grad_bytes_);
  master_grad_bytes_ = converted;
}

void ShardState::release_master_grads(bool converted_only) {
  for (size_t i = 0; i < ddp_masters_.size(); ++i)
    if (!converted_only || grad_is_copied(i)) at::Tensor(ddp_masters_[i]).mutable_grad().reset();  // a handle
  mem_.sub(Mem::MasterGrads, master_grad_bytes_);
  master_grad_bytes_ = 0;
}

void ShardState::check_outside_summon() const {
  // Symmetric: every rank holds a FullParams for the scope, kept or not.
  TORCH_CHECK(summons_ == 0, "shardtorch: rank ", world_->rank(), ": an optimizer step or a checkpoint load inside a "
              "summon_full_params scope: the scope's full parameters would be stale (and written back over the new "
              "values on exit); leave the scope first");
}

void ShardState::after_optimizer_step() {
  world_->note_step_done();
  check_outside_summon();
  release_held();  // the step makes the full copies a graph-building backward held stale
  if (ddp_) {  // the optimizer updated the parameters themselves, or their masters
    stepped_since_zero_ = true;
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < ddp_masters_.size(); ++i) ddp_params_[i].copy_(ddp_masters_[i]);
    // The step has read the fp32 copies; views of fp32 buckets stay until
    // zero_grad, like the parameters' own gradients.
    release_master_grads(/*converted_only=*/true);
    return;
  }
  for (auto& u : units()) {
    for (auto& f : u->flats())
      if (f->persistent()) regather(*u, *f, "updated parameters");
    u->reshard();  // non-persistent full copies are stale now
  }
}

void ShardState::regather(Unit& u, FlatParam& f, const std::string& what) {
  at::Tensor mine = gather_input(f);
  if (offloader_) offloader_->current_waits_for_copies();  // gathered on the compute stream
  shard_comm().all_gather_into(f.full(), mine, what + " of unit '" + u.label() + "'");
}

void ShardState::regather_unsharded() {
  c10::NoGradGuard no_grad;
  for (auto& u : units())
    if (u->state() == UnitState::Unsharded)
      for (auto& f : u->flats()) regather(*u, *f, "parameters after summon_full_params");
}

void ShardState::note_forward_for_reduction(Unit& u) {
  // Not inside a backward: a checkpointed unit's recomputation runs forwards there.
  if (!c10::GradMode::is_enabled() || callback_queued_) return;
  if (u.is_root()) reduction_order_closed_ = true;  // a new forward starts at the root
  if (!u.reduces()) return;
  auto restart = [&] {
    for (const auto& w : reduction_order_)
      if (auto x = w.lock()) x->set_in_reduction_order(false);
    reduction_order_.clear();
    reduction_order_closed_ = false;
  };
  if (reduction_order_closed_) {
    restart();
  } else if (!reduction_order_.empty() && order_head_.lock().get() == &u &&
             reduction_order_.front().lock().get() != &u) {
    // Under a plain root nothing marks where a forward starts: the unit that
    // began the last differentiated order beginning again marks it, so that a forward run
    // after zero_grad and never differentiated (a look at one unit, on some
    // ranks only) does not head this step's order on those ranks alone.
    restart();
  }
  if (u.in_reduction_order()) return;
  u.set_in_reduction_order(true);
  reduction_order_.push_back(u.weak_from_this());
}

void ShardState::issue_reductions(bool at_end) {
  while (issue_cursor_ > 0) {
    auto u = reduction_order_[issue_cursor_ - 1].lock();
    if (u && !u->issued()) {
      if (u->reduced()) {
        u->issue_reduction();
      } else if (!at_end) {
        return;  // not final yet: the units after it wait, on every rank alike
      }  // at the end: not final means it took no part in this backward
    }
    --issue_cursor_;
  }
  if (!at_end) return;  // units outside the order wait for the end
  auto all = units();
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if ((*it)->reduces() && (*it)->reduced() && !(*it)->issued()) (*it)->issue_reduction();
}

std::shared_ptr<Unit> ShardState::note_forward_and_next(Unit& u) {
  if (!options_.prefetches() || !c10::GradMode::is_enabled()) return nullptr;
  if (u.is_root() || recording_stale_) recording_.clear();  // a new forward starts at the root, or after zero_grad
  recording_stale_ = false;
  if (recording_.empty()) following_ = true;
  recording_.push_back(u.weak_from_this());
  const size_t pos = recording_.size() - 1;
  const bool in_order = pos < forward_order_.size() && forward_order_[pos].lock().get() == &u;
  following_ = following_ && in_order;
  // Prefetch only along the order the last complete step ran, while this
  // forward follows it.
  if (!in_order || pos + 1 >= forward_order_.size()) return nullptr;
  auto next = forward_order_[pos + 1].lock();
  return next && next->state() == UnitState::Sharded ? next : nullptr;
}

bool ShardState::needed_again_at_once(const Unit& u) const {
  if (!options_.prefetches() || !c10::GradMode::is_enabled() || !following_) return false;
  size_t last = forward_order_.size();  // one past the last unit with parameters
  while (last > 0) {
    auto unit = forward_order_[last - 1].lock();
    if (unit && unit->has_params()) break;
    --last;
  }
  const size_t next = recording_.size();  // the position the next pre-forward takes
  if (next < last) return forward_order_[next].lock().get() == &u;  // u runs again at once
  return next == last && last > 0 && forward_order_[last - 1].lock().get() == &u;  // backward starts with u
}

std::shared_ptr<Unit> ShardState::next_in_backward(Unit& u) {
  // The root stays gathered through backward, and its outputs' hooks can fire
  // late in it: it neither moves the cursor nor is a prefetch target.
  if (!options_.prefetches() || u.is_root()) return nullptr;
  const size_t n = forward_order_.size();
  auto at = [&](size_t i) { return forward_order_[i].lock().get(); };
  auto one_past_u_below = [&](size_t i) {  // one past u's last position below i; 0 if none
    while (i > 0 && at(i - 1) != &u) --i;
    return i;
  };
  // u's nearest position below the cursor; else (the backward left the order) its last one.
  size_t i = one_past_u_below(std::min(backward_cursor_, n));
  if (i == 0) i = one_past_u_below(n);
  if (i == 0) return nullptr;
  backward_cursor_ = i;  // u is at i - 1; positions below are still ahead of this backward
  // A unit that ran several times in a row finds the last of those positions
  // at each of its hooks: what backward needs after it is below the run.
  size_t j = i - 1;
  while (j > 0 && at(j - 1) == &u) --j;
  if (j == 0) return nullptr;
  auto prev = forward_order_[j - 1].lock();
  // The order is the last step's: this step's forward may have run prev after
  // u, so that prev has reduced already and is not needed again. A unit none
  // of whose outputs this step needs a gradient (a frozen backbone fed by
  // data under a trainable head) has no backward to gather for.
  return prev && prev->state() == UnitState::Sharded && !prev->reduced() && prev->may_take_part_in_backward()
             ? prev
             : nullptr;
}

void ShardState::enable_offload(c10::Device device) {
  offloader_ = std::make_unique<Offloader>(device, /*pin=*/!device.is_cpu());
}

at::Tensor ShardState::gather_input(FlatParam& f) {
  if (offloader_) {
    if (f.low_copy_stale()) offloader_->wait_idle();  // no copy may still read the bf16 copy it remakes
    return offloader_->to_device(f.upload_source(), f.compute_dtype());  // always a new tensor
  }
  at::Tensor src = f.gather_source();
  // With the shard a view of a persistent full buffer, the input would alias the output.
  // (Compared by storage: Tensor::is_alias_of would read the freed buffer's data pointer.)
  const bool alias = src.storage().unsafeGetStorageImpl() == f.full().storage().unsafeGetStorageImpl();
  return alias ? src.clone() : src;
}

void ShardState::low_copies_stale() {
  for (auto& u : units())
    for (auto& f : u->flats()) f->mark_low_copy_stale();
}

void ShardState::remake_low_copies() {
  for (auto& u : units())
    for (auto& f : u->flats()) f->refresh_low_copy();
}

void ShardState::launch_gathers(const std::function<void()>& launch) {
  if (offloader_) {
    offloader_->on_side_stream(launch);
  } else {
    launch();
  }
}

at::Tensor ShardState::on_comm_device(const at::Tensor& t) {
  return t.to(world_->comm().device(), t.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
}

void ShardState::deliver_gradient(const at::Tensor& reduced, bool owned,
                                  std::function<void(const at::Tensor&)> accumulate) {
  if (offloader_) {
    offloader_->to_host(reduced, owned, std::move(accumulate));
  } else {
    accumulate(reduced);
  }
}

std::vector<at::Tensor> ShardState::local_gradients(bool& partial) {
  check_backward_finished("reading the gradients (clip_grad_norm, GradScaler)");
  // The strategy is the same everywhere: decide on it, not on what this rank
  // happens to hold, so that every rank communicates or none does.
  partial = strategy() != Strategy::NoShard && strategy() != Strategy::OptimizerOnly;
  std::vector<at::Tensor> grads;
  if (ddp_) {
    for (const auto& p : ddp_optimized())
      if (p.grad().defined()) grads.push_back(p.grad());
    return grads;
  }
  for (auto& u : units()) {
    for (auto& f : u->flats()) {
      if (f->full_grad().defined()) {
        grads.push_back(f->full_grad());  // OptimizerOnly: whole and identical on every rank
      } else if (f->shard_grad().defined()) {
        grads.push_back(f->shard_grad());
      }
    }
  }
  return grads;
}

void ShardState::note_ddp_gradient(size_t i) {
  if (!stepped_since_zero_) return;
  stepped_since_zero_ = false;  // once per step at most
  if (warned_unzeroed_ || ddp_->grad_view(i).scalar_type() == ddp_params_[i].scalar_type()) return;
  warned_unzeroed_ = true;
  // LibTorch's Module::zero_grad reaches our buckets only through a unit (the
  // root, if it is one); with fp32 buckets of bf16 gradients the parameters
  // hold no gradient it could clear.
  TORCH_WARN("shardtorch (NoShard): rank ", world_->rank(), ": a backward after an optimizer step with no zero_grad "
             "that reached the gradient buckets since: their ", ddp_->grad_view(i).scalar_type(), " gradients are not "
             "the parameters' own (", ddp_params_[i].scalar_type(), "), so this step's gradients add to the last "
             "step's. LibTorch's model->zero_grad() reaches them only through a unit; call opt->zero_grad(), or make "
             "the root a unit (SHARDTORCH_MODULE). If you accumulate across steps on purpose, ignore this.");
}

namespace {
class DdpGradHook : public torch::autograd::FunctionPostHook {
 public:
  DdpGradHook(std::weak_ptr<ShardState> state, size_t index) : state_(std::move(state)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    auto s = state_.lock();
    if (!s) return outputs;
    try {
      s->refuse_backward_in_grad_summon("parameter", s->ddp_names()[index_]);
      failure_point("NoShard gradient hook");
      s->ensure_end_of_backward_callback();
      s->check_grad_arrival(s->ddp_params()[index_], s->ddp_names()[index_]);
      s->note_ddp_gradient(index_);
      s->ddp()->mark_ready(index_, s->sync());
    } catch (...) {
      rethrow_naming(s->world().rank(), [&] { return "the gradient hook of parameter '" + s->ddp_names()[index_] + "' (NoShard)"; });
    }
    return outputs;
  }

 private:
  std::weak_ptr<ShardState> state_;
  size_t index_;
};
}  // namespace

void ShardState::add_frozen_master(const at::Tensor& param, at::Tensor master) {
  mem_.add(Mem::ReplicatedParams, master.nbytes());
  masters_[param.unsafeGetTensorImpl()] = std::move(master);
}

void ShardState::enable_ddp(std::vector<at::Tensor> params, std::vector<std::string> names,
                            const std::unordered_set<const void*>& keep) {
  ddp_params_ = params;
  ddp_names_ = names;
  const auto& mp = options_.mixed_precision();
  if (mp.param_dtype()) {  // fp32 masters for the optimizer; the parameters compute in param_dtype
    c10::NoGradGuard no_grad;
    for (auto& p : ddp_params_) {
      ddp_masters_.push_back(p.detach().clone());
      masters_[p.unsafeGetTensorImpl()] = ddp_masters_.back();
      if (!keep.count(p.unsafeGetTensorImpl()))
        p.set_data(p.detach().to(*mp.param_dtype()));  // before the accumulators exist (below)
      mem_.add(Mem::ReplicatedParams, ddp_masters_.back().nbytes());
    }
  }
  for (const auto& p : ddp_params_) mem_.add(Mem::ReplicatedParams, p.nbytes());
  std::optional<at::ScalarType> reduce;
  if (mp.param_dtype()) reduce = mp.reduce_dtype().value_or(*mp.param_dtype());
  ddp_ = std::make_unique<AllReduceBucketer>(ddp_params_, std::move(names), options_.bucket_mb(), world_->comm(),
                                             &mem_, options_.ddp_async(), reduce);
  for (size_t i = 0; i < ddp_params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(ddp_params_[i]);
    acc->add_post_hook(std::make_unique<DdpGradHook>(weak_from_this(), i));
    ddp_accumulators_.push_back(std::move(acc));
  }
}

// ---------------------------------------------------------------- registry

namespace {
struct Registry {
  std::mutex mu;
  std::vector<std::pair<std::weak_ptr<torch::nn::Module>, std::shared_ptr<ShardState>>> entries;
  void prune() {
    entries.erase(std::remove_if(entries.begin(), entries.end(), [](const auto& e) { return e.first.expired(); }),
                  entries.end());
  }
};
Registry& registry() {
  static Registry r;
  return r;
}
}  // namespace

void register_model(torch::nn::Module& root, const std::shared_ptr<ShardState>& state) {
  std::weak_ptr<torch::nn::Module> weak = root.weak_from_this();
  TORCH_CHECK(!weak.expired(), "shardtorch::shard: the root module must be owned by a std::shared_ptr (declare "
                               "it through its holder, e.g. `Net net;` after SHARDTORCH_MODULE(Net) or "
                               "TORCH_MODULE(Net), or create it with std::make_shared)");
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.prune();
  r.entries.emplace_back(weak, state);
}

std::shared_ptr<ShardState> lookup_model(torch::nn::Module& root) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.prune();
  for (const auto& [weak, state] : r.entries) {
    auto m = weak.lock();
    if (m.get() == &root) return state;
  }
  return nullptr;
}

std::shared_ptr<ShardState> state_of(torch::nn::Module& root) { return lookup_model(root); }

std::shared_ptr<ShardState> require_state(torch::nn::Module& root, const std::string& what) {
  auto s = lookup_model(root);
  TORCH_CHECK(s, "shardtorch: ", what, ": this model was never sharded; call shardtorch::shard(model, world) first");
  return s;
}

std::map<const void*, std::vector<std::string>> parameter_names(torch::nn::Module& root) {
  std::map<const void*, std::vector<std::string>> names;
  for (const auto& item : root.named_parameters()) names[item.value().unsafeGetTensorImpl()].push_back(item.key());
  return names;
}

}  // namespace shardtorch::detail
