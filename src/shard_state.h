#pragma once
// Internal: the state behind shard(). One ShardState per sharded model, kept
// alive by the model (its units, and the registry entry that lives as long as
// the root module), by ShardedModel handles and by optimizers.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "shardtorch/all_reduce_bucketer.h"
#include "shardtorch/reduce_scatter_bucketer.h"
#include "shardtorch/sharded.h"
#include "offload.h"

namespace shardtorch::detail {

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

enum class UnitState { Sharded, Gathering, Unsharded, Reducing };

class Unit;

/// What a checkpointed unit needs in backward (docs/design.md).
struct Checkpointing {
  std::weak_ptr<ShardState> state;
  std::string label;               // the unit's name, for errors
  std::vector<at::Tensor> params;  // its trainable parameters: where the nested backward stops
  std::weak_ptr<Unit> unit;  // the unit (sharded strategies; a checkpointed unit has none inside it)
  // The last forward's node: alive and not yet differentiated means a second
  // forward now would give its parameters two gradient accumulations.
  std::weak_ptr<std::atomic<bool>> last_pending;
};
const char* state_name(UnitState s);

class Unit : public std::enable_shared_from_this<Unit> {
 public:
  Unit(std::shared_ptr<ShardState> owner, std::string name, int index, bool is_root, bool reshard_after_forward,
       bool persistent);

  const std::string& name() const { return name_; }
  std::string label() const { return name_.empty() ? "<root>" : name_; }
  int index() const { return index_; }
  bool is_root() const { return is_root_; }
  UnitState state() const { return state_; }
  std::vector<std::unique_ptr<FlatParam>>& flats() { return flats_; }
  bool has_params() const { return !flats_.empty(); }
  ShardState& owner() { return *owner_; }

  /// Persistent units (ZeRO-1/2) are gathered once at shard() and stay so.
  void mark_persistent_gathered() { state_ = UnitState::Unsharded; }
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
  /// Gathers the unit; under grad mode, a unit with frozen parameters starts
  /// a ForwardCall, whose exits post_forward hooks.
  void pre_forward();
  std::optional<at::ScalarType> input_dtype() const;
  std::optional<at::ScalarType> output_dtype() const;
  void post_forward(const std::vector<at::Tensor>& outputs);
  /// Its forward threw after pre_forward (docs/design.md, "A forward that
  /// fails"): frees what post_forward would have, and every unit a prefetch
  /// left gathering.
  void abandon_forward();
  void pre_backward();
  void on_grad_ready(size_t flat, size_t param);
  /// Its gradients are final in this backward ("FINAL" in docs/design.md,
  /// "Ordering and consistency across ranks"): with sync they are handed on
  /// for reduction in the reduction order (ShardState::issue_reductions),
  /// without it they keep accumulating; then it reshards, unless told not to
  /// (frozen parameters may still be needed).
  void reduce_grads(bool reshard_now = true);
  /// Hands every trainable flat gradient to its reduction (ShardState decides when).
  void issue_reduction();
  /// At the end of a backward: touched and not reduced yet, or (a unit this
  /// backward did not run) holding gradients accumulated without sync.
  bool needs_final_reduce() const;
  /// Its gradients are final in this backward (handed on, or waiting for their turn).
  bool reduced() const { return reduced_; }
  /// A grad-mode forward since the last backward gave it an output that needs
  /// a gradient (or one it cannot hook): it may take part in the next
  /// backward. A frozen block fed by data takes none, and is not prefetched.
  bool may_take_part_in_backward() const { return forward_in_graph_; }
  /// Its gradients were handed to their reduction in this backward.
  bool issued() const { return issued_; }
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
  /// Activation checkpointing: the unit is recomputed in backward;
  /// complete_nested_backward() makes it final once that recomputation's
  /// backward is done, whatever has arrived.
  void set_checkpointed() { checkpointed_ = true; }
  void complete_nested_backward() {
    if (touched_ && !reduced_ && reduces()) reduce_grads();
    reshard();  // its recomputation, and so all of its backward, is done
  }
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
  /// No backward node of a live forward of it may still read its frozen
  /// parameters: every such forward sends no gradient out of the unit, or
  /// has run, in this backward, each of its exit nodes this backward runs
  /// (docs/design.md, RESHARD).
  bool frozen_unread() const;
  /// An exit hook of `call` fired: frees the unit if it is done with.
  void exit_done(ForwardCall& call);
  /// At post-forward: hooks the nodes of `call`'s forward through which
  /// gradient leaves the unit (docs/design.md, RESHARD).
  void hook_exits(ForwardCall& call, const std::vector<at::Tensor>& outputs);
  /// Its place in the reduction order being recorded (ShardState).
  bool in_reduction_order() const { return in_reduction_order_; }
  void set_in_reduction_order(bool in) { in_reduction_order_ = in; }
  void reset_backward() {
    touched_ = reduced_ = issued_ = unhookable_forward_ = forward_in_graph_ = false;
    received_grads_ = 0;
  }
  void register_grad_hooks();

