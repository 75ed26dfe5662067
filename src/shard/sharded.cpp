#include "shardtorch/sharded.h"
#include "base/log.h"
#include "base/check.h"
#include "base/text.h"

// shard(): finding units and parameters, checking the model across ranks,
// building flat parameters (or, for NoShard, the all-reduce buckets).
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cctype>
#include <exception>
#include <functional>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "comm/world_access.h"
#include "deferred/deferred_session.h"
#include "runtime/placement.h"
#include "runtime/shard_state.h"
#include "shard/model_walk.h"
#include "shardtorch/comm_hooks.h"
#include "shardtorch/deferred.h"

namespace shardtorch {

// ---------------------------------------------------------------- shard()

using detail::batch_norm_tensors;
using detail::DtypeOf;
using detail::flat_groups;
using detail::FoundParam;
using detail::FoundUnit;
using detail::ModelWalk;
using detail::quoted_names;
using detail::walk_model;

namespace {

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

// Every option of ShardOptions as (name, value) pairs, in a fixed order: what
// must agree across ranks (docs/api.md, "Options that must agree").
using OptionValues = std::vector<std::pair<std::string, std::string>>;
OptionValues option_values(const ShardOptions& o) {
  auto dtype = [](const std::optional<at::ScalarType>& t) {
    return t ? std::string(c10::toString(*t)) : std::string("unset");
  };
  auto flag = [](bool b) { return std::string(b ? "true" : "false"); };
  std::ostringstream mb;
  mb.precision(17);
  mb << o.bucket_mb();
  const auto& mp = o.mixed_precision();
  OptionValues v = {
      {"strategy", strategy_name(o.strategy())},
      {"mixed_precision.param_dtype", dtype(mp.param_dtype())},
      {"mixed_precision.reduce_dtype", dtype(mp.reduce_dtype())},
      {"mixed_precision.output_dtype", dtype(mp.output_dtype())},
      {"mixed_precision.buffer_dtype", dtype(mp.buffer_dtype())},
      {"mixed_precision.cast_root_inputs", flag(mp.cast_root_inputs())},
      {"mixed_precision.keep_batch_norm_fp32", flag(mp.keep_batch_norm_fp32())},
      {"reshard_after_forward", flag(o.reshard_after_forward())},
      {"bucket_mb", mb.str()},
      {"sync_module_states", flag(o.sync_module_states())},
      {"broadcast_buffers", flag(o.broadcast_buffers())},
      {"hybrid_shard_size", std::to_string(o.hybrid_shard_size())},
      {"ddp_async", flag(o.ddp_async())},
      {"error_on_unused_parameters", flag(o.error_on_unused_parameters())},
      {"prefetch", flag(o.prefetch())},
      {"cpu_offload", flag(o.cpu_offload())},
      {"activation_checkpointing", flag(o.activation_checkpointing())},
  };
  for (const auto& [unit, value] : o.per_unit_reshard())
    v.emplace_back("reshard_after_forward_for('" + unit + "')", flag(value));
  for (const auto& [unit, value] : o.per_unit_checkpointing())
    v.emplace_back("activation_checkpointing_for('" + unit + "')", flag(value));
  return v;
}

// Option lines of a description start with this; the model's lines follow.
constexpr const char* kOptionLine = "option\t";

std::string describe_options(const OptionValues& options) {
  std::string s;
  for (const auto& [name, value] : options) s += std::string(kOptionLine) + name + "\t" + value + "\n";
  return s;
}

// Splits a description into its options (name -> value, in order) and the model's lines.
void parse_description(const std::string& desc, OptionValues& options, std::vector<std::string>& model) {
  const size_t prefix = std::char_traits<char>::length(kOptionLine);
  for (const auto& line : split_lines(desc)) {
    if (line.compare(0, prefix, kOptionLine) == 0) {
      const size_t tab = line.find('\t', prefix);
      options.emplace_back(line.substr(prefix, tab - prefix), tab == std::string::npos ? "" : line.substr(tab + 1));
    } else {
      model.push_back(line);
    }
  }
}

// The options every rank passed differ from rank 0's: every rank throws the
// same error, naming each differing option, both ranks and both values.
void check_same_options(const std::vector<OptionValues>& all, const World& world) {
  std::ostringstream err;
  int listed = 0, more = 0;
  auto value_in = [](const OptionValues& v, const std::string& name) -> std::optional<std::string> {
    for (const auto& [n, value] : v)
      if (n == name) return value;
    return std::nullopt;
  };
  for (size_t r = 1; r < all.size(); ++r) {
    std::vector<std::string> names;  // rank 0's order, then names rank r alone has
    for (const auto& [n, v] : all[0]) names.push_back(n);
    for (const auto& [n, v] : all[r])
      if (!value_in(all[0], n)) names.push_back(n);
    for (const auto& name : names) {
      const auto a = value_in(all[0], name), b = value_in(all[r], name);
      if (a == b) continue;
      if (listed >= 8) {
        ++more;
        continue;
      }
      err << (listed++ ? "; " : "") << "option " << name << " is " << a.value_or("unset") << " on rank "
          << world.global_rank_of(0) << " but " << b.value_or("unset") << " on rank "
          << world.global_rank_of(static_cast<int>(r));
    }
  }
  if (listed == 0) return;
  std::ostringstream msg;
  msg << "shardtorch::shard: ShardOptions differ across ranks: " << err.str();
  if (more) msg << "; and " << more << " more";
  msg << ". Every rank must pass the same ShardOptions (seen on rank " << world.global_rank() << ")";
  throw Error(msg.str());
}

// Every rank learns every rank's description (options, then the model); all
// throw the same error: differing options first, then differing models.
void check_same_model_everywhere(World& world, const std::string& mine) {
  auto all = world.comm().all_gather_strings(mine, "shard(): options and model description");
  std::vector<OptionValues> options(all.size());
  std::vector<std::vector<std::string>> models(all.size());
  for (size_t r = 0; r < all.size(); ++r) parse_description(all[r], options[r], models[r]);
  check_same_options(options, world);
  const auto& ref = models[0];
  std::ostringstream err;
  std::vector<int> bad;
  for (int r = 1; r < world.size(); ++r) {
    const auto& other = models[r];
    size_t n = std::min(ref.size(), other.size());
    size_t i = 0;
    while (i < n && ref[i] == other[i]) ++i;
    if (i == n && ref.size() == other.size()) continue;
    if (bad.empty()) {
      err << "shardtorch::shard: models differ across ranks: ";
      if (i < n) {
        err << "entry " << i << " is " << ref[i] << " on rank " << world.global_rank_of(0) << " but " << other[i]
            << " on rank " << world.global_rank_of(r);
      } else {
        const std::string first = std::to_string(world.global_rank_of(0)),
                          rth = std::to_string(world.global_rank_of(r));
        err << "rank " << first << " has " << ref.size() << " parameters and buffers, rank " << rth << " has "
            << other.size()
            << " (first extra: " << (ref.size() > n ? ref[n] + " on rank " + first : other[n] + " on rank " + rth)
            << ")";
      }
    }
    bad.push_back(r);
  }
  if (bad.empty()) return;
  err << "; ranks that differ from rank " << world.global_rank_of(0) << ":";
  for (int r : bad) err << " " << world.global_rank_of(r);
  err << " (seen on rank " << world.global_rank() << ")";
  throw Error(err.str());
}

// Deferred construction (shardtorch/deferred.h): gives the deferred ones
// among `params` (all, or those of `unit`) their values on `device`.
void materialize_params(const std::vector<FoundParam>& params, std::optional<int> unit, c10::Device device, int rank) {
  std::vector<at::Tensor> ts;
  std::vector<std::string> names;
  for (const auto& p : params) {
    if ((unit && p.unit != *unit) || !is_deferred(p.tensor)) continue;
    ts.push_back(p.tensor);
    names.push_back(p.name);
  }
  if (!ts.empty()) detail::materialize_tensors(ts, names, device, rank);
}

void materialize_buffers(const std::vector<std::pair<std::string, at::Tensor>>& buffers, c10::Device device, int rank) {
  std::vector<at::Tensor> ts;
  std::vector<std::string> names;
  for (const auto& [name, b] : buffers) {
    if (!is_deferred(b)) continue;
    ts.push_back(b);
    names.push_back(name);
  }
  if (!ts.empty()) detail::materialize_tensors(ts, names, device, rank);
}

}  // namespace

namespace {

// NoShard: the parameters stay whole; gradients go through buckets. Under
// mixed precision the parameters become param_dtype and the optimizer gets
// fp32 masters (ReplicatedPath::enable); frozen ones are cast and keep an
// fp32 master for checkpoints (ReplicatedPath::add_frozen_master).
// `keep`: parameters that stay in their dtype (batch norm's, MixedPrecision::keep_batch_norm_fp32).
void setup_no_shard(detail::ShardState& state, World& world, std::vector<FoundParam>& params,
                    const std::unordered_set<const void*>& keep) {
  std::vector<at::Tensor> trainable;
  std::vector<std::string> names;
  c10::NoGradGuard no_grad;
  const auto& mp = state.options().mixed_precision();
  detail::ReplicatedPath& replicated = state.enable_replicated();
  for (auto& p : params) {
    if (state.options().sync_module_states() && world.size() > 1)
      world.comm().broadcast(p.tensor, 0, "parameter '" + p.name + "' at shard()");
    if (!p.tensor.requires_grad()) {  // frozen: whole on every rank
      if (mp.param_dtype() && p.tensor.is_floating_point() && p.tensor.scalar_type() != *mp.param_dtype() &&
          !keep.count(p.tensor.unsafeGetTensorImpl())) {
        // It computes in param_dtype; the fp32 master is what checkpoints keep.
        replicated.masters().add_frozen(p.tensor, p.tensor.detach().clone());
        p.tensor.set_data(p.tensor.detach().to(*mp.param_dtype()));
      }
      state.mem().add(Mem::ReplicatedParams, p.tensor.nbytes());
      continue;
    }
    trainable.push_back(p.tensor);
    names.push_back(p.name);
  }
  replicated.enable(std::move(trainable), std::move(names), keep);
}

// What a per-unit option that names no unit is told: the names it could give.
std::string units_to_name(const std::vector<FoundUnit>& units) {
  std::vector<std::string> names;
  for (const auto& u : units)
    if (!u.name.empty()) names.push_back(u.name);
  return " (" + (names.empty() ? std::string("it has no unit but the root") : "its units: " + quoted_names(names, 8)) +
         "; a module is a unit when declared shardtorch::Sharded<Impl>)";
}

// Activation checkpointing: which units recompute (docs/design.md). Every
// unit without a unit inside, the root excepted, under the global option;
// per-unit settings override it, and asking for the root or an enclosing
// unit is an error.
//
// A parameter shared with another unit (a tied LM head's weight, kept by the
// common ancestor) would get its gradient in two autograd graph tasks, the
// outer backward and the nested one that recomputes: two accumulations where
// the hooks count one. Such a unit is left out (an error when named).
std::vector<bool> checkpointed_units(const std::vector<FoundUnit>& units, const std::vector<FoundParam>& params,
                                     const ShardOptions& options, bool root_is_unit) {
  std::vector<bool> leaf(units.size(), true), out(units.size(), false);
  for (const auto& u : units)
    if (u.parent >= 0) leaf[u.parent] = false;
  std::unordered_map<const void*, int> owner;
  for (const auto& p : params) owner[p.tensor.unsafeGetTensorImpl()] = p.unit;
  auto shared_param = [&](size_t u) -> std::string {  // "" if none
    auto* module = dynamic_cast<torch::nn::Module*>(units[u].base);
    if (module == nullptr) return "";
    for (const auto& item : module->named_parameters()) {
      auto it = owner.find(item.value().unsafeGetTensorImpl());
      if (it != owner.end() && it->second != static_cast<int>(u)) return item.key();
    }
    return "";
  };
  auto is_root = [&](size_t u) { return root_is_unit && u == 0; };
  if (options.activation_checkpointing()) {
    for (size_t u = 0; u < units.size(); ++u) out[u] = leaf[u] && !is_root(u) && shared_param(u).empty();
  }
  for (const auto& [name, value] : options.per_unit_checkpointing()) {
    auto it = std::find_if(units.begin(), units.end(), [&](const FoundUnit& u) { return u.name == name; });
    SHARDTORCH_CHECK(it != units.end(), "shardtorch::shard: activation_checkpointing_for('", name,
                     "') names no unit of this model", units_to_name(units));
    const size_t u = static_cast<size_t>(it - units.begin());
    if (value) {
      SHARDTORCH_CHECK(!is_root(u), "shardtorch::shard: activation_checkpointing_for('", name,
                       "'): the root unit cannot be "
                       "checkpointed (its forward encloses every other unit); checkpoint the units inside it");
      if (!leaf[u]) {
        auto inner = std::find_if(units.begin(), units.end(),
                                  [&](const FoundUnit& v) { return v.parent == static_cast<int>(u); });
        SHARDTORCH_CHECK(false, "shardtorch::shard: activation_checkpointing_for('", name, "'): unit '", name,
                         "' has units inside it (first: '", inner->name,
                         "'), whose forwards would run twice; "
                         "checkpoint the inner units instead");
      }
      const std::string shared = shared_param(u);
      SHARDTORCH_CHECK(shared.empty(), "shardtorch::shard: activation_checkpointing_for('", name, "'): its parameter '",
                       shared,
                       "' is shared with another unit (tied), and recomputing would give it two gradient "
                       "accumulations in one backward; such a unit cannot be checkpointed");
    }
    out[u] = value;
  }
  return out;
}

// Makes the chosen units checkpointed, each with its own trainable
// parameters (a leaf unit: those of its module tree) and, under the sharded
// strategies (`made`, one per unit), its Unit.
void enable_checkpointing(const std::vector<FoundUnit>& units, const std::vector<bool>& checkpointed,
                          const std::shared_ptr<detail::ShardState>& state,
                          const std::vector<std::shared_ptr<detail::Unit>>& made = {}) {
  for (size_t u = 0; u < units.size(); ++u) {
    if (!checkpointed[u]) continue;
    std::vector<at::Tensor> trainable;
    if (auto* module = dynamic_cast<torch::nn::Module*>(units[u].base))
      for (const auto& p : module->parameters())
        if (p.requires_grad()) trainable.push_back(p);
    detail::ShardState::enable_checkpointing(*units[u].base, state, units[u].name, std::move(trainable),
                                             made.empty() ? nullptr : made[u]);
  }
}

}  // namespace

namespace {

// What shard() decides before the exchange: configuration errors are found
// here and raised after it. Options that differ across ranks make one rank's
// configuration invalid and not another's, and that rank throwing alone
// would leave the others waiting in the exchange until the timeout. Once
// options and models agree, every rank finds the same error.
struct Config {
  int shard_size = 0;
  std::vector<bool> checkpointed;
  std::exception_ptr error;
};

Config check_config(const ShardOptions& options, const World& world, const ModelWalk& found, bool root_is_unit) {
  Config c;
  c.shard_size = world.size();
  const Strategy strategy = options.strategy();
  const auto& mp = options.mixed_precision();
  try {
    if (strategy == Strategy::HybridShard) {
      const int s = options.hybrid_shard_size();
      SHARDTORCH_CHECK(s != 0,
                       "shardtorch::shard: HybridShard needs hybrid_shard_size(S), the ranks of a shard group: "
                       "set it to a divisor of the world size ",
                       world.size(), " (0, the default, is unset)");
      SHARDTORCH_CHECK(s >= 1 && world.size() % s == 0, "shardtorch::shard: HybridShard needs hybrid_shard_size (now ",
                       s, ") to divide the world size ", world.size());
      c.shard_size = s;
    }
    auto low_precision = [](at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat; };
    SHARDTORCH_CHECK(!mp.param_dtype() || low_precision(*mp.param_dtype()),
                     "shardtorch::shard: MixedPrecision param_dtype ", *mp.param_dtype(),
                     " must be BFloat16, Half or Float");
    SHARDTORCH_CHECK(!mp.reduce_dtype() || low_precision(*mp.reduce_dtype()),
                     "shardtorch::shard: MixedPrecision reduce_dtype ", *mp.reduce_dtype(),
                     " must be BFloat16, Half or Float");
    SHARDTORCH_CHECK(!(mp.reduce_dtype() && !mp.param_dtype()),
                     "shardtorch::shard: MixedPrecision reduce_dtype needs param_dtype");
    SHARDTORCH_CHECK(
        !(options.cpu_offload() && strategy == Strategy::NoShard),
        "shardtorch::shard: cpu_offload needs a "
        "sharding strategy; NoShard keeps whole parameters on the device (use OptimizerOnly for replicated "
        "parameters with the optimizer in host memory)");
    for (const auto& [unit, flag] : options.per_unit_reshard()) {
      bool known =
          std::any_of(found.units.begin(), found.units.end(), [&](const FoundUnit& u) { return u.name == unit; });
      SHARDTORCH_CHECK(known, "shardtorch::shard: reshard_after_forward_for('", unit, "') names no unit of this model",
                       units_to_name(found.units));
    }
    c.checkpointed = checkpointed_units(found.units, found.params, options, root_is_unit);
  } catch (const std::exception& e) {
    // Raised on every rank after the exchange (agree_on_model), naming this one.
    const std::string prefix = "shardtorch::shard: ", m = e.what();
    c.error = m.compare(0, prefix.size(), prefix) == 0
                  ? std::make_exception_ptr(
                        Error(prefix + "rank " + std::to_string(world.global_rank()) + ": " + m.substr(prefix.size())))
                  : std::current_exception();
  } catch (...) {
    c.error = std::current_exception();
  }
  return c;
}

// A parameter on another device than the backend's ("" if none): part of the
// description, so that a rank alone with it makes every rank fail at the
// exchange (checked after it, it failed that rank only and left the others
// waiting in shard()'s next collective until the timeout).
std::string misplaced_parameter(World& world, const std::vector<FoundParam>& params) {
  const c10::Device comm_device = world.comm().device();
  for (const auto& p : params) {
    if (p.tensor.device() == comm_device || is_deferred(p.tensor)) continue;  // deferred: made on comm_device
    std::ostringstream os;
    os << "parameter '" << p.name << "' is on " << p.tensor.device() << " but the " << world.backend_name()
       << " backend works on " << comm_device << "; move the model there first";
    return os.str();
  }
  return "";
}

// Collective: every rank's options and model against rank 0's; then this
// rank's configuration error or misplaced parameter, the same on every rank.
void agree_on_model(World& world, const ShardOptions& options, const ModelWalk& found, const Config& config) {
  const std::string misplaced = misplaced_parameter(world, found.params);
  std::ostringstream desc;
  desc << describe_options(option_values(options));
  for (const auto& p : found.params) desc << param_line(p, found.units) << "\n";
  for (const auto& [name, b] : found.buffers)
    desc << "buffer '" << name << "' " << c10::toString(b.scalar_type()) << b.sizes() << "\n";
  if (!misplaced.empty()) desc << misplaced << "\n";
  if (world.size() > 1) check_same_model_everywhere(world, desc.str());
  if (config.error) std::rethrow_exception(config.error);
  SHARDTORCH_CHECK(misplaced.empty(), "shardtorch::shard: rank ", world.global_rank(), ": ", misplaced);
}

// The bytes of the parameters of each of found.units, then of those outside every unit.
std::vector<int64_t> param_bytes_by_unit(const ModelWalk& found) {
  std::vector<int64_t> bytes(found.units.size() + 1, 0);
  for (const auto& p : found.params) {
    const size_t at = p.unit >= 0 && static_cast<size_t>(p.unit) < found.units.size() ? static_cast<size_t>(p.unit)
                                                                                      : found.units.size();
    bytes[at] += p.tensor.numel() * static_cast<int64_t>(p.tensor.element_size());
  }
  return bytes;
}

// NoShard: every parameter whole, gradients all-reduced in buckets; a root
// unit only applies the mixed-precision casts of the root's inputs and output.
void shard_replicated(torch::nn::Module& root, World& world, ModelWalk& found, const std::vector<bool>& checkpointed,
                      const std::shared_ptr<detail::ShardState>& state, const std::unordered_set<const void*>& keep) {
  const c10::Device comm_device = world.comm().device();
  // A deferred model is materialised unit by unit, the parameters outside
  // every unit last, so that progress shows.
  const std::vector<int64_t> bytes = param_bytes_by_unit(found);
  const bool outside =
      std::any_of(found.params.begin(), found.params.end(), [](const FoundParam& p) { return p.unit < 0; });
  const int64_t parts = static_cast<int64_t>(found.units.size()) + (outside ? 1 : 0);
  detail::ProgressReporter progress("shard", "units", parts, std::accumulate(bytes.begin(), bytes.end(), int64_t{0}),
                                    state->options().progress());
  for (size_t u = 0; u < found.units.size(); ++u) {
    materialize_params(found.params, static_cast<int>(u), comm_device, world.global_rank());
    progress.advance(1, bytes[u]);
  }
  if (outside) {
    materialize_params(found.params, -1, comm_device, world.global_rank());
    progress.advance(1, bytes.back());
  }
  materialize_buffers(found.buffers, comm_device, world.global_rank());
  progress.finish();
  setup_no_shard(*state, world, found.params, keep);
  state->buffers().setup(world, state->options(), found.buffers, keep);
  if (auto* base = dynamic_cast<UnitBase*>(&root)) {
    auto unit = std::make_shared<detail::Unit>(state, "", /*is_root=*/true, false, /*persistent=*/true);
    unit->gather().mark_persistent_gathered();
    state->units().add(unit);
    detail::ShardState::attach(*base, unit);
  }
  for (const auto& u : found.units) detail::ShardState::attach_no_shard(*u.base, state);
  enable_checkpointing(found.units, checkpointed, state);
}

// The sharded strategies: one Unit per unit module, its parameters laid out
// in FlatParams (one per dtype and requires_grad), this rank's shard kept.
std::vector<std::shared_ptr<detail::Unit>> make_units(World& world, const ModelWalk& found, bool root_is_unit,
                                                      int shard_size, const std::shared_ptr<detail::ShardState>& state,
                                                      const std::unordered_set<const void*>& keep) {
  const ShardOptions& options = state->options();
  const auto& mp = options.mixed_precision();
  const auto& units = found.units;
  const c10::Device comm_device = world.comm().device();
  const Strategy strategy = options.strategy();
  const bool persistent = strategy == Strategy::ShardGradOp || strategy == Strategy::OptimizerOnly;
  Comm& shard_comm = state->topology().shard_comm();
  std::vector<std::shared_ptr<detail::Unit>> made;
  const std::vector<int64_t> unit_bytes = param_bytes_by_unit(found);
  detail::ProgressReporter progress("shard", "units", static_cast<int64_t>(units.size()),
                                    std::accumulate(unit_bytes.begin(), unit_bytes.end() - 1, int64_t{0}),
                                    options.progress());
  for (size_t u = 0; u < units.size(); ++u) {
    bool is_root = root_is_unit && u == 0;
    auto unit = std::make_shared<detail::Unit>(state, units[u].name, is_root,
                                               options.reshard_after_forward_of(units[u].name), persistent);
    // A deferred unit is made whole here, each parameter given its values
    // straight into its flat parameter's full buffer (FlatParam), sliced and
    // freed: one unit in full at a time, plus one parameter being replayed.
    for (auto& members : flat_groups(found.params, static_cast<int>(u), {}, keep)) {
      const at::ScalarType dtype = members.front()->tensor.scalar_type();
      const bool kept = keep.count(members.front()->tensor.unsafeGetTensorImpl()) > 0;
      std::vector<at::Tensor> ts;
      std::vector<std::string> names;
      for (const auto* p : members) {
        ts.push_back(p->tensor);
        names.push_back(p->name);
      }
      auto flat = std::make_unique<FlatParam>(std::move(ts), std::move(names), shard_size, shard_comm.rank(),
                                              &state->mem(), persistent, comm_device);
      if (options.sync_module_states() && world.size() > 1) {
        world.comm().broadcast(flat->buffer().tensor(), 0, "parameters of unit '" + unit->label() + "' at shard()");
        flat->write_back_shard();
      }
      if (mp.param_dtype() && at::isFloatingType(dtype) && !kept) {
        flat->set_mixed_precision(*mp.param_dtype(), mp.reduce_dtype().value_or(*mp.param_dtype()));
      }
      if (auto* off = state->copies().offloader()) flat->host().offload_shard(off->pin());
      flat->buffer().set_access_error(unit->gather().sharded_access_error(*flat));
      flat->buffer().free();
      unit->flats().push_back(std::move(flat));
    }
    if (persistent) unit->gather().mark_persistent_gathered();
    unit->register_grad_hooks();
    state->units().add(unit);
    made.push_back(unit);
    progress.advance(1, unit_bytes[u]);
  }
  progress.finish();
  return made;
}

}  // namespace

ShardedModel shard(torch::nn::Module& root, std::shared_ptr<World> world, ShardOptions options) {
  SHARDTORCH_CHECK(world, "shardtorch::shard: no world");
  // Its tensors would be deferred too: the collectives below would read meta memory.
  SHARDTORCH_CHECK(!detail::deferred_init_live(), "shardtorch::shard: rank ", world->global_rank(),
                   ": called while a shardtorch::DeferredInit lives on this thread; end the guard's scope first "
                   "(construct the model inside it, shard after it: docs/large-models.md)");
  SHARDTORCH_CHECK(!detail::lookup_model(root), "shardtorch::shard: rank ", world->global_rank(),
                   ": this model is already "
                   "sharded; shard() was called twice (build a new model to shard it again)");
  if (auto split = detail::first_split(root)) {
    // Another rank of the tensor-parallel group in `world` would average
    // gradients of other slices into this one's, and sync_module_states would
    // copy its slices over this rank's.
    const World& tp = *split->second.group;
    for (int r = 0; r < world->size(); ++r)
      for (int t = 0; t < tp.size(); ++t)
        SHARDTORCH_CHECK(
            world->global_rank_of(r) == world->global_rank() || world->global_rank_of(r) != tp.global_rank_of(t),
            detail::rank_prefix(world->global_rank()), ": shardtorch::shard: the model is split over a ",
            "tensor-parallel group of ", tp.size(), " ranks ('", split->first,
            "' among its parameters), and the World to shard it over holds rank ", world->global_rank_of(r),
            " of that group too (the ranks of a data-parallel World must hold the same slices): shard it over "
            "the mesh's data-parallel dimension (shard(model, (*mesh)[\"dp\"]); a mesh {dp 1, tp N} for "
            "tensor parallelism alone), never over the World the tensor-parallel group was made from");
  }
  world->note_progress("shard()");
  const Strategy strategy = options.strategy();
  ModelWalk found = walk_model(root, /*allow_sharded=*/false);
  const bool root_is_unit = dynamic_cast<UnitBase*>(&root) != nullptr;
  const Config config = check_config(options, *world, found, root_is_unit);
  agree_on_model(*world, options, found, config);

  auto state = std::make_shared<detail::ShardState>(world, options);
  // Kept in their dtype under mixed precision (batch norm's).
  const auto& mp = options.mixed_precision();
  const auto keep = mp.keep_batch_norm_fp32() && (mp.param_dtype() || mp.buffer_dtype())
                        ? batch_norm_tensors(root)
                        : std::unordered_set<const void*>{};
  if (strategy == Strategy::NoShard) {
    shard_replicated(root, *world, found, config.checkpointed, state, keep);
    detail::register_model(root, state, /*owned=*/root_is_unit);  // the root's Unit owns it; units hold it weakly
    detail::collective_context(*world).setup_done();
    world->note_progress("shard() done");
    return ShardedModel(state);
  }

  std::vector<std::string> orphans;
  for (const auto& p : found.params)
    if (p.unit < 0) orphans.push_back(p.name);
  SHARDTORCH_CHECK(orphans.empty(), detail::rank_prefix(world->global_rank()), ": shardtorch::shard: ", orphans.size(),
                   " parameter(s) belong to no unit (first: '", orphans.front(),
                   "') and the root module is not a unit; declare the root as shardtorch::Sharded<Impl> "
                   "(see docs/api.md)");
  SHARDTORCH_CHECK(!found.units.empty(), detail::rank_prefix(world->global_rank()),
                   ": shardtorch::shard: the model has no unit; mark modules with shardtorch::Sharded<Impl>");

  state->topology().build(strategy, config.shard_size);
  if (options.cpu_offload()) state->copies().enable_offload(world->comm().device());
  auto made = make_units(*world, found, root_is_unit, config.shard_size, state, keep);
  materialize_buffers(found.buffers, world->comm().device(), world->global_rank());
  state->buffers().setup(*world, options, found.buffers, keep);
  for (size_t u = 0; u < found.units.size(); ++u) detail::ShardState::attach(*found.units[u].base, made[u]);
  enable_checkpointing(found.units, config.checkpointed, state, made);
  detail::register_model(root, state, /*owned=*/true);
  detail::collective_context(*world).setup_done();
  world->note_progress("shard() done");
  return ShardedModel(state);
}

ShardedModel sharded_model(torch::nn::Module& root) {
  return ShardedModel(detail::require_state(root, "sharded_model"));
}

// ---------------------------------------------------------------- ShardedModel

Strategy parse_strategy(const std::string& name) {
  std::string n;
  for (char c : name) n += (c == '-') ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (n == "full_shard" || n == "fullshard" || n == "zero3") return Strategy::FullShard;
  if (n == "shard_grad_op" || n == "shardgradop" || n == "zero2") return Strategy::ShardGradOp;
  if (n == "optimizer_only" || n == "optimizeronly" || n == "zero1") return Strategy::OptimizerOnly;
  if (n == "no_shard" || n == "noshard" || n == "ddp") return Strategy::NoShard;
  if (n == "hybrid_shard" || n == "hybridshard" || n == "hybrid") return Strategy::HybridShard;
  SHARDTORCH_CHECK(false, "shardtorch: unknown strategy '", name,
                   "'; expected one of full_shard (zero3), shard_grad_op (zero2), optimizer_only (zero1), "
                   "no_shard (ddp), hybrid_shard");
}

const char* strategy_name(Strategy s) {
  switch (s) {
    case Strategy::FullShard:
      return "full_shard";
    case Strategy::ShardGradOp:
      return "shard_grad_op";
    case Strategy::OptimizerOnly:
      return "optimizer_only";
    case Strategy::NoShard:
      return "no_shard";
    case Strategy::HybridShard:
      return "hybrid_shard";
  }
  return "?";
}

const World& ShardedModel::world() const { return state_->world(); }
Strategy ShardedModel::strategy() const { return state_->options().strategy(); }
void ShardedModel::set_requires_gradient_sync(bool sync) { state_->backward().set_sync(sync); }
bool ShardedModel::requires_gradient_sync() const { return state_->backward().sync(); }
ShardedModel::NoSync::NoSync(std::shared_ptr<detail::ShardState> s)
    : state_(std::move(s)), previous_(state_->backward().sync()) {
  state_->backward().set_sync(false);
}
ShardedModel::NoSync::~NoSync() {
  if (state_) state_->backward().set_sync(previous_);
}
ShardedModel::NoSync ShardedModel::no_sync() { return NoSync(state_); }
ShardStats ShardedModel::stats() const {
  ShardStats s;
  s.gradient_reductions = state_->path().reducer().reductions();
  s.reductions_deferred = state_->order().reductions_deferred();
  s.reduce_scatters_overlapped = state_->path().sharded().bucketer().launches().counts().while_in_flight;
  s.reduce_scatters_past_the_limit = state_->path().sharded().bucketer().launches().counts().past_limit;
  s.buckets_launched_during_backward =
      state_->path().replicated() ? state_->path().replicated()->bucketer().launched_during_backward() : 0;
  if (const auto* off = state_->copies().offloader()) s.offload = {off->bytes_to_device(), off->bytes_to_host()};
  return s;
}
void ShardedModel::register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook) {
  const int rank = state_->world().global_rank();
  SHARDTORCH_CHECK(hook, detail::rank_prefix(rank), ": register_comm_hook: the hook is null");
  SHARDTORCH_CHECK(!state_->path().reducer().comm_hook(), detail::rank_prefix(rank),
                   ": register_comm_hook: this model has a communication hook already (one per model, as under DDP)");
  state_->backward().check_finished("register_comm_hook");
  state_->path().reducer().set_comm_hook(std::move(hook));
}

c10::intrusive_ptr<c10d::Backend> ShardedModel::comm_hook_group() const {
  switch (state_->options().strategy()) {
    case Strategy::NoShard:
      return state_->world().comm().backend();
    case Strategy::HybridShard: {
      Comm* replicas = state_->topology().replica_comm();
      return replicas && replicas->size() > 1 ? replicas->backend() : c10::intrusive_ptr<c10d::Backend>();
    }
    default:
      return {};
  }
}

MemorySnapshot ShardedModel::memory() const {
  MemorySnapshot m = state_->mem().snapshot();
  m.rank = state_->world().global_rank();
  return m;
}
void ShardedModel::reset_peak_memory() { state_->mem().reset_peaks(); }
CommStats ShardedModel::comm_stats() const {
  CommStats stats = state_->topology().stats();
  stats.comm_hook = state_->path().reducer().hook_stats();
  return stats;
}

std::vector<UnitInfo> ShardedModel::units() const {
  std::vector<UnitInfo> out;
  if (state_->path().replicated()) return out;  // NoShard has no units
  for (auto& u : state_->units().all()) {
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
