#include "shardtorch/deferred.h"
#include "deferred/deferred_session.h"
#include "base/check.h"
#include "base/env.h"

// Deferred construction (docs/large-models.md has the design).
//
// A DeferredInit puts DispatchKey::DeferredInit (the out-of-core key PyTorch
// reserves for deferred module initialisation; nothing in LibTorch registers a
// kernel for it) into the thread's included dispatch keys, and this file
// registers a boxed fallback for it. The key sits above autograd and
// BackendSelect, so every operator reaches the fallback first:
// - a factory (no tensor argument, a `device` argument) runs with its device
//   replaced by meta; the result becomes a deferred tensor: a TensorImpl over
//   the meta storage whose key set carries DeferredInit (so that operators on
//   it reach the fallback after the guard is gone too) and whose BackendMeta
//   names its session and its id;
// - an operator with deferred arguments runs on the meta device (key
//   excluded, below autograd) and is recorded: its arguments (deferred ones
//   by id), the deferred tensors it returned, the storages it wrote to
//   (schema alias annotations), and for a random operator its place in the
//   chain of its generator;
// - anything else runs as usual.
// Replay (materialize) runs, in recorded order, the operators the asked-for
// tensors depend on: their creators, the writers of their storages, and
// recursively what those read, each writer only if it ran before the reader.
// Random operators get an explicit clone of their generator in the state
// eager construction would have given them: each generator's chain starts
// from a clone taken at its first recorded use and advances through the
// chain's operators in order; an operator passed over (not needed yet) is
// run on an empty tensor of its shape for its draws only, and the state
// before it is kept for when it is needed.
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <climits>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace shardtorch {

namespace detail {

namespace {

constexpr auto kKey = c10::DispatchKey::DeferredInit;

// Where a deferred tensor sits in an operator's arguments (elem -1: the
// argument itself, else the index in a tensor list).
struct FakeRef {
  int arg;
  int elem;
  int64_t id;
};

struct RecordedOp {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;  // as called; deferred tensors replaced by meta stand-ins
  std::vector<FakeRef> fakes;     // the deferred arguments
  std::vector<FakeRef> outputs;   // the deferred tensors returned (arg: return index)
  int gen_arg = -1;               // index of the Generator? argument of a random operator
  int chain = -1;
  size_t chain_pos = 0;
  std::optional<at::Generator> before;  // the chain's state before this operator, once known
};

struct FakeInfo {
  int creator;         // the operator that returned it
  int64_t storage;     // storage id: views share their base's
  c10::Device device;  // asked for at construction
  std::string name;    // "" until named
  std::string shape;
  int64_t source = -1;  // the first deferred argument of its creator, if any
  bool zeros = false;   // skip_deferred_init: materialised as zeros, not replayed
};

struct Chain {
  at::Generator cursor;  // state after ops[next - 1]
  std::vector<int> ops;
  size_t next = 0;
};

thread_local std::shared_ptr<DeferredSession> tls_session;

at::Generator clone_generator(at::Generator g) {
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.clone();
}

std::string rank_text() {
  const auto rank = launcher_rank();
  return rank ? "rank " + std::to_string(*rank) + ": " : "";
}

// Operators that return something other than tensors from metadata alone
// (shapes, dtypes, flags): they run on the meta device, unrecorded.
bool metadata_only(const c10::FunctionSchema& s) {
  static const std::set<std::string> names = {"aten::_has_compatible_shallow_copy_type",
                                              "aten::is_same_size",
                                              "aten::size",
                                              "aten::stride",
                                              "aten::numel",
                                              "aten::sym_size",
                                              "aten::sym_stride",
                                              "aten::sym_numel",
                                              "aten::sym_storage_offset",
                                              "aten::dim",
                                              "aten::is_complex",
                                              "aten::is_floating_point",
                                              "aten::is_signed",
                                              "aten::is_conj",
                                              "aten::is_neg",
                                              "aten::is_inference",
                                              "aten::_is_zerotensor",
                                              "aten::result_type",
                                              "aten::can_cast",
                                              "aten::promote_types",
                                              "aten::output_nr",
                                              "aten::_version",
                                              "aten::is_leaf",
                                              "aten::retains_grad",
                                              "aten::is_contiguous",
                                              "aten::is_non_overlapping_and_dense",
                                              "aten::is_set_to",
                                              "aten::is_pinned",
                                              "aten::storage_offset"};
  return names.count(s.name()) > 0;
}

// Random operators without a Generator argument (they draw from the default
// generator inside): they are decomposed, so that the random operator they
// call (normal_, uniform_, ... with a Generator argument) is what is recorded.
bool random_without_generator(const c10::FunctionSchema& s) {
  static const std::set<std::string> names = {
      "aten::rand",          "aten::randn",           "aten::randint",       "aten::randperm",
      "aten::rand_like",     "aten::randn_like",      "aten::randint_like",  "aten::dropout",
      "aten::dropout_",      "aten::feature_dropout", "aten::alpha_dropout", "aten::feature_alpha_dropout",
      "aten::native_dropout"};
  return names.count(s.name()) > 0;
}

bool returns_only_tensors(const c10::FunctionSchema& s) {
  for (const auto& r : s.returns()) {
    const auto& t = r.type();
    if (t->isSubtypeOf(*c10::TensorType::get()) || t->isSubtypeOf(*c10::ListType::ofTensors()) ||
        t->isSubtypeOf(*c10::OptionalType::ofTensor()))
      continue;
    return false;
  }
  return true;
}

int generator_arg(const c10::FunctionSchema& s) {
  const auto& args = s.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    c10::TypePtr t = args[i].type();
    if (auto o = t->cast<c10::OptionalType>()) t = o->getElementType();
    if (t->kind() == c10::TypeKind::GeneratorType) return static_cast<int>(i);
  }
  return -1;
}

// Calls f(elem, tensor) for every defined tensor in an argument.
template <class F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    if (v.toTensor().defined()) f(-1, v.toTensor());
  } else if (v.isTensorList()) {
    auto l = v.toTensorList();
    for (size_t j = 0; j < l.size(); ++j) {
      at::Tensor t = l.get(j);
      if (t.defined()) f(static_cast<int>(j), t);
    }
  } else if (v.isList()) {
    auto l = v.toList();
    for (size_t j = 0; j < l.size(); ++j) {
      c10::IValue e = l.get(j);
      if (e.isTensor() && e.toTensor().defined()) f(static_cast<int>(j), e.toTensor());
    }
  }
}

