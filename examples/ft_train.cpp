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
// healed past it) in its second: torchrun restarts it and it heals. A "b"
// after the step kills it in the backward, between its gradient buckets'
// all-reduces; an "h", while it sends its state to a group it heals. A kill
// waits, past its step, until this incarnation has committed a step that
// counted all --groups groups, so that a group slow to start is up to date
// before anyone dies. Every group appends its committed steps (and whose
// gradients each averaged) to DIR/steps-GROUP.txt and saves its final state;
// (lines "<step> quorum <id> at <epoch ms> counted <groups>"), and
// `ft_train --reference --dir DIR --groups 3` then replays those steps in
// one process and checks every group against it (exit status 0 when equal);
// `torchrun --no-python --standalone --nproc-per-node 3 ft_train --reference
// --exact --dir DIR --groups 3` replays them with the groups' own reduction
// order and requires every group bitwise equal to it (groups of one rank).
// --model gpt trains the example GPT (examples/gpt.h) instead of the MLP;
// --cpu-offload turns on ShardOptions::cpu_offload inside each group.
// --snapshots SHM_DIR keeps in-memory snapshots of each group (Snapshots,
// one job per group, every --snapshot-every committed steps): a restarted
// group restores the newest one and starts from its step (Manager::set_step),
// counted with the groups at that step or healed from those ahead; it prints
// "group G: restored step S from memory, then ..." at its first commit.
#include <ATen/core/jit_type.h>
#include <torch/torch.h>

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "cli.h"
#include "gpt.h"
#include "shardtorch/ft.h"
#include "shardtorch/shardtorch.h"
#include "shardtorch/snapshot.h"

