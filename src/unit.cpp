// The life of a unit: gather, free, hooks and gradient hand-off (docs/design.md).
#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <sstream>
#include <unordered_set>

#include "errors.h"
#include "shard_state.h"

namespace shardtorch::detail {

const char* state_name(UnitState s) {
  switch (s) {
    case UnitState::Sharded: return "sharded";
    case UnitState::Gathering: return "gathering";
    case UnitState::Unsharded: return "unsharded";
    case UnitState::Reducing: return "reducing";
  }
  return "?";
}

Unit::Unit(std::shared_ptr<ShardState> owner, std::string name, int index, bool is_root, bool reshard_after_forward,
           bool persistent)
    : owner_(std::move(owner)),
      name_(std::move(name)),
      index_(index),
      is_root_(is_root),
      reshard_after_forward_(reshard_after_forward && !is_root),
      persistent_(persistent) {}

void Unit::unshard_async() {
  if (state_ != UnitState::Sharded || persistent_) return;
  state_ = UnitState::Gathering;
  try {
    for (auto& f : flats_) gather_inputs_.push_back(owner_->gather_input(*f));  // under offload, all copies first
    for (auto& f : flats_) f->alloc_full();  // on the compute stream (offload.h)
    owner_->launch_gathers([&] {
      for (size_t i = 0; i < flats_.size(); ++i)
        gathers_.push_back(owner_->shard_comm().all_gather_async(
            flats_[i]->full(), gather_inputs_[i], "parameters of unit '" + label() + "' (" + flats_[i]->describe() + ")"));
    });
  } catch (...) {
    // Out of memory, say (prefetch raises the peak), and caught by the user:
    // the unit must go back to sharded, not be taken later for gathered with
    // buffers no collective filled. (If some all-gathers did launch, the
    // ranks are out of step; those are waited for here.)
    free_full();
    throw;
  }
  if (!flats_.empty()) owner_->mem().unit_gathered();
}

void Unit::unshard() {
  if (state_ == UnitState::Unsharded) return;
  unshard_async();  // nothing if a prefetch launched it already
  TORCH_CHECK(state_ == UnitState::Gathering, "shardtorch: rank ", owner_->world().rank(), ": unit '", label(),
              "' asked to gather while ", state_name(state_));
  size_t i = 0;
  try {
    for (; i < gathers_.size(); ++i) owner_->shard_comm().wait(gathers_[i]);
  } catch (...) {
    // A failed (timed-out) all-gather: the unit goes back to sharded, so that
    // the cleanup after the error and the next forward do not wait for it again.
    free_full(i + 1, /*failed=*/i);
    if (!flats_.empty()) owner_->mem().unit_released();
    throw;
  }
  gathers_.clear();
  gather_inputs_.clear();
  state_ = UnitState::Unsharded;
}

void Unit::free_full(size_t wait_from, size_t failed) {
  // gathers_[i] fills flats_[i]->full(). Memory a collective that failed may
  // still write into is never freed (FlatParam::free_full's abandon).
  std::vector<bool> abandon(flats_.size(), false);
  if (failed < abandon.size()) abandon[failed] = true;
  for (size_t i = wait_from; i < gathers_.size(); ++i) {
    try {
      owner_->shard_comm().wait(gathers_[i]);  // never free memory a collective still writes
    } catch (const std::exception& e) {
      abandon[i] = true;
      TORCH_WARN("shardtorch: rank ", owner_->world().rank(), ": an all-gather of unit '", label(),
                 "' that nothing read failed; the ranks may be out of step: ", e.what());
    }
  }
  gathers_.clear();
  gather_inputs_.clear();
  for (size_t i = 0; i < flats_.size(); ++i) flats_[i]->free_full(abandon[i]);
  state_ = UnitState::Sharded;
}

void Unit::reshard() {
  if (state_ == UnitState::Sharded || persistent_ || pins_ > 0) return;
  free_full();  // a gather in flight is waited for; nobody reads what it brings
  if (!flats_.empty()) owner_->mem().unit_released();
}

std::string Unit::sharded_access_error(const FlatParam& flat) const {
  std::ostringstream os;
  os << "shardtorch: rank " << owner_->world().rank() << ": unit '" << label()
     << "' is sharded, so its parameters (";
  const size_t shown = std::min<size_t>(flat.names().size(), 2);
  for (size_t i = 0; i < shown; ++i) {
    os << (i ? ", '" : "'") << flat.names()[i] << "' " << c10::IntArrayRef(flat.layout().shape(i));
  }
  if (flat.names().size() > shown) os << " and " << flat.names().size() - shown << " more";
  os << ") have no memory outside the unit's forward and backward. Read or change them inside a "
        "shardtorch::FullParams scope (summon_full_params), or get their values from full_parameters()";
  return os.str();
}

void Unit::pre_forward() {
  owner_->world().note_progress(c10::GradMode::is_enabled() ? "forward" : "forward without grad", label());
  owner_->recover_if_backward_failed();
  owner_->note_forward_for_reduction(*this);
  call_.reset();
  if (has_frozen_ && c10::GradMode::is_enabled()) {
    // Its frozen parameters may be read after its last trainable gradient
    // (LoRA: x W_frozen + x A B, where A's and B's accumulators run before
    // the product with W_frozen yields x's gradient): they are freed once
    // every live forward of it has run, in this backward, the nodes through
    // which gradient leaves it (frozen_unread; hook_exits).
    calls_.erase(std::remove_if(calls_.begin(), calls_.end(), [](const auto& c) { return c.expired(); }),
                 calls_.end());
    call_ = std::make_shared<ForwardCall>();
    calls_.push_back(call_);
    if (checkpointed_) {
      call_->hooked = -1;  // complete_nested_backward frees it
    } else {
      call_->first_node = at::sequence_number::peek();  // nodes made from here on are this forward's
      call_->thread = at::RecordFunction::currentThreadId();
    }
  }
  unshard();
  if (auto next = owner_->note_forward_and_next(*this)) next->unshard_async();
}

void Unit::abandon_forward() {
  call_.reset();
  // A prefetch launched in this forward (by this unit, or by one nested in
  // it that had finished) gathers for a forward that will not come: nobody
  // waits on a Gathering unit but its own pre-forward or pre-backward.
  for (auto& u : owner_->units())
    if (u->state() == UnitState::Gathering) u->reshard();
  // The root's forward holds every other: none is computing now, and those
  // post-forward kept gathered for the backward (with prefetch, the last
  // block) wait for one that will not come.
  if (is_root_)
    for (auto& u : owner_->units())
      if (u.get() != this && u->reshard_after_forward_) u->reshard();
  if (reshard_after_forward_ || !c10::GradMode::is_enabled()) reshard();
}

std::optional<at::ScalarType> Unit::input_dtype() const {
  const auto& mp = owner_->options().mixed_precision();
  if (!is_root_ || !mp.cast_root_inputs()) return std::nullopt;
  return mp.param_dtype();
}

std::optional<at::ScalarType> Unit::output_dtype() const {
  return is_root_ ? owner_->options().mixed_precision().output_dtype() : std::nullopt;
}

void Unit::post_forward(const std::vector<at::Tensor>& outputs) {
  bool grad_mode = c10::GradMode::is_enabled();
  std::shared_ptr<ForwardCall> call = std::move(call_);  // lives as long as the hooks on the outputs
  if (call && grad_mode && call->hooked == 0) hook_exits(*call, outputs);
  if (grad_mode) {
    if (outputs.empty()) {  // nothing to hook: it may take part, and how long its graph lives cannot be told
      forward_in_graph_ = true;
      if (call) unhookable_forward_ = true;
    }
    std::weak_ptr<Unit> weak = weak_from_this();
    for (const auto& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      forward_in_graph_ = true;
      t.register_hook([weak, call](const at::TensorBase&) {
        auto u = weak.lock();
        if (!u) return;
        run_naming(u->owner().world().rank(), "pre-backward hook",
                   [&] { return "the pre-backward hook of unit '" + u->label() + "'"; }, [&] { u->pre_backward(); });
      });
    }
  }
  // Without a hooked output the unit cannot be gathered again before autograd
  // reaches it, so it may be freed only when nothing will differentiate it:
  // no grad mode, or tensor outputs of which none requires grad.
  bool safe = !grad_mode || !outputs.empty();
  // Without grad mode no backward follows, so even the root gives its memory back.
  // With prefetch, a unit that runs again next, or the last unit of the forward
  // (backward starts with it), stays: freeing it would only gather it again at once.
  const bool needed_next = owner_->needed_again_at_once(*this);
  if ((reshard_after_forward_ || !grad_mode) && safe && !needed_next) reshard();
}

void Unit::pre_backward() {
  owner_->refuse_backward_in_grad_summon("unit", label());
  owner_->world().note_progress("backward", label());
  owner_->ensure_end_of_backward_callback();
  touched_ = true;
  // A unit already final in this backward reads no more of its trainable
  // parameters: an output hook firing after that (an output its parameters
  // did not touch) gathers nothing, whatever other ranks' data did.
  if (!reduced_) unshard();
  if (auto next = owner_->next_in_backward(*this)) next->unshard_async();
  // None of its gradients will arrive in this backward (a gate routed around
  // its layers on this rank): they are final now.
  // It reshards unless its parameters are still read: trainable ones in the
  // graph (backward(inputs=...) that leaves them out) or frozen ones.
  if (expected_now_ == 0 && reduces() && !reduced_ && owner_->backward_reduces())
    reduce_grads(/*reshard_now=*/in_graph_now_ == 0);
}

namespace {
// Starts `call`'s count for graph task `task`: how many of its exit nodes
// that task will run (alive, in its graph and, in a backward restricted to
// some inputs, needed). A forward whose exits this backward does not run
// has nothing of it run here.
void count_exits_for(Unit::ForwardCall& call, int task) {
  if (call.task == task) return;
  call.task = task;
  call.fired = 0;
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  const auto* exec = torch::autograd::get_current_graph_task_exec_info();
  call.expected = 0;
  for (const auto& w : call.exits) {
    auto n = w.lock();
    if (!n || (nodes != nullptr && nodes->count(n.get()) == 0)) continue;
    if (exec != nullptr && !exec->empty()) {
      // Needed: run. Captured only (autograd::grad of a tensor it makes): its
      // inputs are taken, the node itself does not run, nor its hook.
      auto it = exec->find(n.get());
      if (it == exec->end() || !it->second.needed_) continue;
    }
    ++call.expected;
  }
}
}  // namespace

bool Unit::frozen_unread() const {
  if (unhookable_forward_) return false;
  const int task = torch::autograd::get_current_graph_task_id();
  return std::all_of(calls_.begin(), calls_.end(), [task](const auto& w) {
    auto c = w.lock();
    if (!c || c->hooked == 0) return true;
    if (c->hooked < 0) return false;
    count_exits_for(*c, task);
    return c->fired >= c->expected;
  });
}

void Unit::exit_done(ForwardCall& call) {
  count_exits_for(call, torch::autograd::get_current_graph_task_id());
  ++call.fired;
  // Gradients final (or none to have), and no live forward's backward left to
  // read the frozen parameters. Not in a backward that builds a graph: that
  // graph reads them again (finish_backward holds what is still gathered).
  if ((reduced_ || !reduces()) && touched_ && frozen_unread() && !owner_->builds_graph()) reshard();
}

void Unit::on_grad_ready(size_t flat, size_t param) {
  owner_->refuse_backward_in_grad_summon("parameter", flats_[flat]->names()[param]);
  try {
    failure_point("gradient hook");
    owner_->ensure_end_of_backward_callback();
    owner_->check_grad_arrival(flats_[flat]->params()[param], flats_[flat]->names()[param]);
    touched_ = true;
    TORCH_CHECK(!reduced_, "shardtorch: rank ", owner_->world().rank(), ": gradient of '", flats_[flat]->names()[param],
                "' arrived after unit '", label(), "' had reduced its gradients in this backward (a parameter "
                "accumulated twice in one backward?)");
    TORCH_CHECK(state_ == UnitState::Unsharded, "shardtorch: rank ", owner_->world().rank(), ": gradient of '",
                flats_[flat]->names()[param], "' arrived while unit '", label(), "' is ", state_name(state_));
  } catch (...) {
    // Refused: the gradient autograd has just accumulated into param.grad
    // (staged and cleared otherwise) would be added to the next backward's.
    at::Tensor(flats_[flat]->params()[param]).mutable_grad().reset();
    throw;
  }
  flats_[flat]->stage_grad(param);
  if (++received_grads_ == expected_now_) reduce_grads();
}

void Unit::expect_from_graph(const std::function<bool(const torch::autograd::Node*)>& runs,
                             const std::function<bool(const torch::autograd::Node*)>& in_graph) {
  if (checkpointed_) {
    expected_now_ = in_graph_now_ = expected_grads_;
    return;
  }
  auto count = [&](const auto& pred) {
    return static_cast<int>(
        std::count_if(accumulators_.begin(), accumulators_.end(), [&](const auto& acc) { return pred(acc.get()); }));
  };
  expected_now_ = count(runs);
  in_graph_now_ = count(in_graph);
}

bool Unit::needs_final_reduce() const {
  if (reduced_ || expected_grads_ == 0) return false;
  if (touched_) return true;
  return std::any_of(flats_.begin(), flats_.end(), [](const auto& f) { return f->has_staging_grad(); });
}

void Unit::reduce_grads(bool reshard_now) {
  if (reduced_) return;
  // A unit the backward did not run reduces what earlier micro-batches staged
  // without its parameters: it stays sharded (a prefetch that gathered it for
  // nothing, the learned order having said it came next, is undone first).
  if (!touched_ && state_ == UnitState::Gathering) reshard();
  const bool idle = !touched_ && state_ == UnitState::Sharded;
  TORCH_CHECK(state_ == UnitState::Unsharded || idle, "shardtorch: rank ", owner_->world().rank(), ": unit '",
              label(), "' reduces its gradients while ", state_name(state_));
  reduced_ = true;
  // Without sync (accumulation) the staged gradients wait for a synchronising
  // backward, which reduces the units holding some: every rank's unit that
  // took part holds them, zeros where no gradient of it arrived.
  if (!owner_->sync() && touched_)
    for (auto& f : flats_)
      if (f->requires_grad()) f->staging_grad();
  if (owner_->sync()) {
    owner_->issue_reductions();  // this unit, if its turn has come, and those that waited for it
    if (!issued_) owner_->count_deferred_reduction();
  }
  // A unit waiting for its turn holds only its staged gradients. Frozen
  // parameters stay while a backward may read them (pre_forward).
  if (reshard_now && (!has_frozen_ || frozen_unread())) reshard();
}

void Unit::issue_reduction() {
  issued_ = true;
  const UnitState was = state_;
  state_ = UnitState::Reducing;
  try {
    reduce_flats();
  } catch (...) {
    state_ = was;  // a reduction that threw (a timed-out collective): the failed backward's cleanup releases the unit
    throw;
  }
  state_ = was;
}

void Unit::reduce_flats() {
  const double world = owner_->world().size();
  for (auto& f : flats_) {
    if (!f->requires_grad()) continue;
    FlatParam* fp = f.get();
    const std::string what = "gradients of unit '" + label() + "' (" + fp->describe() + ")";
    at::Tensor g = fp->take_staging_grad();
    if (g.numel() == 0) {  // a flat of empty parameters: an empty gradient, and nothing to send
      const bool full = owner_->strategy() == Strategy::OptimizerOnly;
      owner_->deliver_gradient(g, /*owned=*/true, [fp, full](const at::Tensor& r) {
        full ? fp->accumulate_full_grad(r, 1.0) : fp->accumulate_shard_grad(r, 1.0);
      });
      continue;
    }
    owner_->count_gradient_reduction();
    // fp16 sums of N gradients can overflow: divide before reducing instead of after.
    double post = world;
    if (g.scalar_type() == at::kHalf) {
      g.div_(world);
      post = 1.0;
    }
    if (owner_->strategy() == Strategy::OptimizerOnly) {  // every rank keeps the whole gradient
      ShardState* owner = owner_.get();
      owner_->bucketer().all_reduce(
          g, owner_->reduce_comm(),
          [fp, post, owner, what](const at::Tensor& reduced) {  // the staging gradient, reduced: no one else writes it
            run_naming(owner->world().rank(), "reduction callback", [&] { return "adding the all-reduced " + what; }, [&] {
              owner->deliver_gradient(reduced, /*owned=*/true,
                                      [fp, post](const at::Tensor& r) { fp->accumulate_full_grad(r, post); });
            });
          },
          what);
      continue;
    }
    ShardState* owner = owner_.get();
    // HybridShard: summed in the shard group, then across the replicas by
    // the bucketer (one all-reduce per launch) before the callback runs.
    owner_->bucketer().reduce_scatter(
        g, owner_->reduce_comm(),
        [fp, post, owner, what](const at::Tensor& reduced) {  // a view of a bucket's output
          run_naming(owner->world().rank(), "reduction callback", [&] { return "adding the reduce-scattered " + what; }, [&] {
            owner->deliver_gradient(reduced, /*owned=*/false,
                                    [fp, post](const at::Tensor& r) { fp->accumulate_shard_grad(r, post); });
          });
        },
        what, owner_->replica_comm());
  }
}

namespace {
// Runs after a node of a unit's forward that sends gradient out of the unit.
class ExitHook : public torch::autograd::FunctionPostHook {
 public:
  ExitHook(std::weak_ptr<Unit> unit, std::weak_ptr<Unit::ForwardCall> call)
      : unit_(std::move(unit)), call_(std::move(call)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    auto u = unit_.lock();
    auto c = call_.lock();
    if (!u || !c) return outputs;
    run_naming(u->owner().world().rank(), "exit hook", [&] { return "the exit hook of unit '" + u->label() + "'"; },
               [&] { u->exit_done(*c); });
    return outputs;
  }

