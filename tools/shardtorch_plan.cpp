// shardtorch-plan: per-rank memory of the example GPT under a strategy, world
// size, precision and offload policy, before anything is launched; and the
// largest GPT of a given shape that fits a memory budget per rank.
//
//   shardtorch-plan --layers 24 --d-model 1024 --heads 16 --vocab 50257 --seq 1024 --world 8
//   shardtorch-plan --d-model 4096 --vocab 50257 --seq 2048 --world 64 --bf16 --fit 80GiB
//   shardtorch-plan --layers 24 --d-model 1024 --pp 4 --world 8       # each pipeline rank's stages, dp 8
//
// Without --strategy every strategy is shown side by side. docs/benchmarks.md
// compares the plans with measurements (shardtorch-sweep does it per run).
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <iostream>
#include <sstream>

#include <boost/program_options.hpp>

#include "../examples/cli.h"
#include "../examples/gpt.h"
#include "shardtorch/deferred.h"
#include "shardtorch/pipeline.h"
#include "shardtorch/plan.h"

namespace po = boost::program_options;
using shardtorch::Mem;
using shardtorch::Strategy;

namespace {

// "80GiB", "512M", "1e9": a number, then a unit or none (bytes).
int64_t parse_bytes(const std::string& option, const std::string& s) {
  double v = 0;
  const auto [end, err] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (err != std::errc() || !(v >= 0))
    throw std::invalid_argument(option + " '" + s + "' is not a size (a number, then B, KiB, MiB, GiB or TiB)");
  std::string unit(end, s.data() + s.size());
  double mult = 1;
  if (unit == "KiB" || unit == "K")
    mult = 1024.0;
  else if (unit == "MiB" || unit == "M")
    mult = 1024.0 * 1024;
  else if (unit == "GiB" || unit == "G")
    mult = 1024.0 * 1024 * 1024;
  else if (unit == "TiB" || unit == "T")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else if (!unit.empty() && unit != "B")
    throw std::invalid_argument(option + " '" + s + "': unknown unit '" + unit + "' (B, KiB, MiB, GiB or TiB)");
  if (!(v * mult < 0x1p62)) throw std::invalid_argument(option + " '" + s + "' is too large");
  return static_cast<int64_t>(v * mult);
}

struct Args {
  gpt::Config cfg;
  int world = 8, hybrid = 0, states = 2;
  int pp = 0, chunks = 1;  // --pp: the world is the data-parallel size of each stage
  int tp = 1;              // --tp: the world is the data-parallel size of each tensor-parallel group
  bool gloo = false;
  std::string strategy, fit, reserve = "0", optimizer = "adamw";
  bool bf16 = false, offload = false, accumulate = false, by_category = false, startup = false;
  double bucket_mb = 25;
};

// The largest divisor of the world size not above half of it (groups of at
// least two replicas), 1 for prime world sizes.
int default_hybrid(int world) {
  for (int s = world / 2; s > 1; --s)
    if (world % s == 0) return s;
  return 1;
}

shardtorch::PlanOptions options_for(const Args& a, Strategy s) {
  auto o = shardtorch::ShardOptions().strategy(s).cpu_offload(a.offload).bucket_mb(a.bucket_mb);
  if (s == Strategy::HybridShard) o.hybrid_shard_size(a.hybrid > 0 ? a.hybrid : default_hybrid(a.world));
  if (a.bf16) o.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16));
  shardtorch::PlanOptions p{o, a.world, a.states, a.accumulate};
  p.pipelined = a.pp > 0;
  p.reduces_in_place = a.gloo;
  return p;
}

// The unit a table prints in: GiB, or MiB or KiB for a model so small that
// GiB would print zeros.
struct Unit {
  double bytes = 1024.0 * 1024 * 1024;
  const char* name = "GiB";
  static Unit for_largest(int64_t largest) {
    if (largest >= 0.01 * 1024 * 1024 * 1024) return {};
    if (largest >= 0.01 * 1024 * 1024) return {1024.0 * 1024, "MiB"};
    return {1024.0, "KiB"};
  }
  std::string operator()(int64_t b) const {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.3f", b / bytes);
    return buf;
  }
};