namespace {

constexpr int64_t kFeatures = 16, kPerRank = 64, kBatch = 8;

int64_t g_hidden = 32;  // --hidden

struct NetImpl : torch::nn::Module {
  NetImpl()
      : l1(register_module("l1", torch::nn::Linear(kFeatures, g_hidden))),
        l2(register_module("l2", torch::nn::Linear(g_hidden, g_hidden))),
        head(register_module("head", torch::nn::Linear(g_hidden, 1))) {}
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

// What is trained: the MLP above (--model mlp) or the example GPT (--model
// gpt), on a data set of `size` samples that every process makes alike.
struct Task {
  std::shared_ptr<torch::nn::Module> root;
  std::function<torch::Tensor(const torch::Tensor&)> loss;  // of a batch, by sample indices
  torch::Tensor first_param;                                // its gradient comes last in a backward
};
std::string g_model = "mlp";  // --model
int g_hybrid_shard_size = 0;  // --hybrid-shard-size
bool g_cpu_offload = false;   // --cpu-offload
double g_tolerance = 1e-6;    // --tolerance
std::string g_snapshots;      // --snapshots: their directory ("": none)
int g_snapshot_every = 1;     // --snapshot-every

Task make_task(int64_t size) {
  torch::manual_seed(0);  // every group, every incarnation: the same start
  if (g_model == "gpt") {
    gpt::GPT model{gpt::Config{}};
    torch::manual_seed(1234);
    auto tokens = torch::randint(model->cfg.vocab, {size, model->cfg.seq_len}, torch::kLong);
    return {model.ptr(),
            [model, tokens](const torch::Tensor& idx) mutable {
              auto batch = tokens.index_select(0, idx);
              return gpt::lm_loss(model->forward(batch), batch);
            },
            model->tok_emb->weight};
  }
  if (g_model != "mlp") throw std::runtime_error("--model: '" + g_model + "' is neither mlp nor gpt");
  Net model;
  auto [x, y] = dataset(size);
  return {model.ptr(),
          [model, x = x, y = y](const torch::Tensor& idx) mutable {
            return torch::mse_loss(model->forward(x.index_select(0, idx)), y.index_select(0, idx));
          },
          model->l1->weight};
}

// The model's parameters, each tensor once (the GPT's head is tied to its embedding).
std::vector<torch::Tensor> unique_parameters(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  std::set<const void*> seen;
  for (auto& p : m.parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  return out;
}

// The median of the steps' times, in ms.
double median_ms(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

using Clock = std::chrono::steady_clock;

// The same training without fault tolerance: one World of R ranks under
// NoShard, rank r reading what group r reads (the baseline of the overhead).
int train_without_ft(int64_t steps, int64_t groups) {
  auto world = shardtorch::World::from_env();
  const int64_t size = groups * kPerRank;
  Task task = make_task(size);
  shardtorch::shard(*task.root, world,
                    shardtorch::ShardOptions().strategy(shardtorch::Strategy::NoShard).bucket_mb(0.002));
  auto opt = shardtorch::AdamW(*task.root, torch::optim::AdamWOptions(1e-2));
  shardtorch::ft::ReplicaSampler sampler(size, groups, world->rank(), 0, 1, kBatch);
  std::vector<double> times;
  for (int64_t step = 0; step < steps; ++step) {
    const auto t0 = Clock::now();
    auto idx = torch::tensor(sampler.batch(step));
    opt->zero_grad();
    task.loss(idx).backward();
    opt->step();
    if (step >= 5) times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  if (world->rank() == 0)
    std::printf("without fault tolerance: %d ranks, step time: median %.3f ms over %zu steps\n", world->size(),
                median_ms(times), times.size());
  return 0;
}

std::string final_path(const std::string& dir, const std::string& group, int rank) {
  return dir + "/final-" + group + "-rank" + std::to_string(rank) + ".pt";
}

// "0@12,1@30b,2@40h" -> {incarnation: (step, where)}: where is ' ' (before
// the step), 'b' (in the backward, between gradient buckets) or 'h' (while
// sending its state to a group it heals, at that step or later).
std::map<int, std::pair<int64_t, char>> parse_kills(const std::string& s) {
  std::map<int, std::pair<int64_t, char>> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto at = item.find('@');
    if (at == std::string::npos) throw std::runtime_error("--kill: '" + item + "' is not INCARNATION@STEP[b|h]");
    char where = item.back() == 'b' || item.back() == 'h' ? item.back() : ' ';
    out[std::stoi(item.substr(0, at))] = {std::stoll(item.substr(at + 1)), where};
  }
  return out;
}

[[noreturn]] void die(const std::string& group, int rank, int64_t step, const char* where) {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::printf("group %s rank %d: killing itself at step %lld%s at %02d:%02d:%02d.%03d\n", group.c_str(), rank,
              static_cast<long long>(step), where, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms));
  std::fflush(stdout);
  std::raise(SIGKILL);
  std::abort();
}

// What a run saves at its end, by key: the whole parameters ("param.NAME")
// and this rank's AdamW state ("opt.I.exp_avg", ... for the optimizer's
// I-th piece, with a hash of its name).
std::map<std::string, torch::Tensor> final_state(torch::nn::Module& root, shardtorch::ShardedOptimizer& opt) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : shardtorch::full_parameters(root)) out["param." + name] = t;
  int64_t i = 0;
  for (const auto& piece : opt.views().pieces()) {
    auto it = opt.inner().state().find(piece.view.unsafeGetTensorImpl());
    if (it == opt.inner().state().end()) continue;
    auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
    out["opt." + std::to_string(i) + ".exp_avg"] = s.exp_avg();
    out["opt." + std::to_string(i) + ".exp_avg_sq"] = s.exp_avg_sq();
    out["opt." + std::to_string(i) + ".name"] =
        torch::tensor(static_cast<int64_t>(std::hash<std::string>()(piece.name) & 0xffffff));
    ++i;
  }
  return out;
}

// `dir` and its parents, as `mkdir -p` makes them (every rank may: one that exists is fine).
void make_dirs(const std::string& dir) {
  for (size_t at = dir.find('/', 1);; at = dir.find('/', at + 1)) {
    const std::string part = dir.substr(0, at);
    if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST)
      throw std::runtime_error("ft_train: cannot create the directory '" + part + "': " + std::strerror(errno));
    if (at == std::string::npos) return;
  }
}

