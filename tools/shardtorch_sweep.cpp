// shardtorch-sweep: memory against throughput. Launches gpt_bench through
// `torchrun --no-python` for every strategy x world size x model size x
// offload x bucket size, and writes per configuration the per-rank peak
// memory by category (the library's accounting) and peak resident memory,
// step time p50/p95, tokens/s, bytes sent per step beside the theoretical
// volume, and the planner's model-state prediction beside the measured one:
//
//   build/tools/shardtorch-sweep --strategies no_shard,full_shard --worlds 1,2 --models 2x64,4x128 --out build/sweep
//
// writes build/sweep/sweep.csv, sweep.json and (bench/plot_sweep.py)
// sweep.png: per-rank memory against tokens/s, one series per strategy.
#include <sys/wait.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include <boost/json.hpp>
#include <boost/program_options.hpp>

#include "../examples/cli.h"
#include "../examples/gpt.h"
#include "support/tool_files.h"
#include "shardtorch/plan.h"

namespace po = boost::program_options;
namespace json = boost::json;
namespace files = shardtorch::tools;
using shardtorch::Mem;
using shardtorch::Strategy;

namespace {

// List entries, checked: the option and the entry are named in the error,
// and a flag is 0 or 1, nothing else.
using cli::number;
int64_t whole(const std::string& option, const std::string& text, int64_t least) {
  const auto v = number<int64_t>(text);
  if (!v || *v < least)
    throw std::invalid_argument(option + " entry '" + text + "' is not a whole number of at least " +
                                std::to_string(least));
  return *v;
}
double positive(const std::string& option, const std::string& text) {
  const auto v = number<double>(text);
  if (!v || !(*v > 0)) throw std::invalid_argument(option + " entry '" + text + "' is not a positive number");
  return *v;
}
bool flag(const std::string& option, const std::string& text) {
  if (text != "0" && text != "1") throw std::invalid_argument(option + " entry '" + text + "' is not 0 or 1");
  return text == "1";
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

struct Config {
  Strategy strategy;
  int world;
  int64_t layers, d_model;
  bool offload;
  double bucket_mb;
  bool recompute;  // activation checkpointing
  std::string label() const {
    std::ostringstream os;
    os << shardtorch::strategy_name(strategy) << " world " << world << " model " << layers << "x" << d_model
       << (offload ? " offload" : "") << (recompute ? " recompute" : "") << " bucket " << bucket_mb << " MiB";
    return os.str();
  }
};

struct Common {
  int64_t vocab = 256, seq = 64, heads = 4, batch = 8;
  int steps = 20, warmup = 3, threads = 1, timeout = 600;
  bool bf16 = false;
  std::string out = "build/sweep", gpt_bench = "build/bench/gpt_bench", torchrun = ".venv/bin/torchrun",
              plot = "bench/plot_sweep.py", python = ".venv/bin/python3";
};

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

int run_shell(const std::string& cmd) {
  int st = std::system(cmd.c_str());
  if (st == -1) return -1;
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// Ring estimates of bytes each rank sends per step (Ψ parameters of e bytes):
// all-reduce 2Ψ(N-1)/N, all-gather or reduce-scatter Ψ(N-1)/N each.
double theory_bytes(Strategy s, int world, int hybrid, double psi_bytes) {
  auto ring = [](int n) { return n > 1 ? static_cast<double>(n - 1) / n : 0.0; };
  switch (s) {
    case Strategy::NoShard:
      return 2 * psi_bytes * ring(world);  // all-reduce of gradients
    case Strategy::FullShard:
      return 3 * psi_bytes * ring(world);  // gather fwd + bwd, reduce-scatter
    case Strategy::ShardGradOp:
      return 2 * psi_bytes * ring(world);  // reduce-scatter, gather after step
    case Strategy::OptimizerOnly:
      return 3 * psi_bytes * ring(world);  // all-reduce, gather after step
    case Strategy::HybridShard:
      return 3 * psi_bytes * ring(hybrid) + 2 * (psi_bytes / hybrid) * ring(world / hybrid);
  }
  return 0;
}

// The lists of the command line, crossed: every configuration to run.
struct Lists {
  std::string strategies = "no_shard,optimizer_only,shard_grad_op,full_shard", worlds = "1,2", models = "2x64,4x128",
              offloads = "0", buckets = "25", recomputes = "0";
};

std::vector<Config> configs_from(const Lists& l) {
  std::vector<Config> configs;
  for (const auto& s : split(l.strategies))
    for (const auto& w : split(l.worlds))
      for (const auto& m : split(l.models))
        for (const auto& o : split(l.offloads))
          for (const auto& b : split(l.buckets))
            for (const auto& ac : split(l.recomputes)) {
              auto x = m.find('x');
              if (x == std::string::npos)
                throw std::invalid_argument("--models entry '" + m + "' is not LAYERSxD_MODEL");
              Config k{shardtorch::parse_strategy(s),
                       static_cast<int>(whole("--worlds", w, 1)),
                       whole("--models", m.substr(0, x), 1),
                       whole("--models", m.substr(x + 1), 1),
                       flag("--offload", o),
                       positive("--bucket-mb", b),
                       flag("--activation-checkpointing", ac)};
              if (k.offload && k.strategy == Strategy::NoShard) continue;  // refused by design
              if (k.strategy == Strategy::HybridShard && (k.world < 2 || k.world % 2)) continue;
              configs.push_back(k);
            }
  if (configs.empty()) throw std::invalid_argument("no configuration to run");
  return configs;
}

po::options_description options_for(Common& c, Lists& l) {
  po::options_description desc("shardtorch-sweep: memory against throughput of the example GPT");
  desc.add_options()("help", "this text")("strategies", po::value(&l.strategies)->default_value(l.strategies),
                                          "comma list (hybrid_shard uses groups of world/2)")(
      "worlds", po::value(&l.worlds)->default_value(l.worlds), "comma list of rank counts")(
      "models", po::value(&l.models)->default_value(l.models), "comma list of LAYERSxD_MODEL")(
      "offload", po::value(&l.offloads)->default_value(l.offloads), "comma list of 0/1")(
      "bucket-mb", po::value(&l.buckets)->default_value(l.buckets), "comma list of bucket sizes in MiB")(
      "activation-checkpointing", po::value(&l.recomputes)->default_value(l.recomputes),
      "comma list of 0/1 (1: the blocks recompute their activations in backward)")(
      "vocab", po::value(&c.vocab)->default_value(c.vocab), "vocabulary")(
      "seq", po::value(&c.seq)->default_value(c.seq), "sequence length")(
      "heads", po::value(&c.heads)->default_value(c.heads), "attention heads")(
      "batch", po::value(&c.batch)->default_value(c.batch), "sequences per rank per step")(
      "steps", po::value(&c.steps)->default_value(c.steps), "measured steps (at least 20)")(
      "warmup", po::value(&c.warmup)->default_value(c.warmup), "steps before measuring")(
      "threads", po::value(&c.threads)->default_value(c.threads), "ATen threads per rank")(
      "bf16", po::bool_switch(&c.bf16), "bf16 compute and reduction")(
      "timeout", po::value(&c.timeout)->default_value(c.timeout), "seconds per configuration")(
      "out", po::value(&c.out)->default_value(c.out), "output directory")(
      "gpt-bench", po::value(&c.gpt_bench)->default_value(c.gpt_bench), "the gpt_bench binary")(
      "torchrun", po::value(&c.torchrun)->default_value(c.torchrun), "torchrun")(
      "python", po::value(&c.python)->default_value(c.python), "python with matplotlib, for the plot")(
      "plot-script", po::value(&c.plot)->default_value(c.plot), "plotting script; empty: no plot");
  return desc;
}

// The torchrun command that runs one configuration, its reports under `prefix`.
std::string run_command(const Common& c, const Config& cfg, int hybrid, const std::string& prefix) {
  std::ostringstream cmd;
  cmd << "timeout " << c.timeout << " " << quote(c.torchrun) << " --no-python --standalone --nproc-per-node "
      << cfg.world << " " << quote(c.gpt_bench) << " --strategy " << shardtorch::strategy_name(cfg.strategy)
      << " --hybrid-shard-size " << hybrid << " --layers " << cfg.layers << " --d-model " << cfg.d_model << " --heads "
      << c.heads << " --vocab " << c.vocab << " --seq " << c.seq << " --batch " << c.batch << " --steps " << c.steps
      << " --warmup " << c.warmup << " --threads " << c.threads << " --bucket-mb " << cfg.bucket_mb
      << (cfg.offload ? " --offload" : "") << (cfg.recompute ? " --activation-checkpointing" : "")
      << (c.bf16 ? " --bf16" : "") << " --quiet --report " << quote(prefix) << " > " << quote(prefix + ".log")
      << " 2>&1";
  return cmd.str();
}

// One configuration's run, from its ranks' reports: the slowest rank's
// times, the largest rank's memory.
struct Measured {
  double p50 = 0, p95 = 0, tps = 1e300;
  int64_t rss = 0, state = 0, sent = 0, params = 0;
  std::vector<int64_t> peaks = std::vector<int64_t>(static_cast<size_t>(Mem::kCount), 0);
};

Measured read_reports(const Config& cfg, const std::string& prefix) {
  Measured m;
  for (int r = 0; r < cfg.world; ++r) {
    const std::string path = prefix + ".rank" + std::to_string(r) + ".json";
    std::ifstream f(path);
    if (!f) throw std::runtime_error("no report " + path);
    std::stringstream ss;
    ss << f.rdbuf();
    const auto v = json::parse(ss.str()).as_object();
    m.p50 = std::max(m.p50, v.at("p50_ms").to_number<double>());
    m.p95 = std::max(m.p95, v.at("p95_ms").to_number<double>());
    m.tps = std::min(m.tps, v.at("tokens_per_s").to_number<double>());
    m.rss = std::max(m.rss, v.at("peak_rss_bytes").to_number<int64_t>());
    m.state = std::max(m.state, v.at("model_state_bytes").to_number<int64_t>());
    m.sent = std::max(m.sent, v.at("bytes_sent_per_step").to_number<int64_t>());
    m.params = v.at("params").to_number<int64_t>();
    const auto& mem = v.at("memory").as_object();
    for (int i = 0; i < static_cast<int>(Mem::kCount); ++i)
      m.peaks[i] =
          std::max(m.peaks[i], mem.at(shardtorch::mem_name(static_cast<Mem>(i))).at("peak").to_number<int64_t>());
  }
  return m;
}

// The plan for one configuration, to set against what it measured.
shardtorch::MemoryPlan plan_for(const Common& c, const Config& cfg, int hybrid) {
  gpt::Config g{c.vocab, c.seq, cfg.d_model, c.heads, cfg.layers};
  auto opts = shardtorch::ShardOptions().strategy(cfg.strategy).cpu_offload(cfg.offload).bucket_mb(cfg.bucket_mb);
  if (cfg.strategy == Strategy::HybridShard) opts.hybrid_shard_size(hybrid);
  if (c.bf16) opts.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kBFloat16));
  return shardtorch::plan_memory(gpt::unit_specs(g), {opts, cfg.world, 2});
}

void write_csv_header(std::ofstream& csv) {
  csv << "strategy,world,layers,d_model,params,offload,bucket_mb,activation_checkpointing,dtype,p50_ms,p95_ms,tokens_"
         "per_s,peak_rss_bytes,"
         "model_state_bytes,planned_model_state_bytes,plan_error,bytes_sent_per_step,theory_bytes_per_step";
  for (int i = 0; i < static_cast<int>(Mem::kCount); ++i) csv << ",peak_" << shardtorch::mem_name(static_cast<Mem>(i));
  csv << "\n";
}

// One configuration's row, in the CSV and in the JSON rows.
void record_row(const Common& c, const Config& cfg, const Measured& m, const shardtorch::MemoryPlan& plan, double err,
                double theory, const std::string& prefix, std::ofstream& csv, json::array& rows) {
  const char* dtype = c.bf16 ? "bfloat16" : "float32";
  csv << shardtorch::strategy_name(cfg.strategy) << "," << cfg.world << "," << cfg.layers << "," << cfg.d_model << ","
      << m.params << "," << cfg.offload << "," << cfg.bucket_mb << "," << cfg.recompute << "," << dtype << "," << m.p50
      << "," << m.p95 << "," << m.tps << "," << m.rss << "," << m.state << "," << plan.model_state() << "," << err
      << "," << m.sent << "," << static_cast<int64_t>(theory);
  json::object peak_obj;
  for (int i = 0; i < static_cast<int>(Mem::kCount); ++i) {
    csv << "," << m.peaks[i];
    peak_obj[shardtorch::mem_name(static_cast<Mem>(i))] = m.peaks[i];
  }
  csv << "\n";
  json::object plan_obj;
  for (int i = 0; i < static_cast<int>(Mem::kCount); ++i)
    if (plan.bytes[i]) plan_obj[shardtorch::mem_name(static_cast<Mem>(i))] = plan.bytes[i];
  rows.push_back(json::object{{"strategy", shardtorch::strategy_name(cfg.strategy)},
                              {"world", cfg.world},
                              {"layers", cfg.layers},
                              {"d_model", cfg.d_model},
                              {"params", m.params},
                              {"offload", cfg.offload},
                              {"bucket_mb", cfg.bucket_mb},
                              {"activation_checkpointing", cfg.recompute},
                              {"dtype", dtype},
                              {"p50_ms", m.p50},
                              {"p95_ms", m.p95},
                              {"tokens_per_s", m.tps},
                              {"peak_rss_bytes", m.rss},
                              {"model_state_bytes", m.state},
                              {"planned_model_state_bytes", plan.model_state()},
                              {"plan_error", err},
                              {"planned", plan_obj},
                              {"peak_memory", peak_obj},
                              {"bytes_sent_per_step", m.sent},
                              {"theory_bytes_per_step", theory},
                              {"report_prefix", prefix}});
}

}  // namespace