// Replaces one tensor of an argument (lists are copied: they are shared).
void replace_tensor(c10::IValue& v, int elem, const at::Tensor& t) {
  if (elem < 0) {
    v = t;
  } else if (v.isTensorList()) {
    auto l = v.toTensorList().copy();
    l.set(elem, t);
    v = l;
  } else {
    auto l = v.toList().copy();
    l.set(elem, t);
    v = l;
  }
}

at::Tensor meta_standin(const at::Tensor& t) {
  c10::impl::ExcludeDispatchKeyGuard no_record(kKey);
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream os;
  os << c10::toString(t.scalar_type()) << t.sizes();
  return os.str();
}

}  // namespace

struct DeferredMeta : c10::BackendMeta {
  DeferredMeta(std::shared_ptr<DeferredSession> s, int64_t i) : session(std::move(s)), id(i) {}
  std::shared_ptr<DeferredSession> session;
  int64_t id;
  std::function<at::Tensor(const at::Tensor&)> take;  // defer_part: the part of the value the tensor is
};

// The value of the deferred tensor `m` describes, from its construction's `v`.
at::Tensor part_of(const DeferredMeta& m, at::Tensor v) { return m.take ? m.take(v) : v; }

DeferredMeta* meta_of(const at::Tensor& t) {
  if (!t.defined() || !t.key_set().has(kKey)) return nullptr;
  return dynamic_cast<DeferredMeta*>(t.unsafeGetTensorImpl()->get_backend_meta());
}

class DeferredSession : public std::enable_shared_from_this<DeferredSession> {
 public:
  std::recursive_mutex mu;
  std::vector<RecordedOp> ops;
  std::vector<FakeInfo> fakes;
  std::vector<std::vector<int>> writers;  // by storage id, in recorded order
  std::vector<Chain> chains;
  std::map<std::pair<int, int>, int> default_chains;
  std::map<const c10::GeneratorImpl*, int> explicit_chains;