 private:
  /// Frees the full parameters and goes back to Sharded (the caller counts
  /// the memory). Gathers in flight from gathers_[wait_from] on are waited
  /// for first; their errors are warned about, nobody reading what they
  /// bring. The buffers of gathers_[failed] and of any that fail here are
  /// leaked, not freed: a failed collective may still write into them.
  void free_full(size_t wait_from = 0, size_t failed = SIZE_MAX);
  /// reduce_grads' work: each trainable flat's gradient to its reduction.
  void reduce_flats();

  std::shared_ptr<ShardState> owner_;
  std::string name_;
  int index_;
  bool is_root_;
  bool reshard_after_forward_;
  bool persistent_;
  UnitState state_ = UnitState::Sharded;
  std::vector<std::unique_ptr<FlatParam>> flats_;
  std::vector<AccumulatorRef> accumulators_;
  std::vector<PendingWork> gathers_;      // in flight while Gathering
  std::vector<at::Tensor> gather_inputs_;  // kept alive for them
  int expected_grads_ = 0, received_grads_ = 0;
  int expected_now_ = 0;  // of expected_grads_, those this backward's graph will deliver
  int in_graph_now_ = 0;  // of expected_grads_, those in this backward's graph at all
  bool has_frozen_ = false;  // a frozen flat: its backward may read it after the last gradient
  std::vector<std::weak_ptr<ForwardCall>> calls_;  // its live forwards (units with frozen parameters)
  std::shared_ptr<ForwardCall> call_;              // this forward's, from pre- to post-forward
  bool touched_ = false, reduced_ = false, issued_ = false;
  // A grad-mode forward since the last backward returned nothing to hook (a
  // custom struct): its graph's life cannot be followed, so frozen
  // parameters are kept to the end of the next backward.
  bool unhookable_forward_ = false;
  bool forward_in_graph_ = false;  // may_take_part_in_backward
  bool checkpointed_ = false, in_reduction_order_ = false;
  int pins_ = 0;
  bool held_ = false;
};

/// Broadcasts `tensors` from rank 0 of `comm` in place, one collective per
/// dtype (the tensors of a dtype are copied into one flat buffer and back).
/// `when` completes the error message ("at shard()").
void broadcast_coalesced(Comm& comm, std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& what,
                         const std::string& when);

class ShardState : public std::enable_shared_from_this<ShardState> {
 public:
  ShardState(std::shared_ptr<World> world, ShardOptions options);

  World& world() { return *world_; }
  const ShardOptions& options() const { return options_; }
  Strategy strategy() const { return options_.strategy(); }
  MemoryTracker& mem() { return mem_; }
  ReduceScatterBucketer& bucketer() { return bucketer_; }

  /// The group parameters are sharded over (the world, or the hybrid shard group).
  Comm& shard_comm() { return shard_group_ ? *shard_group_ : world_->comm(); }
  /// HybridShard: the ranks holding the same shard; else null.
  Comm* replica_comm() { return replica_group_.get(); }
  /// The group gradient reduce-scatters run on: the shard group's ranks in a
  /// communicator of their own where units gather in backward (FullShard,
  /// HybridShard), so that the reductions, issued in the reduction order,
  /// never have to fall between the same all-gathers on every rank (a unit
  /// final at another point of the backward on some ranks would pair a
  /// reduce-scatter with an all-gather). Else the shard group.
  Comm& reduce_comm() { return reduce_group_ ? *reduce_group_ : shard_comm(); }
  void set_reduce_group(std::shared_ptr<Comm> g) { reduce_group_ = std::move(g); }
  /// For its lifetime, every communicator of the model waits at least the
  /// world's file_timeout: the checkpoints' collectives, which wait for other
  /// ranks' file writes, reads and fsyncs.
  class FileWaits {
   public:
    explicit FileWaits(ShardState& state) {
      for (Comm* c : {&state.world().comm(), &state.shard_comm(), state.replica_comm(), &state.reduce_comm()}) {
        if (c == nullptr || std::find(comms_.begin(), comms_.end(), c) != comms_.end()) continue;
        comms_.push_back(c);
        raised_.push_back(std::make_unique<Comm::TimeoutAtLeast>(*c, state.world().file_timeout()));
      }
    }

