// Pipeline: the layers cut into stages, this rank's stages built and sharded
// over the data-parallel dimension, the parameters tied across stages found
// (docs/parallelism.md). The step itself is in pipeline_step.cpp.
#include "shardtorch/pipeline.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <unordered_map>

#include "base/check.h"
#include "base/files.h"
#include "base/log.h"
#include "base/text.h"
#include "parallel/pipeline_runtime.h"
#include "runtime/shard_state.h"
#include "shardtorch/deferred.h"

namespace shardtorch {
namespace detail {
namespace {

// A layer's parameters, each distinct tensor once, named as in the unsplit model.
std::vector<std::pair<std::string, at::Tensor>> layer_params(const PipelineLayer& layer) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::set<const void*> seen;
  for (const auto& [path, module] : layer.modules)
    for (const auto& item : module->named_parameters(/*recurse=*/true))
      if (seen.insert(item.value().unsafeGetTensorImpl()).second)
        out.emplace_back(path + "." + item.key(), item.value());
  return out;
}

// The first layer of each of `stages` stages, splitting `weight` (per layer)
// into contiguous parts whose largest sum is as small as it can be.
std::vector<int> balanced_split(const std::vector<int64_t>& weight, int stages) {
  const int n = static_cast<int>(weight.size());
  std::vector<int64_t> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + weight[i];
  const int64_t inf = std::numeric_limits<int64_t>::max();
  // best[s][i]: the smallest largest part of layers [0, i) in s parts; cut[s][i] where the last part begins.
  std::vector<std::vector<int64_t>> best(stages + 1, std::vector<int64_t>(n + 1, inf));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s)
    for (int i = s; i <= n; ++i)
      for (int j = s - 1; j < i; ++j) {
        if (best[s - 1][j] == inf) continue;
        const int64_t v = std::max(best[s - 1][j], prefix[i] - prefix[j]);
        if (v < best[s][i]) {
          best[s][i] = v;
          cut[s][i] = j;
        }
      }
  std::vector<int> starts(stages);
  for (int s = stages, i = n; s >= 1; --s) {
    starts[s - 1] = cut[s][i];
    i = cut[s][i];
  }
  return starts;
}

std::string dims_text(c10::IntArrayRef sizes) {
  std::ostringstream os;
  os << sizes;
  return os.str();
}

// The first layer of each stage from PipelineOptions::split_at; "" or why not.
std::string named_split(const std::vector<PipelineLayer>& layers, const std::vector<std::string>& names, int stages,
                        std::vector<int>& starts) {
  if (static_cast<int>(names.size()) != stages - 1)
    return "split_at names " + std::to_string(names.size()) + " layers; " + std::to_string(stages) + " stages need " +
           std::to_string(stages - 1);
  starts.push_back(0);
  for (const auto& name : names) {
    auto it = std::find_if(layers.begin(), layers.end(), [&](const PipelineLayer& l) { return l.name == name; });
    if (it == layers.end()) {
      std::string known;
      for (size_t i = 0; i < layers.size() && i < 24; ++i) known += (i ? ", '" : "'") + layers[i].name + "'";
      if (layers.size() > 24) known += ", ... (" + std::to_string(layers.size()) + " in all)";
      return "split_at names layer '" + name + "', which is not one of the layers (" + known + ")";
    }
    const int at = static_cast<int>(it - layers.begin());
    if (at <= starts.back()) return "split_at: layer '" + name + "' does not come after the previous split point";
    starts.push_back(at);
  }
  return "";
}

// What every rank must agree on (the options, the layers with their
// parameters, the split) as text, the split, and this rank's configuration
// error ("" if none), raised only after the ranks agree.
struct Design {
  std::string text;
  std::vector<int> starts;
  std::string bad;
  /// The layer indices of each stage, of `n` layers in all.
  std::vector<std::vector<int>> by_stage(int n) const {
    std::vector<std::vector<int>> out(starts.size());
    for (size_t s = 0; s < starts.size(); ++s)
      for (int l = starts[s]; l < (s + 1 < starts.size() ? starts[s + 1] : n); ++l) out[s].push_back(l);
    return out;
  }
};

Design design(const std::vector<PipelineLayer>& layers, const PipelineOptions& options, int p, int dp_size) {
  Design d;
  const int v = options.chunks_per_rank(), stages = p * v;
  const int n = static_cast<int>(layers.size());
  auto fail = [&](const std::string& why) {
    if (d.bad.empty()) d.bad = why;
  };
  std::vector<int64_t> weight(n, 0);
  std::set<const void*> counted;
  std::ostringstream desc;
  desc << "schedule " << schedule_name(options.schedule()) << ", " << options.microbatches() << " micro-batches, " << v
       << " chunk(s) per rank, " << p << " pipeline ranks, " << dp_size << " data-parallel, strategy "
       << strategy_name(options.shard().strategy()) << "\n";
  for (int i = 0; i < n; ++i) {
    const auto& l = layers[i];
    if (!l.forward) fail("layer " + std::to_string(i) + " ('" + l.name + "') has no forward");
    desc << "layer " << i << " '" << l.name << "':";
    for (const auto& [path, m] : l.modules) desc << " " << path;
    desc << "\n";
    for (const auto& [name, t] : layer_params(l)) {
      desc << "  " << name << " " << c10::toString(t.scalar_type()) << dims_text(t.sizes())
           << (t.requires_grad() ? "" : " frozen") << "\n";
      if (counted.insert(t.unsafeGetTensorImpl()).second) weight[i] += t.numel();
    }
  }
  if (options.shard().mixed_precision().param_dtype() == at::kHalf)
    fail(
        "fp16 mixed precision needs a loss scaler (GradScaler), which a pipeline's step does not apply yet; use "
        "bf16 (MixedPrecision().param_dtype(at::kBFloat16))");
  if (n < stages)
    fail(std::to_string(n) + " layers cannot fill " + std::to_string(stages) + " stages (" + std::to_string(p) +
         " pipeline ranks x " + std::to_string(v) + " chunks)");
  else if (options.split_at().empty())
    d.starts = balanced_split(weight, stages);
  else
    fail(named_split(layers, options.split_at(), stages, d.starts));
  desc << "stages begin at layers:";
  for (int s : d.starts) desc << " " << s << " '" << layers[static_cast<size_t>(s)].name << "'";
  d.text = desc.str();
  return d;
}

// Throws on every rank, naming the first line that differs, unless every
// rank of `world` has the same `text` (collective).
void require_same_design(World& world, const std::string& text, const std::string& me) {
  const auto all = world.comm().all_gather_strings(text, "the pipeline's layers and options");
  for (int r = 0; r < world.size(); ++r) {
    if (all[r] == all[0]) continue;
    const auto d = detail::first_line_difference(all[0], all[r]);
    SHARDTORCH_CHECK(false, me, ": the ranks build different pipelines: line ", d.line, " of the description is '", d.a,
                     "' on rank ", world.global_rank_of(0), " but '", d.b, "' on rank ", world.global_rank_of(r),
                     "; every rank must pass the same layers and PipelineOptions");
  }
}

}  // namespace

