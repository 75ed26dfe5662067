// Training with in-memory snapshots under torchrun --max-restarts, killed on
// purpose (tests/snapshot_kill.sh drives it). Every run of one strategy
// trains the same model on the same data; a run that dies restores from its
// snapshots (or its disk checkpoint) and ends with the final parameters
// written to --out, which must equal those of a run that never died.
//
// --kill "I:R@S:PHASE[:LOSS],...": in incarnation I (TORCHELASTIC_RESTART_COUNT),
// rank R kills itself (SIGKILL) at step S, in PHASE: forward (before it),
// backward (between the units' reductions), reduce-scatter (inside one: the
// step's second reduce-scatter posted to the backend, not yet complete on
// the other ranks, which fail at their next collective with it), optimizer (before its step)
// or snapshot (its file written, not yet in place). LOSS: "node" deletes the
// rank's own snapshots first (its node's memory is lost, its buddy's copy
// remains); "pair" deletes those of the rank and of its buddy, and the copies
// each keeps (both nodes lost: only the disk checkpoint remains); "damage"
// flips a byte of the rank's newest snapshot (its checksum must refuse it).
//
// --rejoin (a hand launch, without torchrun): a rank whose step fails stays
// alive and calls Snapshots::rejoin(); the launcher starts a replacement for
// the lost rank with SHARDTORCH_REJOIN=1 and TORCHELASTIC_RESTART_COUNT set
// to its incarnation. Each rank that rejoined prints "rank R: rejoined at step S".
//
// For bench/snapshots/run.sh: --model gpt trains the example GPT
// (--d-model, --layers, --batch); rank 0 prints the median step time of this
// incarnation and, as wall-clock epoch milliseconds, when a rank was killed,
// when the first step after a restart ended and when step --report-step
// ended after it. Without --dir, a restarted
// run resumes from --checkpoint (the disk baseline). A rank that fails
// prints "rank R failed: " and the error, and exits with 1.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../examples/gpt.h"
#include "../src/base/errors.h"
#include "../src/base/files.h"
#include "shardtorch/checkpoint/safetensors.h"
#include "shardtorch/shardtorch.h"

namespace {

struct BlockImpl : torch::nn::Module {
  BlockImpl() : fc(register_module("fc", torch::nn::Linear(16, 16))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(fc(x)); }
  torch::nn::Linear fc;
};
SHARDTORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl()
      : b1(register_module("b1", Block())),
        b2(register_module("b2", Block())),
        b3(register_module("b3", Block())),
        head(register_module("head", torch::nn::Linear(16, 1))) {}
  torch::Tensor forward(torch::Tensor x, const std::function<void()>& mid_backward) {
    auto h = b1(x);
    if (h.requires_grad())
      h.register_hook([mid_backward](torch::Tensor g) {
        mid_backward();  // b3's and b2's reductions are done, b1's not started
        return g;
      });
    return head(b3(b2(h)));
  }
  Block b1, b2, b3;
  torch::nn::Linear head;
};
SHARDTORCH_MODULE(Net);

struct Kill {
  int incarnation = -1, rank = -1;
  int64_t step = -1;
  std::string phase, loss;
};

std::vector<Kill> parse_kills(const std::string& text) {
  std::vector<Kill> out;
  std::stringstream all(text);
  std::string one;
  while (std::getline(all, one, ',')) {
    if (one.empty()) continue;
    std::vector<std::string> f;
    std::stringstream parts(one);
    std::string p;
    while (std::getline(parts, p, ':')) f.push_back(p);
    const auto at = f.size() > 1 ? f[1].find('@') : std::string::npos;
    if (f.size() < 3 || at == std::string::npos) throw std::runtime_error("--kill: bad '" + one + "'");
    Kill k;
    k.incarnation = std::stoi(f[0]);
    k.rank = std::stoi(f[1].substr(0, at));
    k.step = std::stoll(f[1].substr(at + 1));
    k.phase = f[2];
    if (f.size() > 3) k.loss = f[3];
    out.push_back(k);
  }
  return out;
}

std::string arg(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == "--" + name) return argv[i + 1];
  return fallback;
}

// A node lost: the snapshots in `dir` that rank `r`'s node kept (its own,
// and the copies it held for others) are gone.
void forget_rank(const std::string& dir, int r) {
  const std::string own = "-r" + std::to_string(r) + "-own-", held = "-held-by-r" + std::to_string(r) + "-";
  for (const auto& e : shardtorch::files::list_directory(dir))
    if (e.find(own) != std::string::npos || e.find(held) != std::string::npos)
      shardtorch::files::remove_all_quietly(shardtorch::files::join(dir, e));
}

