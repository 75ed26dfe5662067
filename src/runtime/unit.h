#pragma once
// Internal: one unit of a sharded model: its flat parameters, where they are
// (gathered or not), and its part in each forward and backward.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardtorch/collectives.h"
#include "runtime/flat_param.h"

namespace shardtorch::detail {

// A unit's lifecycle, one enum per axis; each axis lives in one part of the
// unit (UnitGather, UnitGrads, UnitForwards) whose private functions named
// after the transitions make them (docs/design.md, "States").
//
//   ParamState (UnitGather):
//                 Sharded --start_gather--> Gathering --finish_gather--> Unsharded
//                 Gathering | Unsharded --free_full--> Sharded
//   GradState (UnitGrads, one backward):
//                 Idle --reach (a hook of it fired)--> Reached --finalize--> Final --issue--> Issued
//                 Idle --finalize (end of backward: gradients staged by earlier
//                                  micro-batches)--> Final
//                 any --reset (end of backward, failed backward)--> Idle
//   ForwardTrace (UnitForwards, grad-mode forwards since the last backward):
//                 None --an output needs a gradient--> InGraph
//                 None | InGraph --no output to hook, frozen parameters--> Untraceable
//                 any --reset--> None
enum class ParamState { Sharded, Gathering, Unsharded };
enum class GradState { Idle, Reached, Final, Issued };
enum class ForwardTrace { None, InGraph, Untraceable };

class ShardState;

// A weak reference to an autograd node, of the kind Node::getptr() returns:
// std::shared_ptr in LibTorch 2.11, c10::intrusive_ptr in 2.13.
template <class P>
struct WeakOf;
template <class T>
struct WeakOf<std::shared_ptr<T>> {
  using type = std::weak_ptr<T>;
};
template <class T, class N>
struct WeakOf<c10::intrusive_ptr<T, N>> {
  using type = c10::weak_intrusive_ptr<T, N>;
};
using WeakNode = WeakOf<decltype(std::declval<torch::autograd::Node&>().getptr())>::type;

/// What holds a gradient accumulator: a shared_ptr up to LibTorch 2.11, an
/// intrusive_ptr in later versions.
using AccumulatorRef = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

const char* state_name(ParamState s);

class Unit;

/// A unit's full parameters (ParamState): the all-gathers that bring them,
/// freeing them, and what keeps them (pins, a hold).
class UnitGather {
 public:
  UnitGather(Unit& unit, bool persistent) : unit_(unit), persistent_(persistent) {}
  UnitGather(const UnitGather&) = delete;
  UnitGather& operator=(const UnitGather&) = delete;

  ParamState state() const { return state_; }
  /// Persistent units (ZeRO-1/2) are gathered once at shard() and stay so.
  void mark_persistent_gathered() { state_ = ParamState::Unsharded; }
  void unshard();
  /// Launches the all-gather and returns (Sharded -> Gathering); unshard()
  /// finishes it.
  void unshard_async();
  /// reshard() does nothing while pinned: summon_full_params pins the units
  /// it keeps, so a forward or backward inside its scope leaves them gathered.
  void pin() { ++pins_; }
  void unpin() { --pins_; }
  /// Gradients of gradients (docs/design.md): held (pinned) for a graph a
  /// backward built, once however often asked. release() unpins and reshards.
  void hold() {
    if (held_) return;
    held_ = true;
    ++pins_;
  }
  void release() {
    if (!held_) return;
    held_ = false;
    --pins_;
    reshard();
  }
  void reshard();
  /// The error a read of `flat`'s parameters throws while they are freed.
  std::string sharded_access_error(const FlatParam& flat) const;

 private:
  /// Frees the full parameters and goes back to Sharded (the caller counts
  /// the memory). Gathers in flight from gathers_[wait_from] on are waited
  /// for first; their errors are warned about (nobody reading what they
  /// bring), unless an error is on its way already (gathers_[failed]'s, or
  /// one unwinding). The buffers of gathers_[failed] and of any that fail here are
  /// leaked, not freed: a failed collective may still write into them.
  void free_full(size_t wait_from = 0, size_t failed = SIZE_MAX);
  void start_gather();   // Sharded -> Gathering
  void finish_gather();  // Gathering -> Unsharded