std::string PipelineRuntime::where(int stage, int mb) const {
  std::ostringstream os;
  os << "stage " << stage << " of " << stages();
  if (mb >= 0) os << ", micro-batch " << mb << " of " << plan.microbatches;
  return os.str();
}

at::Tensor PipelineRuntime::run_stage(int stage, const at::Tensor& x) const {
  at::Tensor y = x;
  for (int l : stage_layers[stage]) y = layers[l].forward(y);
  return y;
}

void PipelineRuntime::find_tied(bool has_dp) {
  World& world = *mesh->world();
  const auto& dims = mesh->dims();
  // Each distinct parameter's holders, by stage in stage order, with its name there.
  std::unordered_map<const void*, std::vector<std::pair<int, std::string>>> holders;
  std::vector<const void*> order;
  std::unordered_map<const void*, at::Tensor> tensors;
  for (int s = 0; s < stages(); ++s)
    for (int l : stage_layers[s])
      for (const auto& [name, t] : layer_params(layers[l])) {
        auto& h = holders[t.unsafeGetTensorImpl()];
        if (h.empty()) order.push_back(t.unsafeGetTensorImpl());
        if (h.empty() || h.back().first != s) h.emplace_back(s, name);
        tensors[t.unsafeGetTensorImpl()] = t;
      }
  std::map<std::vector<int>, std::shared_ptr<Comm>> groups;  // by the pipeline ranks holding a tie
  const Strategy strategy = options.shard().strategy();
  for (const void* key : order) {
    const auto& h = holders[key];
    std::set<int> pranks;
    for (const auto& [s, name] : h) pranks.insert(plan.rank_of(s));
    if (pranks.size() < 2 || !pranks.count(rank)) continue;
    std::vector<int> members;
    for (int pr : pranks)
      for (int d = 0; d < dp->size(); ++d) {
        std::vector<int> coords;
        for (const auto& [dim, size] : dims)
          coords.push_back(dim == options.pp_dim()               ? pr
                           : (has_dp && dim == options.dp_dim()) ? d
                                                                 : mesh->coordinate(dim));
        members.push_back(mesh->rank_at(coords));
      }
    std::vector<int> key_ranks(pranks.begin(), pranks.end());
    auto& group = groups[key_ranks];
    if (!group) group = world.new_group(members, "pipeline tied parameters");
    TiedParam tp;
    for (const auto& [s, name] : h) {
      tp.all.push_back(name);
      if (tp.name.empty() && holds(s)) tp.name = name;
    }
    tp.tensor = tensors[key];
    state->stage().tied_names[key] = tp.all;
    tp.counted_here = holds(h.front().first);
    tp.group = group;
    tp.copies = strategy == Strategy::NoShard || strategy == Strategy::OptimizerOnly ? dp->size()
                : strategy == Strategy::HybridShard ? dp->size() / std::max(1, options.shard().hybrid_shard_size())
                                                    : 1;
    tied.push_back(std::move(tp));
  }
  if (!tied.empty() || !groups.empty()) check_tied_equal();
}

}  // namespace detail