   private:
    std::vector<Comm*> comms_;
    std::vector<std::unique_ptr<Comm::TimeoutAtLeast>> raised_;
  };
  void set_groups(std::shared_ptr<Comm> shard, std::shared_ptr<Comm> replica) {
    shard_group_ = std::move(shard);
    replica_group_ = std::move(replica);
  }

  /// Flat gradients handed on for reduction, plus NoShard buckets launched.
  int64_t gradient_reductions() const { return gradient_reductions_ + (ddp_ ? ddp_->launched() : 0); }
  void count_gradient_reduction() { ++gradient_reductions_; }

  bool sync() const { return sync_; }
  /// summon_full_params scopes alive (on every rank, rank0_only or not).
  /// `with_grads`: the scope set param.grad; a backward inside it is refused.
  /// Throws (this rank) inside a summon_full_params(with_grads) scope.
  /// Names `kind` `name` ("unit", its label): the message is built only on failure,
  /// since every gradient hook calls this.
  void refuse_backward_in_grad_summon(const char* kind, const std::string& name) const;
  void enter_summon(bool with_grads) {
    ++summons_;
    grad_summons_ += with_grads;
  }
  void leave_summon(bool with_grads) {
    --summons_;
    grad_summons_ -= with_grads;
  }
  /// Throws (this rank) inside a summon_full_params scope: an optimizer step
  /// or a checkpoint load there would leave the scope's full copies stale.
  void check_outside_summon() const;
  void set_sync(bool s) { sync_ = s; }

  /// Units in pre-order of the module tree; throws if the model is gone.
  std::vector<std::shared_ptr<Unit>> units() const;
  void add_unit(const std::shared_ptr<Unit>& u) { units_.push_back(u); }
  static void attach(UnitBase& base, std::shared_ptr<Unit> unit) { base.unit_ = std::move(unit); }
  static void attach_no_shard(UnitBase& base, const std::shared_ptr<ShardState>& state) {
    base.no_shard_state_ = state;
  }

  /// The module's buffers, broadcast from rank 0 after each optimizer step
  /// (ShardOptions::broadcast_buffers). After the step, not at the end of
  /// backward: the copy raises the buffers' version counters, and batch norm
  /// saves its running statistics for backward, so a graph kept alive with
  /// retain_graph would fail its next backward. The step already changes the
  /// parameters in place, which such a graph cannot outlive either.
  void set_synced_buffers(std::vector<std::pair<std::string, at::Tensor>> buffers) {
    synced_buffers_ = std::move(buffers);
  }
  void broadcast_buffers_after_step() {
    if (!synced_buffers_.empty()) broadcast_coalesced(world_->comm(), synced_buffers_, "buffers", "after a step");
  }

  /// NoShard: the bucketed all-reduce over the model's own parameters.
  /// `keep`: parameters that stay in their dtype under mixed precision.
  void enable_ddp(std::vector<at::Tensor> params, std::vector<std::string> names,
                  const std::unordered_set<const void*>& keep = {});
  AllReduceBucketer* ddp() { return ddp_.get(); }
  const std::vector<at::Tensor>& ddp_params() const { return ddp_params_; }
  const std::vector<std::string>& ddp_names() const { return ddp_names_; }
  /// NoShard under mixed precision: fp32 masters of ddp_params (else empty).
  const std::vector<at::Tensor>& ddp_masters() const { return ddp_masters_; }
  /// The tensors the optimizer updates under NoShard: masters, or the parameters.
  const std::vector<at::Tensor>& ddp_optimized() const { return ddp_masters_.empty() ? ddp_params_ : ddp_masters_; }
  /// NoShard under mixed precision: a frozen floating parameter computes in
  /// param_dtype and keeps its fp32 master here.
  void add_frozen_master(const at::Tensor& param, at::Tensor master);
  /// NoShard: the value of record of a parameter (what checkpoints save and
  /// load): its fp32 master under mixed precision, else the parameter itself.
  at::Tensor record_of(const at::Tensor& param) const {
    auto it = masters_.find(param.unsafeGetTensorImpl());
    return it == masters_.end() ? param : it->second;
  }
  /// NoShard: loads `value` into a parameter's record and, when that is a
  /// master, casts it into the parameter too.
  void load_record(const at::Tensor& param, const at::Tensor& value) const {
    at::Tensor record = record_of(param);
    record.copy_(value.view(record.sizes()));
    if (!record.is_same(param)) at::Tensor(param).copy_(record);
  }
  /// Points the masters' grads at the reduced gradients: views of buckets in
  /// the masters' dtype, or fp32 copies of buckets in a lower dtype. The
  /// copies are transient (master_grads): after_optimizer_step() releases
  /// them (converted_only), zero_grad every master grad, so between steps
  /// NoShard holds 16 bytes per parameter under bf16, as ZeRO counts it, not 20.
  void bind_master_grads();
  void release_master_grads(bool converted_only = false);