int train(int64_t steps, int64_t groups, const std::string& dir, const std::string& kill, int kill_rank,
          const std::string& strategy, int step_ms, int timeout_ms, int quorum_timeout_ms, bool prefetch_quorum) {
  make_dirs(dir);  // the steps' logs and the final states go there
  auto world = shardtorch::World::from_env();
  const int incarnation =
      std::atoi(std::getenv("TORCHELASTIC_RESTART_COUNT") ? std::getenv("TORCHELASTIC_RESTART_COUNT") : "0");
  const int64_t size = groups * world->size() * kPerRank;
  Task task = make_task(size);
  // Small buckets: several all-reduces per step, so that a kill in the
  // backward lands between them.
  shardtorch::shard(*task.root, world,
                    shardtorch::ShardOptions()
                        .strategy(shardtorch::parse_strategy(strategy))
                        .hybrid_shard_size(g_hybrid_shard_size)
                        .cpu_offload(g_cpu_offload)
                        .bucket_mb(0.002));
  auto opt = shardtorch::AdamW(*task.root, torch::optim::AdamWOptions(1e-2));
  shardtorch::ft::Manager manager(world, *task.root, *opt,
                                  shardtorch::ft::ManagerOptions()
                                      .timeout(std::chrono::milliseconds(timeout_ms))
                                      .quorum_timeout(std::chrono::milliseconds(quorum_timeout_ms))
                                      .prefetch_quorum(prefetch_quorum));
  const std::string group = manager.replica_group();
  const int64_t group_index = std::stoll(group);
  shardtorch::ft::ReplicaSampler sampler(size, groups, group_index, world->rank(), world->size(), kBatch);
  const auto kills = parse_kills(kill);
  const auto my_kill = kills.count(incarnation) && world->rank() == kill_rank
                           ? std::optional<std::pair<int64_t, char>>(kills.at(incarnation))
                           : std::nullopt;
  // The program's own state that a heal carries: here the samples this group
  // has read (a data loader's position would go the same way).
  int64_t samples_read = 0;
  bool all_counted = false;  // this incarnation committed a step that counted every group
  const auto kill_due = [&](char where) {
    return my_kill && my_kill->second == where && manager.step() >= my_kill->first && all_counted;
  };
  manager.set_user_state(
      [&] {
        if (kill_due('h')) die(group, world->rank(), manager.step(), " while sending its state to a healing group");
        return std::to_string(samples_read);
      },
      [&](const std::string& s) { samples_read = std::stoll(s); });
  if (world->rank() == 0) std::printf("group %s: incarnation %d\n", group.c_str(), incarnation);
  std::fflush(stdout);
  // In-memory snapshots of this group, one job per group, with the data
  // position. The step restored is the Manager's: the quorum counts this
  // group with the groups at it, or heals it from those ahead.
  std::unique_ptr<shardtorch::Snapshots> snaps;
  int64_t restored = -1;
  if (!g_snapshots.empty()) {
    shardtorch::SnapshotOptions so;
    so.dir = g_snapshots;
    so.every = g_snapshot_every;
    so.job = "ft_train-group" + group;
    snaps = std::make_unique<shardtorch::Snapshots>(world, *task.root, opt.get(), so);
    snaps->register_state(
        "samples_read", [&] { return std::to_string(samples_read); },
        [&](const std::string& s) { samples_read = std::stoll(s); });
    restored = snaps->restore();
    if (restored >= 0) manager.set_step(restored);
  }
  std::vector<double> times;  // steps that committed without a heal or a new quorum
  while (manager.step() < steps) {
    const auto t0 = Clock::now();
    if (kill_due(' ')) die(group, world->rank(), manager.step(), "");
    manager.start_step();
    auto idx = torch::tensor(sampler.batch(manager.step()));
    opt->zero_grad();
    auto loss = task.loss(idx);
    if (kill_due('b')) {
      // The first layer's gradient comes last: the other buckets' all-reduces are under way.
      const int64_t at_step = manager.step();
      task.first_param.register_hook([&group, rank = world->rank(), at_step](torch::Tensor g) {
        die(group, rank, at_step, " in the backward, between its gradient buckets");
        return g;
      });
    }
    loss.backward();
    if (manager.should_commit()) {
      opt->step();
      samples_read += idx.size(0);
      const auto& r = manager.last_step();
      if (static_cast<int64_t>(r.counted.size()) == groups) all_counted = true;
      if (r.healed.empty() && !r.reconfigured && r.step >= 5)
        times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      if (world->rank() == 0) {
        std::ofstream log(dir + "/steps-" + group + ".txt", std::ios::app);
        const auto ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
                .count();
        log << r.step << " quorum " << r.quorum_id << " at " << ms << " counted";
        for (const auto& g : r.counted) log << ' ' << g;
        log << '\n';
        if (r.step % 10 == 0)
          std::printf("group %s step %lld loss %.5f\n", group.c_str(), static_cast<long long>(r.step),
                      loss.item<double>());
        std::fflush(stdout);
      }
      // Committed steps only (docs/fault_tolerance.md, "Snapshots under the
      // replica-group manager").
      if (snaps) snaps->after_step(manager.step());
      if (restored >= 0 && world->rank() == 0) {
        const bool healed = std::count(r.healed.begin(), r.healed.end(), group) > 0;
        std::printf("group %s: restored step %lld from memory, then %s at step %lld\n", group.c_str(),
                    static_cast<long long>(restored), healed ? "healed" : "counted without a heal",
                    static_cast<long long>(r.step));
        std::fflush(stdout);
      }
      restored = -1;
    }
    if (step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
  }
  // Final state: the whole parameters and this rank's optimizer state.
  torch::serialize::OutputArchive ar;
  for (const auto& [key, t] : final_state(*task.root, *opt)) ar.write(key, t);
  ar.save_to(final_path(dir, group, world->rank()));
  if (snaps) snaps->finish();
  if (world->rank() == 0) {
    std::printf("group %s: done at step %lld, %lld samples read on rank 0\n", group.c_str(),
                static_cast<long long>(manager.step()), static_cast<long long>(samples_read));
    std::printf("group %s: step time: median %.3f ms over %zu steady steps\n", group.c_str(), median_ms(times),
                times.size());
  }
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

// The committed steps, from the groups' logs: step -> the groups it counted
// (every log that has a step agrees on it). Empty on an error (printed).
std::vector<std::vector<int64_t>> read_counted(int64_t groups, const std::string& dir) {
  std::map<int64_t, std::string> counted;  // step -> "g1 g2 ..."
  for (int64_t g = 0; g < groups; ++g) {
    std::ifstream in(dir + "/steps-" + std::to_string(g) + ".txt");
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      int64_t step, qid, ms;
      std::string word, who;
      ls >> step >> word >> qid >> word >> ms >> word;  // "<step> quorum <id> at <epoch ms> counted <groups>"
      std::getline(ls, who);
      auto [it, fresh] = counted.emplace(step, who);
      if (!fresh && it->second != who) {
        std::fprintf(stderr, "step %lld: group %lld logged counted {%s}, another group {%s}\n",
                     static_cast<long long>(step), static_cast<long long>(g), who.c_str(), it->second.c_str());
        return {};
      }
    }
  }
  const int64_t steps = counted.empty() ? 0 : counted.rbegin()->first + 1;
  if (static_cast<int64_t>(counted.size()) != steps) {
    std::fprintf(stderr, "the logs miss some of steps 0..%lld\n", static_cast<long long>(steps - 1));
    return {};
  }
  std::vector<std::vector<int64_t>> out;
  for (int64_t s = 0; s < steps; ++s) {
    std::istringstream who(counted[s]);
    out.emplace_back();
    for (int64_t g; who >> g;) out.back().push_back(g);
  }
  return out;
}

// Replays the committed steps in one process: step s averages the gradients
// of the groups that counted in it (each group's ranks' batches, as it read them).
int reference(int64_t groups, int ranks, const std::string& dir) {
  const auto counted = read_counted(groups, dir);
  if (counted.empty()) return 1;
  const int64_t steps = static_cast<int64_t>(counted.size());
  const int64_t size = groups * ranks * kPerRank;
  Task task = make_task(size);
  torch::optim::AdamW opt(unique_parameters(*task.root), torch::optim::AdamWOptions(1e-2));
  int64_t multi = 0;
  for (int64_t s = 0; s < steps; ++s) {
    const std::vector<int64_t>& gs = counted[static_cast<size_t>(s)];
    if (gs.size() > 1) ++multi;
    opt.zero_grad();
    torch::Tensor total;
    for (int64_t g : gs)
      for (int r = 0; r < ranks; ++r) {
        shardtorch::ft::ReplicaSampler sampler(size, groups, g, r, ranks, kBatch);
        auto l = task.loss(torch::tensor(sampler.batch(s)));
        total = total.defined() ? total + l : l;
      }
    (total / static_cast<double>(gs.size() * static_cast<size_t>(ranks))).backward();
    opt.step();
  }
  std::printf("reference: %lld steps replayed (%lld averaged more than one group)\n", static_cast<long long>(steps),
              static_cast<long long>(multi));
  int bad = 0, unequal = 0;
  double worst = 0;
  for (int64_t g = 0; g < groups; ++g) {
    auto got = read_archive(final_path(dir, std::to_string(g), 0));
    std::set<const void*> compared;  // a tied parameter may be saved under one of its names
    for (const auto& item : task.root->named_parameters()) {
      if (!got.count("param." + item.key())) continue;
      compared.insert(item.value().unsafeGetTensorImpl());
      const double d = (got.at("param." + item.key()) - item.value()).abs().max().item<double>();
      worst = std::max(worst, d);
      if (!(d <= g_tolerance)) {
        std::fprintf(stderr, "group %lld: parameter %s differs from the reference by %g\n", static_cast<long long>(g),
                     item.key().c_str(), d);
        ++bad;
      }
    }
    if (compared.size() != unique_parameters(*task.root).size()) {
      std::fprintf(stderr, "group %lld: the final state lacks some parameters\n", static_cast<long long>(g));
      ++bad;
    }
    for (int r = 0; r < ranks; ++r) {
      auto mine = read_archive(final_path(dir, std::to_string(g), r));
      auto first = read_archive(final_path(dir, "0", r));
      for (const auto& [key, t] : first)
        if (!mine.count(key) || !torch::equal(mine.at(key), t)) {
          std::fprintf(stderr, "group %lld rank %d: '%s' is not bitwise equal to group 0's\n",
                       static_cast<long long>(g), r, key.c_str());
          ++unequal;
        }
    }
  }
  if (ranks == 1 && g_model == "mlp") {  // NoShard, one rank: the optimizer's pieces are whole parameters, in order
    auto got = read_archive(final_path(dir, "0", 0));
    int64_t i = 0;
    for (const auto& p : task.root->parameters()) {
      auto& s = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
      const double d = (got.at("opt." + std::to_string(i) + ".exp_avg") - s.exp_avg()).abs().max().item<double>();
      worst = std::max(worst, d);
      if (!(d <= g_tolerance)) {
        std::fprintf(stderr, "exp_avg of parameter %lld differs from the reference by %g\n", static_cast<long long>(i),
                     d);
        ++bad;
      }
      ++i;
    }
  }
  std::printf("every group bitwise equal: %s; largest difference from the reference: %g (tolerance %g)\n",
              unequal ? "NO" : "yes", worst, g_tolerance);
  return bad || unequal ? 1 : 0;
}

// The gradient hook of the exact replay, as the manager's: this rank's
// bucket (zeros when its group did not count at the step), summed over the
// world and divided by the number of groups counted.
class ReplayHook : public c10d::CommHookInterface {
 public:
  ReplayHook(shardtorch::HookGroup group, const bool& counts, const double& counted)
      : group_(std::move(group)), counts_(counts), counted_(counted) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor buffer = bucket.getBuffer();
    if (!counts_) buffer.zero_();
    std::vector<at::Tensor> v{buffer};
    return group_->allreduce(v)->getFuture()->then(
        [buffer, counted = counted_](c10::ivalue::Future&) {
          buffer.div_(counted);
          return c10::IValue(buffer);
        },
        c10::TensorType::get());
  }
  at::Tensor parseHookResult(const c10::IValue& result) override { return result.toTensor(); }

 private:
  shardtorch::HookGroup group_;
  const bool& counts_;
  const double& counted_;
};

