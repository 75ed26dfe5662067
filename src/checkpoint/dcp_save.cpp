// A sharded model saved as a PyTorch distributed checkpoint: each rank
// writes its pieces (boxes of its parameters) into __<rank>_0.distcp, rank 0
// the metadata, as torch.distributed.checkpoint's FileSystemWriter lays
// them out; the directory is published as a sharded checkpoint's is.
#include <c10/core/GradMode.h>
#include <c10/util/accumulate.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <sstream>

#include "base/check.h"
#include "base/files.h"
#include "base/log.h"
#include "checkpoint/agreement.h"
#include "checkpoint/dcp_items.h"
#include "checkpoint/dcp_source.h"
#include "checkpoint/dcp_stage.h"
#include "checkpoint/model_part.h"
#include "checkpoint/pickle_reader.h"
#include "checkpoint/publish.h"
#include "checkpoint/tied_names.h"
#include "checkpoint/tp_slices.h"
#include "optim/optimizer_state.h"
#include "runtime/shard_state.h"
#include "shardtorch/dcp_checkpoint.h"

namespace shardtorch {
namespace {

using checkpoint::SafetensorsError;
namespace dcp = checkpoint::dcp;
namespace pickle = checkpoint::pickle;

constexpr const char* kMarker = ".metadata";

// Something this rank writes: a box of a tensor (its elements `data`,
// contiguous), or a pickled value.
struct Item {
  std::string key;
  std::string dtype;          // torch's name; "" for a value
  std::vector<int64_t> size;  // the whole tensor's
  std::vector<int64_t> offsets, sizes;
  at::Tensor data;
  std::string pickled;
};

// The boxes of elements [begin, begin + values.numel()) of a tensor of `shape`;
// a tensor without elements is one empty box of its shape, as torch writes it.
void add_boxes(std::vector<Item>& out, const std::string& key, const std::vector<int64_t>& shape, int64_t begin,
               const at::Tensor& values) {
  const at::Tensor flat = values.reshape({-1});
  if (c10::multiply_integers(shape) == 0) {
    out.push_back({key, dcp::torch_name_of(flat.scalar_type()), shape, std::vector<int64_t>(shape.size(), 0), shape,
                   at::empty(shape, flat.options()), ""});
    return;
  }
  for (const auto& b : dcp::boxes_of_range(shape, begin, begin + flat.numel()))
    out.push_back({key, dcp::torch_name_of(flat.scalar_type()), shape, b.offsets, b.sizes,
                   flat.narrow(0, b.begin - begin, b.numel).contiguous().view(b.sizes), ""});
}

// The boxes of `param`'s elements [begin, begin + values.numel()) (its own,
// flattened) in the tensor a checkpoint holds: the whole one when
// parallelize() split it. A box of the slice is, in the whole tensor, one
// box per block of the split dimension it spans (a slice's rows of a block
// are consecutive there). A split tensor without elements is written by its
// tp rank 0 alone.
void add_param_boxes(std::vector<Item>& out, const std::string& key, const at::Tensor& param, int64_t begin,
                     const at::Tensor& values) {
  const auto p = detail::placement_of(param);
  const at::Tensor flat = values.reshape({-1});
  if (!p) {
    add_boxes(out, key, param.sizes().vec(), begin, flat);
    return;
  }
  if (c10::multiply_integers(p->full_shape) == 0) {
    if (p->rank == 0) add_boxes(out, key, p->full_shape, 0, flat);
    return;
  }
  const detail::Blocks b = detail::blocks_of(*p);
  const auto d = static_cast<size_t>(p->dim);
  const std::string dtype = dcp::torch_name_of(flat.scalar_type());
  for (const auto& box : dcp::boxes_of_range(param.sizes().vec(), begin, begin + flat.numel())) {
    const at::Tensor v = flat.narrow(0, box.begin - begin, box.numel).view(box.sizes);
    for (int64_t x = box.offsets[d], end = x + box.sizes[d]; x < end;) {
      const int64_t within = x % b.count, n = std::min(b.count - within, end - x);
      std::vector<int64_t> offsets = box.offsets, sizes = box.sizes;
      offsets[d] = x / b.count * b.block + b.start + within;
      sizes[d] = n;
      out.push_back({key, dtype, p->full_shape, offsets, sizes,
                     v.narrow(static_cast<int64_t>(d), x - box.offsets[d], n).contiguous(), ""});
      x += n;
    }
  }
}

std::string pickle_float(double v) { return pickle::Writer().real(v).finish(); }
std::string pickle_bool(bool v) { return pickle::Writer().boolean(v).finish(); }
std::string pickle_none() { return pickle::Writer().none().finish(); }

// A group's options as torch 2.13's optimizer writes them in param_groups
// (every key: a strict dcp.load requires each the loading optimizer has).
std::vector<std::pair<std::string, std::string>> group_options(torch::optim::OptimizerOptions& o) {
  std::vector<std::pair<std::string, std::string>> out;
  auto betas = [](const std::tuple<double, double>& b) {
    return pickle::Writer().mark().real(std::get<0>(b)).real(std::get<1>(b)).tuple().finish();
  };
  auto adam_like = [&](double lr, const std::tuple<double, double>& b, double eps, double wd, bool amsgrad,
                       bool decoupled) {
    out = {{"lr", pickle_float(lr)},
           {"betas", betas(b)},
           {"eps", pickle_float(eps)},
           {"weight_decay", pickle_float(wd)},
           {"amsgrad", pickle_bool(amsgrad)},
           {"maximize", pickle_bool(false)},
           {"foreach", pickle_none()},
           {"capturable", pickle_bool(false)},
           {"differentiable", pickle_bool(false)},
           {"fused", pickle_none()},
           {"decoupled_weight_decay", pickle_bool(decoupled)}};
  };
  if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&o)) {
    adam_like(w->lr(), w->betas(), w->eps(), w->weight_decay(), w->amsgrad(), true);
  } else if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&o)) {
    adam_like(a->lr(), a->betas(), a->eps(), a->weight_decay(), a->amsgrad(), false);
  } else if (auto* s = dynamic_cast<torch::optim::SGDOptions*>(&o)) {
    out = {{"lr", pickle_float(s->lr())},
           {"momentum", pickle_float(s->momentum())},
           {"dampening", pickle_float(s->dampening())},
           {"weight_decay", pickle_float(s->weight_decay())},
           {"nesterov", pickle_bool(s->nesterov())},
           {"maximize", pickle_bool(false)},
           {"foreach", pickle_none()},
           {"differentiable", pickle_bool(false)},
           {"fused", pickle_none()}};
  }
  return out;
}