  /// The gradient tensors this rank holds (shards, whole ZeRO-1 gradients or
  /// NoShard bucket views); `partial` is set when other ranks hold other parts.
  std::vector<at::Tensor> local_gradients(bool& partial);

  /// fp16 mixed precision needs a GradScaler; one registers itself here.
  bool has_scaler() const { return has_scaler_; }
  void set_has_scaler() { has_scaler_ = true; }

  /// CPU offload: the host/device copies; null without offload.
  Offloader* offloader() { return offloader_.get(); }
  const Offloader* offloader() const { return offloader_.get(); }
  void enable_offload(c10::Device device);
  /// What a flat parameter's all-gather sends: its shard on the compute device
  /// in the compute dtype, never aliasing the full buffer.
  at::Tensor gather_input(FlatParam& f);
  /// all-gathers `f`'s full parameters from the shards, into its full buffer.
  void regather(Unit& u, FlatParam& f, const std::string& what);
  /// Runs `launch` (all-gathers of gather_input()s) so that it waits for the
  /// offload copies but the compute stream does not wait for them (offload on
  /// an accelerator; otherwise it just runs).
  void launch_gathers(const std::function<void()>& launch);
  /// A copy of `t` on the communication device (master shards and gradient
  /// shards may be in host memory under offload).
  at::Tensor on_comm_device(const at::Tensor& t);
  /// Hands a reduced gradient to `accumulate`: at once, or under offload after
  /// its copy to host memory (at the end of backward).
  /// `owned`: the caller hands `reduced` over (nobody reuses its memory).
  void deliver_gradient(const at::Tensor& reduced, bool owned, std::function<void(const at::Tensor&)> accumulate);
  /// Before the CPU writes master shards (the optimizer step, loading
  /// checkpoints, writeback): no offload copy may still read them. Outside
  /// the optimizer step (`step`) the masters' bf16 copies are marked stale.
  void wait_for_offload_copies(bool step = false) {
    if (!offloader_) return;
    offloader_->wait_idle();
    if (!step) low_copies_stale();  // the loads write through copy_, which the version shows: belt and braces
  }
  /// Offload: every master's bf16 copy is made again before its next use
  /// (the masters changed where their version counters may not show it).
  void low_copies_stale();
  /// Offload: makes every stale bf16 copy of a master again, now (call only
  /// while no copy to the device runs).
  void remake_low_copies();

  /// Prefetch (docs/design.md): records the forward order of units in grad
  /// mode and returns the unit to gather next after `u`, forward or backward
  /// (null: none known, or prefetch off).
  std::shared_ptr<Unit> note_forward_and_next(Unit& u);
  std::shared_ptr<Unit> next_in_backward(Unit& u);
  /// With prefetch, while this forward has followed the learned order up to
  /// u (at its post-forward): u runs again next (a repeated unit), or it is
  /// the last unit with parameters, which backward needs first. Either way
  /// it stays gathered: freeing it would only gather it again at once.
  bool needed_again_at_once(const Unit& u) const;

  /// The reduction order (docs/design.md, "Ordering and consistency across
  /// ranks"): records u's first forward in grad mode since the last backward
  /// ended (outside backward; units with trainable parameters).
  void note_forward_for_reduction(Unit& u);
  /// Hands on, in the reduction order, every final unit whose turn has come;
  /// stops at the first that is not final yet. `at_end`: the backward is
  /// ending, so the units not final take no part and are skipped, and the
  /// final ones outside the order follow in reverse pre-order.
  void issue_reductions(bool at_end = false);
  /// This backward reduces gradients (not a grad call, not create_graph).
  bool backward_reduces() const { return !builds_graph_ && !inputs_only_; }
  /// This backward was started with create_graph.
  bool builds_graph() const { return builds_graph_; }
  /// Units whose gradients were final before their turn in the reduction
  /// order, since shard() (they waited; 0 when units finish in that order).
  int64_t reductions_deferred() const { return reductions_deferred_; }
  void count_deferred_reduction() {
    if (!finishing_) ++reductions_deferred_;
  }