// Replays the committed steps with the groups' own arithmetic, under
// torchrun with one process per group (groups of one rank, NoShard): rank
// g computes group g's gradient at every step, and the ranks reduce it as
// the groups' cross-replica all-reduce did, through Gloo over one rank per
// group in the groups' order, with the same buckets (the hook above). A
// step that counted three groups had all three in its cross-replica group,
// in this order; the sum of two gradients, or of one, with zeros, does not
// depend on the order. So, for up to three groups, every group's final state
// must be bitwise this replay's.
int reference_exact(int64_t groups, const std::string& dir) {
  auto world = shardtorch::World::from_env();
  if (world->size() != groups || groups > 3)
    throw std::runtime_error(
        "--reference --exact: run under torchrun with one process per group "
        "(--nproc-per-node " +
        std::to_string(groups) + "), for at most 3 groups of one rank each (this world has " +
        std::to_string(world->size()) + " ranks)");
  const auto counted = read_counted(groups, dir);
  if (counted.empty()) return 1;
  const int64_t size = groups * kPerRank;
  Task task = make_task(size);
  auto sharded = shardtorch::shard(*task.root, world,
                                   shardtorch::ShardOptions().strategy(shardtorch::Strategy::NoShard).bucket_mb(0.002));
  auto opt = shardtorch::AdamW(*task.root, torch::optim::AdamWOptions(1e-2));
  bool counts = false;
  double n = 1;
  sharded.register_comm_hook(std::make_unique<ReplayHook>(sharded.comm_hook_group(), counts, n));
  const int64_t g = world->rank();
  shardtorch::ft::ReplicaSampler sampler(size, groups, g, 0, 1, kBatch);
  for (size_t s = 0; s < counted.size(); ++s) {
    counts = std::count(counted[s].begin(), counted[s].end(), g) > 0;
    n = static_cast<double>(counted[s].size());
    opt->zero_grad();
    task.loss(torch::tensor(sampler.batch(static_cast<int64_t>(s)))).backward();
    opt->step();
  }
  const auto want = final_state(*task.root, *opt);
  if (world->rank() != 0) return 0;
  int unequal = 0;
  for (int64_t h = 0; h < groups; ++h) {
    auto got = read_archive(final_path(dir, std::to_string(h), 0));
    for (const auto& [key, t] : want)
      if (!got.count(key) || !torch::equal(got.at(key), t)) {
        std::fprintf(stderr, "group %lld: '%s' is not bitwise the exact replay's (largest difference %g)\n",
                     static_cast<long long>(h), key.c_str(),
                     got.count(key) && got.at(key).sizes() == t.sizes()
                         ? (got.at(key).to(torch::kDouble) - t.to(torch::kDouble)).abs().max().item<double>()
                         : -1.0);
        ++unequal;
      }
  }
  std::printf("exact replay: %zu steps; every group bitwise equal to it: %s\n", counted.size(), unequal ? "NO" : "yes");
  return unequal ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    namespace po = boost::program_options;
    int64_t steps = 60, groups = 3;
    int kill_rank = 0, ranks = 1, step_ms = 0, timeout_ms = 30000, quorum_timeout_ms = 60000;
    std::string dir = ".", kill, strategy = "no_shard";
    bool ref = false, exact = false, no_ft = false, prefetch_quorum = false;
    po::options_description desc("options");
    desc.add_options()("help", "this text")("steps", cli::number_option(steps, "--steps"), "steps to commit")(
        "groups", cli::number_option(groups, "--groups"), "replica groups (the data set is split among them)")(
        "dir", po::value(&dir)->default_value(dir), "where the step logs and final states go")(
        "strategy", po::value(&strategy)->default_value(strategy), "the sharding strategy inside each group")(
        "hybrid-shard-size", cli::number_option(g_hybrid_shard_size, "--hybrid-shard-size"),
        "--strategy hybrid_shard: ranks per shard group")(
        "cpu-offload", po::bool_switch(&g_cpu_offload),
        "ShardOptions::cpu_offload: masters, gradient shards and optimizer state in host memory (not no_shard)")(
        "kill", po::value(&kill)->default_value(kill), "INCARNATION@STEP,...: die (SIGKILL) there")(
        "kill-rank", cli::number_option(kill_rank, "--kill-rank"), "which rank of the group dies")(
        "step-ms", cli::number_option(step_ms, "--step-ms"), "sleep after each step (slows a demo down)")(
        "timeout-ms", cli::number_option(timeout_ms, "--timeout-ms"), "ManagerOptions::timeout")(
        "quorum-timeout-ms", cli::number_option(quorum_timeout_ms, "--quorum-timeout-ms"),
        "ManagerOptions::quorum_timeout")("prefetch-quorum", po::bool_switch(&prefetch_quorum),
                                          "ManagerOptions::prefetch_quorum")(
        "reference", po::bool_switch(&ref), "replay the logs in one process and compare")(
        "exact", po::bool_switch(&exact),
        "with --reference: replay with the groups' own reduction order instead (under torchrun, one process per "
        "group, groups of one rank) and require every group bitwise equal")(
        "no-ft", po::bool_switch(&no_ft), "the same training without fault tolerance: one World, rank r as group r")(
        "hidden", cli::number_option(g_hidden, "--hidden"), "width of the MLP's hidden layers")(
        "model", po::value(&g_model)->default_value(g_model), "mlp, or gpt (the example GPT, examples/gpt.h)")(
        "snapshots", po::value(&g_snapshots)->default_value(g_snapshots),
        "keep in-memory snapshots of this group in DIR (node-local memory, e.g. under /dev/shm) and restore from "
        "them at a restart")("snapshot-every", cli::number_option(g_snapshot_every, "--snapshot-every"),
                             "--snapshots: a snapshot every this many committed steps")(
        "tolerance", po::value(&g_tolerance)->default_value(g_tolerance),
        "--reference: the largest difference from the replay allowed")("ranks", cli::number_option(ranks, "--ranks"),
                                                                       "ranks per group (with --reference)");
    if (!cli::parse_command_line(argc, argv, desc, "usage: ft_train [options]  (under torchrun --no-python)")) return 0;
    if (ref) return exact ? reference_exact(groups, dir) : reference(groups, ranks, dir);
    if (no_ft) return train_without_ft(steps, groups);
    return train(steps, groups, dir, kill, kill_rank, strategy, step_ms, timeout_ms, quorum_timeout_ms,
                 prefetch_quorum);
  } catch (...) {
    return cli::report_error("ft_train");
  }
}