// The command line, into `a`.
po::options_description options_for_args(Args& a) {
  po::options_description desc("shardtorch-plan: per-rank memory of the example GPT before launch");
  desc.add_options()("help", "this text")("layers", po::value(&a.cfg.n_layer)->default_value(12), "transformer blocks")(
      "d-model", po::value(&a.cfg.d_model)->default_value(768), "model width")(
      "heads", po::value(&a.cfg.n_head)->default_value(12), "attention heads (no effect on memory)")(
      "vocab", po::value(&a.cfg.vocab)->default_value(50257), "vocabulary")(
      "seq", po::value(&a.cfg.seq_len)->default_value(1024), "sequence length (position embedding)")(
      "world", po::value(&a.world)->default_value(a.world), "ranks")("strategy", po::value(&a.strategy),
                                                                     "one strategy (default: all side by side)")(
      "hybrid-shard-size", po::value(&a.hybrid)->default_value(0), "hybrid_shard group size (default world/2)")(
      "bf16", po::bool_switch(&a.bf16), "bf16 compute and reduction, fp32 masters")(
      "offload", po::bool_switch(&a.offload), "CPU offload (not for no_shard)")(
      "accumulate", po::bool_switch(&a.accumulate), "gradient accumulation without synchronisation (no_sync)")(
      "bucket-mb", po::value(&a.bucket_mb)->default_value(a.bucket_mb), "bucket size")(
      "optimizer", po::value(&a.optimizer)->default_value(a.optimizer),
      "adamw|adam (2 states), sgd-momentum (1), sgd (0)")(
      "fit", po::value(&a.fit), "also find the most layers whose device peak fits this per rank (e.g. 80GiB)")(
      "reserve", po::value(&a.reserve)->default_value(a.reserve),
      "with --fit: memory kept back per rank for what the planner does not predict (activations, workspace), e.g. "
      "6GiB")("by-category", po::bool_switch(&a.by_category),
              "also print every memory category of each strategy's plan")(
      "pp", po::value(&a.pp)->default_value(a.pp),
      "pipeline ranks: plan each one's stages (the GPT's layers split by parameter count), --world being the "
      "data-parallel size of each")("chunks", po::value(&a.chunks)->default_value(a.chunks),
                                    "with --pp: stages per pipeline rank (interleaved schedules)")(
      "tp", po::value(&a.tp)->default_value(a.tp),
      "tensor-parallel ranks (gpt::tp_plan's split): plan one rank's slices, --world being the data-parallel size")(
      "gloo", po::bool_switch(&a.gloo), "CPU ranks: Gloo reduces in place, so buckets need no outputs")(
      "startup", po::bool_switch(&a.startup),
      "also print each strategy's peak during construct + shard() + load, deferred and eager (MemoryPlan::startup_*)");
  return desc;
}

