// PyTorch distributed checkpoints loaded straight into a sharded model: each
// rank reads the chunks, and the byte ranges within them, that overlap what
// it holds; optimizer state in the layout of get_state_dict(model, optim).
#include <c10/core/GradMode.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <memory>
#include <set>
#include <sstream>

#include "checkpoint/agreement.h"
#include "checkpoint/dcp_source.h"
#include "checkpoint/name_mapping.h"
#include "optim/optimizer_state.h"
#include "runtime/shard_state.h"
#include "shardtorch/checkpoint/safetensors.h"
#include "shardtorch/dcp_checkpoint.h"

namespace shardtorch {
namespace {

using checkpoint::SafetensorsError;
namespace dcp = checkpoint::dcp;
using Changes = std::vector<std::function<void()>>;

std::string shape_text(c10::IntArrayRef s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

// The checkpoint's keys sorted by what they are to this model.
struct Keys {
  std::map<std::string, const dcp::Entry*> model;  // model name -> entry
  // (model name, kind) -> entry: "<optimizer_prefix>state.<fqn>.<kind>"
  std::map<std::pair<std::string, std::string>, const dcp::Entry*> optim;
  bool any_optim_state = false;
};

Keys sort_keys(const dcp::Metadata& md, const std::set<std::string>& model_names, const DcpLoadOptions& options,
               bool with_optimizer, DcpLoadReport& report, const std::string& where) {
  Keys keys;
  auto map = [&](const std::string& fqn) {
    return checkpoint::map_checkpoint_name(fqn, options.prefix_rules(), options.map_name());
  };
  auto unexpected = [&](const std::string& key, const std::string& m) {
    if (options.ignore_unexpected()) {
      report.unexpected.push_back(key);
      return;
    }
    std::string hint;
    for (const auto& name : model_names)
      if (checkpoint::ends_with(m, "." + name)) {
        hint = " (the checkpoint's '" + m + "' is the model's '" + name + "' behind a prefix: strip_prefix(\"" +
               m.substr(0, m.size() - name.size()) + "\")?)";
        break;
      }
    throw SafetensorsError(where + ": unexpected tensor '" + key + "'" + (m != key ? " (mapped to '" + m + "')" : "") +
                           ": the model has no parameter or buffer of that name" + hint +
                           " (map the checkpoint's names with DcpLoadOptions().model_prefix/strip_prefix/"
                           "replace_prefix/map_name, skip it by mapping it to nullopt, or pass "
                           "ignore_unexpected(true))");
  };
  const std::string& op = options.optimizer_prefix();
  const std::string& mp = options.model_prefix();
  for (const auto& e : md.entries) {
    const std::string& key = e.name;
    if (!op.empty() && key.rfind(op, 0) == 0) {
      const std::string rest = key.substr(op.size());
      const auto dot = rest.rfind('.');
      if (rest.rfind("state.", 0) != 0 || dot == std::string::npos || dot <= 6) {
        report.ignored.push_back(key);  // param_groups: the optimizer keeps its own options
        continue;
      }
      keys.any_optim_state = true;
      if (!with_optimizer) {
        report.ignored.push_back(key);
        continue;
      }
      auto m = map(rest.substr(6, dot - 6));
      if (!m) {
        report.skipped.push_back(key);
        continue;
      }
      if (!model_names.count(*m)) {
        unexpected(key, *m);
        continue;
      }
      keys.optim[{*m, rest.substr(dot + 1)}] = &e;
      continue;
    }
    if (key.rfind(mp, 0) != 0) {
      report.ignored.push_back(key);
      continue;
    }
    auto m = map(key.substr(mp.size()));
    if (!m) {
      report.skipped.push_back(key);
      continue;
    }
    if (!model_names.count(*m)) {
      unexpected(key, *m);
      continue;
    }
    if (!e.tensor)
      throw SafetensorsError(where + ": '" + key + "' is a pickled value, not a tensor, but the model's '" + *m +
                             "' is a tensor");
    if (!keys.model.emplace(*m, &e).second)
      throw SafetensorsError(where + ": '" + keys.model[*m]->name + "' and '" + key + "' both map to the model's '" +
                             *m + "' (change the name mapping so that at most one does, or skip the other)");
  }
  return keys;
}

// A step count from the checkpoint: a 0-d tensor (float32 in torch's AdamW)
// or a pickled int (older torch).
int64_t read_step(dcp::Source& src, const dcp::Entry& e, const std::string& where) {
  double v = 0;
  if (e.tensor) {
    if (!e.size.empty() && !(e.size.size() == 1 && e.size[0] == 1))
      throw SafetensorsError(where + ": '" + e.name + "' has shape " + shape_text(e.size) + "; a step is one number");
    at::Tensor t = at::empty({1}, at::kDouble);
    dcp::Source::run(src.plan(e, 0, 1), t);
    v = t.item<double>();
  } else {
    const std::string text = dcp::read_value_item(src.file(e.bytes.relative_path), e);
    try {
      size_t used = 0;
      v = std::stod(text, &used);
      if (used != text.size()) throw std::invalid_argument(text);
    } catch (const std::exception&) {
      throw SafetensorsError(where + ": '" + e.name + "' is " + text + ", not a step count");
    }
  }
  if (!(v >= 0) || v != std::floor(v) || v > 9e15)
    throw SafetensorsError(where + ": '" + e.name + "' is " + std::to_string(v) + ", not a step count");
  return static_cast<int64_t>(v);
}

}  // namespace

DcpLoadReport load_dcp_checkpoint(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir,
                                  const DcpLoadOptions& options) {
  auto state = detail::require_state(root, "load_dcp_checkpoint");
  shardtorch::detail::ProgressReporter progress("load_dcp_checkpoint", "tensors", 0, 0, options.progress());
  progress.count_io();
  detail::FileWaits file_waits(*state);
  state->copies().wait_for_offload_copies();
  c10::NoGradGuard no_grad;
  const std::string what = "shardtorch::load_dcp_checkpoint '" + dir + "'";
  // Check, agree, change, agree (as the other loaders).
  DcpLoadReport report;
  std::unique_ptr<dcp::Source> src;
  Changes changes;
  std::string error, fingerprint;
  try {
    state->check_outside_summon();
    src = std::make_unique<dcp::Source>(dir);
    fingerprint = src->fingerprint();
    const std::string where = "DCP checkpoint '" + src->dir() + "'";
    std::set<std::string> model_names;
    for (const auto& item : root.named_parameters()) model_names.insert(item.key());
    for (const auto& item : root.named_buffers())
      if (item.value().defined()) model_names.insert(item.key());
    const Keys keys = sort_keys(src->metadata(), model_names, options, opt != nullptr, report, where);

    auto missing = [&](const std::string& m, const char* kind) {
      if (options.may_be_missing(m)) {
        report.missing.push_back(m);
        return;
      }
      std::string hint;
      for (const auto& e : src->metadata().entries)
        if (checkpoint::ends_with(e.name, "." + m) && e.name != options.model_prefix() + m) {
          hint = " (the checkpoint has '" + e.name + "': model_prefix(\"" + e.name.substr(0, e.name.size() - m.size()) +
                 "\")?)";
          break;
        }
      throw SafetensorsError(where + ": no tensor for the model's " + kind + " '" + m + "'" + hint +
                             "; map the checkpoint's names onto the model's (DcpLoadOptions().model_prefix, "
                             "strip_prefix, replace_prefix, map_name), or allow it to be missing (allow_missing, "
                             "allow_missing_if)");
    };
    auto check = [&](const dcp::Entry& e, const std::string& m, c10::IntArrayRef want, at::ScalarType dtype,
                     const char* kind) {
      const std::string named = "'" + e.name + "'" + (e.name != m ? " (the model's '" + m + "')" : "");
      if (c10::IntArrayRef(e.size) != want)
        throw SafetensorsError(where + ": " + named + " has shape " + shape_text(e.size) + " but the model's " + kind +
                               " has shape " + shape_text(want) +
                               " (is the model built with the checkpoint's configuration?)");
      const at::ScalarType saved = dcp::scalar_type_of(e.dtype);
      if (!options.allow_lossy_casts() && !checkpoint::is_safe_cast(saved, dtype))
        throw SafetensorsError(where + ": " + named + " is " + checkpoint::dtype_text(saved) + " but the model's " +
                               kind + " is " + checkpoint::dtype_text(dtype) + ", and a cast from " +
                               checkpoint::dtype_text(saved) + " to " + checkpoint::dtype_text(dtype) +
                               " can change values: refused (DcpLoadOptions().allow_lossy_casts(true) casts anyway)");
    };
    dcp::Source* s = src.get();
    auto names = detail::parameter_names(root);
    auto source_of = [&](const at::Tensor& p) -> std::pair<const dcp::Entry*, std::string> {
      for (const auto& n : names[p.unsafeGetTensorImpl()]) {
        auto it = keys.model.find(n);
        if (it != keys.model.end()) return {it->second, n};
      }
      return {nullptr, ""};
    };
    if (state->replicated()) {  // every rank holds every parameter whole
      std::set<const void*> done;
      for (const auto& item : root.named_parameters()) {
        at::Tensor p = item.value();
        if (!done.insert(p.unsafeGetTensorImpl()).second) continue;  // tied: from the first name held
        auto [e, n] = source_of(p);
        if (e == nullptr) {
          missing(item.key(), "parameter");
          continue;
        }
        const at::Tensor record = state->record_of(p);
        check(*e, n, p.sizes(), record.scalar_type(), "parameter");
        changes.push_back([state, s, p, record, fill = s->plan(*e, 0, p.numel()), &report] {
          at::Tensor t = at::empty({p.numel()}, record.options());
          report.bytes_read += dcp::Source::run(fill, t);
          state->load_record(p, t.view(p.sizes()));
        });
      }
    } else {
      const int rank = state->topology().shard_comm().rank();
      const bool checks_empty = state->world().rank() == 0;  // an empty parameter is no rank's: rank 0 checks it
      for (auto& u : state->units())
        for (auto& f : u->flats())
          for (size_t i = 0; i < f->params().size(); ++i) {
            const at::Tensor& p = f->params()[i];
            auto [e, n] = source_of(p);
            const auto& ns = names[p.unsafeGetTensorImpl()];
            if (e == nullptr) {
              missing(ns.empty() ? f->names()[i] : ns.front(), "parameter");
              continue;
            }
            auto piece = f->layout().piece(i, rank);
            if (!piece && !(f->layout().numel(i) == 0 && checks_empty)) continue;
            check(*e, n, f->layout().shape(i), f->dtype(), "parameter");
            if (!piece || piece->length == 0) continue;
            at::Tensor dst = f->shard().narrow(0, piece->shard_offset, piece->length);
            changes.push_back([dst, fill = s->plan(*e, piece->param_offset, piece->length), &report] {
              report.bytes_read += dcp::Source::run(fill, dst);
            });
          }
    }
    for (const auto& item : root.named_buffers()) {  // every rank keeps every buffer whole
      if (!item.value().defined()) continue;
      auto it = keys.model.find(item.key());
      if (it == keys.model.end()) {
        missing(item.key(), "buffer");
        continue;
      }
      at::Tensor b = item.value();
      check(*it->second, item.key(), b.sizes(), b.scalar_type(), "buffer");
      changes.push_back([b, fill = s->plan(*it->second, 0, b.numel()), &report]() mutable {
        at::Tensor t = at::empty({b.numel()}, b.options());
        report.bytes_read += dcp::Source::run(fill, t);
        b.copy_(t.view(b.sizes()));
      });
    }

    if (opt) {
      auto kind = detail::optimizer_kind(*opt);
      if (!kind)
        throw SafetensorsError(where +
                               ": the optimizer is none of Adam, AdamW and SGD, whose state this loader "
                               "reads (pass a null optimizer to load the parameters alone)");
      const bool adam = *kind != detail::OptimizerKind::SGD;
      std::set<const void*> amsgrad;
      for (auto& group : opt->inner().param_groups()) {
        auto& o = group.options();
        bool on = false;
        if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&o)) on = a->amsgrad();
        if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&o)) on = w->amsgrad();
        if (on)
          for (const auto& p : group.params()) amsgrad.insert(p.unsafeGetTensorImpl());
      }
      std::map<std::string, std::vector<int64_t>> param_shapes;
      for (const auto& item : root.named_parameters()) param_shapes[item.key()] = item.value().sizes().vec();
      // Every name of each parameter (a tied one has several): its state may be under any.
      std::map<std::string, const std::vector<std::string>*> all_names;
      for (const auto& [impl, ns] : names)
        for (const auto& n : ns) all_names[n] = &ns;
      auto* st = &opt->inner().state();
      for (const auto& piece : opt->views().pieces()) {
        void* key = piece.view.unsafeGetTensorImpl();
        std::string held;  // the name the checkpoint holds this parameter's state under
        const std::string first = adam ? "exp_avg" : "momentum_buffer";
        auto ns = all_names.find(piece.name);
        for (const auto& n : ns != all_names.end() ? *ns->second : std::vector<std::string>{piece.name})
          if (keys.optim.count({n, first})) {
            held = n;
            break;
          }
        if (held.empty()) {  // never stepped (or no optimizer state saved at all): a fresh start
          changes.push_back([st, key] { st->erase(key); });
          continue;
        }
        std::vector<std::string> kinds =
            adam ? std::vector<std::string>{"exp_avg", "exp_avg_sq"} : std::vector<std::string>{"momentum_buffer"};
        if (adam && amsgrad.count(key)) kinds.push_back("max_exp_avg_sq");
        std::vector<dcp::Source::Fill> fills;
        for (const auto& k : kinds) {
          auto it = keys.optim.find({held, k});
          if (it == keys.optim.end())
            throw SafetensorsError(where + ": '" + options.optimizer_prefix() + "state." + held + "." + k +
                                   "' is missing" +
                                   (k == "max_exp_avg_sq" ? " (the parameter is in a group with amsgrad; the "
                                                            "checkpoint's optimizer had none)"
                                                          : ""));
          check(*it->second, held, param_shapes.at(held), piece.view.scalar_type(), "optimizer state");
          fills.push_back(s->plan(*it->second, piece.param_offset, piece.length));
        }
        int64_t step = 0;
        if (adam) {
          auto it = keys.optim.find({held, "step"});
          if (it == keys.optim.end())
            throw SafetensorsError(where + ": '" + options.optimizer_prefix() + "state." + held + ".step' is missing");
          step = read_step(*s, *it->second, where);
        }
        changes.push_back([st, key, fills, kind = *kind, step, options = piece.view.options(), length = piece.length,
                           shape = piece.view.sizes().vec(), &report] {
          std::vector<at::Tensor> t;
          for (const auto& fill : fills) {
            at::Tensor flat = at::empty({length}, options);
            report.bytes_read += dcp::Source::run(fill, flat);
            t.push_back(flat.view(shape));
          }
          (*st)[key] = detail::make_optimizer_state(kind, step, t);
        });
      }
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  detail::load_agreed(*state, error, fingerprint, changes, what, nullptr, &progress);
  if (opt) opt->views().count_optimizer_state(opt->inner());
  if (src) {
    report.files_opened = src->files_opened();
    report.items_opened = src->items_opened();
  }
  return report;
}

}  // namespace shardtorch
