#pragma once
// Internal: how shards reach the all-gathers and reduced gradients reach the
// shards: directly, or under CPU offload through the Offloader's copies
// between host memory and the compute device (docs/offload.md).
#include <ATen/ATen.h>

#include <functional>
#include <memory>

#include "runtime/offload.h"
#include "shardtorch/world.h"

namespace shardtorch {
class FlatParam;
}

namespace shardtorch::detail {

class UnitList;

/// Told of each reduced gradient that offload hands on (StepInBackward).
class GradientListener {
 public:
  virtual ~GradientListener() = default;
  /// On the reducing thread, before the gradient is handed on; may throw.
  virtual void before(FlatParam& flat) = 0;
  /// On the offload thread, after the gradient was added into the host shard.
  virtual void arrived(FlatParam& flat) = 0;
  /// On the offload thread, instead of adding (`flat` has no gradient yet):
  /// updates `flat`'s masters from `host`, its reduced gradient in host
  /// memory to be divided by `divisor`, keeping no gradient. False: it cannot,
  /// nothing changed (the gradient is then added and arrived() told).
  virtual bool consume(FlatParam& flat, const at::Tensor& host, double divisor) = 0;
  /// Whether `flat`'s masters were updated since the last optimizer step.
  virtual bool stepped(const FlatParam& flat) const = 0;
  virtual bool any_stepped() const = 0;
};

class ShardCopies {
 public:
  ShardCopies(World& world, const UnitList& units) : world_(world), units_(units) {}

  /// CPU offload: the host/device copies; null without offload.
  Offloader* offloader() { return offloader_.get(); }
  const Offloader* offloader() const { return offloader_.get(); }
  void enable_offload(c10::Device device);
  /// What a flat parameter's all-gather sends: its shard on the compute device
  /// in the compute dtype, never aliasing the full buffer.
  at::Tensor gather_input(FlatParam& f);
  /// Runs `launch` (all-gathers of gather_input()s) so that it waits for the
  /// offload copies but the compute stream does not wait for them (offload on
  /// an accelerator; otherwise it just runs).
  void launch_gathers(const std::function<void()>& launch);
  /// A copy of `t` on the communication device (master shards and gradient
  /// shards may be in host memory under offload).
  at::Tensor on_comm_device(const at::Tensor& t);
  /// Adds `flat`'s reduced gradient, divided by `divisor`, into its full
  /// (`full`) or shard gradient: at once, or under offload on the offload
  /// thread after its copy to host memory (at the latest at the end of
  /// backward), then tells the listener, which may consume it instead.
  /// `owned`: the caller hands `reduced` over (nobody reuses its memory).
  void deliver_gradient(FlatParam& flat, const at::Tensor& reduced, bool owned, double divisor, bool full);
  /// Offload: the listener of delivered gradients (null: none). Waits for the
  /// offload thread first.
  void set_gradient_listener(GradientListener* listener);
  GradientListener* gradient_listener() const { return listener_; }
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

 private:
  std::string unit_of(const FlatParam& f) const;  // the label of the unit holding `f`, for errors

  World& world_;
  const UnitList& units_;
  std::unique_ptr<Offloader> offloader_;
  GradientListener* listener_ = nullptr;
};

}  // namespace shardtorch::detail
