// Activation checkpointing: a unit's forward without saved activations, and
// the autograd node that recomputes them in backward (docs/design.md,
// "Activation checkpointing").
#include <ATen/Context.h>
#include "base/log.h"
#include "base/check.h"
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <mutex>

#include "runtime/checkpointing.h"
#include "runtime/shard_state.h"

namespace shardtorch {

namespace detail {

void checkpointed_forward_takes_unkeepable_arguments(const UnitBase& unit) {
  SHARDTORCH_CHECK(
      false, "shardtorch: unit '", unit.checkpoint_label(),
      "' is checkpointed (activation_checkpointing), but "
      "its forward takes an argument that cannot be kept until backward (a view such as IntArrayRef, "
      "TensorList or string_view would dangle; a non-const reference would be written to a copy); take it by "
      "value, or turn checkpointing off for the unit (activation_checkpointing_for)");
}

void checkpointed_unit_destroyed() {
  SHARDTORCH_CHECK(false,
                   "shardtorch: backward through a checkpointed unit whose module was destroyed after its forward");
}

void checkpointed_forward_returns_non_tensors(const UnitBase& unit) {
  SHARDTORCH_CHECK(
      false, "shardtorch: unit '", unit.checkpoint_label(),
      "' is checkpointed (activation_checkpointing), but "
      "its forward returns something other than tensors (a tensor, a std::vector or a std::tuple of them): "
      "its outputs cannot be recomputed; turn checkpointing off for it (activation_checkpointing_for)");
}

namespace {

// The default generators' states, to replay random draws (dropout) when
// recomputing: the CPU's and that of every accelerator the unit touches.
class RngStates {
 public:
  RngStates() = default;
  explicit RngStates(const std::vector<c10::Device>& devices) {
    for (const auto& d : devices) {
      at::Generator gen = at::globalContext().defaultGenerator(d);
      std::lock_guard<std::mutex> lock(gen.mutex());
      states_.emplace_back(gen, gen.get_state());
    }
  }
  void apply() const {
    for (const auto& [gen, state] : states_) {
      at::Generator g = gen;
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(state);
    }
  }
  RngStates current() const {
    RngStates now;
    for (const auto& [gen, state] : states_) {
      at::Generator g = gen;
      std::lock_guard<std::mutex> lock(g.mutex());
      now.states_.emplace_back(g, g.get_state());
    }
    return now;
  }

 private:
  std::vector<std::pair<at::Generator, at::Tensor>> states_;
};

// The autocast state (enabled, dtype) of the CPU and of each accelerator
// type the unit touches, as the forward saw it, so that the recomputation
// computes in the same dtypes even though backward runs outside the user's
// autocast region. An Applied sets them for its scope and then restores what
// it replaced.
class AutocastStates {
  struct State {
    c10::DeviceType type;
    bool enabled;
    at::ScalarType dtype;
  };

 public:
  AutocastStates() = default;
  explicit AutocastStates(const std::vector<c10::Device>& devices) {
    for (const auto& d : devices) {
      if (!at::autocast::is_autocast_available(d.type())) continue;
      if (std::none_of(states_.begin(), states_.end(), [&](const State& s) { return s.type == d.type(); }))
        states_.push_back(now(d.type()));
    }
  }

  // Autocast's cache of parameter casts, off while the unit runs: in the
  // first run the casts would be kept (made under no-grad, with no history)
  // until the user's region ends, a low-precision copy of every checkpointed
  // unit's parameters; in the recomputation they would be reused without
  // history when backward runs inside the region.
  class NoCache {
   public:
    NoCache() : was_(at::autocast::is_autocast_cache_enabled()) { at::autocast::set_autocast_cache_enabled(false); }
    ~NoCache() { at::autocast::set_autocast_cache_enabled(was_); }
    NoCache(const NoCache&) = delete;
    NoCache& operator=(const NoCache&) = delete;

   private:
    bool was_;
  };