// Throws std::invalid_argument naming the option that makes no sense; sets a.states.
void validate(Args& a, const po::variables_map& vm) {
  auto given = [&](const char* o) { return vm.count(o) > 0 && !vm[o].defaulted(); };
  if (given("reserve") && a.fit.empty()) throw std::invalid_argument("--reserve applies with --fit only");
  if (given("chunks") && a.pp == 0) throw std::invalid_argument("--chunks applies with --pp only");
  if (a.offload && !a.strategy.empty() && shardtorch::parse_strategy(a.strategy) == Strategy::NoShard)
    throw std::invalid_argument(
        "--offload with --strategy no_shard: NoShard keeps whole parameters on the device; CPU offload needs a "
        "sharding strategy");
  if (a.hybrid != 0 && (a.hybrid < 1 || a.world % a.hybrid != 0))
    throw std::invalid_argument("--hybrid-shard-size " + std::to_string(a.hybrid) + " must divide --world " +
                                std::to_string(a.world));
  if (a.cfg.n_layer < 1 || a.cfg.d_model < 1 || a.cfg.n_head < 1 || a.cfg.vocab < 1 || a.cfg.seq_len < 1 ||
      a.world < 1 || a.bucket_mb <= 0)
    throw std::invalid_argument(
        "--layers, --d-model, --heads, --vocab, --seq and --world must be at least 1, and "
        "--bucket-mb positive");
  if (a.cfg.d_model > (int64_t{1} << 20) || a.cfg.vocab > (int64_t{1} << 30) || a.cfg.seq_len > (int64_t{1} << 30))
    throw std::invalid_argument("--d-model (at most 2^20), --vocab or --seq (at most 2^30) too large to plan");
  if (a.optimizer == "adamw" || a.optimizer == "adam")
    a.states = 2;
  else if (a.optimizer == "sgd-momentum")
    a.states = 1;
  else if (a.optimizer == "sgd")
    a.states = 0;
  else
    throw std::invalid_argument("unknown --optimizer " + a.optimizer);
  if (a.pp < 0 || a.chunks < 1 || (a.pp > 0 && a.cfg.n_layer + 2 < a.pp * a.chunks))
    throw std::invalid_argument("--pp " + std::to_string(a.pp) + " x --chunks " + std::to_string(a.chunks) +
                                " stages need at least that many of the GPT's " + std::to_string(a.cfg.n_layer + 2) +
                                " pipeline layers (embedding, blocks, head)");
  if (a.pp > 0 && !a.fit.empty()) throw std::invalid_argument("--fit plans without --pp");
  if (a.tp < 1) throw std::invalid_argument("--tp " + std::to_string(a.tp) + " must be 1 or more");
  if (a.tp > 1 && a.pp > 0) throw std::invalid_argument("--tp plans without --pp");
  if (a.tp > 1 && (a.cfg.vocab % a.tp || a.cfg.d_model % a.tp || a.cfg.n_head % a.tp))
    throw std::invalid_argument("--tp " + std::to_string(a.tp) + " must divide --vocab (" +
                                std::to_string(a.cfg.vocab) + "), --d-model (" + std::to_string(a.cfg.d_model) +
                                ") and --heads (" + std::to_string(a.cfg.n_head) + "), which tp_plan splits");
}

// The strategies to plan: the one asked for, or all that apply.
std::vector<Strategy> strategies_for(const Args& a) {
  std::vector<Strategy> strategies;
  if (!a.strategy.empty())
    strategies.push_back(shardtorch::parse_strategy(a.strategy));
  else
    strategies = {Strategy::NoShard, Strategy::OptimizerOnly, Strategy::ShardGradOp, Strategy::FullShard,
                  Strategy::HybridShard};
  if (!a.strategy.empty() && a.world < 2 && strategies.front() == Strategy::HybridShard)
    throw std::invalid_argument("--strategy hybrid_shard needs --world 2 or more");
  if (a.world < 2)
    strategies.erase(std::remove(strategies.begin(), strategies.end(), Strategy::HybridShard), strategies.end());
  if (a.offload)
    strategies.erase(std::remove(strategies.begin(), strategies.end(), Strategy::NoShard), strategies.end());
  return strategies;
}

// --pp: the units of the stages pipeline rank `r` holds, from a deferred
// GPT (nothing allocated).
std::vector<shardtorch::UnitSpec> stage_units(const Args& a, int r) {
  gpt::GPT model = shardtorch::deferred([&] { return gpt::GPT(a.cfg); });
  auto options = shardtorch::PipelineOptions().chunks_per_rank(a.chunks).microbatches(a.pp * a.chunks);
  if (a.chunks > 1) options.schedule(shardtorch::Schedule::Interleaved1F1B);
  return shardtorch::pipeline_unit_specs(gpt::pipeline_layers(model), options, a.pp, r);
}