// What this rank writes, and the optimizer's groups as far as it knows them
// (group -> names of the parameters it holds pieces of).
struct Collected {
  std::vector<Item> items;
  std::map<size_t, std::set<std::string>> groups;
};

// A parameter range this rank holds: its names (every one it is saved
// under), the parameter, first element, values.
struct Range {
  const std::vector<std::string>* names;
  at::Tensor param;
  int64_t begin;
  at::Tensor values;
};

// The ranges this rank holds, and the writers they are spread over
// (`writers` ranks holding the same ranges, this rank `me` among them).
struct HeldRanges {
  std::vector<Range> ranges;
  int writers = 1, me = 0;
};

// `part`: a range another part saves is left out.
HeldRanges held_ranges(torch::nn::Module& root, detail::ShardState& state, checkpoint::ParameterNames& names,
                       const checkpoint::ModelPart* part) {
  HeldRanges h;
  auto mine = [&](const std::string& local) { return !part || !part->saved_by_another_part(local); };
  if (state.path().replicated()) {
    std::set<const void*> seen;
    for (const auto& item : root.named_parameters()) {
      const at::Tensor& p = item.value();
      if (!seen.insert(p.unsafeGetTensorImpl()).second || !mine(item.key())) continue;
      h.ranges.push_back({&names[p.unsafeGetTensorImpl()], p, 0, state.path().record_of(p).detach()});
    }
    h.writers = state.world().size();
    h.me = state.world().rank();
    return h;
  }
  const int shard_rank = state.topology().shard_comm().rank();
  for (auto& u : state.units().all())
    for (auto& f : u->flats())
      for (size_t i = 0; i < f->params().size(); ++i) {
        const at::Tensor& p = f->params()[i];
        if (!mine(f->names()[i])) continue;
        if (auto piece = f->layout().piece(i, shard_rank))
          h.ranges.push_back({&names[p.unsafeGetTensorImpl()], p, piece->param_offset,
                              f->shard().narrow(0, piece->shard_offset, piece->length)});
        else if (f->layout().numel(i) == 0 && shard_rank == 0)  // no rank's piece: written once, empty
          h.ranges.push_back({&names[p.unsafeGetTensorImpl()], p, 0, f->shard().narrow(0, 0, 0)});
      }
  if (state.topology().replica_comm()) {
    h.writers = state.topology().replica_comm()->size();
    h.me = state.topology().replica_comm()->rank();
  }
  return h;
}

