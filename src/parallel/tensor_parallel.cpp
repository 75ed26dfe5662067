// Tensor parallelism (shardtorch/tensor_parallel.h, docs/parallelism.md):
// the plan applied to a model's modules, the split layers' forwards and the
// vocabulary-parallel cross entropy.
#include "shardtorch/tensor_parallel.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

#include "base/check.h"
#include "base/text.h"
#include "deferred/deferred_session.h"
#include "parallel/tp_comm.h"
#include "parallel/tp_layer.h"
#include "parallel/tp_replicas.h"
#include "runtime/placement.h"
#include "runtime/shard_state.h"
#include "shardtorch/deferred.h"

namespace shardtorch {

using detail::TpLayer;

namespace {

const char* kind_name(TpStyle::Kind k) {
  switch (k) {
    case TpStyle::Kind::Colwise:
      return "colwise";
    case TpStyle::Kind::Rowwise:
      return "rowwise";
    case TpStyle::Kind::VocabEmbedding:
      return "vocab_embedding";
    case TpStyle::Kind::SequenceParallel:
      return "sequence_parallel";
    case TpStyle::Kind::ShardOutput:
      return "shard_output";
  }
  return "?";
}

std::vector<std::string> segments(const std::string& name) {
  std::vector<std::string> out;
  std::stringstream ss(name);
  for (std::string s; std::getline(ss, s, '.');) out.push_back(s);
  if (name.empty()) out.clear();
  return out;
}

// `*` stands for exactly one segment of a dotted module name.
bool matches(const std::string& pattern, const std::string& name) {
  const auto p = segments(pattern), n = segments(name);
  if (p.size() != n.size()) return false;
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] != "*" && p[i] != n[i]) return false;
  return true;
}

std::string what(const TpLayer& l) { return std::string(kind_name(l.style.kind())) + " layer '" + l.name + "'"; }

// A layer whose input every rank of its group must hold alike (not a slice):
// at its first forward, the ranks compare a signature of their inputs (the
// count, the sum, the sum of squares and a weighted sum, as bits) and all
// throw if one differs. A data loader indexed by the global rank instead of
// the dp coordinate would otherwise train on a mix of batches without a word.
void compare_inputs_once(TpLayer& l, const at::Tensor& x) {
  if (l.inputs_compared) return;
  l.inputs_compared = true;
  Comm& comm = l.group->comm();
  if (comm.size() == 1) return;
  c10::NoGradGuard no_grad;
  // In chunks of 1 Mi elements: a copy of the whole input in double, at the
  // first step's peak of activations, could itself run out of memory.
  constexpr int64_t kChunk = int64_t{1} << 20;
  const at::Tensor v = x.detach().reshape({-1});
  const auto f64 = v.options().dtype(at::kDouble);
  at::Tensor sum = at::zeros({}, f64), squares = at::zeros({}, f64), weighted = at::zeros({}, f64);
  for (int64_t from = 0; from < v.numel(); from += kChunk) {
    const int64_t n = std::min(kChunk, v.numel() - from);
    const at::Tensor c = v.narrow(0, from, n).to(at::kDouble);
    sum += c.sum();
    squares += c.square().sum();
    weighted += (c * at::arange(from, from + n, f64).remainder(7).add(1)).sum();
  }
  at::Tensor mine =
      at::stack({at::scalar_tensor(static_cast<double>(v.numel()), f64), sum, squares, weighted}).to(comm.device());
  at::Tensor all = at::empty({comm.size() * 4}, mine.options());
  comm.all_gather_into(all, mine, what(l) + "'s inputs, compared once");
  all = all.cpu();
  const auto* sums = all.data_ptr<double>();
  for (int r = 1; r < comm.size(); ++r) {
    if (std::memcmp(sums, sums + 4 * r, 4 * sizeof(double)) == 0) continue;  // bit for bit: NaN equals itself
    SHARDTORCH_CHECK(
        false, detail::rank_prefix(l.group->global_rank()), ": ", what(l),
        ": the ranks of its tensor-parallel group got different inputs in its first forward (rank ",
        l.group->global_rank_of(r), "'s ", static_cast<int64_t>(sums[4 * r]), " elements sum to ", sums[4 * r + 1],
        ", their squares to ", sums[4 * r + 2], ", rank ", l.group->global_rank_of(0), "'s ",
        static_cast<int64_t>(sums[0]), " to ", sums[1], " and ", sums[2],
        sums[4 * r + 1] == sums[1] && sums[4 * r + 2] == sums[2] ? "; the same values in another order" : "",
        "). Every rank of a tensor-parallel group computes on the same batch: give "
        "each dp coordinate its own batch (mesh->coordinate(\"dp\")) and every tp rank of it the same "
        "one, not a batch per global rank");
  }
}