// The table: one line per strategy (per pipeline rank with --pp), and with
// --by-category every category.
void print_plans(const Args& a, const std::vector<Strategy>& strategies) {
  if (a.pp > 0) {
    std::vector<std::vector<shardtorch::MemoryPlan>> plans(a.pp);  // per pipeline rank, per strategy
    int64_t largest = 0;
    for (int r = 0; r < a.pp; ++r) {
      const auto units = stage_units(a, r);
      for (Strategy s : strategies) {
        plans[r].push_back(shardtorch::plan_memory(units, options_for(a, s)));
        largest = std::max({largest, plans[r].back().device_peak(), plans[r].back().host()});
      }
    }
    const Unit gib = Unit::for_largest(largest);
    std::printf(
        "GPT: %lld layers, d_model %lld, vocab %lld, seq %lld; %d pipeline ranks x %d data-parallel%s; one "
        "line per strategy and pipeline rank (%s, rank 0 of its dp group); activations are not included\n",
        static_cast<long long>(a.cfg.n_layer), static_cast<long long>(a.cfg.d_model),
        static_cast<long long>(a.cfg.vocab), static_cast<long long>(a.cfg.seq_len), a.pp, a.world,
        a.bf16 ? ", bf16" : ", fp32", gib.name);
    std::printf("%-15s %4s %14s %10s %10s %10s %10s\n", "strategy", "pp", "params", "state_B", "transient", "device",
                "host");
    for (int r = 0; r < a.pp; ++r)
      for (size_t k = 0; k < strategies.size(); ++k) {
        const auto& p = plans[r][k];
        std::printf("%-15s %4d %14lld %10s %10s %10s %10s\n", shardtorch::strategy_name(strategies[k]), r,
                    static_cast<long long>(p.params), gib(p.model_state()).c_str(), gib(p.transient()).c_str(),
                    gib(p.device_peak()).c_str(), gib(p.host()).c_str());
      }
    return;
  }
  const auto units = gpt::unit_specs(a.cfg, a.tp);
  std::vector<shardtorch::MemoryPlan> plans;  // per strategy
  int64_t largest = 0;
  for (Strategy s : strategies) {
    plans.push_back(shardtorch::plan_memory(units, options_for(a, s)));
    largest = std::max({largest, plans.back().device_peak(), plans.back().host()});
  }
  const Unit gib = Unit::for_largest(largest);
  std::printf(
      "GPT: %lld layers, d_model %lld, vocab %lld, seq %lld; %d ranks%s%s%s%s; optimizer %s\n",
      static_cast<long long>(a.cfg.n_layer), static_cast<long long>(a.cfg.d_model), static_cast<long long>(a.cfg.vocab),
      static_cast<long long>(a.cfg.seq_len), a.world,
      a.tp > 1 ? (" data-parallel x " + std::to_string(a.tp) + " tensor-parallel (one rank's slices)").c_str() : "",
      a.bf16 ? ", bf16" : ", fp32", a.offload ? ", CPU offload" : "", a.accumulate ? ", accumulating without sync" : "",
      a.optimizer.c_str());
  std::printf(
      "per rank, %s (rank 0, which owns the most); transient = peak estimates of gathered params, "
      "gradient staging and buckets, and NoShard's fp32 gradient copies under mixed precision; activations "
      "are not included\n",
      gib.name);
  std::printf("%-15s %14s %10s %10s %10s %10s %10s %10s %10s\n", "strategy", "params", "params_B", "grads_B", "optim_B",
              "state_B", "transient", "device", "host");
  std::string reports;  // --by-category
  for (size_t k = 0; k < strategies.size(); ++k) {
    const Strategy s = strategies[k];
    const auto& p = plans[k];
    if (a.by_category) reports += std::string("\n") + shardtorch::strategy_name(s) + ":\n" + p.report();
    const int64_t params_b = p.of(Mem::ShardedParams) + p.of(Mem::ReplicatedParams) + p.of(Mem::HostParams);
    const int64_t grads_b = p.of(Mem::Gradients) + p.of(Mem::HostGradients);
    const int64_t optim_b = p.of(Mem::OptimizerState) + p.of(Mem::HostOptimizerState);
    std::printf("%-15s %14lld %10s %10s %10s %10s %10s %10s %10s\n", shardtorch::strategy_name(s),
                static_cast<long long>(p.params), gib(params_b).c_str(), gib(grads_b).c_str(), gib(optim_b).c_str(),
                gib(p.model_state()).c_str(), gib(p.transient()).c_str(), gib(p.device_peak()).c_str(),
                gib(p.host()).c_str());
  }
  if (a.by_category) std::printf("%s", reports.c_str());
  if (!a.startup) return;
  std::printf(
      "\nconstruct + shard() + load, per rank, %s: the library's parameters and full flat buffers at their "
      "peak (docs/scale.md)\n%-15s %10s %10s\n",
      gib.name, "strategy", "deferred", "eager");
  for (size_t k = 0; k < strategies.size(); ++k)
    std::printf("%-15s %10s %10s\n", shardtorch::strategy_name(strategies[k]), gib(plans[k].startup_deferred).c_str(),
                gib(plans[k].startup_eager).c_str());
}

