// Fault-tolerant training across replica groups (docs/fault_tolerance.md):
// each replica group is one torchrun job; torchft's lighthouse forms a quorum
// of the live groups every step; a group that dies is restarted by its
// torchrun and heals from a live one while the others go on. Launch a
// lighthouse, then one torchrun per group:
//
//   .venv/bin/torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas 2 --heartbeat_timeout_ms 1000 &
//   for g in 0 1 2; do
//     SHARDTORCH_FT_LIGHTHOUSE=127.0.0.1:29510 SHARDTORCH_FT_REPLICA_GROUP=$g \
//       torchrun --no-python --standalone --nproc-per-node 1 --max-restarts 3 \
//       build/examples/ft_train --steps 60 --groups 3 --dir /tmp/ft &
//   done
//
// --kill "0@12,1@30" makes this group kill itself (SIGKILL) at its step 12
// in its first incarnation and at step 30 (or the first step after it
// healed past it) in its second: torchrun restarts
// it and it heals. Every group appends its committed steps (and whose
// gradients each averaged) to DIR/steps-GROUP.txt and saves its final state;
// `ft_train --reference --dir DIR --groups 3` then replays those steps in
// one process and checks every group against it (exit status 0 when equal).
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "cli.h"
#include "shardtorch/ft.h"
#include "shardtorch/shardtorch.h"

namespace {

constexpr int64_t kFeatures = 16, kPerRank = 64, kBatch = 8;

struct NetImpl : torch::nn::Module {
  NetImpl()
      : l1(register_module("l1", torch::nn::Linear(kFeatures, 32))),
        l2(register_module("l2", torch::nn::Linear(32, 32))), head(register_module("head", torch::nn::Linear(32, 1))) {}
  torch::Tensor forward(torch::Tensor x) { return head(torch::tanh(l2(torch::tanh(l1(x))))); }
  torch::nn::Linear l1, l2, head;
};
SHARDTORCH_MODULE(Net);  // the root is a unit (FullShard shards it)

// The data set: the same on every process.
std::pair<torch::Tensor, torch::Tensor> dataset(int64_t size) {
  torch::manual_seed(1234);
  auto x = torch::randn({size, kFeatures});
  auto y = torch::tanh(x.matmul(torch::randn({kFeatures, 1})) * 0.5);
  return {x, y};
}

Net fresh_model() {
  torch::manual_seed(0);  // every group, every incarnation: the same start
  return Net();
}

std::string final_path(const std::string& dir, const std::string& group, int rank) {
  return dir + "/final-" + group + "-rank" + std::to_string(rank) + ".pt";
}

// "0@12,1@30" -> {incarnation: step}
std::map<int, int64_t> parse_kills(const std::string& s) {
  std::map<int, int64_t> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto at = item.find('@');
    if (at == std::string::npos) throw std::runtime_error("--kill: '" + item + "' is not INCARNATION@STEP");
    out[std::stoi(item.substr(0, at))] = std::stoll(item.substr(at + 1));
  }
  return out;
}