int64_t epoch_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int train(int argc, char** argv, int& rank) {
  const int64_t started_ms = epoch_ms();
  const std::string strategy = arg(argc, argv, "strategy", "full_shard");
  const int64_t steps = std::stoll(arg(argc, argv, "steps", "10"));
  const int every = std::stoi(arg(argc, argv, "every", "1"));
  const int64_t save_every = std::stoll(arg(argc, argv, "save-every", "0"));
  const std::string dir = arg(argc, argv, "dir", "");
  const std::string ckpt = arg(argc, argv, "checkpoint", "");
  const std::string out = arg(argc, argv, "out", "");
  const auto kills = parse_kills(arg(argc, argv, "kill", ""));
  const int64_t report_step = std::stoll(arg(argc, argv, "report-step", "-1"));
  const bool snapshots = !dir.empty();
  bool rejoin = false;
  for (int i = 1; i < argc; ++i) rejoin = rejoin || std::string(argv[i]) == "--rejoin";
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const int incarnation = restarts ? std::atoi(restarts) : 0;

  const std::string model_kind = arg(argc, argv, "model", "mlp");
  auto world = shardtorch::World::from_env();
  rank = world->rank();
  const int64_t world_ms = epoch_ms();
  torch::manual_seed(0);
  Net net;
  gpt::Config cfg;
  cfg.d_model = std::stoll(arg(argc, argv, "d-model", "32"));
  cfg.n_layer = std::stoll(arg(argc, argv, "layers", "2"));
  const int64_t batch = std::stoll(arg(argc, argv, "batch", "8"));  // sequences per rank and step (gpt)
  cfg.seq_len = 64;
  cfg.vocab = 256;
  gpt::GPT gpt_model{cfg};
  const bool is_gpt = model_kind == "gpt";
  if (!is_gpt && model_kind != "mlp") throw std::runtime_error("--model: mlp or gpt");
  torch::nn::Module& model = is_gpt ? static_cast<torch::nn::Module&>(*gpt_model) : *net;
  shardtorch::shard(model, world,
                    shardtorch::ShardOptions()
                        .strategy(shardtorch::parse_strategy(strategy))
                        .hybrid_shard_size(strategy == "hybrid_shard" ? 2 : 0)
                        .bucket_mb(is_gpt ? 25.0 : 0.0005));
  auto opt = shardtorch::AdamW(model, torch::optim::AdamWOptions(1e-2));

  // The data loader: a position that advances with every batch read, and
  // batches that depend on it (and on the rank) alone.
  int64_t position = 0;
  auto next_batch = [&] {
    torch::manual_seed(1000 + 7919 * position + world->rank());
    ++position;
    auto x = torch::randn({8, 16});
    return std::make_pair(x, torch::sin(x.sum(1, true)));
  };

  Kill mine;
  for (const auto& k : kills)
    if (k.incarnation == incarnation && k.rank == world->rank()) mine = k;
  int64_t step = 0;  // the optimizer steps done
  shardtorch::SnapshotOptions so;
  so.every = every;
  so.dir = dir;
  so.job = "test";
  so.fallback_dir = ckpt;
  std::unique_ptr<shardtorch::Snapshots> snaps;
  // Killed in step S once every rank has finished step S - 1: the ranks
  // share this machine, so wait (at most 10 s) for every rank's newest
  // snapshot to be in place; a rank still writing it would otherwise make
  // the restore's step depend on the machine's load.
  const auto wait_for_snapshots = [&] {
    if (!snapshots || step < every) return;
    const int64_t last = step - step % every;
    for (int r = 0; r < world->size(); ++r)
      for (int t = 0; t < 1000 && !shardtorch::files::exists(shardtorch::detail::own_snapshot_path(so, r, last)); ++t)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
  };
  int64_t first = 0;  // the step this incarnation starts after
  int64_t snapshots_written = 0;
  const auto die_at = [&](const std::string& phase) {
    // The step a phase belongs to: the one being done, or (a snapshot,
    // written in the background while the next steps run) the one it is of:
    // the k-th written is of the k-th multiple of `every` after `first`.
    const int64_t of = phase == "snapshot" ? (first / every + snapshots_written) * every : step + 1;
    if (mine.phase != phase || of != mine.step) return;
    // Inside a reduce-scatter no wait: the collective would complete meanwhile
    // (the step waited at its start).
    if (phase != "snapshot" && phase != "reduce-scatter") wait_for_snapshots();
    if (mine.loss == "damage") {  // the last byte of its newest snapshot flipped
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      const std::string f = shardtorch::files::join(shardtorch::detail::own_snapshot_path(so, world->rank(), step),
                                                    "rank-" + std::to_string(world->rank()) + ".safetensors");
      std::FILE* fp = std::fopen(f.c_str(), "r+b");
      if (!fp || std::fseek(fp, -1, SEEK_END) != 0) throw std::runtime_error("cannot damage " + f);
      const int c = std::fgetc(fp);
      std::fseek(fp, -1, SEEK_END);
      std::fputc(c ^ 0xff, fp);
      std::fclose(fp);
    }
    if (mine.loss == "node" || mine.loss == "pair") {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the copies in flight land first
      forget_rank(dir, world->rank());
      if (mine.loss == "pair") forget_rank(dir, snaps->buddies()[static_cast<size_t>(world->rank())]);
    }
    std::fprintf(stderr, "rank %d: killed at step %lld (%s%s%s) at epoch ms %lld\n", world->rank(),
                 static_cast<long long>(mine.step), phase.c_str(), mine.loss.empty() ? "" : ", ", mine.loss.c_str(),
                 static_cast<long long>(epoch_ms()));
    std::fflush(stderr);
    std::raise(SIGKILL);
  };
  if (snapshots) {
    snaps = std::make_unique<shardtorch::Snapshots>(world, model, opt.get(), so);
    snaps->register_state(
        "position", [&] { return std::to_string(position); }, [&](const std::string& s) { position = std::stoll(s); });
    shardtorch::checkpoint::set_crash_hook([&](const std::string& point) {
      if (point != "snapshot written") return;
      ++snapshots_written;
      die_at("snapshot");
    });
    const int64_t restored = snaps->restore();
    if (restored >= 0) step = restored;
  } else if (!ckpt.empty() && incarnation > 0 && shardtorch::sharded_checkpoint_exists(ckpt)) {
    std::map<std::string, std::string> user;
    step = shardtorch::load_sharded_checkpoint(model, opt.get(), ckpt, &user);
    position = std::stoll(user.at("position"));
  }
  if (world->rank() == 0)
    std::printf("incarnation %d: starts after step %lld (epoch ms: process %lld, world %lld, restored %lld)\n",
                incarnation, static_cast<long long>(step), static_cast<long long>(started_ms),
                static_cast<long long>(world_ms), static_cast<long long>(epoch_ms()));
  int posted = 0;  // reduce-scatters posted in this step
  shardtorch::detail::set_test_point_action([&](const char* site) {
    if (std::string(site) == "reduce-scatter posted" && ++posted == 2) die_at("reduce-scatter");
  });
  std::vector<double> times;
  first = step;
  bool rejoined = false;  // this process rejoined a replacement (--rejoin)
  while (step < steps) {
    try {
      const auto t0 = std::chrono::steady_clock::now();
      posted = 0;
      if (mine.phase == "reduce-scatter" && step + 1 == mine.step) wait_for_snapshots();
      die_at("forward");
      opt->zero_grad();
      torch::Tensor loss;
      if (is_gpt) {
        torch::manual_seed(1000 + 7919 * position + world->rank());
        ++position;
        auto tokens = torch::randint(cfg.vocab, {batch, cfg.seq_len}, torch::kLong);
        loss = gpt::lm_loss(gpt_model->forward(tokens), tokens);
      } else {
        auto [x, y] = next_batch();
        loss = torch::mse_loss(net->forward(x, [&] { die_at("backward"); }), y);
      }
      loss.backward();
      die_at("optimizer");
      opt->step();
      ++step;
      if (snaps) snaps->after_step(step);
      if (save_every > 0 && step % save_every == 0 && !ckpt.empty())
        shardtorch::save_sharded_checkpoint(
            model, opt.get(), ckpt, step,
            snaps ? snaps->user_state() : std::map<std::string, std::string>{{"position", std::to_string(position)}});
      times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      if (step == first + 1 && (incarnation > 0 || rejoined) && world->rank() == 0)
        std::printf("first step after the restart ended at epoch ms %lld\n", static_cast<long long>(epoch_ms()));
      if (step == report_step && (incarnation > 0 || rejoined) && world->rank() == 0)
        std::printf("step %lld ended again at epoch ms %lld\n", static_cast<long long>(step),
                    static_cast<long long>(epoch_ms()));
    } catch (const std::exception& e) {
      if (!rejoin || !snaps) throw;
      std::fprintf(stderr, "rank %d: step %lld failed, rejoining: %s\n", world->rank(),
                   static_cast<long long>(step + 1), e.what());
      step = snaps->rejoin();
      first = step;
      rejoined = true;
      std::fprintf(stderr, "rank %d: rejoined at step %lld at epoch ms %lld\n", world->rank(),
                   static_cast<long long>(step), static_cast<long long>(epoch_ms()));
    }
  }
  if (world->rank() == 0 && times.size() > 3) {
    std::vector<double> steady(times.begin() + 3, times.end());
    std::nth_element(steady.begin(), steady.begin() + static_cast<long>(steady.size() / 2), steady.end());
    std::printf("median step ms %.3f over %zu steps\n", steady[steady.size() / 2], times.size() - 3);
  }
  if (snaps && world->rank() == 0)
    std::printf("bytes kept by rank 0: %lld\n", static_cast<long long>(snaps->bytes_kept()));
  if (snaps) snaps->finish();
  if (!out.empty()) shardtorch::save_full_state_dict(model, out);
  shardtorch::detail::set_test_point_action({});
  return 0;
}

int main(int argc, char** argv) {
  int rank = -1;
  try {
    return train(argc, argv, rank);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d failed: %s\n", rank, e.what());
    return 1;
  }
}