  std::string describe(int64_t id) const {
    const auto& f = fakes.at(id);
    if (!f.name.empty()) return "parameter or buffer '" + f.name + "' (" + f.shape + ")";
    if (f.source >= 0 && f.source != id)
      return "a tensor " + f.shape + " computed by " + ops.at(f.creator).op.schema().name() + " from " +
             describe(f.source);
    return "a deferred tensor " + f.shape + " (not yet named: shard() and shardtorch::deferred() name them)";
  }

  int chain_of(const c10::IValue& explicit_gen, c10::Device device) {
    if (!explicit_gen.isNone()) {
      at::Generator g = explicit_gen.toGenerator();
      auto it = explicit_chains.find(g.unsafeGetGeneratorImpl());
      if (it != explicit_chains.end()) return it->second;
      chains.push_back(Chain{clone_generator(g), {}, 0});
      explicit_chains[g.unsafeGetGeneratorImpl()] = static_cast<int>(chains.size()) - 1;
      return static_cast<int>(chains.size()) - 1;
    }
    auto key = std::make_pair(static_cast<int>(device.type()), static_cast<int>(device.index()));
    auto it = default_chains.find(key);
    if (it != default_chains.end()) return it->second;
    chains.push_back(Chain{clone_generator(at::globalContext().defaultGenerator(device)), {}, 0});
    default_chains[key] = static_cast<int>(chains.size()) - 1;
    return static_cast<int>(chains.size()) - 1;
  }

  // Makes `t` (a meta tensor an operator returned) a deferred tensor created
  // by operator `op`; `inputs` are the operator's deferred arguments.
  at::Tensor adopt(const at::Tensor& t, int op, const std::vector<std::pair<at::Tensor, int64_t>>& inputs,
                   c10::Device device, int64_t& id) {
    for (const auto& [in, in_id] : inputs) {
      if (in.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {  // returned as it is (in-place)
        id = in_id;
        return t;
      }
    }
    int64_t storage = -1;
    for (const auto& [in, in_id] : inputs)
      if (in.has_storage() && t.has_storage() &&
          in.storage().unsafeGetStorageImpl() == t.storage().unsafeGetStorageImpl())
        storage = fakes[in_id].storage;
    const bool new_storage = storage < 0;
    if (new_storage) {
      storage = static_cast<int64_t>(writers.size());
      writers.emplace_back();
    }
    id = static_cast<int64_t>(fakes.size());
    fakes.push_back(FakeInfo{op, storage, device, "", shape_of(t), inputs.empty() ? -1 : inputs.front().second});
    at::Tensor out = t;
    if (!t.key_set().has(kKey)) {  // a new meta tensor: give it the key (views of a deferred tensor have it)
      out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set().add(kKey), t.dtype());
      out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
    }
    out.unsafeGetTensorImpl()->set_backend_meta(c10::make_intrusive<DeferredMeta>(shared_from_this(), id));
    return out;
  }

  at::Generator generator_for(int o) {
    auto& r = ops[o];
    if (r.before) return clone_generator(*r.before);
    auto& ch = chains[r.chain];
    while (ch.next < r.chain_pos) {
      const int q = ch.ops[ch.next];
      ops[q].before = clone_generator(ch.cursor);
      draw_only(q, ch.cursor);
      ++ch.next;
    }
    r.before = clone_generator(ch.cursor);
    ++ch.next;
    return ch.cursor;  // running the operator advances the chain past it
  }

  // Runs a random operator not needed now on empty tensors of its
  // arguments' shapes, for the generator's draws only (they depend on the
  // shapes, not on the values).
  void draw_only(int q, const at::Generator& gen) {
    const auto& r = ops[q];
    torch::jit::Stack st = r.args;
    for (const auto& f : r.fakes) {
      at::Tensor standin = f.elem < 0 ? st[f.arg].toTensor()
                                      : (st[f.arg].isTensorList() ? at::Tensor(st[f.arg].toTensorList().get(f.elem))
                                                                  : st[f.arg].toList().get(f.elem).toTensor());
      at::Tensor t = at::zeros(standin.sizes(), standin.options().device(fakes[f.id].device));
      replace_tensor(st[f.arg], f.elem, t);
    }
    st[r.gen_arg] = gen;
    r.op.callBoxed(st);
  }

