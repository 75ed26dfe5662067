#include "shardtorch/sharded.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

#include "shard_state.h"

namespace shardtorch {
namespace detail {

const char* state_name(UnitState s) {
  switch (s) {
    case UnitState::Sharded: return "sharded";
    case UnitState::Gathering: return "gathering";
    case UnitState::Unsharded: return "unsharded";
    case UnitState::Reducing: return "reducing";
  }
  return "?";
}

// ---------------------------------------------------------------- Unit

Unit::Unit(std::shared_ptr<ShardState> owner, std::string name, int index, bool is_root,
           bool reshard_after_forward)
    : owner_(std::move(owner)),
      name_(std::move(name)),
      index_(index),
      is_root_(is_root),
      reshard_after_forward_(reshard_after_forward && !is_root) {}

void Unit::unshard() {
  if (state_ == UnitState::Unsharded) return;
  TORCH_CHECK(state_ == UnitState::Sharded, "shardtorch: rank ", owner_->world().rank(), ": unit '", label(),
              "' asked to gather while ", state_name(state_));
  state_ = UnitState::Gathering;
  for (auto& f : flats_) {
    f->alloc_full();
    owner_->world().comm().all_gather_into(f->full(), f->shard(),
                                           "parameters of unit '" + label() + "' (" + f->describe() + ")");
  }
  state_ = UnitState::Unsharded;
  if (!flats_.empty()) owner_->mem().unit_gathered();
}

void Unit::reshard() {
  if (state_ == UnitState::Sharded) return;
  for (auto& f : flats_) f->free_full();
  state_ = UnitState::Sharded;
  if (!flats_.empty()) owner_->mem().unit_released();
}

void Unit::pre_forward() { unshard(); }

void Unit::post_forward(const std::vector<at::Tensor>& outputs) {
  bool grad_mode = c10::GradMode::is_enabled();
  int hooked = 0;
  if (grad_mode) {
    std::weak_ptr<Unit> weak = weak_from_this();
    for (const auto& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      t.register_hook([weak](const at::TensorBase&) {
        if (auto u = weak.lock()) u->pre_backward();
      });
      ++hooked;
    }
  }
  // Without a hooked output the unit cannot be gathered again before autograd
  // reaches it, so it may be freed only when nothing will differentiate it:
  // no grad mode, or tensor outputs of which none requires grad.
  bool safe = !grad_mode || !outputs.empty();
  // Without grad mode no backward follows, so even the root gives its memory back.
  if ((reshard_after_forward_ || !grad_mode) && safe) reshard();
}

void Unit::pre_backward() {
  owner_->ensure_end_of_backward_callback();
  touched_ = true;
  unshard();
}

void Unit::on_grad_ready(size_t flat, size_t param) {
  owner_->ensure_end_of_backward_callback();
  touched_ = true;
  TORCH_CHECK(state_ == UnitState::Unsharded, "shardtorch: rank ", owner_->world().rank(), ": gradient of '",
              flats_[flat]->names()[param], "' arrived while unit '", label(), "' is ", state_name(state_));
  flats_[flat]->stage_grad(param);
  if (++received_grads_ == expected_grads_) reduce_grads();
}

void Unit::reduce_grads() {
  if (reduced_) return;
  TORCH_CHECK(state_ == UnitState::Unsharded, "shardtorch: rank ", owner_->world().rank(), ": unit '", label(),
              "' reduces its gradients while ", state_name(state_));
  state_ = UnitState::Reducing;
  auto& comm = owner_->world().comm();
  const double world = comm.size();
  for (auto& f : flats_) {
    if (!f->requires_grad()) continue;
    FlatParam* fp = f.get();
    owner_->bucketer().reduce_scatter(
        fp->take_staging_grad(), comm,
        [fp, world](const at::Tensor& reduced) { fp->accumulate_shard_grad(reduced, world); },
        "gradients of unit '" + label() + "' (" + fp->describe() + ")");
  }
  reduced_ = true;
  state_ = UnitState::Unsharded;
  reshard();
}

namespace {
// Runs after a parameter's gradient has been accumulated into param.grad.
class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(std::weak_ptr<Unit> unit, size_t flat, size_t param) : unit_(std::move(unit)), flat_(flat), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto u = unit_.lock()) u->on_grad_ready(flat_, param_);
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
      TORCH_CHECK(acc, "shardtorch: no gradient accumulator for '", flats_[f]->names()[i], "'");
      acc->add_post_hook(std::make_unique<GradReadyHook>(weak_from_this(), f, i));
      accumulators_.push_back(std::move(acc));  // the parameter holds it only weakly
      ++expected_grads_;
    }
  }
}