int train(int64_t steps, int64_t groups, const std::string& dir, const std::string& kill, int kill_rank,
          const std::string& strategy, int step_ms) {
  auto world = shardtorch::World::from_env();
  const int incarnation = std::atoi(std::getenv("TORCHELASTIC_RESTART_COUNT") ? std::getenv("TORCHELASTIC_RESTART_COUNT") : "0");
  Net model = fresh_model();
  shardtorch::shard(*model, world, shardtorch::ShardOptions().strategy(shardtorch::parse_strategy(strategy)));
  auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));
  shardtorch::ft::Manager manager(world, *model, *opt);
  const std::string group = manager.replica_group();
  const int64_t group_index = std::stoll(group);
  auto [x, y] = dataset(groups * world->size() * kPerRank);
  shardtorch::ft::ReplicaSampler sampler(x.size(0), groups, group_index, world->rank(), world->size(), kBatch);
  const auto kills = parse_kills(kill);
  if (world->rank() == 0) std::printf("group %s: incarnation %d\n", group.c_str(), incarnation);
  std::fflush(stdout);
  while (manager.step() < steps) {
    auto k = kills.find(incarnation);
    if (k != kills.end() && manager.step() >= k->second && world->rank() == kill_rank) {
      std::printf("group %s rank %d: killing itself at step %lld\n", group.c_str(), world->rank(),
                  static_cast<long long>(manager.step()));
      std::fflush(stdout);
      std::raise(SIGKILL);
    }
    manager.start_step();
    auto idx = torch::tensor(sampler.batch(manager.step()));
    opt->zero_grad();
    auto loss = torch::mse_loss(model->forward(x.index_select(0, idx)), y.index_select(0, idx));
    loss.backward();
    if (manager.should_commit()) {
      opt->step();
      const auto& r = manager.last_step();
      if (world->rank() == 0) {
        std::ofstream log(dir + "/steps-" + group + ".txt", std::ios::app);
        log << r.step << " quorum " << r.quorum_id << " counted";
        for (const auto& g : r.counted) log << ' ' << g;
        log << '\n';
        if (r.step % 10 == 0) std::printf("group %s step %lld loss %.5f\n", group.c_str(), static_cast<long long>(r.step), loss.item<double>());
        std::fflush(stdout);
      }
    }
    if (step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
  }
  // Final state: the whole parameters and this rank's optimizer state.
  auto params = shardtorch::full_parameters(*model);
  torch::serialize::OutputArchive ar;
  for (const auto& [name, t] : params) ar.write("param." + name, t);
  int64_t i = 0;
  for (const auto& piece : opt->views().pieces()) {
    auto it = opt->inner().state().find(piece.view.unsafeGetTensorImpl());
    if (it == opt->inner().state().end()) continue;
    auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
    ar.write("opt." + std::to_string(i) + ".exp_avg", s.exp_avg());
    ar.write("opt." + std::to_string(i) + ".exp_avg_sq", s.exp_avg_sq());
    ar.write("opt." + std::to_string(i) + ".name", torch::tensor(static_cast<int64_t>(std::hash<std::string>()(piece.name) & 0xffffff)));
    ++i;
  }
  ar.save_to(final_path(dir, group, world->rank()));
  if (world->rank() == 0) std::printf("group %s: done at step %lld\n", group.c_str(), static_cast<long long>(manager.step()));
  return 0;
}

std::map<std::string, torch::Tensor> read_archive(const std::string& path) {
  torch::serialize::InputArchive ar;
  ar.load_from(path);
  std::map<std::string, torch::Tensor> out;
  for (const auto& key : ar.keys()) {
    torch::Tensor t;
    ar.read(key, t);
    out[key] = t;
  }
  return out;
}