 private:
  std::weak_ptr<Unit> unit_;
  std::weak_ptr<Unit::ForwardCall> call_;
};
}  // namespace

void Unit::hook_exits(ForwardCall& call, const std::vector<at::Tensor>& outputs) {
  using torch::autograd::Node;
  // The nodes this forward made: sequence numbers from first_node on, on
  // this thread (numbers count per thread). Gradient accumulators (the
  // largest number) are leaves: this unit's own are inside it, any other
  // (a leaf input, a captured parameter) is outside. A node with an edge to
  // a node outside sends gradient out of the unit (EXIT): once every exit
  // node has run in a backward, every node of the forward that leads out
  // has, and the others lead only to the unit's own accumulators. Per unit,
  // where a hook on an input tensor waited for all its consumers (an
  // encoder output feeding every decoder layer kept them all gathered), and
  // where an input's history rewritten in the forward (an in-place change
  // of a view) or a captured tensor would have been missed.
  std::unordered_set<const Node*> own;
  for (const auto& acc : accumulators_) own.insert(acc.get());
  const auto accumulator = [](const Node* n) { return n->sequence_nr() == UINT64_MAX; };
  std::vector<Node*> exits, todo;
  std::unordered_set<Node*> seen;
  bool unsure = false;  // a node of another thread: which side it is on cannot be told
  auto visit = [&](Node* n) {
    if (seen.insert(n).second) todo.push_back(n);
  };
  auto inside = [&](const Node* n) {
    if (!accumulator(n) && n->thread_id() != call.thread) unsure = true;
    return !accumulator(n) && n->sequence_nr() >= call.first_node;
  };
  for (const auto& t : outputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    Node* fn = t.grad_fn().get();
    if (fn && inside(fn)) visit(fn);  // else made before this forward: nothing of it is read through this output
  }
  while (!todo.empty() && !unsure) {
    Node* n = todo.back();
    todo.pop_back();
    bool out = false;
    for (const auto& e : n->next_edges()) {
      Node* next = e.function.get();
      if (next == nullptr) continue;
      if (inside(next)) {
        visit(next);
      } else if (!accumulator(next) || own.count(next) == 0) {
        out = true;
      }
    }
    if (out) exits.push_back(n);
  }
  // Every node the forward made on this thread (each took one sequence
  // number) must have been reached from its outputs. One that was not (an
  // auxiliary loss kept on the module, x W_frozen summed into it) can read
  // the frozen parameters after every exit has run, or a temporary was made
  // and dropped: which, cannot be told, so that forward is kept as well.
  if (!unsure && seen.size() != at::sequence_number::peek() - call.first_node) unsure = true;
  if (unsure) {
    call.hooked = -1;  // kept to the end of the backward
    return;
  }
  std::weak_ptr<Unit> weak_unit = weak_from_this();
  std::weak_ptr<ForwardCall> weak_call = call.weak_from_this();
  for (Node* n : exits) {
    n->add_post_hook(std::make_unique<ExitHook>(weak_unit, weak_call));
    call.exits.emplace_back(n->getptr());
  }
  call.hooked = static_cast<int>(exits.size());
}

namespace {
// Runs after a parameter's gradient has been accumulated into param.grad.
class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(std::weak_ptr<Unit> unit, size_t flat, size_t param)
      : unit_(std::move(unit)), flat_(flat), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    auto u = unit_.lock();
    if (!u) return outputs;
    try {
      u->on_grad_ready(flat_, param_);
    } catch (...) {
      rethrow_naming(u->owner().world().rank(), [&] {
        return "the gradient hook of parameter '" + u->flats()[flat_]->names()[param_] + "' of unit '" + u->label() + "'";
      });
    }
    return outputs;
  }

 private:
  std::weak_ptr<Unit> unit_;
  size_t flat_, param_;
};
}  // namespace

void Unit::register_grad_hooks() {
  for (size_t f = 0; f < flats_.size(); ++f) {
    if (!flats_[f]->requires_grad()) continue;
    const auto& params = flats_[f]->params();
    for (size_t i = 0; i < params.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(params[i]);
      TORCH_CHECK(acc, "shardtorch: rank ", owner_->world().rank(), ": unit '", label(), "': parameter '",
                  flats_[f]->names()[i], "' has no gradient accumulator (is it a view or a non-leaf tensor?)");
      acc->add_post_hook(std::make_unique<GradReadyHook>(weak_from_this(), f, i));
      accumulators_.push_back(std::move(acc));  // the parameter holds it only weakly
      ++expected_grads_;
    }
  }
  has_frozen_ = std::any_of(flats_.begin(), flats_.end(), [](const auto& f) { return !f->requires_grad(); });
}

}  // namespace shardtorch::detail