// The parts of dimension `dim` (length parts x k x n, rank r's slices of each part) of `t`.
at::Tensor slice_of(const at::Tensor& t, int64_t dim, int parts, int n, int r) {
  const int64_t part = t.size(dim) / parts, k = part / n;
  std::vector<at::Tensor> pieces;
  for (int j = 0; j < parts; ++j) pieces.push_back(t.narrow(dim, j * part + r * k, k));
  return at::cat(pieces, dim).contiguous();
}

// `p`'s gradient summed over the group before it accumulates (sequence
// parallelism: each rank saw part of the sequence). Once per parameter.
void sum_gradient_over(at::Tensor p, const std::shared_ptr<World>& group, const std::string& name,
                       std::set<const void*>& hooked) {
  if (!p.requires_grad() || !hooked.insert(p.unsafeGetTensorImpl()).second) return;
  const std::string label = "the gradient of '" + name + "' (sequence parallel)";
  std::weak_ptr<World> weak = group;
  p.register_hook([weak, label](const at::Tensor& g) -> at::Tensor {
    auto w = weak.lock();
    if (!w || w->size() == 1) return g;
    at::Tensor t = g.contiguous().clone();
    w->comm().all_reduce(t, c10d::ReduceOp::SUM, label);
    return t;
  });
}

}  // namespace

// ---------------------------------------------------------------- layers

namespace {

// A split Linear's forward (ParallelLinear, TiedLinear) with its own weight and bias.
at::Tensor linear_forward(TpLayer& l, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  Comm& comm = l.group->comm();
  const std::string w = what(l);
  switch (l.style.kind()) {
    case TpStyle::Kind::Colwise: {
      if (!l.sequence_parallel) compare_inputs_once(l, input);
      at::Tensor x = l.sequence_parallel ? detail::tp::gather_for_column(input, l.sequence_dim, comm, w + " input")
                                         : detail::tp::copy_to_group(input, comm, w + " input");
      at::Tensor y = at::linear(x, weight, bias);
      if (!l.style.gather_output()) return y;
      y = detail::tp::gather_dim(y, -1, comm, w + " output");
      if (l.style.parts() > 1) {  // [r0: p0 p1 p2 | r1: p0 p1 p2] -> [p0: r0 r1 | p1: ... | p2: ...]
        auto shape = y.sizes().vec();
        const int64_t k = shape.back() / (comm.size() * l.style.parts());
        auto split = shape;
        split.back() = comm.size();
        split.push_back(l.style.parts());
        split.push_back(k);
        y = y.reshape(split).transpose(-3, -2).reshape(shape);
      }
      return y;
    }
    case TpStyle::Kind::Rowwise: {
      at::Tensor x = input;
      const int64_t local = weight.size(1);
      if (x.size(-1) != local) {  // the whole input: each rank takes its slice of the features
        SHARDTORCH_CHECK(x.size(-1) == local * comm.size(), detail::rank_prefix(l.group->global_rank()), ": ", w,
                         " takes inputs whose last dimension is its slice (", local, ") or the whole (",
                         local * comm.size(), "), got ", describe(x));
        compare_inputs_once(l, x);
        x = detail::tp::split_dim(x, -1, comm, w + " input");
      }
      if (comm.size() == 1) return at::linear(x, weight, bias);  // what the unsplit layer computes, bitwise
      at::Tensor y = at::linear(x, weight);
      y = l.sequence_parallel ? detail::tp::reduce_scatter(y, l.sequence_dim, comm, w + " output")
                              : detail::tp::reduce_from_group(y, comm, w + " output");
      return bias.defined() ? y + bias : y;
    }
    case TpStyle::Kind::ShardOutput:
      compare_inputs_once(l, input);
      return detail::tp::split_dim(at::linear(input, weight, bias), l.style.dim(), comm, w + " output");
    default:
      break;
  }
  SHARDTORCH_CHECK(false, "shardtorch: ", w, ": not a style of a Linear");
}

}  // namespace