  /// Queues finish_backward() on the autograd engine once per backward. In a
  /// nested backward (activation checkpointing) the outer one's callback
  /// stands: nothing is queued. Records what kind of backward runs (below).
  void ensure_end_of_backward_callback();
  /// Gradients of gradients (docs/design.md): units still gathered at the end
  /// of a backward that builds a graph (create_graph) are held for that
  /// graph's backward until release_held(): at the optimizer step, a
  /// checkpoint load or after a failed backward.
  void release_held();
  /// A parameter gradient reached its accumulator in this backward: refused
  /// (naming `name`) in one that builds a graph, after dropping the gradient
  /// (its graph would keep the forward's graph alive).
  void check_grad_arrival(const at::Tensor& param, const std::string& name) const;
  /// NoShard, parameter i's gradient arrived: warns once if a step went by
  /// without a zero_grad that could reach buckets of another dtype than i.
  void note_ddp_gradient(size_t i);
  /// Activation checkpointing runs a nested backward (a second autograd graph
  /// task) inside the outer one; hooks firing there belong to the outer one.
  class NestedBackward {
   public:
    explicit NestedBackward(ShardState& s) : s_(s) { ++s_.nested_backward_; }
    ~NestedBackward() { --s_.nested_backward_; }
    NestedBackward(const NestedBackward&) = delete;
    NestedBackward& operator=(const NestedBackward&) = delete;

   private:
    ShardState& s_;
  };
  /// shard(): makes `base` a checkpointed unit (docs/design.md).
  /// `unit`: its Unit under the sharded strategies, null under NoShard.
  static void enable_checkpointing(UnitBase& base, std::shared_ptr<ShardState> state, std::string label,
                                   std::vector<at::Tensor> params, const std::shared_ptr<Unit>& unit);
  void finish_backward();
  /// At the start of a forward and in zero_grad(): outside any backward, a
  /// queued end-of-backward that never ran means the last backward failed;
  /// abandon_backward() then, before anything gathers, reduces or zeroes
  /// (with its warning unless `warn` is false).
  void recover_if_backward_failed(bool warn = true);
  /// Throws (this rank) when a backward since the last zero_grad did not
  /// finish (dropping what it left first): `who` would read partial gradients.
  void check_backward_finished(const char* who);
  /// Throws (this rank) naming a parameter whose requires_grad changed since shard().
  void check_requires_grad_unchanged() const;
  /// Changes whenever the gradients may have: at the end of every backward
  /// and at every zero_grad (the GradScaler's "already unscaled" is per value).
  uint64_t gradient_generation() const { return gradient_generation_; }
  void gradients_changed() { ++gradient_generation_; }
  /// zero_grad() of the optimizer or of a module: recovers from a failed
  /// backward, counts a gradient generation, and ends the forward order being
  /// recorded (a root that is not a unit marks no forward's start, so forwards
  /// in grad mode without a backward, an evaluation, would run on into the next).
  void on_zero_grad();
  /// The optimizer's zero_grad (and NoShard's root module's): every gradient
  /// of the model, after on_zero_grad().
  void zero_grads();
  /// `f` runs at every on_zero_grad() until removed (an optimizer's views
  /// drop their gradients, which would keep the old shards' memory alive).
  int add_zero_grad_listener(std::function<void()> f) {
    zero_grad_listeners_.emplace(next_listener_, std::move(f));
    return next_listener_++;
  }
  void remove_zero_grad_listener(int id) { zero_grad_listeners_.erase(id); }
  /// After a backward failed (an exception in a hook, a collective, or at its
  /// end): waits for and drops reductions in flight, drops staged gradients,
  /// reshards and resets every unit, so that the next backward starts clean.
  void abandon_backward(bool warn);
  /// After the optimizer changed the shards: rebuild persistent full buffers
  /// (ZeRO-1/2), free the stale full copies of the others.
  void after_optimizer_step();
  /// Leaving summon_full_params: every unit still unsharded (ZeRO-1/2, whose
  /// full buffers persist, or one a forward left gathered) gathers its full
  /// parameters again from the shards. Collective.
  void regather_unsharded();