using detail::PipelineRuntime;

Pipeline::Pipeline(std::vector<PipelineLayer> layers, std::shared_ptr<DeviceMesh> mesh, PipelineOptions options)
    : rt_(std::make_unique<PipelineRuntime>()) {
  SHARDTORCH_CHECK(mesh, "shardtorch::Pipeline: no device mesh");
  auto& rt = *rt_;
  World& world = *mesh->world();
  const std::string me = detail::rank_prefix(world.global_rank()) + ": shardtorch::Pipeline";
  rt.mesh = mesh;
  rt.options = options;
  const auto& dims = mesh->dims();
  std::string names;
  for (const auto& d : dims) names += (names.empty() ? "'" : ", '") + d.first + "'";
  SHARDTORCH_CHECK(std::any_of(dims.begin(), dims.end(), [&](const auto& d) { return d.first == options.pp_dim(); }),
                   me, ": the device mesh ", mesh->describe(), " has no dimension '", options.pp_dim(),
                   "' for the stages (it has ", names,
                   "); name it in PipelineOptions::pp_dim (and the data-parallel one in dp_dim)");
  rt.pp = mesh->group(options.pp_dim());
  const bool has_dp = !options.dp_dim().empty() &&
                      std::any_of(dims.begin(), dims.end(), [&](const auto& d) { return d.first == options.dp_dim(); });
  rt.dp = has_dp ? mesh->group(options.dp_dim()) : world.subworld({world.rank()}, "pipeline stage without dp");
  rt.rank = rt.pp->rank();
  const int p = rt.pp->size(), v = options.chunks_per_rank(), stages = p * v;
  const int n = static_cast<int>(layers.size());

  // Checked before anything else can fail on one rank alone.
  detail::Design design = detail::design(layers, options, p, rt.dp->size());
  try {
    if (design.bad.empty()) rt.plan = pipeline::make_plan(options.schedule(), p, v, options.microbatches());
  } catch (const std::exception& e) {
    design.bad = e.what();
    const std::string lead = "shardtorch: ";  // `me` names the library already
    if (design.bad.compare(0, lead.size(), lead) == 0) design.bad.erase(0, lead.size());
  }
  detail::require_same_design(world, design.text, me);
  SHARDTORCH_CHECK(design.bad.empty(), me, ": ", design.bad);

  rt.layers = std::move(layers);
  rt.stage_layers = design.by_stage(n);

  // This rank's stages, placed in one module and sharded together.
  rt.module = detail::PipelineStage();
  for (int s = 0; s < stages; ++s)
    if (rt.holds(s))
      for (int l : rt.stage_layers[s])
        for (const auto& [path, m] : rt.layers[l].modules) rt.module->place(path, m);
  rt.sharded.emplace(shard(*rt.module, rt.dp, options.shard()));
  const Strategy strategy = options.shard().strategy();
  if (rt.dp->size() == 1 && strategy != Strategy::NoShard && !options.shard().cpu_offload() && world.rank() == 0)
    SHARDTORCH_WARN("Pipeline: strategy ", strategy_name(strategy),
                    " over a data-parallel group of one rank shards nothing: each stage's parameters are whole on "
                    "its rank either way",
                    strategy == Strategy::FullShard || strategy == Strategy::HybridShard
                        ? ", and each step gathers a second copy of them"
                        : "",
                    "; NoShard (PipelineOptions().shard(ShardOptions().strategy(Strategy::NoShard))) costs less "
                    "memory and time (docs/parallelism.md, \"Composition with sharding\")");
  rt.state = detail::require_state(*rt.module, "shardtorch::Pipeline");
  rt.state->gathers().set_pipelined();
  rt.state->stage().partial = p > 1 || rt.dp->size() != world.size();
  rt.find_tied(has_dp);

  const bool gathers =
      options.shard().strategy() == Strategy::FullShard || options.shard().strategy() == Strategy::HybridShard;
  if (gathers || !rt.tied.empty()) {
    pipeline::PlanOptions po;
    po.gathers = gathers;
    po.tied = !rt.tied.empty();
    rt.plan = pipeline::make_plan(options.schedule(), p, v, options.microbatches(), po);
  }
  pipeline::PlanOptions fo;
  fo.gathers = gathers;
  rt.forward_plan = pipeline::make_forward_plan(p, v, options.microbatches(), fo);
  world.note_progress("pipeline built");
}