// ---------------------------------------------------------------- ShardState

ShardState::ShardState(std::shared_ptr<World> world, ShardOptions options)
    : world_(std::move(world)), options_(options), bucketer_(options.bucket_mb(), &mem_) {}

std::vector<std::shared_ptr<Unit>> ShardState::units() const {
  std::vector<std::shared_ptr<Unit>> out;
  for (const auto& w : units_) {
    auto u = w.lock();
    TORCH_CHECK(u, "shardtorch: a unit of this sharded model no longer exists (was the model destroyed?)");
    out.push_back(std::move(u));
  }
  return out;
}

void ShardState::ensure_end_of_backward_callback() {
  if (callback_queued_) return;
  callback_queued_ = true;
  auto units_now = units();
  if (!units_now.empty()) {
    auto keep = units_now.front();  // owns a shared_ptr to this state
    torch::autograd::Engine::get_default_engine().queue_callback([keep] { keep->owner().finish_backward(); });
  }
}

void ShardState::finish_backward() {
  callback_queued_ = false;
  auto all = units();
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if ((*it)->needs_final_reduce()) (*it)->reduce_grads();
  }
  bucketer_.flush();
  bucketer_.free();
  for (auto& u : all) {
    u->reshard();
    u->reset_backward();
  }
}

void ShardState::reshard_all() {
  for (auto& u : units()) u->reshard();
}

std::shared_ptr<ShardState> state_of(torch::nn::Module& root) {
  std::vector<torch::nn::Module*> stack{&root};
  while (!stack.empty()) {
    auto* m = stack.back();
    stack.pop_back();
    if (auto* b = dynamic_cast<UnitBase*>(m); b && b->unit_handle()) return b->unit_handle()->owner_shared();
    for (auto& c : m->children()) stack.push_back(c.get());
  }
  return nullptr;
}

}  // namespace detail

// ---------------------------------------------------------------- UnitBase

UnitBase::~UnitBase() = default;

void UnitBase::before_forward() { unit_->pre_forward(); }
void UnitBase::after_forward(const std::vector<at::Tensor>& outputs) { unit_->post_forward(outputs); }

// ---------------------------------------------------------------- shard()