  class Applied {
   public:
    explicit Applied(const AutocastStates& want) {
      for (const auto& s : want.states_) before_.push_back(now(s.type));
      try {
        for (const auto& s : want.states_) set(s);
      } catch (...) {
        for (const auto& s : before_) set(s);
        throw;
      }
    }
    ~Applied() {
      for (const auto& s : before_) set(s);
    }
    Applied(const Applied&) = delete;
    Applied& operator=(const Applied&) = delete;

   private:
    NoCache no_cache_;
    std::vector<State> before_;
  };

 private:
  static State now(c10::DeviceType type) {
    return {type, at::autocast::is_autocast_enabled(type), at::autocast::get_autocast_dtype(type)};
  }
  static void set(const State& s) {
    at::autocast::set_autocast_enabled(s.type, s.enabled);
    at::autocast::set_autocast_dtype(s.type, s.dtype);
  }
  std::vector<State> states_;
};

std::vector<c10::Device> unit_devices(const std::vector<at::Tensor>& inputs, ShardState& state) {
  std::vector<c10::Device> out{c10::Device(c10::kCPU)};
  auto add = [&](c10::Device d) {
    if (d.is_cpu() || d.is_meta()) return;
    if (!d.has_index()) return;
    if (std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  };
  add(state.world().comm().device());
  for (const auto& t : inputs)
    if (t.defined()) add(t.device());
  return out;
}

struct Recompute : torch::CustomClassHolder {
  std::shared_ptr<Checkpointing> ac;
  RecomputeFn run;
  RngStates rng;
  AutocastStates autocast;
  size_t inputs = 0;  // the unit's tensor inputs; the node may take one more (below)
  std::shared_ptr<std::atomic<bool>> pending = std::make_shared<std::atomic<bool>>(true);  // no backward yet
  std::vector<at::Tensor> keep_apart;  // the module's parameters and buffers: outputs must not be them
  std::vector<at::Tensor> buffers;     // the module's buffers
};

// The module's buffers as the first run left them, put back where the
// recomputation changed them (batch norm's running statistics and batch
// count) once it and its backward are done or have failed: a step's
// statistics count once, as without checkpointing. Compared by value, since
// batch norm updates its statistics without raising their version counters;
// restored only after the nested backward, which batch norm saves them for.
class BuffersKept {
 public:
  explicit BuffersKept(const std::vector<at::Tensor>& buffers) {
    at::NoGradGuard no_grad;
    for (const auto& b : buffers)
      if (b.defined()) kept_.emplace_back(b, b.detach().clone());
  }
  ~BuffersKept() {
    at::NoGradGuard no_grad;
    for (auto& [b, value] : kept_) {
      try {
        if (!at::equal(b, value)) b.detach().copy_(value);
      } catch (const std::exception& e) {  // a destructor must not throw (it may run while one unwinds)
        SHARDTORCH_WARN("shardtorch: a checkpointed unit's buffer of shape ", b.sizes(),
                        " could not be put back after "
                        "its recomputation: ",
                        e.what());
      }
    }
  }
  BuffersKept(const BuffersKept&) = delete;
  BuffersKept& operator=(const BuffersKept&) = delete;

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> kept_;
};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  // Runs under no-grad (Function::apply): nothing is saved but the inputs.
  static variable_list forward(AutogradContext* ctx, at::TensorList all, c10::intrusive_ptr<Recompute> r) {
    ctx->set_materialize_grads(false);  // an output nobody used gets no zeros to backpropagate
    std::vector<at::Tensor> in(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(r->inputs));
    std::vector<int64_t> versions;
    for (const auto& t : in) versions.push_back(t.defined() ? static_cast<int64_t>(t._version()) : 0);
    variable_list outs;
    {
      AutocastStates::NoCache no_cache;
      outs = r->run(in, /*first=*/true);
    }
    for (size_t i = 0; i < in.size(); ++i) {
      SHARDTORCH_CHECK(
          !in[i].defined() || static_cast<int64_t>(in[i]._version()) == versions[i],
          "shardtorch: checkpointed "
          "unit '",
          r->ac->label, "' modified its input ", i, " (shape ", in[i].sizes(),
          ") in place; the "
          "recomputation in backward would see the modified value. Compute on a copy (x = x + f(x) instead "
          "of x += f(x)), or turn checkpointing off for the unit (activation_checkpointing_for)");
    }
    auto aliases = [](const at::Tensor& o, const std::vector<at::Tensor>& ts) {
      return std::any_of(ts.begin(), ts.end(), [&](const at::Tensor& t) { return t.defined() && o.is_alias_of(t); });
    };
    variable_list constant;
    for (auto& o : outs) {
      if (!o.defined()) continue;
      // An output that is not a fresh tensor (a view, an input, a parameter or
      // buffer returned as it is) becomes one, so that this node can own its
      // history without taking over another tensor's.
      if (o.is_view() || o.requires_grad() || aliases(o, in) || aliases(o, r->keep_apart)) o = o.clone();
      if (!o.is_floating_point() && !o.is_complex()) constant.push_back(o);
    }
    r->keep_apart.clear();
    if (!constant.empty()) ctx->mark_non_differentiable(constant);
    ctx->save_for_backward(in);
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(r);
    return outs;
  }

  // The saved inputs, detached, each requiring grad as it did.
  static std::vector<at::Tensor> detached_inputs(AutogradContext* ctx) {
    std::vector<at::Tensor> in;
    for (const auto& t : ctx->get_saved_variables()) {
      if (!t.defined()) {
        in.push_back(t);
        continue;
      }
      at::Tensor d = t.detach();
      d.requires_grad_(t.requires_grad());
      in.push_back(std::move(d));
    }
    return in;
  }

  // The unit's forward again, in grad mode, with the random and autocast
  // states of the first run (this thread's own are restored after).
  static variable_list rerun_forward(Recompute& r, const std::vector<at::Tensor>& in) {
    const RngStates now = r.rng.current();
    r.rng.apply();
    try {
      at::AutoGradMode grad_mode(true);
      AutocastStates::Applied autocast(r.autocast);
      variable_list outs = r.run(in, /*first=*/false);
      now.apply();
      return outs;
    } catch (...) {
      now.apply();
      throw;
    }
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto r = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    std::shared_ptr<ShardState> state = r->ac->state.lock();
    SHARDTORCH_CHECK(state, "shardtorch: backward through checkpointed unit '", r->ac->label,
                     "' after its sharded model was destroyed");
    const int rank = state->world().global_rank();
    // The gradients come from a nested backward that accumulates into .grad:
    // no graph of them (double backward), and no autograd::grad (which must
    // not touch .grad).
    SHARDTORCH_CHECK(
        !c10::GradMode::is_enabled(), detail::rank_prefix(rank), ": checkpointed unit '", r->ac->label,
        "': backward with create_graph (double backward) is not supported through activation checkpointing");
    SHARDTORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(), detail::rank_prefix(rank),
                     ": checkpointed unit '", r->ac->label,
                     "': torch::autograd::grad (or backward with inputs) is not "
                     "supported through activation checkpointing; use loss.backward()");
    state->summons().refuse_backward("checkpointed unit", r->ac->label);
    *r->pending = false;
    // The outer backward's end callback, queued on the outer graph task (the
    // nested backward below is another one).
    state->backward().ensure_end_of_backward_callback();
    std::vector<at::Tensor> in = detached_inputs(ctx);
    const BuffersKept buffers_kept(r->buffers);  // until the nested backward below is done
    const variable_list outs = rerun_forward(*r, in);
    SHARDTORCH_CHECK(outs.size() == grads.size(), detail::rank_prefix(rank), ": checkpointed unit '", r->ac->label,
                     "' returned ", grads.size(), " tensors in forward but ", outs.size(),
                     " when recomputed in backward (its forward must be deterministic in structure)");
    // The nested backward stops at the detached inputs and the unit's own
    // parameters: a tensor the unit uses but did not take as an argument
    // (a captured one) gets no gradient from it, rather than a second walk
    // through the outer graph.
    variable_list stop_at;
    for (const auto& d : in)
      if (d.defined() && d.requires_grad()) stop_at.push_back(d);
    for (const auto& p : r->ac->params)
      if (p.requires_grad()) stop_at.push_back(p);
    variable_list roots, root_grads;
    for (size_t i = 0; i < outs.size(); ++i) {
      if (!outs[i].defined() || !outs[i].requires_grad() || !grads[i].defined()) continue;
      SHARDTORCH_CHECK(outs[i].sizes() == grads[i].sizes(), detail::rank_prefix(rank), ": checkpointed unit '",
                       r->ac->label, "' output ", i, " has shape ", outs[i].sizes(), " when recomputed but ",
                       grads[i].sizes(), " in forward");
      roots.push_back(outs[i]);
      root_grads.push_back(grads[i]);
    }
    if (!roots.empty() && !stop_at.empty()) {
      BackwardTracker::Nested nested(state->backward());
      torch::autograd::backward(roots, root_grads, /*retain_graph=*/std::nullopt, /*create_graph=*/false, stop_at);
    }
    // Every gradient the unit will get in this backward has arrived: a
    // parameter the recomputation did not use on this rank gets none
    // (docs/design.md, "Ordering and consistency across ranks").
    if (auto u = r->ac->unit.lock()) u->complete_nested_backward();
    variable_list result;
    for (const auto& d : in) result.push_back(d.defined() && d.requires_grad() ? d.grad() : at::Tensor());
    // The empty input (if the node took one) and the Recompute argument get
    // none; extra undefined results are allowed.
    result.resize(result.size() + 2);
    return result;
  }
};

}  // namespace

void ShardState::enable_checkpointing(UnitBase& base, std::shared_ptr<ShardState> state, std::string label,
                                      std::vector<at::Tensor> params, const std::shared_ptr<Unit>& unit) {
  auto c = std::make_shared<Checkpointing>();
  c->state = std::move(state);
  c->label = std::move(label);
  c->params = std::move(params);
  if (unit) unit->grads().set_checkpointed();
  c->unit = unit;
  base.checkpointing_ = std::move(c);
}

}  // namespace detail