at::Tensor ParallelLinearImpl::forward(const at::Tensor& input) {
  if (!tp) return at::linear(input, weight, bias);
  return linear_forward(*tp, input, weight, bias);
}

TiedLinearImpl::TiedLinearImpl(at::Tensor shared_weight)
    : weight(register_parameter("weight", std::move(shared_weight))) {}

at::Tensor TiedLinearImpl::forward(const at::Tensor& input) {
  if (!tp) return at::linear(input, weight);
  return linear_forward(*tp, input, weight, at::Tensor());
}

at::Tensor ParallelEmbeddingImpl::forward(const at::Tensor& indices) {
  if (!tp) return torch::nn::EmbeddingImpl::forward(indices);
  TpLayer& l = *tp;
  Comm& comm = l.group->comm();
  const std::string w = what(l);
  compare_inputs_once(l, indices);
  if (l.style.kind() == TpStyle::Kind::ShardOutput)
    return detail::tp::split_dim(torch::nn::EmbeddingImpl::forward(indices), l.style.dim(), comm, w + " output");
  // VocabEmbedding: rows [vocab_start, vocab_end) here; other ids look up zeros, summed over the group.
  const at::Tensor outside = (indices < l.vocab_start) | (indices >= l.vocab_end);
  const at::Tensor local = (indices - l.vocab_start).masked_fill(outside, 0);
  at::Tensor out = at::embedding(weight, local, /*padding_idx=*/-1, options.scale_grad_by_freq(), options.sparse());
  out = out.masked_fill(outside.unsqueeze(-1), 0.0);
  return l.sequence_parallel ? detail::tp::reduce_scatter(out, l.sequence_dim, comm, w + " output")
                             : detail::tp::reduce_from_group(out, comm, w + " output");
}

// ---------------------------------------------------------------- the plan