int main(int argc, char** argv) {
  Common c;
  Lists lists;
  po::options_description desc = options_for(c, lists);
  try {
    po::variables_map vm;
    po::store(po::parse_command_line(argc, argv, desc), vm);
    if (vm.count("help")) {
      std::cout << desc << "\n";
      return 0;
    }
    po::notify(vm);
    if (c.steps < 20) throw std::invalid_argument("--steps must be at least 20 (p95 over fewer means little)");
    if (!files::is_regular_file(c.gpt_bench))
      throw std::invalid_argument("no gpt_bench at " + c.gpt_bench + " (build first)");

    const std::vector<Config> configs = configs_from(lists);
    const std::string runs_dir = files::join(c.out, "runs");
    const std::string csv_path = files::join(c.out, "sweep.csv"), json_path = files::join(c.out, "sweep.json");
    files::create_directories(runs_dir);

    json::array rows;
    std::ofstream csv(csv_path);
    write_csv_header(csv);
    double worst_plan_error = 0;
    const auto start = std::chrono::steady_clock::now();
    int failed = 0, over_theory = 0;
    for (size_t k = 0; k < configs.size(); ++k) {
      const Config& cfg = configs[k];
      const std::string prefix = files::join(runs_dir, "run" + std::to_string(k));
      const int hybrid = std::max(1, cfg.world / 2);
      double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(
          stderr, "[%zu/%zu] %s ... (elapsed %.0f s%s)\n", k + 1, configs.size(), cfg.label().c_str(), elapsed,
          k > 0 ? (", eta " + std::to_string(static_cast<int>(elapsed / k * (configs.size() - k))) + " s").c_str()
                : "");
      int rc = run_shell(run_command(c, cfg, hybrid, prefix));
      if (rc != 0) {
        std::fprintf(stderr, "    FAILED (exit %d); log: %s.log\n", rc, prefix.c_str());
        ++failed;
        continue;
      }
      Measured m;
      try {
        m = read_reports(cfg, prefix);
      } catch (const std::exception& e) {  // a missing, truncated or foreign report
        std::fprintf(stderr, "    FAILED reading the reports: %s; log: %s.log\n", e.what(), prefix.c_str());
        ++failed;
        continue;
      }
      auto plan = plan_for(c, cfg, hybrid);
      const double err = m.state > 0 ? std::abs(static_cast<double>(plan.model_state() - m.state)) / m.state : 0.0;
      worst_plan_error = std::max(worst_plan_error, err);
      const double theory =
          theory_bytes(cfg.strategy, cfg.world, hybrid, static_cast<double>(m.params) * (c.bf16 ? 2 : 4));
      // Less than the theory is expected (the root unit stays gathered
      // between forward and backward); more would be traffic the strategy
      // should not send. 5% leaves room for the padding of flat parameters.
      const bool over = static_cast<double>(m.sent) > 1.05 * theory + 4096;
      over_theory += over;
      std::fprintf(stderr,
                   "    p50 %.1f ms  p95 %.1f ms  %.0f tokens/s  model state %s/rank (plan %s, %.2f%%)  "
                   "peak RSS %s  sent %s/step (theory %s)\n",
                   m.p50, m.p95, m.tps, shardtorch::format_bytes(m.state).c_str(),
                   shardtorch::format_bytes(plan.model_state()).c_str(), 100 * err,
                   shardtorch::format_bytes(m.rss).c_str(), shardtorch::format_bytes(m.sent).c_str(),
                   shardtorch::format_bytes(static_cast<int64_t>(theory)).c_str());
      if (over) std::fprintf(stderr, "    FAILED: sent more than 5%% over the theoretical volume\n");
      record_row(c, cfg, m, plan, err, theory, prefix, csv, rows);
    }
    json::object summary{{"vocab", c.vocab},     {"seq", c.seq},
                         {"heads", c.heads},     {"batch", c.batch},
                         {"steps", c.steps},     {"warmup", c.warmup},
                         {"threads", c.threads}, {"worst_plan_error", worst_plan_error},
                         {"failed", failed},     {"over_theory", over_theory},
                         {"rows", rows}};
    csv.close();
    if (!csv) throw std::runtime_error("could not write " + csv_path);
    {
      std::ofstream out(json_path);
      out << json::serialize(summary) << "\n";
      out.close();
      if (!out) throw std::runtime_error("could not write " + json_path);
    }
    std::fprintf(stderr,
                 "sweep: %zu configurations (%d failed, %d sent more than the theory); planner vs measured "
                 "model state: worst %.2f%% (target 5%%)\n",
                 configs.size(), failed, over_theory, 100 * worst_plan_error);
    std::fprintf(stderr, "sweep: wrote %s/sweep.csv and sweep.json\n", c.out.c_str());
    if (!c.plot.empty()) {
      std::string png = files::join(c.out, "sweep.png");
      int rc = run_shell(quote(c.python) + " " + quote(c.plot) + " " + quote(json_path) + " " + quote(png));
      if (rc != 0) {
        std::fprintf(stderr, "sweep: the plot failed (exit %d)\n", rc);
        return 1;
      }
      std::fprintf(stderr, "sweep: wrote %s\n", png.c_str());
    }
    return failed > 0 || over_theory > 0 || worst_plan_error > 0.05 ? 1 : 0;
  } catch (...) {
    return cli::report_error("shardtorch-sweep");
  }
}
