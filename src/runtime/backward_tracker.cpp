#include "runtime/backward_tracker.h"
#include "base/check.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>

#include "comm/world_access.h"
#include "base/errors.h"
#include "base/log.h"
#include "runtime/shard_state.h"

namespace shardtorch::detail {

void BackwardTracker::begin(int task, BackwardKind kind) {
  TORCH_INTERNAL_ASSERT(phase_ == BackwardPhase::Idle, "a backward began while another one runs");
  phase_ = BackwardPhase::Running;
  callback_task_ = task;
  kind_ = kind;
}

void BackwardTracker::start_finishing() { phase_ = BackwardPhase::Finishing; }

void BackwardTracker::end_finishing() {
  TORCH_INTERNAL_ASSERT(phase_ == BackwardPhase::Finishing, "the end of a backward that was not finishing");
  phase_ = BackwardPhase::Idle;
  detail::collective_context(model_.world()).backward_ends();
}

void BackwardTracker::ensure_end_of_backward_callback() {
  if (nested_ > 0 && running()) return;  // the recomputing node queued it on the outer task
  const int task = torch::autograd::get_current_graph_task_id();
  if (running() && task == callback_task_) return;
  // Queued for a backward that is still running: this one runs inside it
  // (reentrant). Its gradients would be taken for the outer backward's, or
  // the outer one for failed; only the recomputation of shardtorch's own
  // checkpointing nests (Nested above). Refused before anything changes.
  SHARDTORCH_CHECK(
      !running() || callback_alive_.expired(), detail::rank_prefix(model_.world().global_rank()),
      ": a backward "
      "inside another backward reached this sharded model (a checkpoint function of your own, or a backward "
      "or torch::autograd::grad run from a hook or from an autograd function's backward). shardtorch cannot "
      "tell its gradients from the outer backward's; the only nesting it supports is its own activation "
      "checkpointing: ShardOptions::activation_checkpointing (or activation_checkpointing_for)");
  // Queued for another backward that never reached its end: an exception escaped it.
  if (running()) abandon(/*warn=*/true);
  ReplicatedPath* replicated = model_.path().replicated();
  if (replicated) model_.world().note_progress("backward");  // units note it per unit
  const bool builds_graph = c10::GradMode::is_enabled();     // the engine runs a backward in grad mode iff create_graph
  // A backward restricted to some tensors (torch::autograd::grad, or
  // backward(inputs=...)) runs only the accumulators of the parameters among
  // them to accumulate; with none of ours it has no gradients to reduce.
  // Decided from the graph, so the same on every rank (unlike whether some
  // parameter's gradient happened to arrive here).
  bool inputs_only = false;
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
  const auto units = model_.units().live();
  if (restricted) {
    auto input = [&](const AccumulatorRef& acc) { return needed(acc.get()); };
    bool any = replicated && std::any_of(replicated->accumulators().begin(), replicated->accumulators().end(), input);
    for (const auto& u : units)
      if (!any) any = std::any_of(u->grads().accumulators().begin(), u->grads().accumulators().end(), input);
    inputs_only = !any;
  }
  begin(task, builds_graph  ? BackwardKind::BuildsGraph
              : inputs_only ? BackwardKind::InputsOnly
                            : BackwardKind::Reduces);
  detail::collective_context(model_.world()).backward_begins(sync_);
  for (const auto& u : units) u->grads().expect_from_graph(runs, in_graph);
  model_.order().on_backward_start();
  auto keep = model_.shared_from_this();
  auto alive = std::make_shared<bool>(true);
  callback_alive_ = alive;
  torch::autograd::Engine::get_default_engine().queue_callback([keep, alive] { keep->backward().finish(); });
}

void BackwardTracker::check_grad_arrival(const at::Tensor& param, const std::string& name) const {
  if (!builds_graph()) return;
  at::Tensor(param).mutable_grad().reset();  // a handle: the parameter itself
  SHARDTORCH_CHECK(
      false, detail::rank_prefix(model_.world().global_rank()), ": the gradient of parameter '", name,
      "' arrived in a backward with create_graph. Parameter gradients are flattened, reduced and detached, so "
      "their higher-order gradients are not supported. Differentiate with respect to inputs instead "
      "(torch::autograd::grad(outputs, inputs, {}, true, /*create_graph=*/true), a gradient penalty) and "
      "call backward() without create_graph");
}

void BackwardTracker::recover_if_failed(bool warn) {
  if (running() && torch::autograd::get_current_graph_task_id() == -1) abandon(warn);
}

void BackwardTracker::check_finished(const char* who) {
  recover_if_failed(/*warn=*/false);  // the error below says it
  SHARDTORCH_CHECK(!partial_grads_, detail::rank_prefix(model_.world().global_rank()), ": ", who,
                   " after a backward that did not "
                   "finish (an exception escaped it): the gradients are partial (its reductions in flight and staged "
                   "gradients were dropped). Call zero_grad() and run the backward again");
}

void BackwardTracker::abandon(bool warn) {
  if (warn) {
    SHARDTORCH_WARN(
        "shardtorch: the previous backward did not finish (an exception escaped it); ",
        "its reductions in flight, its staged gradients and any gradients accumulated under no_sync were ",
        "dropped. Gradients reduced before the failure may be partial: call zero_grad() before the next step.");
  }
  phase_ = BackwardPhase::Idle;  // from any phase
  partial_grads_ = true;         // until zero_grad
  detail::collective_context(model_.world()).backward_ends();
  model_.order().on_backward_abandoned();
  gradients_changed();  // partly reduced, staged ones dropped
  model_.gathers().release_held();
  model_.path().reducer().discard();
  if (auto* off = model_.copies().offloader()) off->discard();
  for (auto& u : model_.units().live()) {
    u->gather().reshard();
    u->reset_backward();
    for (auto& f : u->flats()) f->grads().drop_staging_grad();
  }
}

void BackwardTracker::finish() {
  model_.order().on_backward_finished();
  start_finishing();
  // Nothing to reduce in a backward that builds a graph (a parameter gradient
  // there is an error) nor in one for tensors none of which is a parameter of
  // ours (torch::autograd::grad, backward(inputs=...): no accumulator runs).
  const bool no_gradients = !reduces();
  if (!no_gradients) gradients_changed();
  try {
    model_.world().note_progress("end of backward");
    failure_point("end of backward");
    if (auto* replicated = model_.path().replicated()) {
      if (!no_gradients) replicated->finish_backward(sync_);
      if (!no_gradients && sync_) model_.optimizer().backward_reduced();
      end_finishing();
      return;
    }
    model_.order().adopt_recording();
    auto all = model_.units().all();
    if (builds_graph()) {  // the graph it built saved these full parameters
      for (auto& u : all)
        if (u->gather().state() == ParamState::Unsharded) u->gather().hold();
    }
    if (!no_gradients) {
      for (auto it = all.rbegin(); it != all.rend(); ++it) {
        if ((*it)->grads().needs_final_reduce()) (*it)->reduce_grads();
      }
      if (sync_) model_.order().issue_reductions(/*at_end=*/true);
      model_.path().sharded().finish_backward(sync_);
      if (auto* off = model_.copies().offloader()) off->worker().drain();  // the gradient shards reach host memory
      if (sync_) model_.optimizer().backward_reduced();
    }
    for (auto& u : all) {
      u->gather().reshard();
      u->reset_backward();
    }
    end_finishing();
  } catch (...) {
    abandon(/*warn=*/false);  // nothing of this backward survives into the next; the caller sees why
    rethrow_naming(model_.world(), [] { return std::string("the end of backward (reducing the gradients)"); });
  }
}

}  // namespace shardtorch::detail