// Replays the committed steps in one process: step s averages the gradients
// of the groups that counted in it (each group's ranks' batches, as it read them).
int reference(int64_t groups, int ranks, const std::string& dir) {
  std::map<int64_t, std::string> counted;  // step -> "g1 g2 ..." (every log agrees)
  for (int64_t g = 0; g < groups; ++g) {
    std::ifstream in(dir + "/steps-" + std::to_string(g) + ".txt");
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      int64_t step, qid;
      std::string word, who;
      ls >> step >> word >> qid >> word;
      std::getline(ls, who);
      auto [it, fresh] = counted.emplace(step, who);
      if (!fresh && it->second != who) {
        std::fprintf(stderr, "step %lld: group %lld logged counted {%s}, another group {%s}\n",
                     static_cast<long long>(step), static_cast<long long>(g), who.c_str(), it->second.c_str());
        return 1;
      }
    }
  }
  const int64_t steps = counted.empty() ? 0 : counted.rbegin()->first + 1;
  if (static_cast<int64_t>(counted.size()) != steps) {
    std::fprintf(stderr, "the logs miss some of steps 0..%lld\n", static_cast<long long>(steps - 1));
    return 1;
  }
  Net model = fresh_model();
  auto [x, y] = dataset(groups * ranks * kPerRank);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  int64_t multi = 0;
  for (int64_t s = 0; s < steps; ++s) {
    std::istringstream who(counted[s]);
    std::vector<int64_t> gs;
    for (int64_t g; who >> g;) gs.push_back(g);
    if (gs.size() > 1) ++multi;
    opt.zero_grad();
    torch::Tensor total;
    for (int64_t g : gs)
      for (int r = 0; r < ranks; ++r) {
        shardtorch::ft::ReplicaSampler sampler(x.size(0), groups, g, r, ranks, kBatch);
        auto idx = torch::tensor(sampler.batch(s));
        auto l = torch::mse_loss(model->forward(x.index_select(0, idx)), y.index_select(0, idx));
        total = total.defined() ? total + l : l;
      }
    (total / static_cast<double>(gs.size() * static_cast<size_t>(ranks))).backward();
    opt.step();
  }
  std::printf("reference: %lld steps replayed (%lld averaged more than one group)\n", static_cast<long long>(steps),
              static_cast<long long>(multi));
  int bad = 0;
  double worst = 0;
  for (int64_t g = 0; g < groups; ++g) {
    auto got = read_archive(final_path(dir, std::to_string(g), 0));
    for (const auto& item : model->named_parameters()) {
      const double d = (got.at("param." + item.key()) - item.value()).abs().max().item<double>();
      worst = std::max(worst, d);
      if (!(d <= 1e-6)) {
        std::fprintf(stderr, "group %lld: parameter %s differs from the reference by %g\n", static_cast<long long>(g),
                     item.key().c_str(), d);
        ++bad;
      }
    }
    for (int r = 0; r < ranks; ++r) {
      auto mine = read_archive(final_path(dir, std::to_string(g), r));
      auto first = read_archive(final_path(dir, "0", r));
      for (const auto& [key, t] : first)
        if (!mine.count(key) || !torch::equal(mine.at(key), t)) {
          std::fprintf(stderr, "group %lld rank %d: '%s' is not bitwise equal to group 0's\n", static_cast<long long>(g),
                       r, key.c_str());
          ++bad;
        }
    }
  }
  if (ranks == 1) {  // NoShard, one rank: the optimizer's pieces are whole parameters, in order
    auto got = read_archive(final_path(dir, "0", 0));
    int64_t i = 0;
    for (const auto& p : model->parameters()) {
      auto& s = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
      const double d = (got.at("opt." + std::to_string(i) + ".exp_avg") - s.exp_avg()).abs().max().item<double>();
      worst = std::max(worst, d);
      if (!(d <= 1e-6)) {
        std::fprintf(stderr, "exp_avg of parameter %lld differs from the reference by %g\n", static_cast<long long>(i), d);
        ++bad;
      }
      ++i;
    }
  }
  std::printf("every group bitwise equal: %s; largest difference from the reference: %g\n", bad ? "NO" : "yes", worst);
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    namespace po = boost::program_options;
    int64_t steps = 60, groups = 3;
    int kill_rank = 0, ranks = 1, step_ms = 0;
    std::string dir = ".", kill, strategy = "no_shard";
    bool ref = false;
    po::options_description desc("options");
    desc.add_options()("help", "this text")("steps", cli::number_option(steps, "--steps"), "steps to commit")(
        "groups", cli::number_option(groups, "--groups"), "replica groups (the data set is split among them)")(
        "dir", po::value(&dir)->default_value(dir), "where the step logs and final states go")(
        "strategy", po::value(&strategy)->default_value(strategy), "no_shard or full_shard (inside each group)")(
        "kill", po::value(&kill)->default_value(kill), "INCARNATION@STEP,...: die (SIGKILL) there")(
        "kill-rank", cli::number_option(kill_rank, "--kill-rank"), "which rank of the group dies")(
        "step-ms", cli::number_option(step_ms, "--step-ms"), "sleep after each step (slows a demo down)")(
        "reference", po::bool_switch(&ref), "replay the logs in one process and compare")(
        "ranks", cli::number_option(ranks, "--ranks"), "ranks per group (with --reference)");
    if (!cli::parse_command_line(argc, argv, desc, "usage: ft_train [options]  (under torchrun --no-python)"))
      return 0;
    if (ref) return reference(groups, ranks, dir);
    return train(steps, groups, dir, kill, kill_rank, strategy, step_ms);
  } catch (...) {
    return cli::report_error("ft_train");
  }
}
