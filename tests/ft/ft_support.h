// What the fault-tolerance tests share (tests/test_ft.cpp, and
// tests/cuda/test_cuda_ft.cpp on a GPU machine): torchft's lighthouse in a
// child process, replica groups that train a small model under a Manager,
// and the single-process replay they must match. The including file defines
// SHARDTORCH_PYTHON_FOR_FT and SHARDTORCH_LIGHTHOUSE (tests/CMakeLists.txt).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtorch/ft.h"
#include "shardtorch/shardtorch.h"
#include "shardtorch/testing.h"

extern char** environ;

namespace ftsupport {
using shardtorch::World;

// 127.0.0.1:`port` (0: any port).
inline sockaddr_in loopback(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = loopback(0);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// torchft_lighthouse on a loopback port (a free one unless `port`), for the
// life of the object.
class Lighthouse {
 public:
  explicit Lighthouse(int min_replicas, int heartbeat_timeout_ms = 30000, int port = 0)
      : min_replicas_(min_replicas), heartbeat_timeout_ms_(heartbeat_timeout_ms), port_(port ? port : free_port()) {
    // A port picked free may be taken before the lighthouse binds it (the
    // lighthouse then exits): another one is tried.
    for (int attempt = 1; !start(); ++attempt) {
      if (port || attempt == 3)
        throw std::runtime_error("torchft_lighthouse exited at start on port " + std::to_string(port_));
      port_ = free_port();
    }
  }
  ~Lighthouse() { stop(); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  // SIGSTOP: it keeps its connections but answers nothing until resume().
  void pause() const { ::kill(pid_, SIGSTOP); }
  void resume() const { ::kill(pid_, SIGCONT); }
  // kill -9, as a crash would: its connections close, its state is lost.
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = 0;
  }
  // A new lighthouse on the same port (none of the earlier one's state).
  void restart() {
    stop();
    if (!start()) throw std::runtime_error("torchft_lighthouse exited at restart on port " + std::to_string(port_));
  }

 private:
  // Starts it and waits until it listens (false: it exited first).
  bool start() {
    const std::string exe = SHARDTORCH_PYTHON_FOR_FT;
    if (::access(exe.c_str(), X_OK) != 0)
      throw std::runtime_error("no Python with torchft at '" + exe +
                               "': run scripts/setup.sh (it installs torchft-nightly)");
    std::vector<std::string> args{exe, SHARDTORCH_LIGHTHOUSE, "--bind", address(), "--min_replicas",
                                  std::to_string(min_replicas_), "--join_timeout_ms", "2000", "--quorum_tick_ms", "20",
                                  // Long: the bare clients below send no heartbeats while they wait for each other.
                                  "--heartbeat_timeout_ms", std::to_string(heartbeat_timeout_ms_)};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    if (posix_spawn(&pid_, exe.c_str(), &fa, nullptr, argv.data(), environ) != 0)
      throw std::runtime_error("could not start " + exe);
    posix_spawn_file_actions_destroy(&fa);
    for (int waited_ms = 0; waited_ms < 60000; waited_ms += 20) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = 0;
        return false;
      }
      if (listening()) return true;
      ::usleep(20000);
    }
    throw std::runtime_error("torchft_lighthouse did not listen on port " + std::to_string(port_) + " within 60 s");
  }

  bool listening() const {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a = loopback(port_);
    const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    return ok;
  }

  int min_replicas_, heartbeat_timeout_ms_, port_;
  pid_t pid_ = 0;
};

// Two replica groups of `ranks` ranks each, in 2*ranks forked processes: each
// group its own World; `hidden` may differ per group.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t hidden)
      : a(register_module("a", torch::nn::Linear(6, hidden))), b(register_module("b", torch::nn::Linear(hidden, 1))) {}
  at::Tensor forward(at::Tensor x) { return b(a(x).tanh()); }
  torch::nn::Linear a, b;
};
SHARDTORCH_MODULE(Net);

