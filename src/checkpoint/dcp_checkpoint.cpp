// PyTorch distributed checkpoints loaded straight into a sharded model: each
// rank reads the chunks, and the byte ranges within them, that overlap what
// it holds; optimizer state in the layout of get_state_dict(model, optim).
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <set>

#include "base/text.h"
#include "checkpoint/agreement.h"
#include "checkpoint/dcp_source.h"
#include "checkpoint/dcp_stage.h"
#include "checkpoint/model_load.h"
#include "checkpoint/model_part.h"
#include "checkpoint/name_mapping.h"
#include "checkpoint/tp_slices.h"
#include "optim/optimizer_state.h"
#include "runtime/shard_state.h"
#include "shardtorch/checkpoint/safetensors.h"
#include "shardtorch/dcp_checkpoint.h"

namespace shardtorch {
namespace {

using checkpoint::SafetensorsError;
namespace dcp = checkpoint::dcp;

using detail::shape_text;

// The checkpoint's keys sorted by what they are to this model.
struct Keys {
  std::map<std::string, const dcp::Entry*> model;  // model name -> entry
  // (model name, kind) -> entry: "<optimizer_prefix>state.<fqn>.<kind>"
  std::map<std::pair<std::string, std::string>, const dcp::Entry*> optim;
  bool any_optim_state = false;
  bool any_optim = false;  // a key under the optimizer's prefix: state or param_groups
};

// A checkpoint name the model has none for: its key, its name before the
// options' mapping, and after it.
struct Unexpected {
  std::string key, raw, mapped;
};

// The first unexpected key, how many more there are, and the model's names
// no tensor maps to: side by side they show a renamed module (with the
// replace_prefix that maps one onto the other) or a prefix. The hints are
// given only for a name no mapping rule changed: a rule added after one that
// matched would not apply.
[[noreturn]] void throw_unexpected(const std::vector<Unexpected>& unexpected, const std::set<std::string>& model_names,
                                   const Keys& keys, const std::string& where) {
  const std::string& key = unexpected.front().key;
  const std::string& m = unexpected.front().mapped;
  std::vector<std::string> others, unmatched;
  for (size_t i = 1; i < unexpected.size(); ++i) others.push_back(unexpected[i].key);
  for (const auto& n : model_names)
    if (!keys.model.count(n)) unmatched.push_back(n);
  std::string hint;
  const bool unmapped = unexpected.front().raw == m;
  for (const auto& name : model_names)
    if (unmapped && checkpoint::ends_with(m, "." + name)) {
      hint = " (the checkpoint's '" + m + "' is the model's '" + name + "' behind a prefix: strip_prefix(\"" +
             m.substr(0, m.size() - name.size()) + "\")?)";
      break;
    }
  // A module renamed: the names under the checkpoint's first part are the
  // ones under another first part that no tensor maps to.
  auto under = [](const std::string& prefix, const std::vector<std::string>& names) {
    std::set<std::string> rest;
    for (const auto& n : names)
      if (n.rfind(prefix, 0) == 0) rest.insert(n.substr(prefix.size()));
    return rest;
  };
  std::vector<std::string> mapped;
  for (const auto& u : unexpected) mapped.push_back(u.mapped);
  const auto a = m.find('.');
  for (const auto& n : unmatched) {
    const auto b = n.find('.');
    if (!unmapped || !hint.empty() || a == std::string::npos || b == std::string::npos) continue;
    const std::string from = m.substr(0, a + 1), to = n.substr(0, b + 1);
    if (under(from, mapped) == under(to, unmatched))
      hint = " (the model's '" + n + "' has no tensor: replace_prefix(\"" + from + "\", \"" + to + "\")?)";
  }
  std::string text = where + ": unexpected tensor '" + key + "'" + (m != key ? " (mapped to '" + m + "')" : "") +
                     ": the model has no parameter or buffer of that name" + hint;
  text += detail::and_more(others, "the model has no name for");
  if (!unmatched.empty())
    text += "; " + std::to_string(unmatched.size()) + " of the model's names have no tensor (" +
            detail::quoted_names(unmatched) + ")";
  throw SafetensorsError(text +
                         ". Map the checkpoint's names with DcpLoadOptions().model_prefix/strip_prefix/replace_prefix/"
                         "map_name, skip a tensor by mapping it to nullopt, or pass ignore_unexpected(true)");
}

Keys sort_keys(const dcp::Metadata& md, const std::set<std::string>& model_names, const DcpLoadOptions& options,
               bool with_optimizer, DcpLoadReport& report, const std::string& where) {
  Keys keys;
  auto map = [&](const std::string& fqn) {
    return checkpoint::map_checkpoint_name(fqn, options.prefix_rules(), options.map_name());
  };
  std::vector<Unexpected> unexpected_keys;  // said after the loop
  auto unexpected = [&](const std::string& key, const std::string& raw, const std::string& m) {
    if (options.ignore_unexpected())
      report.unexpected.push_back(key);
    else
      unexpected_keys.push_back({key, raw, m});
  };
  const std::string& op = options.optimizer_prefix();
  const std::string& mp = options.model_prefix();
  for (const auto& e : md.entries) {
    const std::string& key = e.name;
    if (!op.empty() && key.rfind(op, 0) == 0) {
      keys.any_optim = true;
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
        unexpected(key, rest.substr(6, dot - 6), *m);
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
      unexpected(key, key.substr(mp.size()), *m);
      continue;
    }
    if (!e.tensor)
      throw SafetensorsError(where + ": '" + key + "' is a pickled value, not a tensor, but the model's '" + *m +
                             "' is a tensor");
    if (!keys.model.emplace(*m, &e).second)
      throw SafetensorsError(where + ": '" + keys.model[*m]->name + "' and '" + key + "' both map to the model's '" +
                             *m + "' (change the name mapping so that at most one does, or skip the other)");
  }
  if (!unexpected_keys.empty()) throw_unexpected(unexpected_keys, model_names, keys, where);
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

// A plan of `param`'s elements [begin, begin + length) (its own, flattened)
// from `e`: from the whole tensor's runs when parallelize() split it.
dcp::Source::Fill plan_of(dcp::Source& src, const dcp::Entry& e, const at::Tensor& param, int64_t begin,
                          int64_t length) {
  if (!detail::placement_of(param)) return src.plan(e, begin, length);
  dcp::Source::Fill out;
  for (const auto& r : checkpoint::saved_runs(param, begin, length))
    for (auto c : src.plan(e, r.whole, r.length).copies) {
      c.to += r.local - begin;
      out.copies.push_back(c);
    }
  return out;
}

// The check phase of one load_dcp_checkpoint on this rank: the checkpoint's
// keys sorted by what they are to the model, then every parameter, buffer
// and optimizer state this rank holds checked and its copy planned
// (run.changes).
class DcpLoad {
 public:
  DcpLoad(torch::nn::Module& root, ShardedOptimizer* opt, const DcpLoadOptions& options, checkpoint::LoadRun& run,
          DcpLoadReport& report, const checkpoint::ModelPart* part)
      : root_(root), opt_(opt), options_(options), run_(run), state_(*run.state), report_(report), part_(part) {}

  void open(const std::string& dir);
  void plan_parameters();
  void plan_buffers();
  void plan_optimizer();
  // What was read (after the changes ran).
  void report_files();

 private:
  void missing(const std::string& m, const char* kind);
  void check(const dcp::Entry& e, const std::string& m, c10::IntArrayRef want, at::ScalarType dtype, const char* kind);
  std::pair<const dcp::Entry*, std::string> source_of(const at::Tensor& p);
  void plan_replicated();
  void plan_piece(FlatParam& f, size_t i, int rank, bool checks_empty);
  void plan_optimizer_piece(const detail::ShardViews::Piece& piece);
  std::string held_name(const detail::ShardViews::Piece& piece) const;

  torch::nn::Module& root_;
  ShardedOptimizer* opt_;
  const DcpLoadOptions& options_;
  checkpoint::LoadRun& run_;
  detail::ShardState& state_;
  DcpLoadReport& report_;
  const checkpoint::ModelPart* part_;  // this rank's part of the model, or null: the whole
  std::unique_ptr<dcp::Source> src_;
  std::string where_;  // starts every error
  Keys keys_;
  checkpoint::ParameterNames names_;
  // plan_optimizer's: the optimizer's kind, the parameters in an amsgrad
  // group, each parameter (as the checkpoint holds it: its shape) and every
  // name of each parameter.
  detail::OptimizerKind kind_{};
  std::set<const void*> amsgrad_;
  std::map<std::string, at::Tensor> params_;
  std::map<std::string, const std::vector<std::string>*> all_names_;
};

void DcpLoad::open(const std::string& dir) {
  src_ = std::make_unique<dcp::Source>(dir);
  run_.fingerprint = src_->fingerprint();
  where_ = "DCP checkpoint '" + src_->dir() + "'";
  names_ = checkpoint::parameter_names(root_, part_);
  std::set<std::string> model_names = checkpoint::model_names(root_, part_);
  // A pipeline stage loaded by itself (ignore_unexpected): its tied
  // parameter goes by its names on every stage, in stage order, so that each
  // stage reads what the first name holds (the unsplit model's checkpoint
  // may hold its optimizer state under that name alone), then by any other
  // names it has here.
  if (!part_)
    for (const auto& [impl, all] : state_.stage().tied_names) {
      auto& ns = names_[impl];
      std::vector<std::string> ordered = all;
      for (const auto& n : ns)
        if (std::find(ordered.begin(), ordered.end(), n) == ordered.end()) ordered.push_back(n);
      ns = std::move(ordered);
      model_names.insert(all.begin(), all.end());
    }
  keys_ = sort_keys(src_->metadata(), model_names, options_, opt_ != nullptr, report_, where_);
}

void DcpLoad::missing(const std::string& m, const char* kind) {
  if (options_.may_be_missing(m)) {
    report_.missing.push_back(m);
    return;
  }
  std::string hint;
  for (const auto& e : src_->metadata().entries)
    if (e.name == m && !options_.model_prefix().empty()) {  // a model's own state_dict(), saved without a prefix
      hint = " (the checkpoint has '" + m + "' without the prefix '" + options_.model_prefix() +
             "', as dcp.save(model.state_dict()) writes it: DcpLoadOptions().model_prefix(\"\")?)";
      break;
    } else if (checkpoint::ends_with(e.name, "." + m) && e.name != options_.model_prefix() + m) {
      hint = " (the checkpoint has '" + e.name + "': model_prefix(\"" + e.name.substr(0, e.name.size() - m.size()) +
             "\")?)";
      break;
    }
  throw SafetensorsError(where_ + ": no tensor for the model's " + kind + " '" + m + "'" + hint +
                         "; map the checkpoint's names onto the model's (DcpLoadOptions().model_prefix, "
                         "strip_prefix, replace_prefix, map_name), or allow it to be missing (allow_missing, "
                         "allow_missing_if)");
}

// The entry's shape, and a dtype it can be cast into.
void DcpLoad::check(const dcp::Entry& e, const std::string& m, c10::IntArrayRef want, at::ScalarType dtype,
                    const char* kind) {
  const std::string named = "'" + e.name + "'" + (e.name != m ? " (the model's '" + m + "')" : "");
  checkpoint::require_shape(where_, named, "", e.size, want, kind);
  const at::ScalarType saved = dcp::scalar_type_of(e.dtype);
  checkpoint::require_castable(where_, named, checkpoint::dtype_text(saved), "", saved, dtype, kind,
                               options_.allow_lossy_casts(), "DcpLoadOptions");
}

// The entry `p` is read from, under the first of its names held (null: none).
std::pair<const dcp::Entry*, std::string> DcpLoad::source_of(const at::Tensor& p) {
  for (const auto& n : names_[p.unsafeGetTensorImpl()]) {
    auto it = keys_.model.find(n);
    if (it != keys_.model.end()) return {it->second, n};
  }
  return {nullptr, ""};
}

void DcpLoad::plan_parameters() {
  if (state_.path().replicated()) {
    plan_replicated();
    return;
  }
  checkpoint::for_each_flat_param(
      state_, [this](FlatParam& f, size_t i, int rank, bool checks_empty) { plan_piece(f, i, rank, checks_empty); });
}

// Every rank holds every parameter whole.
void DcpLoad::plan_replicated() {
  dcp::Source* s = src_.get();
  std::set<const void*> done;
  for (const auto& item : root_.named_parameters()) {
    at::Tensor p = item.value();
    if (!done.insert(p.unsafeGetTensorImpl()).second) continue;  // tied: from the first name held
    auto [e, n] = source_of(p);
    if (e == nullptr) {
      missing(item.key(), "parameter");
      continue;
    }
    const at::Tensor record = state_.path().record_of(p);
    check(*e, n, checkpoint::saved_shape(p), record.scalar_type(), "parameter");
    run_.changes.push_back(
        [state = run_.state, s, p, record, fill = plan_of(*s, *e, p, 0, p.numel()), report = &report_] {
          at::Tensor t = at::empty({p.numel()}, record.options());
          report->bytes_read += dcp::Source::run(fill, t);
          state->path().load_record(p, t.view(p.sizes()));
        });
  }
}

// Parameter `i` of `f`: this rank's piece of it.
void DcpLoad::plan_piece(FlatParam& f, size_t i, int rank, bool checks_empty) {
  const at::Tensor& p = f.params()[i];
  auto [e, n] = source_of(p);
  const auto& ns = names_[p.unsafeGetTensorImpl()];
  if (e == nullptr) {
    missing(ns.empty() ? f.names()[i] : ns.front(), "parameter");
    return;
  }
  auto piece = f.layout().piece(i, rank);
  if (!piece && !(f.layout().numel(i) == 0 && checks_empty)) return;
  check(*e, n, checkpoint::saved_shape(p), f.dtype(), "parameter");
  if (!piece || piece->length == 0) return;
  at::Tensor dst = f.shard().narrow(0, piece->shard_offset, piece->length);
  run_.changes.push_back([dst, fill = plan_of(*src_, *e, p, piece->param_offset, piece->length), report = &report_] {
    report->bytes_read += dcp::Source::run(fill, dst);
  });
}

// Every rank keeps every buffer whole.
void DcpLoad::plan_buffers() {
  for (const auto& item : root_.named_buffers()) {
    if (!item.value().defined()) continue;
    auto it = keys_.model.find(item.key());
    if (it == keys_.model.end()) {
      missing(item.key(), "buffer");
      continue;
    }
    at::Tensor b = item.value();
    check(*it->second, item.key(), b.sizes(), b.scalar_type(), "buffer");
    run_.changes.push_back([b, fill = src_->plan(*it->second, 0, b.numel()), report = &report_]() mutable {
      at::Tensor t = at::empty({b.numel()}, b.options());
      report->bytes_read += dcp::Source::run(fill, t);
      b.copy_(t.view(b.sizes()));
    });
  }
}

void DcpLoad::plan_optimizer() {
  if (!opt_) return;
  auto kind = detail::optimizer_kind(*opt_);
  if (!kind)
    throw SafetensorsError(where_ +
                           ": the optimizer is none of Adam, AdamW and SGD, whose state this loader "
                           "reads (pass a null optimizer to load the parameters alone)");
  kind_ = *kind;
  if (!keys_.any_optim) {   // saved with the model alone (state saved before any step still has param_groups)
    std::string elsewhere;  // an optimizer saved under another prefix
    for (const auto& e : src_->metadata().entries)
      if (const auto at = e.name.find("state.");
          at != std::string::npos && (at == 0 || e.name[at - 1] == '.') && elsewhere.empty())
        elsewhere = " (it has '" + e.name + "': optimizer_prefix(\"" + e.name.substr(0, at) + "\")?)";
    throw SafetensorsError(where_ + ": an optimizer was given but the checkpoint holds no optimizer (no key under '" +
                           options_.optimizer_prefix() + "'" + elsewhere +
                           "): it was saved with the model alone, and the optimizer's moments and step counts would "
                           "start from zero while the parameters go on. Pass a null optimizer to load the parameters "
                           "alone (the optimizer then starts fresh), or a checkpoint saved with the optimizer");
  }
  amsgrad_ = detail::amsgrad_params(*opt_);
  for (const auto& item : root_.named_parameters()) params_.emplace(item.key(), item.value());
  // Every name of each parameter (a tied one has several, a stage's tied one
  // those of the other stages too): its state may be under any.
  for (const auto& [impl, ns] : names_) {
    auto param = params_.end();  // under a name this module gives it (a stage's tie: not the first)
    for (const auto& n : ns)
      if (param == params_.end()) param = params_.find(n);
    for (const auto& n : ns) {
      all_names_[n] = &ns;
      if (param != params_.end()) params_.emplace(n, param->second);
    }
  }
  for (const auto& piece : opt_->views().pieces()) plan_optimizer_piece(piece);
}

// The name the checkpoint holds the state of `piece`'s parameter under ("": none).
std::string DcpLoad::held_name(const detail::ShardViews::Piece& piece) const {
  const std::string first = kind_ != detail::OptimizerKind::SGD ? "exp_avg" : "momentum_buffer";
  auto ns = all_names_.find(piece.name);
  for (const auto& n : ns != all_names_.end() ? *ns->second : std::vector<std::string>{piece.name})
    if (keys_.optim.count({n, first})) return n;
  return "";
}

void DcpLoad::plan_optimizer_piece(const detail::ShardViews::Piece& piece) {
  const bool adam = kind_ != detail::OptimizerKind::SGD;
  auto* st = &opt_->inner().state();
  void* key = piece.view.unsafeGetTensorImpl();
  const std::string held = held_name(piece);
  if (held.empty()) {  // never stepped (or no optimizer state saved at all): a fresh start
    run_.changes.push_back([st, key] { st->erase(key); });
    return;
  }
  std::vector<std::string> kinds =
      adam ? std::vector<std::string>{"exp_avg", "exp_avg_sq"} : std::vector<std::string>{"momentum_buffer"};
  if (adam && amsgrad_.count(key)) kinds.push_back("max_exp_avg_sq");
  std::vector<dcp::Source::Fill> fills;
  for (const auto& k : kinds) {
    auto it = keys_.optim.find({held, k});
    if (it == keys_.optim.end())
      throw SafetensorsError(where_ + ": '" + options_.optimizer_prefix() + "state." + held + "." + k + "' is missing" +
                             (k == "max_exp_avg_sq" ? " (the parameter is in a group with amsgrad; the "
                                                      "checkpoint's optimizer had none)"
                                                    : ""));
    const at::Tensor& param = params_.at(held);
    check(*it->second, held, checkpoint::saved_shape(param), piece.view.scalar_type(), "optimizer state");
    fills.push_back(plan_of(*src_, *it->second, param, piece.param_offset, piece.length));
  }
  int64_t step = 0;
  if (adam) {
    auto it = keys_.optim.find({held, "step"});
    if (it == keys_.optim.end())
      throw SafetensorsError(where_ + ": '" + options_.optimizer_prefix() + "state." + held + ".step' is missing");
    step = read_step(*src_, *it->second, where_);
  }
  run_.changes.push_back([st, key, fills, kind = kind_, step, options = piece.view.options(), length = piece.length,
                          shape = piece.view.sizes().vec(), report = &report_] {
    std::vector<at::Tensor> t;
    for (const auto& fill : fills) {
      at::Tensor flat = at::empty({length}, options);
      report->bytes_read += dcp::Source::run(fill, flat);
      t.push_back(flat.view(shape));
    }
    (*st)[key] = detail::make_optimizer_state(kind, step, t);
  });
}

void DcpLoad::report_files() {
  if (!src_) return;
  report_.files_opened = src_->files_opened();
  report_.items_opened = src_->items_opened();
}

}  // namespace

namespace {

// load_dcp_checkpoint, of the whole model or (`part`) of one part of it:
// collective over part->world.
DcpLoadReport load_dcp(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir,
                       const DcpLoadOptions& options, const checkpoint::ModelPart* part) {
  checkpoint::LoadRun run(root, "load_dcp_checkpoint", dir, options.progress(), part ? part->world.get() : nullptr);
  DcpLoadReport report;
  DcpLoad load(root, opt, options, run, report, part);  // holds the source the changes read from
  try {
    run.state->summons().check_outside();
    load.open(dir);
    load.plan_parameters();
    load.plan_buffers();
    load.plan_optimizer();
  } catch (const std::exception& e) {
    run.error = e.what();
  }
  run.finish();
  if (opt) opt->views().count_optimizer_state(opt->inner());
  load.report_files();
  return report;
}

}  // namespace

DcpLoadReport load_dcp_checkpoint(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir,
                                  const DcpLoadOptions& options) {
  const auto state = detail::require_state(root, "load_dcp_checkpoint");
  checkpoint::dcp::refuse_pipeline_stage(*state, options.ignore_unexpected(), "load_dcp_checkpoint");
  const auto part = checkpoint::tensor_parallel_part(root, *state, "load_dcp_checkpoint");
  return load_dcp(root, opt, dir, options, part ? &*part : nullptr);
}

DcpLoadReport checkpoint::load_dcp_checkpoint(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir,
                                              const DcpLoadOptions& options, const ModelPart& part) {
  detail::require_state(root, "load_dcp_checkpoint");
  return load_dcp(root, opt, dir, options, &part);
}

}  // namespace shardtorch