// The optimizer's state of the parameter ranges this rank writes
// (`written`: (first name, first element)), and every group it knows of.
void collect_optimizer(torch::nn::Module& root, ShardedOptimizer& opt, const checkpoint::ParameterNames& names,
                       const std::set<std::pair<std::string, int64_t>>& written, const std::string& op, Collected& c) {
  const auto kind = detail::optimizer_kind(opt);
  std::map<const void*, size_t> group_of;
  for (size_t g = 0; g < opt.inner().param_groups().size(); ++g)
    for (const auto& p : opt.inner().param_groups()[g].params()) group_of[p.unsafeGetTensorImpl()] = g;
  std::map<std::string, at::Tensor> params;  // by every name here
  for (const auto& item : root.named_parameters()) params.emplace(item.key(), item.value());
  std::map<std::string, std::string> first_name;  // any name -> the first (the optimizer's key)
  for (const auto& [impl, ns] : names)
    for (const auto& n : ns) first_name[n] = ns.front();
  const auto& st = opt.inner().state();
  for (const auto& piece : opt.views().pieces()) {
    const std::string name = first_name.count(piece.name) ? first_name[piece.name] : piece.name;
    auto g = group_of.find(piece.view.unsafeGetTensorImpl());
    if (g != group_of.end()) c.groups[g->second].insert(name);
    if (!written.count({name, piece.param_offset})) continue;
    const at::Tensor& param = params.at(piece.name);
    auto it = st.find(piece.view.unsafeGetTensorImpl());
    const torch::optim::OptimizerParamState* ps = it == st.end() ? nullptr : it->second.get();
    // A parameter not stepped yet has no state: zeros and step 0 are what
    // torch's optimizer starts from (and what a strict load requires).
    auto tensors = ps ? detail::optimizer_state_tensors(ps) : std::vector<std::pair<std::string, at::Tensor>>{};
    const bool sgd = kind == detail::OptimizerKind::SGD;
    if (!ps && !sgd) tensors = {{"exp_avg", at::zeros_like(piece.view)}, {"exp_avg_sq", at::zeros_like(piece.view)}};
    for (auto& [k, t] : tensors) add_param_boxes(c.items, op + name + "." + k, param, piece.param_offset, t);
    if (sgd && tensors.empty()) c.items.push_back({op + name + ".momentum_buffer", "", {}, {}, {}, {}, pickle_none()});
    const auto placement = detail::placement_of(param);
    if (!sgd && piece.param_offset == 0 && (!placement || placement->rank == 0)) {
      // Once per parameter (with its first element): a 0-d float32 tensor, as torch's AdamW keeps it.
      const double step = ps ? static_cast<double>(detail::optimizer_state_step(ps)) : 0.0;
      add_boxes(c.items, op + name + ".step", {}, 0, at::full({}, step, at::kFloat));
    }
  }
}