 private:
  std::shared_ptr<World> world_;
  ShardOptions options_;
  MemoryTracker mem_;
  std::shared_ptr<Comm> shard_group_, replica_group_, reduce_group_;
  ReduceScatterBucketer bucketer_;  // after the groups: its destructor may wait on them
  std::vector<std::weak_ptr<Unit>> units_;
  std::unique_ptr<AllReduceBucketer> ddp_;
  std::unique_ptr<Offloader> offloader_;
  std::vector<std::pair<std::string, at::Tensor>> synced_buffers_;
  std::map<int, std::function<void()>> zero_grad_listeners_;
  int next_listener_ = 0;
  std::vector<std::weak_ptr<Unit>> recording_, forward_order_;  // this step's forward; the last complete one
  bool recording_stale_ = false;  // zero_grad since: the next forward starts a new recording
  bool following_ = false;  // this forward has run the units of forward_order_ in its order so far
  size_t backward_cursor_ = SIZE_MAX;  // this backward's place in forward_order_ (next_in_backward)
  // The reduction order, in first-forward order (issued from the back); a
  // backward's end closes it, and the next forward starts a new one.
  std::vector<std::weak_ptr<Unit>> reduction_order_;
  std::weak_ptr<Unit> order_head_;  // the first unit of the order the last backward used
  bool reduction_order_closed_ = false;
  size_t issue_cursor_ = 0;  // reduction_order_[0, issue_cursor_) are still to be issued
  bool finishing_ = false;   // in finish_backward
  int64_t reductions_deferred_ = 0;
  std::vector<at::Tensor> ddp_params_, ddp_masters_;
  std::vector<std::string> ddp_names_;
  std::unordered_map<const void*, at::Tensor> masters_;  // NoShard + mixed precision: every parameter's fp32 master
  std::vector<AccumulatorRef> ddp_accumulators_;
  int nested_backward_ = 0;
  bool builds_graph_ = false;  // this backward was started with create_graph
  bool inputs_only_ = false;   // ... for tensors none of which is a parameter of ours
  bool callback_queued_ = false;
  // NoShard: an optimizer step happened and no zero_grad reached the buckets
  // since (warned about once, where the buckets are not the gradients).
  bool stepped_since_zero_ = false, warned_unzeroed_ = false;
  uint64_t gradient_generation_ = 0;
  int callback_task_ = -1;  // the autograd graph task the callback was queued for
  // Alive as long as that graph task holds the callback: until it has run it,
  // or the task is destroyed (an exception escaped the backward).
  std::weak_ptr<void> callback_alive_;
  bool sync_ = true;
  int summons_ = 0, grad_summons_ = 0;
  bool partial_grads_ = false;  // a backward since the last zero_grad failed
  int64_t gradient_reductions_ = 0;
  bool has_scaler_ = false;
  int64_t master_grad_bytes_ = 0;
  /// NoShard: master i's grad is a copy (its bucket is in another dtype), not a view of its bucket.
  bool grad_is_copied(size_t i) const { return ddp_->grad_view(i).scalar_type() != ddp_masters_[i].scalar_type(); }
};

/// The registry of sharded models, by root module (entries die with it).
void register_model(torch::nn::Module& root, const std::shared_ptr<ShardState>& state);
std::shared_ptr<ShardState> lookup_model(torch::nn::Module& root);
/// The state of a sharded model; throws, naming `what` (the call), if it never was.
std::shared_ptr<ShardState> require_state(torch::nn::Module& root, const std::string& what);

/// Every name the module gives each parameter tensor (a tied one has several).
std::map<const void*, std::vector<std::string>> parameter_names(torch::nn::Module& root);

/// Collective (checkpoints): every rank reports what went wrong on it ("" if
/// nothing) and, when nothing did, a fingerprint of what it read. If any rank
/// failed, every rank throws checkpoint::SafetensorsError "<what>: rank R:
/// <R's error>" (R the first that failed); if the fingerprints differ, every
/// rank throws naming the two. So no rank carries on alone after another
/// failed, and no collective is left waiting for a rank that threw.
void agree_on_errors(World& world, const std::string& error, const std::string& what,
                     const std::string& fingerprint = "");

/// Collective, the end of a checkpoint load: agrees on what the check phase
/// found (`error`, `fingerprint`), runs the planned `changes`, agrees again
/// (a failure while copying says the model is partly loaded), then rebuilds
/// what the new values make stale (after_optimizer_step).
void load_agreed(ShardState& state, const std::string& error, const std::string& fingerprint,
                 const std::vector<std::function<void()>>& changes, const std::string& what);

}  // namespace shardtorch::detail