namespace {

struct Match {
  std::string name;
  std::shared_ptr<torch::nn::Module> module;
  TpStyle style;
};

using Fail = std::function<void(const std::string&)>;

// The modules the plan's rules take, in rule order; a rule that takes none
// or a module two rules take fails.
std::vector<Match> match_rules(torch::nn::Module& model, const TpPlan& plan, const Fail& fail) {
  std::vector<Match> matched;
  const auto modules = model.named_modules();
  std::map<std::string, std::string> rule_of;  // module -> the rule that took it
  for (const auto& [pattern, style] : plan.rules()) {
    bool any = false;
    for (const auto& item : modules) {
      if (!matches(pattern, item.key())) continue;
      any = true;
      if (auto it = rule_of.find(item.key()); it != rule_of.end()) {
        fail("module '" + item.key() + "' is matched by rules " + it->second + " and '" + pattern + "' (" +
             kind_name(style.kind()) + "); a module takes one rule");
        continue;
      }
      rule_of[item.key()] = "'" + pattern + "' (" + kind_name(style.kind()) + ")";
      matched.push_back({item.key(), item.value(), style});
    }
    if (!any) fail("rule '" + pattern + "' (" + kind_name(style.kind()) + ") matches no module of the model");
  }
  return matched;
}

// One match described (for the agreement) and checked: the right module
// type, sizes that a group of `n` divides.
void check_match(const Match& m, int n, std::ostringstream& desc, const Fail& fail) {
  auto* lin = dynamic_cast<ParallelLinearImpl*>(m.module.get());
  auto* tied = dynamic_cast<TiedLinearImpl*>(m.module.get());
  auto* emb = dynamic_cast<ParallelEmbeddingImpl*>(m.module.get());
  const at::Tensor linear_weight = lin ? lin->weight : tied ? tied->weight : at::Tensor();
  const auto kind = m.style.kind();
  desc << m.name << " " << kind_name(kind) << " parts " << m.style.parts() << " heads " << m.style.heads() << " dim "
       << m.style.dim() << " gather " << m.style.gather_output();
  const std::string who = "module '" + m.name + "' (" + kind_name(kind) + ")";
  const std::string ranks = " the group's " + std::to_string(n) + " ranks";
  if ((lin && lin->tp) || (tied && tied->tp) || (emb && emb->tp)) {
    fail(who + " is split already: parallelize() runs once per model");
  } else if ((kind == TpStyle::Kind::Colwise || kind == TpStyle::Kind::Rowwise) && !linear_weight.defined()) {
    fail(who + " is not a shardtorch::ParallelLinear (a drop-in for torch::nn::Linear) or TiedLinear");
  } else if (kind == TpStyle::Kind::VocabEmbedding && !emb) {
    fail(who + " is not a shardtorch::ParallelEmbedding: declare it as one (a drop-in for torch::nn::Embedding)");
  } else if (kind == TpStyle::Kind::ShardOutput && !linear_weight.defined() && !emb) {
    fail(who + " needs a shardtorch::ParallelLinear, TiedLinear or ParallelEmbedding");
  } else if (kind == TpStyle::Kind::Colwise) {
    const int64_t out = linear_weight.size(0), parts = m.style.parts();
    desc << " out " << out;
    if (parts < 1 || out % parts != 0 || (out / parts) % n != 0)
      fail(who + ": its " + std::to_string(out) + " output features in " + std::to_string(parts) +
           " part(s) do not split evenly across" + ranks);
    if (m.style.heads() > 0 && m.style.heads() % n != 0)
      fail(who + ": its " + std::to_string(m.style.heads()) + " attention heads do not split across" + ranks);
  } else if (kind == TpStyle::Kind::Rowwise) {
    const int64_t in = linear_weight.size(1);
    desc << " in " << in;
    if (in % n != 0) fail(who + ": its " + std::to_string(in) + " input features do not split across" + ranks);
  } else if (kind == TpStyle::Kind::VocabEmbedding) {
    const int64_t v = emb->weight.size(0);
    desc << " vocab " << v;
    if (v % n != 0) fail(who + ": its vocabulary of " + std::to_string(v) + " does not split across" + ranks);
    if (emb->options.padding_idx() || emb->options.max_norm())
      fail(who + ": padding_idx and max_norm are not supported with a vocabulary split");
  }
  desc << "\n";
}

// Splits the matched modules' parameters (once each: a tied one may be
// matched twice) and attaches their layers.
class Splitter {
 public:
  Splitter(std::shared_ptr<World> tp, const TpPlan& plan, std::string me)
      : tp_(std::move(tp)), plan_(plan), me_(std::move(me)), n_(tp_->size()), r_(tp_->rank()) {}