// --fit: the most layers whose device peak fits `budget` per rank, per strategy.
void print_fit(const Args& a, const std::vector<Strategy>& strategies, int64_t reserve, int64_t budget) {
  std::printf(
      "\nlargest GPT of this shape (d_model %lld, vocab %lld, seq %lld) whose device peak fits %s per rank%s:\n",
      static_cast<long long>(a.cfg.d_model), static_cast<long long>(a.cfg.vocab), static_cast<long long>(a.cfg.seq_len),
      shardtorch::format_bytes(budget).c_str(),
      reserve > 0 ? (" (" + a.fit + " less " + a.reserve + " kept back)").c_str() : "");
  for (Strategy s : strategies) {
    auto peak = [&](int64_t layers) {
      gpt::Config c = a.cfg;
      c.n_layer = layers;
      auto p = shardtorch::plan_memory(gpt::unit_specs(c, a.tp), options_for(a, s));
      return std::make_pair(p.device_peak(), p.params);
    };
    if (peak(0).first > budget) {
      std::printf("  %-15s nothing fits: the embeddings alone need %s\n", shardtorch::strategy_name(s),
                  shardtorch::format_bytes(peak(0).first).c_str());
      continue;
    }
    // Under offload the sharded strategies' device peak stops growing with
    // depth (only one unit is on the device at a time): say so instead of
    // searching forever.
    if (peak(2048).first == peak(1024).first) {
      gpt::Config c = a.cfg;
      c.n_layer = 1;
      auto one = shardtorch::plan_memory(gpt::unit_specs(c, a.tp), options_for(a, s));
      c.n_layer = 2;
      auto two = shardtorch::plan_memory(gpt::unit_specs(c, a.tp), options_for(a, s));
      std::printf("  %-15s any depth: the device peak stays %s; host memory grows by %s per layer\n",
                  shardtorch::strategy_name(s), shardtorch::format_bytes(peak(1024).first).c_str(),
                  shardtorch::format_bytes(two.host() - one.host()).c_str());
      continue;
    }
    const int64_t lo = shardtorch::largest_that_fits([&](int64_t n) { return peak(n).first; }, budget, 1 << 20);
    auto [bytes, params] = peak(lo);
    std::printf("  %-15s %s%lld layers, %.3f B parameters, device peak %s\n", shardtorch::strategy_name(s),
                lo == (1 << 20) ? "at least " : "",  // the search's limit, not an answer
                static_cast<long long>(lo), params / 1e9, shardtorch::format_bytes(bytes).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  po::options_description desc = options_for_args(a);
  try {
    po::variables_map vm;
    po::positional_options_description none;  // every argument is an option: a stray word is an error
    po::store(po::command_line_parser(argc, argv).options(desc).positional(none).run(), vm);
    if (vm.count("help")) {
      std::cout << desc << "\n";
      return 0;
    }
    po::notify(vm);
    validate(a, vm);
    const int64_t reserve = parse_bytes("--reserve", a.reserve),
                  budget = a.fit.empty() ? 0 : parse_bytes("--fit", a.fit) - reserve;
    if (!a.fit.empty() && budget <= 0)
      throw std::invalid_argument("--reserve " + a.reserve + " leaves nothing of --fit " + a.fit);
    const std::vector<Strategy> strategies = strategies_for(a);
    print_plans(a, strategies);
    if (!a.fit.empty()) print_fit(a, strategies, reserve, budget);
    return 0;
  } catch (...) {
    return cli::report_error("shardtorch-plan");
  }
}