std::vector<UnitSpec> pipeline_unit_specs(const std::vector<PipelineLayer>& layers, const PipelineOptions& options,
                                          int pp_size, int pp_rank) {
  SHARDTORCH_CHECK(pp_size >= 1 && pp_rank >= 0 && pp_rank < pp_size, "shardtorch::pipeline_unit_specs: rank ", pp_rank,
                   " of ", pp_size, " pipeline ranks");
  const detail::Design design = detail::design(layers, options, pp_size, 1);
  SHARDTORCH_CHECK(design.bad.empty(), "shardtorch::pipeline_unit_specs: ", design.bad);
  const pipeline::Plan plan =
      pipeline::make_plan(options.schedule(), pp_size, options.chunks_per_rank(), options.microbatches());
  const auto by_stage = design.by_stage(static_cast<int>(layers.size()));
  auto stage = detail::PipelineStage();
  for (size_t s = 0; s < by_stage.size(); ++s)
    if (plan.rank_of(static_cast<int>(s)) == pp_rank)
      for (int l : by_stage[s])
        for (const auto& [path, m] : layers[l].modules) stage->place(path, m);
  return unit_specs(*stage);
}

Pipeline::~Pipeline() = default;
Pipeline::Pipeline(Pipeline&&) noexcept = default;
Pipeline& Pipeline::operator=(Pipeline&&) noexcept = default;