// `part`: this rank's part of the model; it writes what the part holds and
// no other part saves.
Collected collect(torch::nn::Module& root, detail::ShardState& state, ShardedOptimizer* opt,
                  const DcpSaveOptions& options, const checkpoint::ModelPart* part) {
  Collected c;
  const std::string& mp = options.model_prefix();
  auto names = checkpoint::parameter_names(root, part);
  const HeldRanges held = held_ranges(root, state, names, part);
  std::vector<int64_t> sizes;
  for (const auto& r : held.ranges) sizes.push_back(r.values.numel());
  const std::vector<int> owner = checkpoint::spread_over_writers(sizes, held.writers);
  std::set<std::pair<std::string, int64_t>> written;  // (first name, first element): its optimizer state goes with it
  for (size_t k = 0; k < held.ranges.size(); ++k) {
    const Range& r = held.ranges[k];
    if (owner[k] != held.me || r.names->empty()) continue;
    for (const auto& n : *r.names) add_param_boxes(c.items, mp + n, r.param, r.begin, r.values);
    written.insert({r.names->front(), r.begin});
  }
  if (opt) collect_optimizer(root, *opt, names, written, options.optimizer_prefix() + "state.", c);
  if (state.world().rank() == 0)  // the buffers, once per part (at tp rank 0)
    for (const auto& item : root.named_buffers())
      if (item.value().defined() && !(part && part->left_to_tp_rank_0(item.key())))
        add_boxes(c.items, mp + item.key(), item.value().sizes().vec(), 0, item.value());
  return c;
}

std::string csv(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

std::vector<int64_t> uncsv(const std::string& s) {
  std::vector<int64_t> v;
  std::istringstream in(s);
  std::string x;
  while (std::getline(in, x, ',')) v.push_back(std::stoll(x));
  return v;
}

// One line per item written: what rank 0 needs for the metadata.
std::string report_line(const Item& it, const dcp::Storage& st) {
  SHARDTORCH_CHECK(it.key.find_first_of("\t\n") == std::string::npos, "shardtorch: the name '", it.key,
                   "' holds a tab or a newline, which a DCP checkpoint cannot name");
  return (it.dtype.empty() ? "V\t" : "T\t") + it.key + "\t" + it.dtype + "\t" + csv(it.size) + "\t" + csv(it.offsets) +
         "\t" + csv(it.sizes) + "\t" + st.relative_path + "\t" + std::to_string(st.offset) + "\t" +
         std::to_string(st.length) + "\n";
}

std::string hex_of(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) out += {digits[c >> 4], digits[c & 15]};
  return out;
}

std::string bytes_of_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

std::vector<std::string> fields_of(const std::string& line) {
  std::vector<std::string> f;
  size_t start = 0;
  while (true) {
    const size_t tab = line.find('\t', start);
    f.push_back(line.substr(start, tab == std::string::npos ? std::string::npos : tab - start));
    if (tab == std::string::npos) return f;
    start = tab + 1;
  }
}

// One save_dcp_checkpoint: rank 0 stages the directory, every rank writes
// its items into its own data file, rank 0 writes the metadata from every
// rank's report and publishes the directory. A failure anywhere fails every
// rank; rank 0 removes what was staged.
class DcpSave {
 public:
  DcpSave(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir, const DcpSaveOptions& options,
          detail::ShardState& state, const checkpoint::ModelPart* part)
      : root_(root),
        opt_(opt),
        options_(options),
        state_(state),
        part_(part),
        world_(part ? *part->world : state.world()),
        dir_(dir),
        what_("shardtorch::save_dcp_checkpoint '" + dir + "'"),
        tmp_(dir + checkpoint::kTmpSuffix) {}