// Made on the CPU (the same numbers whatever the device), then moved to `device`.
inline at::Tensor batch_x(int64_t group, int rank, int64_t step, const c10::Device& device = at::kCPU) {
  at::manual_seed(100 * group + 10 * rank + step);
  return at::randn({4, 6}).to(device);
}

inline std::shared_ptr<World> group_world(World& all, int ranks, const c10::Device& device = at::kCPU) {
  const int g = all.rank() / ranks;
  auto store = c10::make_intrusive<c10d::PrefixStore>("group" + std::to_string(g), all.store());
  return World::create(store, all.rank() % ranks, ranks, shardtorch::WorldOptions().device(device));
}

using Named = std::map<std::string, at::Tensor>;

// How train_group trains each group.
struct GroupRun {
  shardtorch::ShardOptions shard;
  int steps = 6;
  int64_t hidden_for_group1 = 8;                             // another width: a different model
  std::optional<shardtorch::ShardOptions> shard_for_group1;  // unset: `shard`
  bool prefetch = false;
  c10::Device device = at::kCPU;  // each group's World computes here (the outer World stays on the CPU)
  double tolerance = 1e-6;        // against the replay, on the same device
  // On every rank after its Manager is made.
  std::function<void(int group, int rank, shardtorch::ft::Manager&)> setup;
  // On every rank after each committed step (after the optimizer step).
  std::function<void(int group, shardtorch::ft::Manager&, Net&, shardtorch::ShardedOptimizer&)> after_step;
};

// Every tensor on the CPU.
struct GroupResult {
  Named params;                      // at the end, full
  std::vector<std::string> counted;  // per committed step: the groups whose gradients counted
  std::vector<Named> grads;          // per committed step: the full gradients the optimizer stepped with
  std::vector<Named> before;         // per committed step: the full parameters it stepped from
  std::vector<int64_t> failed;       // per step not committed: step() after it
  int rebuilt = 0;                   // steps that built the cross-replica group
};

inline GroupResult train_group(World& all, int ranks, const std::string& lighthouse, const GroupRun& run) {
  auto world = group_world(all, ranks, run.device);
  const int g = all.rank() / ranks;
  at::manual_seed(0);
  Net model(g == 1 ? run.hidden_for_group1 : 8);
  model->to(run.device);
  shardtorch::shard(*model, world, g == 1 && run.shard_for_group1 ? *run.shard_for_group1 : run.shard);
  auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));
  shardtorch::ft::Manager m(world, *model, *opt,
                            shardtorch::ft::ManagerOptions()
                                .lighthouse(lighthouse)
                                .replica_group(std::to_string(g))
                                .log(false)
                                .prefetch_quorum(run.prefetch));
  if (run.setup) run.setup(g, world->rank(), m);
  GroupResult out;
  while (m.step() < run.steps) {
    m.start_step();
    auto x = batch_x(g, world->rank(), m.step(), run.device);
    opt->zero_grad();
    model->forward(x).pow(2).mean().backward();
    const bool committed = m.should_commit();
    if (m.last_step().reconfigured) ++out.rebuilt;
    if (!committed) {
      out.failed.push_back(m.step());
      continue;
    }
    {
      auto full = shardtorch::summon_full_params(*model, shardtorch::SummonOptions().with_grads(true).writeback(false));
      Named grads, before;
      for (auto& item : model->named_parameters()) {
        grads[item.key()] = item.value().grad().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
        before[item.key()] = item.value().detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
      }
      out.grads.push_back(std::move(grads));
      out.before.push_back(std::move(before));
    }
    opt->step();
    std::string who;
    for (auto& c : m.last_step().counted) who += c;
    out.counted.push_back(who);
    if (run.after_step) run.after_step(g, m, model, *opt);
  }
  // Each round's answer is dropped from the group's store after the next round starts.
  const std::string rounds = "shardtorch-ft/" + std::to_string(g) + "/incarnation0/round/";
  if (world->store()->check({rounds + "0"})) throw std::runtime_error("the group's store keeps every round");
  for (auto& [name, t] : shardtorch::full_parameters(*model)) out.params[name] = t.to(at::kCPU);
  return out;
}