  void apply(const Match& m) {
    auto layer = std::make_shared<TpLayer>();
    layer->name = m.name;
    layer->style = m.style;
    layer->group = tp_;
    layer->sequence_parallel = plan_.sequence_parallel();
    layer->sequence_dim = plan_.sequence_dim();
    const auto kind = m.style.kind();
    const std::string prefix = m.name.empty() ? "" : m.name + ".";
    if (auto* tied = dynamic_cast<TiedLinearImpl*>(m.module.get())) {
      if (kind == TpStyle::Kind::Colwise) split(tied->weight, prefix + "weight", 0, m.style.parts());
      if (kind == TpStyle::Kind::Rowwise) split(tied->weight, prefix + "weight", 1, 1);
      tied->tp = layer;
    } else if (auto* lin = dynamic_cast<ParallelLinearImpl*>(m.module.get())) {
      if (kind == TpStyle::Kind::Colwise) {
        split(lin->weight, prefix + "weight", 0, m.style.parts());
        if (lin->bias.defined()) split(lin->bias, prefix + "bias", 0, m.style.parts());
      } else if (kind == TpStyle::Kind::Rowwise) {
        split(lin->weight, prefix + "weight", 1, 1);
        // The bias is added after the reduction: whole on every rank; under
        // sequence parallelism to a slice of the sequence, so its gradient is partial.
        if (lin->bias.defined() && plan_.sequence_parallel())
          sum_gradient_over(lin->bias, tp_, prefix + "bias", hooked_);
      }
      lin->tp = layer;
    } else if (auto* emb = dynamic_cast<ParallelEmbeddingImpl*>(m.module.get())) {
      if (kind == TpStyle::Kind::VocabEmbedding) {
        const int64_t v = emb->weight.size(0);
        split(emb->weight, prefix + "weight", 0, 1);
        layer->vocab_start = r_ * (v / n_);
        layer->vocab_end = (r_ + 1) * (v / n_);
      }
      emb->tp = layer;
    }
    if (kind == TpStyle::Kind::SequenceParallel && plan_.sequence_parallel())
      for (auto& item : m.module->named_parameters(/*recurse=*/true))
        sum_gradient_over(item.value(), tp_, prefix + item.key(), hooked_);
    report.applied.emplace_back(m.name, kind);
  }

  TpReport report;

 private:
  void split(at::Tensor& p, const std::string& name, int64_t dim, int parts) {
    const void* key = p.unsafeGetTensorImpl();
    if (auto it = split_.find(key); it != split_.end()) {
      SHARDTORCH_CHECK(it->second == std::make_pair(dim, parts), me_, ": parameter '", name,
                       "' is split twice in different ways (tied to another split parameter?)");
      return;
    }
    const auto full = p.sizes().vec();
    if (is_deferred(p)) {  // materialised (by shard()) as its slice
      auto shape = full;
      shape[dim] /= n_;
      detail::defer_part(p, shape,
                         [dim, parts, n = n_, r = r_](const at::Tensor& v) { return slice_of(v, dim, parts, n, r); });
    } else {
      p.set_(slice_of(p.detach(), dim, parts, n_, r_).clone());
    }
    split_[key] = {dim, parts};
    detail::set_placement(p, detail::Placement{dim, parts, full, r_, n_, tp_});
    report.split.emplace_back(name, full);
  }

  std::shared_ptr<World> tp_;
  const TpPlan& plan_;
  const std::string me_;
  const int n_, r_;
  std::unordered_map<const void*, std::pair<int64_t, int>> split_;  // a parameter's split: (dim, parts)
  std::set<const void*> hooked_;
};

}  // namespace