  const std::string& what() const { return what_; }
  int rank() const { return world_.rank(); }
  void stage();
  Collected collect_items(std::string& known);
  void add_groups(const std::vector<std::string>& all_known, std::vector<Item>& items);
  std::string write_items(const std::vector<Item>& items);
  dcp::Metadata metadata_of(const std::vector<std::string>& reports, DcpSaveReport& out) const;
  void publish(const dcp::Metadata& md);
  // Collective: every rank's `mine`; if any rank failed (error_), every rank
  // throws, rank 0 removing what was staged.
  std::vector<std::string> gather(const std::string& mine);

 private:
  torch::nn::Module& root_;
  ShardedOptimizer* opt_;
  const DcpSaveOptions& options_;
  detail::ShardState& state_;
  const checkpoint::ModelPart* part_;
  World& world_;  // every rank of every part
  const std::string dir_, what_, tmp_;
  std::string error_;  // this rank's, agreed at the next gather
};

// Collective: rank 0's staging directory, empty.
void DcpSave::stage() {
  std::string prepared;
  if (world_.rank() == 0) {
    try {
      checkpoint::check_replaceable(dir_, kMarker, "DCP checkpoint");
      files::remove_all(tmp_);
      files::create_directories(tmp_);
      checkpoint::crash_point("staging directory created");
    } catch (const std::exception& e) {
      prepared = e.what();
    }
  }
  try {
    detail::agree_on_errors(world_, prepared, what_);
  } catch (...) {  // another rank refused, or never came: nothing is written
    if (world_.rank() == 0) files::remove_all_quietly(tmp_);
    throw;
  }
}

// What this rank writes; `known` gets the groups it knows ("<group>\t<name>" lines).
Collected DcpSave::collect_items(std::string& known) {
  Collected c;
  try {
    c = collect(root_, state_, opt_, options_, part_);
    for (const auto& [g, ns] : c.groups)
      for (const auto& n : ns) known += "P\t" + std::to_string(g) + "\t" + n + "\n";
    if (opt_) {
      auto& groups = opt_->inner().param_groups();
      for (size_t g = 0; g < groups.size(); ++g)
        for (const auto& [k, v] : group_options(groups[g].options()))
          known += "O\t" + std::to_string(g) + "\t" + k + "\t" + hex_of(v) + "\n";
    }
  } catch (const std::exception& e) {
    error_ = e.what();
  }
  return c;
}

std::vector<std::string> DcpSave::gather(const std::string& mine) {
  try {
    return detail::agreed_fingerprints(world_, error_, what_, mine);
  } catch (...) {
    if (world_.rank() == 0) files::remove_all_quietly(tmp_);
    throw;
  }
}