  Unit& unit_;
  bool persistent_;
  ParamState state_ = ParamState::Sharded;
  std::vector<PendingWork> gathers_;       // in flight while Gathering
  std::vector<at::Tensor> gather_inputs_;  // kept alive for them
  int pins_ = 0;
  bool held_ = false;
};

/// A unit's gradients in one backward (GradState): the accumulators its
/// hooks are on, how many gradients it expects and has received, and its
/// place in the reduction order. The unit drives the transitions.
class UnitGrads {
 public:
  explicit UnitGrads(Unit& unit) : unit_(unit) {}
  UnitGrads(const UnitGrads&) = delete;
  UnitGrads& operator=(const UnitGrads&) = delete;

  GradState state() const { return grad_; }
  /// Its gradients are final in this backward (handed on, or waiting for their turn).
  bool reduced() const { return grad_ == GradState::Final || grad_ == GradState::Issued; }
  /// Its gradients were handed to their reduction in this backward.
  bool issued() const { return grad_ == GradState::Issued; }
  /// Has trainable parameters, so it reduces gradients.
  bool reduces() const { return expected_grads_ > 0; }
  /// Its parameters' gradient accumulators (the nodes its hooks are on).
  const std::vector<AccumulatorRef>& accumulators() const { return accumulators_; }
  /// At a backward's first hook: how many of its gradients the engine will
  /// deliver ("EXPECTED"): `runs` says whether the engine will run an
  /// accumulator in this backward. A checkpointed unit expects all: its
  /// accumulators run in the nested backward's graph.
  /// `in_graph`: the accumulator is in the graph at all (backward(inputs=...)
  /// may run only some of those in it).
  void expect_from_graph(const std::function<bool(const torch::autograd::Node*)>& runs,
                         const std::function<bool(const torch::autograd::Node*)>& in_graph);
  /// At the end of a backward: touched and not reduced yet, or (a unit this
  /// backward did not run) holding gradients accumulated without sync.
  bool needs_final_reduce() const;
  /// Activation checkpointing: the unit is recomputed in backward
  /// (Unit::complete_nested_backward).
  void set_checkpointed() { checkpointed_ = true; }
  bool checkpointed() const { return checkpointed_; }
  /// Its place in the reduction order being recorded (ExecutionOrder).
  bool in_reduction_order() const { return in_reduction_order_; }
  void set_in_reduction_order(bool in) { in_reduction_order_ = in; }

 private:
  friend class Unit;
  void reach() {  // Idle -> Reached; Reached, Final, Issued stay
    if (grad_ == GradState::Idle) grad_ = GradState::Reached;
  }
  bool reached() const { return grad_ != GradState::Idle; }
  void finalize();  // Idle | Reached -> Final
  void issue();     // Final -> Issued
  void reset() {    // any -> Idle
    grad_ = GradState::Idle;
    received_grads_ = 0;
  }

  Unit& unit_;
  GradState grad_ = GradState::Idle;
  std::vector<AccumulatorRef> accumulators_;
  int expected_grads_ = 0, received_grads_ = 0;
  int expected_now_ = 0;  // of expected_grads_, those this backward's graph will deliver
  int in_graph_now_ = 0;  // of expected_grads_, those in this backward's graph at all
  bool checkpointed_ = false, in_reduction_order_ = false;
};

/// A unit with frozen parameters: one grad-mode forward of it, alive as
/// long as that forward's graph (the hooks on its outputs hold it).
struct ForwardCall : std::enable_shared_from_this<ForwardCall> {
  int hooked = 0;    // exit nodes hooked (hook_exits); -1: cannot tell, kept to the end of backward
  int fired = 0;     // their hooks fired in graph task `task`
  int expected = 0;  // of them, those graph task `task` runs
  int task = -1;
  uint64_t first_node = 0;  // the first sequence number of a node this forward may make ...
  uint64_t thread = 0;      // ... on this thread
  std::vector<WeakNode> exits;
};

/// A unit's grad-mode forwards since the last backward (ForwardTrace) and,
/// for frozen parameters, the live forwards whose backward may still read
/// them (docs/design.md, RESHARD).
class UnitForwards {
 public:
  explicit UnitForwards(Unit& unit) : unit_(unit) {}
  UnitForwards(const UnitForwards&) = delete;
  UnitForwards& operator=(const UnitForwards&) = delete;