namespace {

struct FoundUnit {
  std::string name;
  UnitBase* base;
  int parent;  // index of the enclosing unit, -1 for none
};

struct FoundParam {
  std::string name;
  at::Tensor tensor;
  int unit;  // -1: no unit encloses it
};

int common_ancestor(const std::vector<FoundUnit>& units, int a, int b) {
  std::set<int> chain;
  for (int u = a; u >= 0; u = units[u].parent) chain.insert(u);
  for (int u = b; u >= 0; u = units[u].parent)
    if (chain.count(u)) return u;
  return -1;
}

void walk(torch::nn::Module& m, const std::string& prefix, int current, std::vector<FoundUnit>& units,
          std::vector<FoundParam>& params, std::unordered_map<const void*, size_t>& seen,
          std::vector<std::pair<std::string, at::Tensor>>& buffers, std::set<const void*>& seen_buffers) {
  if (auto* b = dynamic_cast<UnitBase*>(&m)) {
    TORCH_CHECK(!b->is_sharded_unit(), "shardtorch::shard: module '", prefix.empty() ? "<root>" : prefix,
                "' is already a unit of a sharded model; shard() was called twice on this model");
    units.push_back({prefix, b, current});
    current = static_cast<int>(units.size()) - 1;
  }
  auto join = [&](const std::string& n) { return prefix.empty() ? n : prefix + "." + n; };
  for (const auto& item : m.named_parameters(/*recurse=*/false)) {
    const void* key = item.value().unsafeGetTensorImpl();
    auto it = seen.find(key);
    if (it == seen.end()) {
      seen.emplace(key, params.size());
      params.push_back({join(item.key()), item.value(), current});
    } else {
      auto& p = params[it->second];
      p.unit = (p.unit < 0 || current < 0) ? -1 : common_ancestor(units, p.unit, current);
    }
  }
  for (const auto& item : m.named_buffers(/*recurse=*/false)) {
    if (!item.value().defined()) continue;
    if (seen_buffers.insert(item.value().unsafeGetTensorImpl()).second) buffers.emplace_back(join(item.key()), item.value());
  }
  for (const auto& child : m.named_children()) {
    walk(*child.value(), join(child.key()), current, units, params, seen, buffers, seen_buffers);
  }
}

std::string param_line(const FoundParam& p, const std::vector<FoundUnit>& units) {
  std::ostringstream os;
  os << "parameter '" << p.name << "' " << c10::toString(p.tensor.scalar_type()) << p.tensor.sizes()
     << (p.tensor.requires_grad() ? "" : " frozen") << " in unit '"
     << (p.unit < 0 ? "<none>" : (units[p.unit].name.empty() ? "<root>" : units[p.unit].name)) << "'";
  return os.str();
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  for (std::string line; std::getline(is, line);) out.push_back(line);
  return out;
}

// Every rank learns every rank's description; all throw the same error.
void check_same_model_everywhere(World& world, const std::string& mine) {
  auto all = world.comm().all_gather_strings(mine, "shard(): model description");
  auto ref = split_lines(all[0]);
  std::ostringstream err;
  std::vector<int> bad;
  for (int r = 1; r < world.size(); ++r) {
    auto other = split_lines(all[r]);
    size_t n = std::min(ref.size(), other.size());
    size_t i = 0;
    while (i < n && ref[i] == other[i]) ++i;
    if (i == n && ref.size() == other.size()) continue;
    if (bad.empty()) {
      err << "shardtorch::shard: models differ across ranks: ";
      if (i < n) {
        err << "entry " << i << " is " << ref[i] << " on rank 0 but " << other[i] << " on rank " << r;
      } else {
        err << "rank 0 has " << ref.size() << " parameters and buffers, rank " << r << " has " << other.size()
            << " (first extra: " << (ref.size() > n ? ref[n] + " on rank 0" : other[n] + " on rank " + std::to_string(r))
            << ")";
      }
    }
    bad.push_back(r);
  }
  if (bad.empty()) return;
  err << "; ranks that differ from rank 0:";
  for (int r : bad) err << " " << r;
  err << " (seen on rank " << world.rank() << ")";
  throw std::runtime_error(err.str());
}

}  // namespace