// Rank 0: each group's options and parameters, in the whole model's order,
// by name (as torch's get_state_dict writes them), from every rank's known
// groups. Ranks whose optimizers' groups differ (a pipeline's stages), or a
// parameter in two groups (tied across stages), fail the save (error_): the
// checkpoint holds one list of groups.
void DcpSave::add_groups(const std::vector<std::string>& all_known, std::vector<Item>& items) {
  try {
    std::map<size_t, std::set<std::string>> params;
    std::map<std::string, std::pair<size_t, size_t>> group_of;  // parameter -> (group, the first rank listing it)
    // Each rank's groups: their options, key by key (pickled).
    std::vector<std::map<size_t, std::vector<std::pair<std::string, std::string>>>> options(all_known.size());
    for (size_t r = 0; r < all_known.size(); ++r) {
      std::istringstream in(all_known[r]);
      std::string line;
      while (std::getline(in, line)) {
        const auto f = fields_of(line);
        const size_t g = std::stoul(f[1]);
        if (f[0] == "O") {
          options[r][g].emplace_back(f[2], bytes_of_hex(f[3]));
          continue;
        }
        params[g].insert(f[2]);
        auto [it, first] = group_of.emplace(f[2], std::make_pair(g, r));
        SHARDTORCH_CHECK(first || it->second.first == g, "parameter '", f[2], "' is in the optimizer's group ",
                         it->second.first, " on rank ", it->second.second, " but in group ", g, " on rank ", r,
                         " (a parameter tied across pipeline stages: each stage's copy steps with its own group's "
                         "options, so the copies drift apart; put it in the same group, with the same options, on "
                         "every stage)");
      }
    }
    // Every rank's groups are rank 0's: the checkpoint holds one list for the whole model.
    const std::string same =
        " (a DCP checkpoint holds one list of groups for the whole model: give every stage's "
        "optimizer the same groups, in the same order, with the same options)";
    for (size_t r = 1; r < options.size(); ++r) {
      SHARDTORCH_CHECK(options[r].size() == options[0].size(), "the optimizer has ", options[r].size(),
                       " group(s) on rank ", r, " but ", options[0].size(), " on rank 0", same);
      for (const auto& [g, kv] : options[r])
        for (size_t k = 0; k < kv.size(); ++k)
          SHARDTORCH_CHECK(options[0].count(g) && k < options[0].at(g).size() && options[0].at(g)[k] == kv[k],
                           "the optimizer's group ", g, " has another '", kv[k].first, "' on rank ", r,
                           " than on rank 0", same);
    }
    for (const auto& [g, kv] : options[0])
      for (const auto& [k, v] : kv)
        items.push_back(
            {options_.optimizer_prefix() + "param_groups." + std::to_string(g) + "." + k, "", {}, {}, {}, {}, v});
    std::vector<std::string> order;  // the whole model's parameters
    if (part_)
      order = part_->order;
    else
      for (const auto& item : root_.named_parameters()) order.push_back(item.key());
    for (const auto& [g, ns] : params) {
      pickle::Writer w;
      w.empty_list().mark();
      for (const auto& n : order)
        if (ns.count(n)) w.string(n);
      w.appends();
      items.push_back({options_.optimizer_prefix() + "param_groups." + std::to_string(g) + ".params",
                       "",
                       {},
                       {},
                       {},
                       {},
                       w.finish()});
    }
  } catch (const std::exception& e) {
    error_ = e.what();
  }
}

// This rank's data file; its report, one line per item.
std::string DcpSave::write_items(const std::vector<Item>& items) {
  const std::string file = "__" + std::to_string(world_.rank()) + "_0.distcp";
  std::string report;
  try {
    shardtorch::detail::ProgressReporter progress("save_dcp_checkpoint", "items", static_cast<int64_t>(items.size()), 0,
                                                  options_.progress());
    progress.count_io();
    dcp::ItemWriter w(tmp_ + "/" + file, file);
    for (const auto& it : items) {
      report += report_line(it, it.dtype.empty() ? w.value(it.pickled) : w.tensor(it.data));
      progress.advance(1);
    }
    w.finish();
    progress.finish();
  } catch (const std::exception& e) {
    error_ = e.what();
  }
  return report;
}

// The metadata of every rank's items, from their reports; `out` gets the
// files and their sizes.
dcp::Metadata DcpSave::metadata_of(const std::vector<std::string>& reports, DcpSaveReport& out) const {
  dcp::Metadata md;
  for (size_t r = 0; r < reports.size(); ++r) {
    out.files.push_back("__" + std::to_string(r) + "_0.distcp");
    std::istringstream in(reports[r]);
    std::string line;
    while (std::getline(in, line)) {
      const auto f = fields_of(line);
      auto [pos, fresh] = md.index.emplace(f[1], md.entries.size());
      if (fresh) {
        dcp::Entry e;
        e.name = f[1];
        e.tensor = f[0] == "T";
        e.dtype = f[2];
        e.size = uncsv(f[3]);
        e.path = dcp::path_of(e.name, options_.model_prefix(), options_.optimizer_prefix());
        md.entries.push_back(std::move(e));
      }
      dcp::Entry& e = md.entries[pos->second];
      const dcp::Storage st{f[6], std::stoull(f[7]), std::stoull(f[8])};
      if (e.tensor)
        e.chunks.push_back({uncsv(f[4]), uncsv(f[5]), st});
      else
        e.bytes = st;
      out.bytes += static_cast<int64_t>(st.length);  // items are laid end to end: the files' sizes
    }
  }
  out.keys = static_cast<int64_t>(md.entries.size());
  return md;
}