  // The values of deferred tensors `ids`, replayed together.
  std::unordered_map<int64_t, at::Tensor> replay(const std::vector<int64_t>& ids) {
    std::lock_guard<std::recursive_mutex> lock(mu);
    std::vector<char> need(ops.size(), 0);
    std::vector<std::pair<int64_t, int>> work;
    for (int64_t id : ids) work.emplace_back(id, INT_MAX);
    auto add = [&](int o) {
      if (need[o]) return;
      need[o] = 1;
      for (const auto& f : ops[o].fakes) work.emplace_back(f.id, o);
    };
    while (!work.empty()) {
      auto [id, bound] = work.back();
      work.pop_back();
      const auto& f = fakes.at(id);
      add(f.creator);
      for (int w : writers[f.storage]) {
        if (w >= bound) break;
        add(w);
      }
    }
    std::unordered_map<int64_t, at::Tensor> env;
    c10::NoGradGuard no_grad;
    for (size_t o = 0; o < ops.size(); ++o) {
      if (!need[o]) continue;
      auto& r = ops[o];
      torch::jit::Stack st = r.args;
      for (const auto& f : r.fakes) replace_tensor(st[f.arg], f.elem, env.at(f.id));
      if (r.gen_arg >= 0) st[r.gen_arg] = generator_for(static_cast<int>(o));
      try {
        r.op.callBoxed(st);
      } catch (const c10::Error& e) {
        SHARDTORCH_CHECK(false, "shardtorch: replaying ", r.op.schema().name(),
                         " recorded at deferred construction failed: ", e.what_without_backtrace());
      }
      for (const auto& out : r.outputs) {
        const c10::IValue& v = st.at(out.arg);
        env[out.id] = out.elem < 0 ? v.toTensor()
                                   : (v.isTensorList() ? at::Tensor(v.toTensorList().get(out.elem))
                                                       : v.toList().get(out.elem).toTensor());
      }
    }
    std::unordered_map<int64_t, at::Tensor> out;
    for (int64_t id : ids) out[id] = env.at(id);
    return out;
  }
};