  /// A grad-mode forward since the last backward gave it an output that needs
  /// a gradient (or one it cannot hook): it may take part in the next
  /// backward. A frozen block fed by data takes none, and is not prefetched.
  bool may_take_part_in_backward() const { return trace_ != ForwardTrace::None; }
  /// It has a frozen flat: its backward may read it after the last gradient.
  bool has_frozen() const { return has_frozen_; }
  /// No backward node of a live forward of it may still read its frozen
  /// parameters: every such forward sends no gradient out of the unit, or
  /// has run, in this backward, each of its exit nodes this backward runs
  /// (docs/design.md, RESHARD).
  bool frozen_unread() const;

 private:
  friend class Unit;
  /// At pre-forward under grad mode, with frozen parameters: this forward's call.
  void start_call();
  /// At post-forward: hooks the nodes of `call`'s forward through which
  /// gradient leaves the unit (docs/design.md, RESHARD).
  void hook_exits(ForwardCall& call, const std::vector<at::Tensor>& outputs);
  void trace_in_graph() {  // None -> InGraph; Untraceable stays
    if (trace_ == ForwardTrace::None) trace_ = ForwardTrace::InGraph;
  }
  void trace_untraceable() { trace_ = ForwardTrace::Untraceable; }  // None | InGraph -> Untraceable
  void reset() { trace_ = ForwardTrace::None; }                     // any -> None

  Unit& unit_;
  ForwardTrace trace_ = ForwardTrace::None;
  bool has_frozen_ = false;
  std::vector<std::weak_ptr<ForwardCall>> calls_;  // its live forwards (units with frozen parameters)
  std::shared_ptr<ForwardCall> call_;              // this forward's, from pre- to post-forward
  // Untraceable: a grad-mode forward since the last backward returned nothing
  // to hook (a custom struct): its graph's life cannot be followed, so frozen
  // parameters are kept to the end of the next backward.
};

/// One unit of a sharded model: its flat parameters, and its part in each
/// forward and backward, which moves its three parts (gather(), grads(),
/// forwards()) through their states.
class Unit : public std::enable_shared_from_this<Unit> {
 public:
  Unit(std::shared_ptr<ShardState> owner, std::string name, bool is_root, bool reshard_after_forward, bool persistent);

  const std::string& name() const { return name_; }
  std::string label() const { return name_.empty() ? "<root>" : name_; }
  bool is_root() const { return is_root_; }
  std::vector<std::unique_ptr<FlatParam>>& flats() { return flats_; }
  bool has_params() const { return !flats_.empty(); }
  ShardState& owner() { return *owner_; }
  UnitGather& gather() { return gather_; }
  UnitGrads& grads() { return grads_; }
  const UnitGrads& grads() const { return grads_; }
  UnitForwards& forwards() { return forwards_; }

  /// Gathers the unit; under grad mode, a unit with frozen parameters starts
  /// a ForwardCall, whose exits post_forward hooks.
  void pre_forward(const std::vector<at::Tensor>& inputs = {});
  void post_forward(const std::vector<at::Tensor>& outputs);
  /// Its forward threw after pre_forward (docs/design.md, "A forward that
  /// fails"): frees what post_forward would have, and every unit a prefetch
  /// left gathering.
  void abandon_forward();
  void pre_backward();
  void on_grad_ready(size_t flat, size_t param);
  /// Its gradients are final in this backward ("FINAL" in docs/design.md,
  /// "Ordering and consistency across ranks"): with sync they are handed on
  /// for reduction in the reduction order (ExecutionOrder::issue_reductions),
  /// without it they keep accumulating; then it reshards, unless told not to
  /// (frozen parameters may still be needed).
  void reduce_grads(bool reshard_now = true);
  /// Hands every trainable flat gradient to its reduction (ExecutionOrder decides when).
  void issue_reduction();
  /// Activation checkpointing: once the recomputation's backward is done its
  /// gradients are final, whatever has arrived.
  void complete_nested_backward() {
    if (grads_.state() == GradState::Reached && grads_.reduces()) reduce_grads();
    gather_.reshard();  // its recomputation, and so all of its backward, is done
  }
  /// An exit hook of `call` fired: frees the unit if it is done with.
  void exit_done(ForwardCall& call);
  /// GradState and ForwardTrace back to their start (any -> Idle, None).
  void reset_backward() {
    grads_.reset();
    forwards_.reset();
  }
  void register_grad_hooks();

 private:
  std::shared_ptr<ShardState> owner_;
  std::string name_;
  bool is_root_;
  bool reshard_after_forward_;
  std::vector<std::unique_ptr<FlatParam>> flats_;
  UnitGather gather_;
  UnitGrads grads_;
  UnitForwards forwards_;
};

}  // namespace shardtorch::detail