// Collective: rank 0 writes the metadata and publishes the directory.
void DcpSave::publish(const dcp::Metadata& md) {
  std::string published;
  if (world_.rank() == 0) {
    try {
      // What rank 0 writes is checked as every reader checks it.
      const std::string bytes = dcp::serialize(md);
      dcp::parse(bytes, tmp_ + "/" + kMarker);
      checkpoint::write_text_durably(tmp_ + "/" + kMarker, bytes);
      checkpoint::fsync_path(tmp_, true);
      checkpoint::crash_point("index written");
      checkpoint::publish(tmp_, dir_, kMarker);
      checkpoint::crash_point("published");
    } catch (const std::exception& e) {
      files::remove_all_quietly(tmp_);
      published = e.what();
    }
  }
  detail::agree_after_publish(world_, published, what_, dir_);
}

}  // namespace

namespace {

// save_dcp_checkpoint, of the whole model or (`part`) of one part of it:
// every rank of every part writes its file, __R_0.distcp for its rank R in
// part->world, and the metadata is the whole model's.
DcpSaveReport save_dcp(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir_arg,
                       const DcpSaveOptions& options, detail::ShardState& state, const checkpoint::ModelPart* part) {
  // Each rank waits for the slowest writer, over the mesh too.
  detail::FileWaits file_waits(state, "save_dcp_checkpoint", part ? part->world.get() : nullptr);
  c10::NoGradGuard no_grad;
  DcpSave save(root, opt, checkpoint::normalized(dir_arg), options, state, part);
  SHARDTORCH_CHECK(!opt || detail::optimizer_kind(*opt), save.what(),
                   ": the optimizer is none of Adam, AdamW and SGD, whose state a DCP checkpoint carries here (pass "
                   "a null optimizer to save the parameters alone)");
  state.copies().wait_for_offload_copies();
  save.stage();
  // What each rank writes; first, the optimizer's groups as far as each
  // rank knows them (a rank knows the groups of the parameters it holds
  // pieces of), for rank 0 to write their parameter lists.
  std::string known;
  Collected c = save.collect_items(known);
  const auto all_known = save.gather(known);
  if (opt && save.rank() == 0) save.add_groups(all_known, c.items);
  const std::string report = save.write_items(c.items);
  c.items.clear();
  const auto reports = save.gather(report);  // every rank's lines, or every rank throws
  checkpoint::crash_point("reports gathered");
  DcpSaveReport out;
  const dcp::Metadata md = save.metadata_of(reports, out);
  save.publish(md);
  return out;
}

}  // namespace

DcpSaveReport save_dcp_checkpoint(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir,
                                  const DcpSaveOptions& options) {
  auto state = detail::require_state(root, "save_dcp_checkpoint");
  checkpoint::dcp::refuse_pipeline_stage(*state, /*ignoring=*/false, "save_dcp_checkpoint");
  const auto part = checkpoint::tensor_parallel_part(root, *state, "save_dcp_checkpoint");
  return save_dcp(root, opt, dir, options, *state, part ? &*part : nullptr);
}

DcpSaveReport checkpoint::save_dcp_checkpoint(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir,
                                              const DcpSaveOptions& options, const ModelPart& part) {
  auto state = detail::require_state(root, "save_dcp_checkpoint");
  return save_dcp(root, opt, dir, options, *state, &part);
}

}  // namespace shardtorch
