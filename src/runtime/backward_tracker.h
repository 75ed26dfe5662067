#pragma once
// Internal: a sharded model's backward as a whole: its start (the first hook
// that fires queues the end-of-backward callback), its end (final units
// reduced, reductions completed) and the recovery from one that failed.
//
//   BackwardPhase: Idle --begin: the first hook of a backward queues the callback--> Running
//                  Running --finish (the callback runs): final units reduced--> Finishing --> Idle
//                  Running | Finishing --abandon (a failed backward)--> Idle
//   BackwardKind, decided at begin: Reduces; InputsOnly (torch::autograd::grad or
//                  backward(inputs=...) reaching no parameter of ours); BuildsGraph (create_graph).
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>

namespace shardtorch::detail {

class ShardState;

enum class BackwardPhase { Idle, Running, Finishing };
enum class BackwardKind { Reduces, InputsOnly, BuildsGraph };

class BackwardTracker {
 public:
  explicit BackwardTracker(ShardState& model) : model_(model) {}

  /// Queues finish() on the autograd engine once per backward. In a nested
  /// backward (activation checkpointing) the outer one's callback stands:
  /// nothing is queued. Records what kind of backward runs.
  void ensure_end_of_backward_callback();
  /// The end-of-backward callback.
  void finish();
  /// After a backward failed (an exception in a hook, a collective, or at its
  /// end): waits for and drops reductions in flight, drops staged gradients,
  /// reshards and resets every unit, so that the next backward starts clean.
  void abandon(bool warn);
  /// At the start of a forward and in zero_grad(): outside any backward, a
  /// queued end-of-backward that never ran means the last backward failed;
  /// abandon() then, before anything gathers, reduces or zeroes (with its
  /// warning unless `warn` is false).
  void recover_if_failed(bool warn = true);
  /// Throws (this rank) when a backward since the last zero_grad did not
  /// finish (dropping what it left first): `who` would read partial gradients.
  void check_finished(const char* who);
  /// zero_grad: the gradients are whole again (nothing partial to warn about).
  void on_zero_grad() { partial_grads_ = false; }

  bool running() const { return phase_ == BackwardPhase::Running; }
  bool finishing() const { return phase_ == BackwardPhase::Finishing; }
  /// This backward reduces gradients (not a grad call, not create_graph).
  bool reduces() const { return kind_ == BackwardKind::Reduces; }
  /// This backward was started with create_graph.
  bool builds_graph() const { return kind_ == BackwardKind::BuildsGraph; }
  /// A parameter gradient reached its accumulator in this backward: refused
  /// (naming `name`) in one that builds a graph, after dropping the gradient
  /// (its graph would keep the forward's graph alive).
  void check_grad_arrival(const at::Tensor& param, const std::string& name) const;

  /// Backwards reduce gradients across ranks (the default); ShardedModel's
  /// no_sync turns it off to accumulate them locally.
  bool sync() const { return sync_; }
  void set_sync(bool s) { sync_ = s; }

  /// Changes whenever the gradients may have: at the end of every backward
  /// and at every zero_grad (the GradScaler's "already unscaled" is per value).
  uint64_t gradient_generation() const { return gradient_generation_; }
  void gradients_changed() { ++gradient_generation_; }

  /// Activation checkpointing runs a nested backward (a second autograd graph
  /// task) inside the outer one; hooks firing there belong to the outer one.
  class Nested {
   public:
    explicit Nested(BackwardTracker& t) : t_(t) { ++t_.nested_; }
    ~Nested() { --t_.nested_; }
    Nested(const Nested&) = delete;
    Nested& operator=(const Nested&) = delete;

   private:
    BackwardTracker& t_;
  };

 private:
  // The transitions of BackwardPhase; each checks its source state.
  void begin(int task, BackwardKind kind);  // Idle -> Running
  void start_finishing();  // Running -> Finishing (Idle if abandoned meanwhile: the callback still runs)
  void end_finishing();    // Finishing -> Idle

  ShardState& model_;
  BackwardPhase phase_ = BackwardPhase::Idle;
  BackwardKind kind_ = BackwardKind::Reduces;  // of the running (or the last) backward
  int nested_ = 0;
  int callback_task_ = -1;  // the autograd graph task the callback was queued for
  // Alive as long as that graph task holds the callback: until it has run it,
  // or the task is destroyed (an exception escaped the backward).
  std::weak_ptr<void> callback_alive_;
  bool partial_grads_ = false;  // a backward since the last zero_grad failed
  bool sync_ = true;
  uint64_t gradient_generation_ = 0;
};

}  // namespace shardtorch::detail