namespace {

void run_meta(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_record(kKey);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  op.callBoxed(stack);
}

[[noreturn]] void cannot_read(const DeferredSession& s, int64_t id, const c10::OperatorHandle& op, bool constructing) {
  std::ostringstream os;
  os << "shardtorch: " << rank_text() << s.describe(id) << " is deferred (constructed under shardtorch::DeferredInit) "
     << "and has no values until shard() or shardtorch::materialize() gives it some, but " << op.schema().name()
     << " reads them";
  if (constructing)
    os << " during deferred construction. A module that reads a tensor's values in its constructor (.item(), a "
          "comparison, a value copied to the host) cannot be constructed deferred; construct it eagerly, or move "
          "that code after shard()";
  else
    os << ". Call shardtorch::shard() (or shardtorch::materialize()) before using the model (a forward before "
          "shard()?)";
  SHARDTORCH_CHECK(false, os.str());
  throw std::logic_error("unreachable");
}

// A deferred tensor among an op's arguments: where it is, and its record.
struct Seen {
  int arg, elem;
  at::Tensor t;
  DeferredMeta* m;
};

// Runs `op` on the meta device in place of its kernel: devices become meta,
// real tensors meta stand-ins; a copy to another device (`to`) that the meta
// run returned as its input becomes a new tensor with a storage of its own.
// `original`: the arguments as called.
void run_on_meta(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t base,
                 const std::vector<c10::IValue>& original, const std::vector<Seen>& fakes,
                 const std::vector<std::pair<int, int>>& reals, const DeferredSession& s, c10::Device device) {
  const auto& schema = op.schema();
  const auto device_arg = schema.argumentIndexWithName("device");
  if (device_arg) (*stack)[base + *device_arg] = c10::Device(c10::kMeta);
  if (auto pin = schema.argumentIndexWithName("pin_memory")) (*stack)[base + *pin] = c10::IValue();
  for (const auto& [arg, elem] : reals) {
    c10::IValue& v = (*stack)[base + arg];
    at::Tensor t = elem < 0
                       ? v.toTensor()
                       : (v.isTensorList() ? at::Tensor(v.toTensorList().get(elem)) : v.toList().get(elem).toTensor());
    if (!t.is_meta()) replace_tensor(v, elem, meta_standin(t));
  }
  run_meta(op, stack);
  const bool moves = device_arg && !(original[*device_arg].isNone()) && !fakes.empty();
  if (!moves) return;
  const size_t nret = schema.returns().size();
  const size_t rbase = stack->size() - nret;
  for (size_t k = 0; k < nret; ++k) {
    c10::IValue& v = (*stack)[rbase + k];
    if (!v.isTensor()) continue;
    for (const auto& f : fakes)
      if (v.toTensor().unsafeGetTensorImpl() == f.t.unsafeGetTensorImpl() && s.fakes.at(f.m->id).device != device) {
        v = meta_standin(v.toTensor());
        break;
      }
  }
}

// Records the op that just ran on meta: its arguments (deferred ones as
// stand-ins), its outputs adopted as new deferred tensors on `device`, the
// storages it writes, and its place in a random generator's chain.
void record_op(const c10::OperatorHandle& op, torch::jit::Stack* stack, std::vector<c10::IValue> original,
               const std::vector<Seen>& fakes, DeferredSession& s, c10::Device device) {
  const auto& schema = op.schema();
  const size_t nret = schema.returns().size();
  const size_t rbase = stack->size() - nret;
  const int idx = static_cast<int>(s.ops.size());
  RecordedOp rec{op, std::move(original), {}, {}, -1, -1, 0, std::nullopt};
  std::vector<std::pair<at::Tensor, int64_t>> inputs;
  for (const auto& f : fakes) {
    rec.fakes.push_back({f.arg, f.elem, f.m->id});
    replace_tensor(rec.args[f.arg], f.elem, meta_standin(f.t));
    inputs.emplace_back(f.t, f.m->id);
  }
  for (size_t k = 0; k < nret; ++k) {
    c10::IValue& v = (*stack)[rbase + k];
    if (v.isTensor()) {
      if (!v.toTensor().defined()) continue;
      int64_t id;
      v = s.adopt(v.toTensor(), idx, inputs, device, id);
      rec.outputs.push_back({static_cast<int>(k), -1, id});
    } else if (v.isTensorList()) {
      auto l = v.toTensorList().copy();
      for (size_t j = 0; j < l.size(); ++j) {
        int64_t id;
        l.set(j, s.adopt(l.get(j), idx, inputs, device, id));
        rec.outputs.push_back({static_cast<int>(k), static_cast<int>(j), id});
      }
      v = l;
    }
  }
  const auto& sargs = schema.arguments();
  for (const auto& f : fakes) {
    const auto* alias = sargs[f.arg].alias_info();
    if (alias && alias->isWrite()) s.writers[s.fakes[f.m->id].storage].push_back(idx);
  }
  if (int g = generator_arg(schema); g >= 0) {
    rec.gen_arg = g;
    rec.chain = s.chain_of(rec.args[g], device);
    rec.chain_pos = s.chains[rec.chain].ops.size();
    s.chains[rec.chain].ops.push_back(idx);
  }
  s.ops.push_back(std::move(rec));
}

void deferred_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  if (random_without_generator(schema)) {  // its kernel's own calls come back here, one by one
    op.redispatchBoxed(ks.remove(kKey), stack);
    return;
  }
  const size_t n = schema.arguments().size();
  const size_t base = stack->size() - n;
  std::vector<Seen> fakes;
  std::vector<std::pair<int, int>> reals;
  for (size_t i = 0; i < n; ++i) {
    for_each_tensor((*stack)[base + i], [&](int elem, const at::Tensor& t) {
      if (auto* m = meta_of(t))
        fakes.push_back({static_cast<int>(i), elem, t, m});
      else
        reals.emplace_back(static_cast<int>(i), elem);
    });
  }
  std::shared_ptr<DeferredSession> recording = tls_session;
  const auto device_arg = schema.argumentIndexWithName("device");
  std::shared_ptr<DeferredSession> s;
  if (fakes.empty()) {
    const bool factory =
        recording && device_arg && reals.empty() && !schema.returns().empty() && returns_only_tensors(schema);
    if (!factory) {
      c10::impl::ExcludeDispatchKeyGuard no_record(kKey);
      op.callBoxed(stack);
      return;
    }
    s = recording;
  } else {
    s = fakes.front().m->session;
    for (const auto& f : fakes)
      SHARDTORCH_CHECK(f.m->session == s, "shardtorch: ", schema.name(),
                       " mixes deferred tensors of two DeferredInit "
                       "sessions (",
                       s->describe(fakes.front().m->id), " and ", f.m->session->describe(f.m->id), ")");
    if (metadata_only(schema)) {
      c10::impl::ExcludeDispatchKeyGuard no_record(kKey);
      op.callBoxed(stack);
      return;
    }
    if (!returns_only_tensors(schema)) cannot_read(*s, fakes.front().m->id, op, static_cast<bool>(recording));
    if (!recording && !reals.empty()) cannot_read(*s, fakes.front().m->id, op, false);
  }
  std::lock_guard<std::recursive_mutex> lock(s->mu);
  std::vector<c10::IValue> original(stack->begin() + base, stack->end());
  std::optional<c10::Device> device;
  if (device_arg && !(*stack)[base + *device_arg].isNone()) device = (*stack)[base + *device_arg].toDevice();
  if (!device) device = fakes.empty() ? c10::Device(c10::kCPU) : s->fakes[fakes.front().m->id].device;
  run_on_meta(op, stack, base, original, fakes, reals, *s, *device);
  record_op(op, stack, std::move(original), fakes, *s, *device);
}

}  // namespace