TpReport parallelize(torch::nn::Module& model, std::shared_ptr<World> tp, const TpPlan& plan) {
  SHARDTORCH_CHECK(tp, "shardtorch::parallelize: no tensor-parallel World");
  World& group = *tp;
  const int n = group.size();
  const std::string me = detail::rank_prefix(group.global_rank()) + ": shardtorch::parallelize";
  // shard() took the parameters into flat shards: there is nothing left to split.
  bool sharded = detail::lookup_model(model) != nullptr;
  for (const auto& m : model.modules(/*include_self=*/true))
    if (auto* u = dynamic_cast<UnitBase*>(m.get()); u && u->is_sharded_unit()) sharded = true;
  SHARDTORCH_CHECK(!sharded, me,
                   ": the model is sharded already; call parallelize() before shard() (shard() "
                   "then shards each rank's slices over the data-parallel group)");
  std::string bad;  // this rank's configuration error, raised after the agreement
  const Fail fail = [&](const std::string& why) {
    if (bad.empty()) bad = why;
  };
  const std::vector<Match> matched = match_rules(model, plan, fail);
  std::ostringstream desc;
  desc << "tensor-parallel group of " << n << ", sequence parallel " << plan.sequence_parallel() << " on dim "
       << plan.sequence_dim() << "\n";
  for (const auto& m : matched) check_match(m, n, desc, fail);
  const auto all = group.comm().all_gather_strings(desc.str(), "the tensor-parallel plan");
  for (int k = 0; k < n; ++k) {
    if (all[k] == all[0]) continue;
    const auto d = detail::first_line_difference(all[0], all[k]);
    SHARDTORCH_CHECK(false, me, ": the ranks of the tensor-parallel group apply different plans or models: line ",
                     d.line, " of the plan as applied is '", d.a, "' on rank ", group.global_rank_of(0), " but '", d.b,
                     "' on rank ", group.global_rank_of(k), " (the group's options, then a line per module a ",
                     "rule matched: its name, style and sizes)");
  }
  SHARDTORCH_CHECK(bad.empty(), me, ": ", bad);
  detail::require_same_parameters(model, group, /*unsplit_only=*/false, me.substr(me.find("shardtorch::")),
                                  "parallelize() splits each rank's copy as if they were equal: build the model "
                                  "from the same seed on every rank (torch::manual_seed before construction), or "
                                  "deferred (shardtorch::deferred, with skip_deferred_init when a checkpoint loaded "
                                  "after shard() gives the values)");

  c10::NoGradGuard no_grad;
  Splitter splitter(tp, plan, me);
  for (const auto& m : matched) splitter.apply(m);
  group.note_progress("parallelize() done");
  return std::move(splitter.report);
}

// ---------------------------------------------------------------- cross entropy

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        const std::shared_ptr<World>& tp) {
  SHARDTORCH_CHECK(tp, "shardtorch::vocab_parallel_cross_entropy: no tensor-parallel World");
  Comm& comm = tp->comm();
  const int64_t v = local_logits.size(-1), start = tp->rank() * v;
  SHARDTORCH_CHECK(targets.sizes() == local_logits.sizes().slice(0, local_logits.dim() - 1),
                   detail::rank_prefix(tp->global_rank()), ": vocab_parallel_cross_entropy: targets ",
                   describe(targets), " do not match the logits ", describe(local_logits),
                   " without their last dimension");
  at::Tensor logits = local_logits.to(at::promote_types(local_logits.scalar_type(), at::kFloat));
  at::Tensor max;
  {
    c10::NoGradGuard no_grad;
    max = std::get<0>(logits.max(-1)).contiguous();
    if (comm.size() > 1)
      comm.all_reduce(max, c10d::ReduceOp::MAX, "the logits' maximum (vocab-parallel cross entropy)");
  }
  const at::Tensor shifted = logits - max.unsqueeze(-1);
  const at::Tensor sum_exp = detail::tp::reduce_from_group(shifted.exp().sum(-1), comm,
                                                           "the exponentials' sum (vocab-parallel cross entropy)");
  const at::Tensor outside = (targets < start) | (targets >= start + v);
  const at::Tensor local = (targets - start).masked_fill(outside, 0);
  const at::Tensor picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0);
  const at::Tensor target_logit =
      detail::tp::reduce_from_group(picked, comm, "the targets' logits (vocab-parallel cross entropy)");
  return (sum_exp.log() - target_logit).mean();
}

}  // namespace shardtorch
