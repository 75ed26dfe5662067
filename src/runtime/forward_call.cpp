// A unit's forwards: gathering before, hooks and freeing after, and for
// units with frozen parameters the exit hooks that tell when a backward has
// read them for the last time (docs/design.md, RESHARD).
#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <unordered_set>

#include "comm/world_access.h"
#include "base/errors.h"
#include "runtime/shard_state.h"

namespace shardtorch::detail {

void Unit::pre_forward(const std::vector<at::Tensor>& inputs) {
  owner_->world().note_progress(c10::GradMode::is_enabled() ? "forward" : "forward without grad", label());
  if (is_root_) WorldAccess::end_setup(owner_->world());  // a forward: the set-up is over
  if (is_root_) {
    auto& context = detail::collective_context(owner_->world());
    c10::GradMode::is_enabled() ? context.root_inputs(inputs) : context.root_forward_without_grad(inputs);
  }
  owner_->backward().recover_if_failed();
  owner_->order().note_forward_for_reduction(*this);
  forwards_.call_.reset();
  if (forwards_.has_frozen_ && c10::GradMode::is_enabled()) forwards_.start_call();
  gather_.unshard();
  if (auto next = owner_->order().note_forward_and_next(*this)) next->gather().unshard_async();
}

void UnitForwards::start_call() {
  // Its frozen parameters may be read after its last trainable gradient
  // (LoRA: x W_frozen + x A B, where A's and B's accumulators run before
  // the product with W_frozen yields x's gradient): they are freed once
  // every live forward of it has run, in this backward, the nodes through
  // which gradient leaves it (frozen_unread; hook_exits).
  calls_.erase(std::remove_if(calls_.begin(), calls_.end(), [](const auto& c) { return c.expired(); }), calls_.end());
  call_ = std::make_shared<ForwardCall>();
  calls_.push_back(call_);
  if (unit_.grads().checkpointed()) {
    call_->hooked = -1;  // complete_nested_backward frees it
  } else {
    call_->first_node = at::sequence_number::peek();  // nodes made from here on are this forward's
    call_->thread = at::RecordFunction::currentThreadId();
  }
}

void Unit::abandon_forward() {
  forwards_.call_.reset();
  // A prefetch launched in this forward (by this unit, or by one nested in
  // it that had finished) gathers for a forward that will not come: nobody
  // waits on a Gathering unit but its own pre-forward or pre-backward.
  for (auto& u : owner_->units().all())
    if (u->gather().state() == ParamState::Gathering) u->gather().reshard();
  // The root's forward holds every other: none is computing now, and those
  // post-forward kept gathered for the backward (with prefetch, the last
  // block) wait for one that will not come.
  if (is_root_)
    for (auto& u : owner_->units().all())
      if (u.get() != this && u->reshard_after_forward_) u->gather().reshard();
  if (reshard_after_forward_ || !c10::GradMode::is_enabled()) gather_.reshard();
}

void Unit::post_forward(const std::vector<at::Tensor>& outputs) {
  bool grad_mode = c10::GradMode::is_enabled();
  std::shared_ptr<ForwardCall> call = std::move(forwards_.call_);  // lives as long as the hooks on the outputs
  if (call && grad_mode && call->hooked == 0) forwards_.hook_exits(*call, outputs);
  if (grad_mode) {
    if (outputs.empty()) {  // nothing to hook: it may take part, and how long its graph lives cannot be told
      forwards_.trace_in_graph();
      if (call) forwards_.trace_untraceable();
    }
    std::weak_ptr<Unit> weak = weak_from_this();
    for (const auto& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      forwards_.trace_in_graph();
      t.register_hook([weak, call](const at::TensorBase&) {
        auto u = weak.lock();
        if (!u) return;
        run_naming(
            u->owner().world(), "pre-backward hook",
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
  const bool needed_next = owner_->order().needed_again_at_once(*this);
  if ((reshard_after_forward_ || !grad_mode) && safe && !needed_next) gather_.reshard();
}

namespace {
// Starts `call`'s count for graph task `task`: how many of its exit nodes
// that task will run (alive, in its graph and, in a backward restricted to
// some inputs, needed). A forward whose exits this backward does not run
// has nothing of it run here.
void count_exits_for(ForwardCall& call, int task) {
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

bool UnitForwards::frozen_unread() const {
  if (trace_ == ForwardTrace::Untraceable) return false;
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
  if ((grads_.reduced() || !grads_.reduces()) && grads_.reached() && forwards_.frozen_unread() &&
      !owner_->backward().builds_graph())
    gather_.reshard();
}

namespace {
// Runs after a node of a unit's forward that sends gradient out of the unit.
class ExitHook : public torch::autograd::FunctionPostHook {
 public:
  ExitHook(std::weak_ptr<Unit> unit, std::weak_ptr<ForwardCall> call)
      : unit_(std::move(unit)), call_(std::move(call)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    auto u = unit_.lock();
    auto c = call_.lock();
    if (!u || !c) return outputs;
    run_naming(
        u->owner().world(), "exit hook", [&] { return "the exit hook of unit '" + u->label() + "'"; },
        [&] { u->exit_done(*c); });
    return outputs;
  }

 private:
  std::weak_ptr<Unit> unit_;
  std::weak_ptr<ForwardCall> call_;
};
}  // namespace

void UnitForwards::hook_exits(ForwardCall& call, const std::vector<at::Tensor>& outputs) {
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
  for (const auto& acc : unit_.grads().accumulators()) own.insert(acc.get());
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
  std::weak_ptr<Unit> weak_unit = unit_.weak_from_this();
  std::weak_ptr<ForwardCall> weak_call = call.weak_from_this();
  for (Node* n : exits) {
    n->add_post_hook(std::make_unique<ExitHook>(weak_unit, weak_call));
    call.exits.emplace_back(n->getptr());
  }
  call.hooked = static_cast<int>(exits.size());
}

}  // namespace shardtorch::detail