bool UnitBase::checkpointing_now() const { return checkpointing_ && c10::GradMode::is_enabled(); }

std::string UnitBase::checkpoint_label() const { return checkpointing_ ? checkpointing_->label : "?"; }

std::vector<at::Tensor> UnitBase::checkpointed_forward(std::vector<at::Tensor> inputs, detail::RecomputeFn run) {
  auto state = checkpointing_->state.lock();
  SHARDTORCH_CHECK(state, "shardtorch: forward through checkpointed unit '", checkpointing_->label,
                   "' after its sharded model was destroyed");
  auto previous = checkpointing_->last_pending.lock();
  SHARDTORCH_CHECK(!previous || !*previous || state->gathers().pipelined(),
                   detail::rank_prefix(state->world().global_rank()), ": checkpointed unit '", checkpointing_->label,
                   "' ran its forward again while the graph of its previous forward is alive and "
                   "not yet differentiated; its parameters would get two gradient accumulations in one backward. A "
                   "checkpointed unit runs once per backward: turn checkpointing off for a unit called twice "
                   "(activation_checkpointing_for), and run forwards that are not differentiated under "
                   "torch::NoGradGuard");
  auto r = c10::make_intrusive<detail::Recompute>();
  r->ac = checkpointing_;
  r->run = std::move(run);
  const auto devices = detail::unit_devices(inputs, *state);
  r->rng = detail::RngStates(devices);
  r->autocast = detail::AutocastStates(devices);
  r->inputs = inputs.size();
  if (auto* module = dynamic_cast<torch::nn::Module*>(this)) {
    for (const auto& p : module->parameters()) r->keep_apart.push_back(p);
    for (const auto& b : module->buffers()) {
      r->keep_apart.push_back(b);
      r->buffers.push_back(b);
    }
  }
  checkpointing_->last_pending = r->pending;
  // No input that needs a gradient: autograd would never run the node and
  // the parameters would get none. An empty tensor that requires grad makes
  // the node part of the graph (only needed if there are such parameters).
  const bool any =
      std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) { return t.defined() && t.requires_grad(); });
  if (!any && !checkpointing_->params.empty())
    inputs.push_back(at::empty({0}, at::TensorOptions().dtype(at::kFloat)).requires_grad_());
  return detail::RecomputeFunction::apply(at::TensorList(inputs), r);
}

}  // namespace shardtorch