ShardedModel shard(torch::nn::Module& root, std::shared_ptr<World> world, ShardOptions options) {
  TORCH_CHECK(world, "shardtorch::shard: no world");
  std::vector<FoundUnit> units;
  std::vector<FoundParam> params;
  std::unordered_map<const void*, size_t> seen;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  std::set<const void*> seen_buffers;
  walk(root, "", -1, units, params, seen, buffers, seen_buffers);

  std::ostringstream desc;
  for (const auto& p : params) desc << param_line(p, units) << "\n";
  for (const auto& [name, b] : buffers) desc << "buffer '" << name << "' " << c10::toString(b.scalar_type()) << b.sizes() << "\n";
  if (world->size() > 1) check_same_model_everywhere(*world, desc.str());

  std::vector<std::string> orphans;
  for (const auto& p : params)
    if (p.unit < 0) orphans.push_back(p.name);
  TORCH_CHECK(orphans.empty(), "shardtorch::shard: ", orphans.size(), " parameter(s) belong to no unit (first: '",
              orphans.front(), "') and the root module is not a unit; declare the root as shardtorch::Sharded<Impl> "
              "(see docs/api.md)");
  TORCH_CHECK(!units.empty(), "shardtorch::shard: the model has no unit; mark modules with shardtorch::Sharded<Impl>");

  const c10::Device comm_device = world->comm().device();
  for (const auto& p : params) {
    TORCH_CHECK(p.tensor.device() == comm_device, "shardtorch::shard: parameter '", p.name, "' is on ",
                p.tensor.device(), " but the ", world->backend_name(), " backend of rank ", world->rank(),
                " works on ", comm_device, "; move the model there first");
  }

  auto state = std::make_shared<detail::ShardState>(world, options);
  const bool root_is_unit = dynamic_cast<UnitBase*>(&root) != nullptr;
  std::vector<std::shared_ptr<detail::Unit>> made;
  for (size_t u = 0; u < units.size(); ++u) {
    bool is_root = root_is_unit && u == 0;
    auto unit = std::make_shared<detail::Unit>(state, units[u].name, static_cast<int>(u), is_root,
                                               options.reshard_after_forward());
    // Group the unit's parameters by (dtype, requires_grad), in registration order.
    std::vector<std::pair<std::pair<at::ScalarType, bool>, std::vector<const FoundParam*>>> groups;
    for (const auto& p : params) {
      if (p.unit != static_cast<int>(u)) continue;
      auto key = std::make_pair(p.tensor.scalar_type(), p.tensor.requires_grad());
      auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
      if (it == groups.end()) {
        groups.push_back({key, {}});
        it = groups.end() - 1;
      }
      it->second.push_back(&p);
    }
    for (auto& [key, members] : groups) {
      std::vector<at::Tensor> ts;
      std::vector<std::string> names;
      for (const auto* p : members) {
        ts.push_back(p->tensor);
        names.push_back(p->name);
      }
      auto flat = std::make_unique<FlatParam>(std::move(ts), std::move(names), world->size(), world->rank(),
                                              &state->mem());
      if (options.sync_module_states() && world->size() > 1) {
        world->comm().broadcast(flat->full(), 0, "parameters of unit '" + unit->label() + "' at shard()");
        flat->write_back_shard();
      }
      flat->free_full();
      unit->flats().push_back(std::move(flat));
    }
    unit->register_grad_hooks();
    state->add_unit(unit);
    made.push_back(unit);
  }
  if (options.sync_module_states() && world->size() > 1) {
    c10::NoGradGuard no_grad;
    for (auto& [name, b] : buffers) {
      TORCH_CHECK(b.device() == comm_device, "shardtorch::shard: buffer '", name, "' is on ", b.device(),
                  ", expected ", comm_device);
      at::Tensor t = b.is_contiguous() ? b : b.contiguous();
      world->comm().broadcast(t, 0, "buffer '" + name + "' at shard()");
      if (!t.is_same(b)) b.copy_(t);
    }
  }
  for (size_t u = 0; u < units.size(); ++u) detail::ShardState::attach(*units[u].base, made[u]);
  return ShardedModel(state);
}

ShardedModel sharded_model(torch::nn::Module& root) {
  auto s = detail::state_of(root);
  TORCH_CHECK(s, "shardtorch: this model was never sharded; call shardtorch::shard(model, world) first");
  return ShardedModel(s);
}

// ---------------------------------------------------------------- ShardedModel

const World& ShardedModel::world() const { return state_->world(); }
MemorySnapshot ShardedModel::memory() const { return state_->mem().snapshot(); }
void ShardedModel::reset_peak_memory() { state_->mem().reset_peaks(); }
const CommStats& ShardedModel::comm_stats() const { return state_->world().comm().stats(); }

std::vector<UnitInfo> ShardedModel::units() const {
  std::vector<UnitInfo> out;
  for (auto& u : state_->units()) {
    UnitInfo info;
    info.name = u->name();
    for (auto& f : u->flats()) {
      info.layouts.push_back(f->layout());
      info.param_names.push_back(f->names());
      info.frozen.push_back(!f->requires_grad());
    }
    out.push_back(std::move(info));
  }
  return out;
}

}  // namespace shardtorch
