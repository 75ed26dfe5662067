#include "shardtorch/plan.h"
#include "base/check.h"

#include "buckets/reduce_scatter_bucketer.h"

#include <algorithm>
#include <map>
#include <sstream>

namespace shardtorch {

int64_t MemoryPlan::model_state() const {
  return of(Mem::ShardedParams) + of(Mem::ReplicatedParams) + of(Mem::Gradients) + of(Mem::OptimizerState) +
         of(Mem::HostParams) + of(Mem::HostGradients) + of(Mem::HostOptimizerState);
}

int64_t MemoryPlan::host() const {
  return of(Mem::HostParams) + of(Mem::HostGradients) + of(Mem::HostOptimizerState) + of(Mem::Snapshots);
}

int64_t MemoryPlan::device_peak() const {
  return of(Mem::ShardedParams) + of(Mem::ReplicatedParams) + of(Mem::Gradients) + of(Mem::OptimizerState) +
         transient();
}

int64_t MemoryPlan::transient() const {
  return of(Mem::GatheredParams) + of(Mem::GradStaging) + of(Mem::Buckets) + of(Mem::MasterGrads);
}

std::string MemoryPlan::report() const {
  std::ostringstream os;
  for (int i = 0; i < static_cast<int>(Mem::kCount); ++i) {
    if (bytes[i] == 0) continue;
    auto m = static_cast<Mem>(i);
    const bool estimate = m == Mem::GatheredParams || m == Mem::GradStaging || m == Mem::Buckets;
    os << "  " << mem_name(m) << " " << format_bytes(bytes[i])
       << (estimate                ? " (peak, estimate)"
           : m == Mem::MasterGrads ? " (backward to step)"
                                   : "")
       << "\n";
  }
  os << "  model state " << format_bytes(model_state()) << " | device peak " << format_bytes(device_peak())
     << " | host " << format_bytes(host()) << "\n";
  return os.str();
}

namespace {
int64_t esize(at::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }

// The ranks a parameter is sharded over; throws on options plan_memory cannot plan.
int checked_shard_size(const PlanOptions& plan) {
  const ShardOptions& o = plan.options;
  SHARDTORCH_CHECK(plan.world_size >= 1, "plan_memory: world size ", plan.world_size, " must be at least 1");
  SHARDTORCH_CHECK(plan.optimizer_states >= 0, "plan_memory: optimizer_states must not be negative");
  SHARDTORCH_CHECK(!(o.cpu_offload() && o.strategy() == Strategy::NoShard),
                   "plan_memory: cpu_offload needs a sharding strategy");
  if (o.strategy() != Strategy::HybridShard) return plan.world_size;
  SHARDTORCH_CHECK(o.hybrid_shard_size() >= 1 && plan.world_size % o.hybrid_shard_size() == 0,
                   "plan_memory: "
                   "hybrid_shard_size ",
                   o.hybrid_shard_size(), " must divide the world size ", plan.world_size);
  return o.hybrid_shard_size();
}

// Whether shard() gives batch norm's parameters flats of their own, kept in
// their dtype (MixedPrecision::keep_batch_norm_fp32; sharded.cpp's `keep`).
bool keeps_batch_norm(const MixedPrecision& mp) {
  return mp.keep_batch_norm_fp32() && (mp.param_dtype() || mp.buffer_dtype());
}

// The units as shard() lays them out under `mp`: a batch-norm flat not kept
// apart joins the unit's flat of its dtype and trainability.
std::vector<UnitSpec> as_laid_out(const std::vector<UnitSpec>& units, const MixedPrecision& mp) {
  if (keeps_batch_norm(mp)) return units;
  std::vector<UnitSpec> out;
  for (const auto& u : units) {
    UnitSpec merged{u.name, {}};
    for (const auto& f : u.flats) {
      auto same = std::find_if(merged.flats.begin(), merged.flats.end(),
                               [&](const FlatSpec& g) { return g.dtype == f.dtype && g.trainable == f.trainable; });
      if (same != merged.flats.end()) {
        same->numel += f.numel;
      } else {
        merged.flats.push_back(FlatSpec{f.numel, f.dtype, f.trainable});
      }
    }
    out.push_back(std::move(merged));
  }
  return out;
}

// The dtypes mixed precision gives a flat parameter (after as_laid_out).
struct Precision {
  const MixedPrecision& mp;
  bool cast(const FlatSpec& f) const {
    return mp.param_dtype() && at::isFloatingType(f.dtype) && !(f.batch_norm && keeps_batch_norm(mp));
  }
  at::ScalarType compute(const FlatSpec& f) const { return cast(f) ? *mp.param_dtype() : f.dtype; }
  // The sharded strategies reduce a flat kept in its dtype in that dtype.
  at::ScalarType reduce(const FlatSpec& f) const {
    return cast(f) ? mp.reduce_dtype().value_or(*mp.param_dtype()) : f.dtype;
  }
  // NoShard's all-reduce buckets: the reduce dtype for every floating-point
  // parameter under mixed precision, kept ones too.
  at::ScalarType bucket(const FlatSpec& f) const {
    return mp.param_dtype() && at::isFloatingType(f.dtype) ? mp.reduce_dtype().value_or(*mp.param_dtype()) : f.dtype;
  }
};

void add(MemoryPlan& out, Mem m, int64_t b) { out.bytes[static_cast<size_t>(m)] += b; }

// NoShard: whole parameters, gradients in the all-reduce buckets.
void plan_replicated(const std::vector<UnitSpec>& units, const PlanOptions& plan, MemoryPlan& out) {
  const auto& mp = plan.options.mixed_precision();
  const Precision p{mp};
  for (const auto& u : units) {
    for (const auto& f : u.flats) {
      out.params += f.numel;
      add(out, Mem::ReplicatedParams, f.numel * esize(p.compute(f)));  // frozen ones too: whole everywhere
      // Masters (ReplicatedPath::enable): a trainable parameter has one under
      // any param_dtype, even its own dtype or kept in it; a frozen one only when cast.
      if (p.compute(f) != f.dtype || (f.trainable && mp.param_dtype() && at::isFloatingType(f.dtype)))
        add(out, Mem::ReplicatedParams, f.numel * esize(f.dtype));
      if (!f.trainable) continue;
      const at::ScalarType rd = p.bucket(f);
      add(out, Mem::Gradients, f.numel * esize(rd));                            // the all-reduce buckets
      if (rd != f.dtype) add(out, Mem::MasterGrads, f.numel * esize(f.dtype));  // transient: backward to step
      add(out, Mem::OptimizerState, plan.optimizer_states * f.numel * esize(f.dtype));
    }
  }
}

// The sharded strategies' transient memory, gathered while tallying what
// each unit holds for good.
struct Transients {
  int64_t root_gathered = 0, other_gathered = 0, kept_gathered = 0, root_staging = 0, other_staging = 0;
  int64_t all_staging = 0, all_gathered = 0;
  // Reduce dtype -> (shard elements that go through buckets, the largest
  // shard too big for a bucket, reduced alone).
  std::map<at::ScalarType, std::pair<int64_t, int64_t>> reduced;
  std::map<at::ScalarType, int64_t> all_cols;  // every shard element reduced, bucketed or not
  std::vector<int64_t> all_reduced;            // OptimizerOnly: the staging gradients, each all-reduced alone
};

// Adds what every unit holds between steps (shards, gradients, optimizer
// state, persistent full buffers) and returns what it needs in a step.
Transients tally_units(const std::vector<UnitSpec>& units, const PlanOptions& plan, int shard_size, MemoryPlan& out) {
  const ShardOptions& o = plan.options;
  const Strategy strategy = o.strategy();
  const Precision p{o.mixed_precision()};
  const bool off = o.cpu_offload();
  const Mem shard_cat = off ? Mem::HostParams : Mem::ShardedParams;
  const Mem grad_cat = off ? Mem::HostGradients : Mem::Gradients;
  const Mem opt_cat = off ? Mem::HostOptimizerState : Mem::OptimizerState;
  const bool persistent = strategy == Strategy::ShardGradOp || strategy == Strategy::OptimizerOnly;
  const int64_t bucket_bytes = static_cast<int64_t>(o.bucket_mb() * 1024.0 * 1024.0);
  Transients t;
  for (const auto& u : units) {
    SHARDTORCH_CHECK(u.name != "<none>", "plan_memory: some parameters belong to no unit and the root is not a unit");
    int64_t gathered = 0, staging = 0;
    for (const auto& f : u.flats) {
      out.params += f.numel;
      const int64_t S = (f.numel + shard_size - 1) / shard_size, padded = S * shard_size;
      const int64_t owned = std::min(f.numel, S);  // rank 0 owns the most (padding sits at the end)
      const at::ScalarType cd = p.compute(f), rd = p.reduce(f);
      if (persistent) {
        add(out, Mem::ReplicatedParams, padded * esize(cd));
        if (cd != f.dtype || off) add(out, shard_cat, S * esize(f.dtype));  // else the shard is a view of it
      } else {
        add(out, shard_cat, S * esize(f.dtype));
        gathered += padded * esize(cd);
      }
      if (off && f.dtype == at::kFloat && cd == at::kBFloat16) add(out, Mem::HostParams, S * 2);  // the bf16 copy sent
      if (!f.trainable) continue;
      add(out, grad_cat, (strategy == Strategy::OptimizerOnly ? padded : S) * esize(f.dtype));
      add(out, opt_cat, plan.optimizer_states * owned * esize(f.dtype));
      staging += padded * esize(rd);
      if (strategy == Strategy::OptimizerOnly) {
        t.all_reduced.push_back(padded * esize(rd));
      } else {
        t.all_cols[rd] += S;
        auto& [bucketed, biggest] = t.reduced[rd];
        if (S * esize(rd) * shard_size <= bucket_bytes) {
          bucketed += S;
        } else {
          biggest = std::max(biggest, S);  // its staging buffer is in flight while it is reduced
        }
      }
    }
    t.all_staging += staging;
    t.all_gathered += gathered;
    if (u.name.empty()) {
      t.root_gathered = gathered, t.root_staging = staging;
    } else if (!o.reshard_after_forward_of(u.name)) {
      t.kept_gathered += gathered;  // stays gathered from its forward to the end of backward
      t.other_staging = std::max(t.other_staging, staging);
    } else {
      t.other_gathered = std::max(t.other_gathered, gathered), t.other_staging = std::max(t.other_staging, staging);
    }
  }
  return t;
}

// Adds the peak of a step's transient memory: gathered units, staging gradients, buckets.
void add_peaks(Transients& t, const PlanOptions& plan, int shard_size, MemoryPlan& out) {
  const ShardOptions& o = plan.options;
  const int64_t bucket_bytes = static_cast<int64_t>(o.bucket_mb() * 1024.0 * 1024.0);
  // The root (and every unit not resharded after forward) stays gathered
  // through backward beside one other unit; two units' staging buffers at
  // most are alive at once, except under accumulation without
  // synchronisation, where every unit keeps one (docs/memory.md).
  // With prefetch, the next unit is gathered while one computes.
  // A pipeline stage gathers every unit for the step and reduces once, after
  // its last backward: every unit's staging gradient is alive then.
  add(out, Mem::GatheredParams,
      plan.pipelined ? t.all_gathered
                     : t.root_gathered + t.kept_gathered + t.other_gathered * (o.prefetches() ? 2 : 1));
  add(out, Mem::GradStaging, plan.accumulates || plan.pipelined ? t.all_staging : t.root_staging + t.other_staging);
  // Per reduce dtype, [N, cols] inputs and [cols] outputs (none on Gloo,
  // which reduces in place: there the estimate is 1/N high): the bucket filling
  // (grown by doubling: up to twice what it holds, never beyond its cap) and
  // at most kMaxReduceScattersInFlight launched ones (a bucket, at most its
  // cap or all bucketed columns, or a shard too big for a bucket).
  // A pipeline stage reduces every unit after its last backward: every
  // column at once.
  const int64_t rows = shard_size + (plan.reduces_in_place ? 0 : 1);
  for (const auto& [dtype, sizes] : t.reduced) {
    const auto [bucketed, biggest] = sizes;
    const int64_t cap = bucket_bytes / (esize(dtype) * shard_size);
    int64_t cols =
        std::min(cap, 2 * bucketed) + kMaxReduceScattersInFlight * std::max(std::min(cap, bucketed), biggest);
    if (plan.pipelined) cols = t.all_cols[dtype];
    add(out, Mem::Buckets, rows * cols * esize(dtype));
  }
  // OptimizerOnly all-reduces each staging gradient alone, in place, at most
  // kMaxReduceScattersInFlight at once (never past it); in flight they count
  // as buckets: at most the largest that many.
  std::sort(t.all_reduced.rbegin(), t.all_reduced.rend());
  for (size_t k = 0; k < t.all_reduced.size() && k < static_cast<size_t>(kMaxReduceScattersInFlight); ++k)
    add(out, Mem::Buckets, t.all_reduced[k]);
}
}  // namespace

// startup_deferred and startup_eager (plan.h): shard() makes the units in
// order; while it makes unit u a rank holds what the units before u keep,
// u's full buffers (sharded strategies; the casts under mixed precision) and
// its shard, and, eagerly constructed, the parameters of u and every later unit.
void add_startup(const std::vector<UnitSpec>& units, const PlanOptions& plan, int shard_size, MemoryPlan& out) {
  const ShardOptions& o = plan.options;
  const Precision p{o.mixed_precision()};
  const bool keeps_full = o.strategy() == Strategy::NoShard || o.strategy() == Strategy::ShardGradOp ||
                          o.strategy() == Strategy::OptimizerOnly;  // the full buffers are in the categories
  std::vector<int64_t> constructed, kept, full;
  for (const auto& u : units) {
    MemoryPlan one;
    if (o.strategy() == Strategy::NoShard)
      plan_replicated({u}, plan, one);
    else
      tally_units({u}, plan, shard_size, one);
    int64_t c = 0, f = 0;
    for (const auto& fs : u.flats) {
      const int64_t padded = (fs.numel + shard_size - 1) / shard_size * shard_size;
      c += fs.numel * esize(fs.dtype);
      if (keeps_full) continue;
      f += padded * esize(fs.dtype);
      if (p.compute(fs) != fs.dtype) f += padded * esize(p.compute(fs));  // set_mixed_precision's cast
    }
    constructed.push_back(c);
    kept.push_back(one.of(Mem::ShardedParams) + one.of(Mem::ReplicatedParams) + one.of(Mem::HostParams));
    full.push_back(f);
  }
  if (o.strategy() == Strategy::NoShard) {  // the parameters stay where they were made
    out.startup_deferred = out.startup_eager = out.of(Mem::ReplicatedParams);
    return;
  }
  int64_t later = 0;
  for (int64_t c : constructed) later += c;
  int64_t before = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    out.startup_deferred = std::max(out.startup_deferred, before + full[u] + kept[u]);
    out.startup_eager = std::max(out.startup_eager, later + before + full[u] + kept[u]);
    later -= constructed[u];
    before += kept[u];
  }
}