bool deferred_init_live() { return tls_session != nullptr; }

void materialize_tensors(const std::vector<at::Tensor>& tensors, const std::vector<std::string>& names,
                         std::optional<c10::Device> device, int rank) {
  SHARDTORCH_CHECK(!tls_session, "shardtorch: ", rank >= 0 ? "rank " + std::to_string(rank) + ": " : rank_text(),
                   "deferred tensors cannot be materialised (shard(), materialize()) while a shardtorch::DeferredInit "
                   "lives on this thread; end the guard's scope first");
  std::map<DeferredSession*, std::vector<size_t>> by_session;
  for (size_t i = 0; i < tensors.size(); ++i)
    if (auto* m = meta_of(tensors[i])) by_session[m->session.get()].push_back(i);
  for (auto& [sp, which] : by_session) {
    std::shared_ptr<DeferredSession> s = meta_of(tensors[which.front()])->session;  // alive while we work
    std::vector<int64_t> ids;
    {
      std::lock_guard<std::recursive_mutex> lock(s->mu);
      for (size_t i : which) {
        const int64_t id = meta_of(tensors[i])->id;
        if (i < names.size() && !names[i].empty() && s->fakes[id].name.empty()) s->fakes[id].name = names[i];
        ids.push_back(id);
      }
    }
    std::vector<int64_t> to_replay;
    std::unordered_map<int64_t, at::Tensor> values;
    for (size_t k = 0; k < which.size(); ++k) {
      const at::Tensor& t = tensors[which[k]];
      if (s->fakes[ids[k]].zeros)
        values[ids[k]] = at::zeros(t.sizes(), t.options().device(device.value_or(s->fakes[ids[k]].device)));
      else
        to_replay.push_back(ids[k]);
    }
    if (!to_replay.empty())
      for (auto& [id, v] : s->replay(to_replay)) values[id] = std::move(v);
    for (size_t k = 0; k < which.size(); ++k) {
      const at::Tensor& t = tensors[which[k]];
      at::Tensor real = values.at(ids[k]);
      if (!s->fakes[ids[k]].zeros) real = part_of(*meta_of(t), real);
      const c10::Device target = device.value_or(real.device());
      if (real.device() != target) {
        real = real.to(target);
      } else if (!real.has_storage() ||
                 real.storage().nbytes() != static_cast<size_t>(real.numel()) * real.element_size() ||
                 !real.is_contiguous()) {
        real = real.clone(at::MemoryFormat::Contiguous);  // a view of something larger: keep its own bytes only
      }
      auto* impl = t.unsafeGetTensorImpl();
      impl->shallow_copy_from(real.getIntrusivePtr());
      impl->set_backend_meta(nullptr);
    }
  }
}

void defer_part(const at::Tensor& t, c10::IntArrayRef shape, std::function<at::Tensor(const at::Tensor&)> take) {
  auto* m = meta_of(t);
  SHARDTORCH_CHECK(m, "shardtorch: internal: defer_part of a tensor that is not deferred");
  if (m->take) take = [first = m->take, then = std::move(take)](const at::Tensor& v) { return then(first(v)); };
  m->take = std::move(take);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
}