// Single-process replay: step s averages the counted groups' ranks' batches.
// Returns the parameters at the end and each step's gradients.
inline std::pair<Named, std::vector<Named>> reference(int ranks, const std::vector<std::string>& counted,
                                                      const c10::Device& device = at::kCPU) {
  at::manual_seed(0);
  Net model(8);
  model->to(device);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  std::vector<Named> grads;
  for (size_t s = 0; s < counted.size(); ++s) {
    opt.zero_grad();
    at::Tensor total;
    for (char c : counted[s])
      for (int r = 0; r < ranks; ++r) {
        auto l = model->forward(batch_x(c - '0', r, static_cast<int64_t>(s), device)).pow(2).mean();
        total = total.defined() ? total + l : l;
      }
    (total / static_cast<double>(counted[s].size() * static_cast<size_t>(ranks))).backward();
    Named step;
    for (auto& item : model->named_parameters()) step[item.key()] = item.value().grad().to(at::kCPU, false, true);
    grads.push_back(std::move(step));
    opt.step();
  }
  Named out;
  for (auto& item : model->named_parameters()) out[item.key()] = item.value().detach().to(at::kCPU, false, true);
  return {out, grads};
}

// Throws unless `t` is bitwise the same on every rank of `all`.
inline void require_alike(World& all, const at::Tensor& t, const std::string& what) {
  auto first = t.clone();
  all.comm().broadcast(first, 0, "compare");
  if (!at::equal(t, first)) throw std::runtime_error(what + " differs between the groups");
}

// `got` (a group's training) against the replay of its committed steps:
// every step's gradients and the final parameters within 1e-6, and the
// parameters bitwise alike in every group, before every step and at the end.
inline void check_against_replay(World& all, int ranks, const GroupResult& got, const GroupRun& run = {}) {
  auto [want, want_grads] = reference(ranks, got.counted, run.device);
  if (got.grads.size() != want_grads.size()) throw std::runtime_error("gradients of a step missing");
  for (size_t s = 0; s < want_grads.size(); ++s)
    for (auto& [name, t] : want_grads[s]) {
      require_alike(all, got.before[s].at(name),
                    "step " + std::to_string(s) + ": " + name + " before the optimizer step");
      const double d = (got.grads[s].at(name) - t).abs().max().item<double>();
      if (!(d <= run.tolerance))
        throw std::runtime_error("step " + std::to_string(s) + ": the gradient of " + name +
                                 " differs from one process by " + std::to_string(d) + " (counted groups " +
                                 got.counted[s] + ")");
    }
  for (auto& [name, t] : want) {
    const double d = (got.params.at(name) - t).abs().max().item<double>();
    if (!(d <= run.tolerance)) throw std::runtime_error(name + " differs from one process by " + std::to_string(d));
    require_alike(all, got.params.at(name), name);  // rank 0's values against everyone's
  }
}

// Group 1 loses its state after step 3 (other weights, garbage optimizer
// state, an older step count): the next quorum heals it from group 0, rank k
// from rank k, before its optimizer step. From then on both groups train
// bitwise alike and like one process (the optimizer state's moments and step
// count show in every later update).
inline void group_1_loses_its_state_after_step_3(int g, shardtorch::ft::Manager& m, Net& model,
                                                 shardtorch::ShardedOptimizer& opt) {
  if (g != 1 || m.step() != 3) return;
  c10::NoGradGuard no_grad;
  {
    auto full = shardtorch::summon_full_params(*model);  // the edits are written back into the shards
    for (auto& p : model->parameters()) p.add_(1.0);
  }
  for (auto& [key, st] : opt.inner().state()) {
    auto& a = static_cast<torch::optim::AdamWParamState&>(*st);
    a.exp_avg().fill_(7.0);
    a.exp_avg_sq().fill_(3.0);
    a.step(1000);
  }
  m.set_step(1);
}

}  // namespace ftsupport