at::Tensor Pipeline::step(const at::Tensor& inputs, const at::Tensor& targets, const LossFn& loss) {
  return rt_->step(inputs, targets, loss);
}

at::Tensor Pipeline::evaluate(const at::Tensor& inputs, const at::Tensor& targets, const LossFn& loss) {
  return rt_->evaluate(inputs, targets, loss);
}

torch::nn::Module& Pipeline::module() const { return *rt_->module; }
ShardedModel Pipeline::sharded() const { return *rt_->sharded; }

std::vector<int> Pipeline::stages() const {
  std::vector<int> out;
  for (int s = 0; s < rt_->stages(); ++s)
    if (rt_->holds(s)) out.push_back(s);
  return out;
}

int Pipeline::num_stages() const { return rt_->stages(); }
bool Pipeline::is_first_stage() const { return rt_->holds(0); }
bool Pipeline::is_last_stage() const { return rt_->holds(rt_->stages() - 1); }

std::vector<std::vector<std::string>> Pipeline::stage_layers() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& s : rt_->stage_layers) {
    out.emplace_back();
    for (int l : s) out.back().push_back(rt_->layers[l].name);
  }
  return out;
}

const pipeline::Plan& Pipeline::plan() const { return rt_->plan; }
const std::vector<PipelineEvent>& Pipeline::timeline() const { return rt_->timeline; }

double Pipeline::clip_grad_norm(double max_norm, double norm_type) { return rt_->clip_grad_norm(max_norm, norm_type); }

std::vector<std::pair<std::string, std::string>> Pipeline::tied_parameters() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& t : rt_->tied)
    for (size_t i = 1; i < t.all.size(); ++i) out.emplace_back(t.all[0], t.all[i]);
  return out;
}

void Pipeline::write_timeline(const std::string& path) const {
  World& world = *rt_->mesh->world();
  std::ostringstream mine;
  mine << "{\"rank\": " << world.global_rank() << ", \"pipeline_rank\": " << rt_->rank << ", \"actions\": [";
  for (size_t i = 0; i < rt_->timeline.size(); ++i) {
    const auto& e = rt_->timeline[i];
    mine << (i ? ", " : "") << "{\"action\": \"" << e.action.str() << "\", \"start\": " << e.start
         << ", \"end\": " << e.end << "}";
  }
  mine << "]}";
  const auto all = world.comm().all_gather_strings(mine.str(), "the pipeline's timelines");
  if (world.rank() != 0) return;
  std::ostringstream out;
  const char* schedule = rt_->timeline_of_evaluation ? "forward" : schedule_name(rt_->plan.schedule);
  out << "{\"schedule\": \"" << schedule << "\", \"pipeline_ranks\": " << rt_->plan.ranks
      << ", \"chunks_per_rank\": " << rt_->plan.chunks << ", \"microbatches\": " << rt_->plan.microbatches
      << ", \"ranks\": [\n";
  for (size_t r = 0; r < all.size(); ++r) out << "  " << all[r] << (r + 1 < all.size() ? ",\n" : "\n");
  out << "]}\n";
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    SHARDTORCH_CHECK(f, detail::rank_prefix(world.global_rank()), ": cannot write the pipeline timeline to '", tmp,
                     "'");
    f << out.str();
    f.close();
    SHARDTORCH_CHECK(f, detail::rank_prefix(world.global_rank()), ": writing the pipeline timeline to '", tmp,
                     "' failed");
  }
  files::rename_durably(tmp, path);
}

}  // namespace shardtorch