void materialize_into(const at::Tensor& t, const std::string& name, const at::Tensor& dst, int rank) {
  SHARDTORCH_CHECK(!tls_session, "shardtorch: ", rank >= 0 ? "rank " + std::to_string(rank) + ": " : rank_text(),
                   "deferred tensors cannot be materialised (shard(), materialize()) while a shardtorch::DeferredInit "
                   "lives on this thread; end the guard's scope first");
  auto* m = meta_of(t);
  SHARDTORCH_CHECK(m, "shardtorch: materialize_into: '", name, "' is not deferred");
  SHARDTORCH_CHECK(dst.sizes() == t.sizes() && dst.scalar_type() == t.scalar_type() && dst.is_contiguous(),
                   "shardtorch: materialize_into: '", name, "': the destination does not match the tensor");
  std::shared_ptr<DeferredSession> s = m->session;  // alive while we work
  const int64_t id = m->id;
  bool zeros = false;
  {
    std::lock_guard<std::recursive_mutex> lock(s->mu);
    if (!name.empty() && s->fakes[id].name.empty()) s->fakes[id].name = name;
    zeros = s->fakes[id].zeros;
  }
  {
    c10::NoGradGuard no_grad;
    if (zeros) {
      dst.zero_();
    } else {
      at::Tensor v = part_of(*m, s->replay({id}).at(id));
      dst.copy_(v);
    }
  }
  auto* impl = t.unsafeGetTensorImpl();
  impl->shallow_copy_from(dst.getIntrusivePtr());
  impl->set_backend_meta(nullptr);
}

}  // namespace detail

struct DeferredInit::KeyGuard {
  c10::impl::IncludeDispatchKeyGuard include{detail::kKey};
};

DeferredInit::DeferredInit() : previous_(detail::tls_session) {
  session_ = previous_ ? previous_ : std::make_shared<detail::DeferredSession>();
  detail::tls_session = session_;
  keys_ = std::make_unique<KeyGuard>();
}

DeferredInit::~DeferredInit() {
  keys_.reset();
  detail::tls_session = previous_;
}

int64_t DeferredInit::recorded_ops() const {
  std::lock_guard<std::recursive_mutex> lock(session_->mu);
  return static_cast<int64_t>(session_->ops.size());
}

bool is_deferred(const at::Tensor& t) { return detail::meta_of(t) != nullptr; }

namespace {
// Parameters then buffers, each tensor once, with their names.
std::vector<std::pair<std::string, at::Tensor>> named_tensors(torch::nn::Module& module, const std::string& prefix) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const void*> seen;
  auto join = [&](const std::string& n) { return prefix.empty() ? n : prefix + "." + n; };
  for (const auto& item : module.named_parameters())
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(join(item.key()), item.value());
  for (const auto& item : module.named_buffers())
    if (item.value().defined() && seen.insert(item.value().unsafeGetTensorImpl()).second)
      out.emplace_back(join(item.key()), item.value());
  return out;
}
}  // namespace

void name_deferred(torch::nn::Module& module, const std::string& prefix) {
  for (const auto& [name, t] : named_tensors(module, prefix)) {
    if (auto* m = detail::meta_of(t)) {
      std::lock_guard<std::recursive_mutex> lock(m->session->mu);
      m->session->fakes[m->id].name = name;
    }
  }
}

int64_t skip_deferred_init(torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& [name, t] : named_tensors(module, "")) {
    if (auto* m = detail::meta_of(t)) {
      std::lock_guard<std::recursive_mutex> lock(m->session->mu);
      m->session->fakes[m->id].zeros = true;
      ++n;
    }
  }
  return n;
}

int64_t count_deferred(torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& [name, t] : named_tensors(module, "")) n += is_deferred(t) ? 1 : 0;
  return n;
}

void materialize(torch::nn::Module& module, std::optional<c10::Device> device) {
  std::vector<at::Tensor> ts;
  std::vector<std::string> names;
  for (auto& [name, t] : named_tensors(module, "")) {
    if (!is_deferred(t)) continue;
    ts.push_back(t);
    names.push_back(name);
  }
  detail::materialize_tensors(ts, names, device, -1);
}

}  // namespace shardtorch

TORCH_LIBRARY_IMPL(_, DeferredInit, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&shardtorch::detail::deferred_fallback>());
}