namespace {

// The in-memory snapshots: what rank 0 holds of each flat parameter (the
// most; NoShard: all of it) in its master dtype, with the optimizer state
// of the trainable ones; two generations of its own and of the copy it keeps.
void add_snapshots(const std::vector<UnitSpec>& units, const PlanOptions& plan, int shard_size, MemoryPlan& out) {
  if (!plan.snapshots) return;
  const int n = plan.options.strategy() == Strategy::NoShard ? 1 : shard_size;
  int64_t one = 0;
  for (const auto& u : units)
    for (const auto& f : u.flats) {
      const int64_t owned = std::min(f.numel, (f.numel + n - 1) / n);
      one += owned * esize(f.dtype) * (1 + (f.trainable ? plan.optimizer_states : 0));
    }
  add(out, Mem::Snapshots, 2 * one * (plan.world_size > 1 ? 2 : 1));
}

}  // namespace

MemoryPlan plan_memory(const std::vector<UnitSpec>& specs, const PlanOptions& plan) {
  const int shard_size = checked_shard_size(plan);
  const std::vector<UnitSpec> units = as_laid_out(specs, plan.options.mixed_precision());
  MemoryPlan out;
  if (plan.options.strategy() == Strategy::NoShard) {
    plan_replicated(units, plan, out);
  } else {
    Transients t = tally_units(units, plan, shard_size, out);
    add_peaks(t, plan, shard_size, out);
  }
  add_startup(units, plan, shard_size, out);
  add_snapshots(units, plan, shard_size, out);
  return out;
}

int64_t largest_that_fits(const std::function<int64_t(int64_t)>& bytes, int64_t budget, int64_t limit) {
  if (limit < 0 || bytes(0) > budget) return -1;
  int64_t lo = 0, hi = 1;  // bytes(lo) fits; grow hi until it does not (or passes the limit)
  while (hi <= limit && bytes(hi) <= budget) lo = hi, hi *= 2;
  hi = std::min(hi, limit + 1);  // bytes(hi) over the budget, or past the limit
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (bytes(mid) <= budget ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace shardtorch
