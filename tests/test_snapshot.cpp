// In-memory snapshots (shardtorch/snapshot.h) inside one run: a model that
// restores a snapshot continues exactly as the run that wrote it, under
// NoShard too; snapshots of another job, another model or another world
// size are never used; persisted snapshots serve when memory is gone; the
// memory report and the planner count their bytes. The kills under torchrun
// are tests/snapshot_kill.sh's.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <thread>

#include "../src/base/errors.h"
#include "../src/base/files.h"
#include "captured_warnings.h"
#include "checkpoint_helpers.h"
#include "models.h"
#include "shardtorch/plan.h"
#include "shardtorch/shardtorch.h"
#include "shardtorch/snapshot.h"
#include "temp_dir.h"

using namespace testmodels;
using shardtorch::SnapshotOptions;
using shardtorch::Snapshots;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;
using Values = std::map<std::string, torch::Tensor>;

namespace {

// The MLP sharded over the world with its AdamW and this rank's rows.
struct Trained {
  MLP model{nullptr};
  std::optional<shardtorch::ShardedModel> sharded;
  std::unique_ptr<shardtorch::ShardedOptimizer> opt;
  torch::Tensor x;
  int64_t data_position = 0;  // the program's own state, registered with the snapshots

  Trained(World& w, Strategy s, int64_t hidden, uint64_t seed) {
    torch::manual_seed(seed);
    model = MLP(hidden);
    sharded = shardtorch::shard(model, w, strategy_options(s, w.size()));
    opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));
    torch::manual_seed(100 + w.rank());
    x = torch::randn({4, 7});
  }
  void step() {
    opt->zero_grad();
    model(x * (1.0 + 0.1 * static_cast<double>(data_position))).pow(2).mean().backward();
    opt->step();
    ++data_position;
  }
  Values values() {
    auto full = shardtorch::summon_full_params(*model);
    return snapshot(*model);
  }
  void register_with(Snapshots& snaps) {
    snaps.register_state(
        "data", [this] { return std::to_string(data_position); },
        [this](const std::string& v) { data_position = std::stoll(v); });
  }
};

void require_same(const Values& got, const Values& want, const std::string& what) {
  require(got.size() == want.size() && !want.empty(), what + ": another set of parameters");
  for (const auto& [n, w] : want) require(got.count(n) && torch::equal(got.at(n), w), what + ": '" + n + "' differs");
}

SnapshotOptions options_in(const std::string& dir, const std::string& job) {
  SnapshotOptions o;
  o.dir = dir;
  o.job = job;
  return o;
}

// Writes snapshots of steps 1 to 3 of the MLP (hidden 13) under `job`.
void write_three_steps(World& w, const std::string& dir, const std::string& job) {
  Trained t(w, Strategy::FullShard, 13, 1);
  Snapshots snaps(w.shared_from_this(), *t.model, t.opt.get(), options_in(dir, job));
  t.register_with(snaps);
  for (int64_t s = 1; s <= 3; ++s) {
    t.step();
    snaps.after_step(s);
  }
}

// restore(), its warnings captured into `warnings`.
int64_t restore_capturing(Snapshots& snaps, CapturedWarnings& warnings) {
  c10::WarningUtils::WarningHandlerGuard guard(&warnings);
  return snaps.restore();
}

class SnapshotRestore : public ::testing::TestWithParam<Strategy> {};

// Three steps snapshotted, a fourth not: a new model (other initial values)
// restores step 3 with the program's state, and its next step is the
// fourth, bitwise (AdamW's moments and step count came back too).
TEST_P(SnapshotRestore, ANewModelContinuesBitwiseFromTheNewestStep) {
  const Strategy strategy = GetParam();
  const TempDir dir("shardtorch-snapshots");
  auto r = run_ranks(2, [&](World& w) {
    Values at3, at4;
    {
      Trained t(w, strategy, 13, 1);
      Snapshots snaps(w.shared_from_this(), *t.model, t.opt.get(), options_in(dir, "continue"));
      t.register_with(snaps);
      require(snaps.restore() == -1, "a fresh start restored something");
      for (int64_t s = 1; s <= 3; ++s) {
        t.step();
        snaps.after_step(s);
      }
      at3 = t.values();
      t.step();
      at4 = t.values();
    }
    Trained again(w, strategy, 13, 2);
    Snapshots snaps(w.shared_from_this(), *again.model, again.opt.get(), options_in(dir, "continue"));
    again.register_with(snaps);
    const int64_t step = snaps.restore();
    require(step == 3, "restored step " + std::to_string(step) + ", expected 3");
    require(again.data_position == 3, "the registered state is " + std::to_string(again.data_position));
    require_same(again.values(), at3, "restored");
    again.step();
    require_same(again.values(), at4, "the step after the restore");
    snaps.finish();
    require(!files::exists(shardtorch::detail::own_snapshot_path(options_in(dir, "continue"), w.rank(), 3)),
            "finish() left this rank's snapshot");
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(strategy) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Snapshots, SnapshotRestore, ::testing::Values(Strategy::NoShard, Strategy::FullShard),
                         StrategyName());

// Under another job's name nothing is found: a fresh start, the other job's
// snapshots left alone. Under the same name: a second live Snapshots of it
// is refused on every rank (it would take the first one's snapshots), and
// torchrun's first attempt (TORCHELASTIC_RESTART_COUNT=0, as for every job
// that torchrun names "none") restores nothing, removing what it found,
// where a restart (count 1) restores.
TEST(Snapshots, AnotherJobsSnapshotsAreNotUsed) {
  const TempDir dir("shardtorch-snapshots");
  auto r = run_ranks(2, [&](World& w) {
    {
      CapturedWarnings warnings;  // write_three_steps does not restore() first: said once
      c10::WarningUtils::WarningHandlerGuard guard(&warnings);
      write_three_steps(w, dir, "job-a");
      require(warnings.any_with("after_step() before restore(): call restore() once before the first step"),
              "no warning for after_step() without restore()");
    }
    {
      Trained t(w, Strategy::FullShard, 13, 2);
      const Values before = t.values();
      Snapshots snaps(w.shared_from_this(), *t.model, t.opt.get(), options_in(dir, "job-b"));
      require(snaps.restore() == -1, "job-b restored job-a's snapshot");
      require_same(t.values(), before, "after the restore");
      require(files::exists(shardtorch::detail::own_snapshot_path(options_in(dir, "job-a"), w.rank(), 3)),
              "job-a's snapshot is gone");
      std::string error = "no error";
      try {
        Snapshots twice(w.shared_from_this(), *t.model, t.opt.get(), options_in(dir, "job-b"));
      } catch (const shardtorch::Error& e) {
        error = e.what();
      }
      require(error.find("the snapshots of job 'job-b' in '" + dir.string() +
                         "' are in use: rank 0: another live "
                         "process holds") != std::string::npos,
              "a second live Snapshots of one job: " + error);
      // Refused for rank 0's lock alone (held here by hand), rank 1 leaves no lock file of its own behind.
      const auto lock_of = [&](int rank) { return dir / (".shardtorch-job-c-r" + std::to_string(rank) + ".lock"); };
      const int held = w.rank() == 0 ? ::open(lock_of(0).string().c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644) : -1;
      if (w.rank() == 0) require(held >= 0 && ::flock(held, LOCK_EX | LOCK_NB) == 0, "could not take rank 0's lock");
      w.barrier();
      error = message_of([&] { Snapshots c(w.shared_from_this(), *t.model, t.opt.get(), options_in(dir, "job-c")); });
      require(error.find("are in use: rank 0: another live process holds") != std::string::npos,
              "rank 0's lock held: " + error);
      if (held >= 0) ::close(held);
      // Rank 1 removes its file before its constructor throws; rank 0 could look before that.
      if (w.rank() == 1) require(!files::exists(lock_of(1)), "rank 1, refused for rank 0's lock, left its lock file");
    }
    for (const char* count : {"1", "0"}) {
      ::setenv("TORCHELASTIC_RESTART_COUNT", count, 1);
      Trained t(w, Strategy::FullShard, 13, 2);
      Snapshots snaps(w.shared_from_this(), *t.model, t.opt.get(), options_in(dir, "job-a"));
      CapturedWarnings warnings;
      const int64_t step = restore_capturing(snaps, warnings);
      ::unsetenv("TORCHELASTIC_RESTART_COUNT");
      if (std::string(count) == "1") {
        require(step == 3, "a restart restored step " + std::to_string(step));
        continue;
      }
      require(step == -1, "torchrun's first attempt restored step " + std::to_string(step));
      require(!files::exists(shardtorch::detail::own_snapshot_path(options_in(dir, "job-a"), w.rank(), 3)),
              "the first attempt left the snapshots it found");
      require(warnings.any_with("at torchrun's first attempt (TORCHELASTIC_RESTART_COUNT=0): another job's or an "
                                "earlier run's, not restored, removed"),
              "no warning for the snapshots a first attempt found");
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// After a restore that refused another model's or world size's snapshots
// (steps 1 to 3): they are gone, and the new job's own steps 1 and 2 are
// written and copied to the buddy (an older step written beside the
// leftovers used to be pruned in their stead, and its copy failed).
void train_two_steps_over_refused(Trained& t, Snapshots& snaps, World& w, const std::string& dir) {
  require(!files::exists(shardtorch::detail::own_snapshot_path(options_in(dir, "job"), w.rank(), 3)),
          "the refused snapshot of step 3 is still there");
  for (int64_t s = 1; s <= 2; ++s) {
    t.step();
    snaps.after_step(s);
  }
  snaps.wait();
  for (int64_t s = 1; s <= 2; ++s)
    require(files::exists(shardtorch::detail::own_snapshot_path(options_in(dir, "job"), w.rank(), s)),
            "the new job's snapshot of step " + std::to_string(s) + " is missing");
}

// The same job's snapshots of another model (another width) are refused by
// their header, with a warning that says why, and removed; the model is
// left as it was.
TEST(Snapshots, AnotherModelsSnapshotsAreRefusedSayingWhy) {
  const TempDir dir("shardtorch-snapshots");
  auto r = run_ranks(2, [&](World& w) {
    write_three_steps(w, dir, "job");
    Trained t(w, Strategy::FullShard, 17, 2);
    const Values before = t.values();
    Snapshots snaps(w.shared_from_this(), *t.model, t.opt.get(), options_in(dir, "job"));
    t.register_with(snaps);
    CapturedWarnings warnings;
    const int64_t step = restore_capturing(snaps, warnings);
    require(step == -1, "restored step " + std::to_string(step) + " of another model");
    require(warnings.any_with("of another model"), "no warning says the snapshot is of another model");
    require(warnings.any_with("; removed"), "no warning says the refused snapshot was removed");
    require_same(t.values(), before, "after the restore");
    train_two_steps_over_refused(t, snaps, w, dir);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Snapshots written at world 2 are refused at world 4 (ranks 0 and 1 find
// files of their rank numbers), saying so.
TEST(Snapshots, AnotherWorldSizesSnapshotsAreRefusedSayingWhy) {
  const TempDir dir("shardtorch-snapshots");
  auto written = run_ranks(2, [&](World& w) { write_three_steps(w, dir, "job"); });
  ASSERT_TRUE(written.ok) << written.summary();
  auto r = run_ranks(4, [&](World& w) {
    Trained t(w, Strategy::FullShard, 13, 1);
    const Values before = t.values();
    Snapshots snaps(w.shared_from_this(), *t.model, t.opt.get(), options_in(dir, "job"));
    CapturedWarnings warnings;
    const int64_t step = restore_capturing(snaps, warnings);
    require(step == -1, "restored step " + std::to_string(step) + " written at another world size");
    if (w.rank() < 2)
      require(warnings.any_with("of rank " + std::to_string(w.rank()) + " of 2, not rank " + std::to_string(w.rank()) +
                                " of 4"),
              "no warning names the world size the snapshot was written at");
    require_same(t.values(), before, "after the restore");
    train_two_steps_over_refused(t, snaps, w, dir);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Snapshots written at world 3 restored at world 2: the files of rank 2
// (its own, the copy it kept of its buddy's, the copy kept of its) and its
// lock file can never be used and go, each named in a warning; they stayed
// in shared memory until removed by hand.
TEST(Snapshots, ASmallerWorldRemovesTheFilesOfTheRanksItLacks) {
  const TempDir dir("shardtorch-snapshots");
  auto written = run_ranks(3, [&](World& w) { write_three_steps(w, dir, "job"); });
  ASSERT_TRUE(written.ok) << written.summary();
  auto of_rank_2 = [&] {
    std::vector<std::string> out;
    for (const auto& e : files::list_directory(dir))
      if (e.find("-r2-") != std::string::npos || e.find("-by-r2-") != std::string::npos ||
          e.find("-r2.lock") != std::string::npos)
        out.push_back(e);
    return out;
  };
  ASSERT_GE(of_rank_2().size(), 3u);  // its own snapshots, those it held, its lock
  auto r = run_ranks(2, [&](World& w) {
    Trained t(w, Strategy::FullShard, 13, 1);
    Snapshots snaps(w.shared_from_this(), *t.model, t.opt.get(), options_in(dir, "job"));
    CapturedWarnings warnings;
    require(restore_capturing(snaps, warnings) == -1, "restored a snapshot written at another world size");
    const auto warned = w.comm().all_gather_strings(
        warnings.any_with("of rank 2, and this job has ranks 0 to 1; removed") ? "1" : "0", "test: warned");
    if (w.rank() == 0) {
      require(std::count(warned.begin(), warned.end(), "1") >= 1, "no rank named a file of rank 2 as removed");
      std::string left;
      for (const auto& e : of_rank_2()) left += " " + e;
      require(left.empty(), "files of rank 2 are still there:" + left);
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Options that differ between ranks fail on every rank at construction,
// naming both (a different buddy map used to hang the first copy for the
// collective timeout); so do state names that differ, at restore(); and a
// state registered after restore() is refused (it would not be restored).
TEST(Snapshots, OptionsOrStateThatDifferBetweenRanksFailOnEveryRank) {
  const TempDir dir("shardtorch-snapshots");
  auto r = run_ranks(3, [&](World& w) {
    Trained t(w, Strategy::FullShard, 13, 1);
    SnapshotOptions o = options_in(dir, "job");
    o.buddy = w.rank() == 1 ? std::vector<int>{2, 0, 1} : std::vector<int>{1, 2, 0};
    std::string e = message_of([&] { Snapshots snaps(w.shared_from_this(), *t.model, t.opt.get(), o); });
    require(e.find("the ranks were given different SnapshotOptions: rank 0 has every 1, persist_every 0, buddy map "
                   "[1, 2, 0] but rank 1 has every 1, persist_every 0, buddy map [2, 0, 1]") != std::string::npos,
            "a buddy map that differs on rank 1: " + e);
    Snapshots snaps(w.shared_from_this(), *t.model, t.opt.get(), options_in(dir, "job"));
    if (w.rank() != 2) t.register_with(snaps);
    e = message_of([&] { snaps.restore(); });
    require(e.find("the ranks registered different state: rank 0 registered 'data' but rank 2 registered none") !=
                std::string::npos,
            "state registered on ranks 0 and 1 only: " + e);
    e = message_of([&] { t.register_with(snaps); });
    require(e.find("register_state(\"data\") after restore()") != std::string::npos,
            "a state registered after restore(): " + e);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// restore() loads once per run: a second call (which would roll back the
// steps trained since) is refused, and so is every call after finish(),
// which removed the job's snapshots (an after_step() there wrote a new one
// that nothing would ever remove).
TEST(Snapshots, ASecondRestoreAndCallsAfterFinishAreRefused) {
  const TempDir dir("shardtorch-snapshots");
  auto r = run_ranks(2, [&](World& w) {
    Trained t(w, Strategy::FullShard, 13, 1);
    const SnapshotOptions o = options_in(dir, "once");
    Snapshots snaps(w.shared_from_this(), *t.model, t.opt.get(), o);
    t.register_with(snaps);
    require(snaps.restore() == -1, "a fresh start restored something");
    t.step();
    snaps.after_step(1);
    std::string e = message_of([&] { snaps.restore(); });
    require(e.find("restore() called again: it loads the newest snapshot once") != std::string::npos,
            "a second restore(): " + e);
    t.step();
    snaps.after_step(2);
    snaps.finish();
    for (const auto& [call, f] : std::vector<std::pair<std::string, std::function<void()>>>{
             {"after_step()", [&] { snaps.after_step(3); }},
             {"restore()", [&] { snaps.restore(); }},
             {"rejoin()", [&] { snaps.rejoin(); }},
             {"finish()", [&] { snaps.finish(); }},
             {"register_state()", [&] { t.register_with(snaps); }}}) {
      e = message_of(f);
      require(e.find(call + " after finish(): finish() removed this job's snapshots") != std::string::npos,
              call + " after finish(): " + e);
    }
    require(!files::exists(shardtorch::detail::own_snapshot_path(o, w.rank(), 3)),
            "after_step(3) after finish() wrote a snapshot");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// The copy of a snapshot runs in the background until the next update,
// which waits for it: here the copy is held back 300 ms, and the optimizer
// step right after after_step() must not change what it copies. wait()
// waits for it too.
TEST(Snapshots, TheNextUpdateWaitsForTheCopyInTheBackground) {
  const TempDir dir("shardtorch-snapshots");
  shardtorch::detail::set_test_point_action([](const char* site) {
    if (std::string(site) == "snapshot copy") std::this_thread::sleep_for(std::chrono::milliseconds(300));
  });
  auto r = run_ranks(2, [&](World& w) {
    Values at1;
    {
      Trained t(w, Strategy::FullShard, 13, 1);
      Snapshots snaps(w.shared_from_this(), *t.model, t.opt.get(), options_in(dir, "guard"));
      t.register_with(snaps);
      t.step();
      at1 = t.values();
      snaps.after_step(1);
      t.step();
    }
    Trained again(w, Strategy::FullShard, 13, 2);
    Snapshots snaps(w.shared_from_this(), *again.model, again.opt.get(), options_in(dir, "guard"));
    again.register_with(snaps);
    require(snaps.restore() == 1, "step 1 was not restored");
    require(again.data_position == 1, "the registered state is " + std::to_string(again.data_position));
    require_same(again.values(), at1, "the snapshot of step 1");
    snaps.finish();
    // wait(): the copy is in place when it returns.
    const SnapshotOptions o = options_in(dir, "wait");
    Snapshots waited(w.shared_from_this(), *again.model, again.opt.get(), o);
    again.step();
    waited.after_step(1);
    waited.wait();
    require(files::exists(shardtorch::detail::own_snapshot_path(o, w.rank(), 1)), "wait() returned before the copy");
    waited.finish();
  });
  shardtorch::detail::set_test_point_action({});
  ASSERT_TRUE(r.ok) << r.summary();
}

// Under a launch that keeps the other ranks alive, rejoin() waits for the
// lost rank's replacement; with none started it fails within the timeout,
// saying what to start, instead of hanging.
TEST(Snapshots, ARejoinWithoutAReplacementFailsWithinTheTimeoutSayingWhatToStart) {
  const TempDir dir("shardtorch-snapshots");
  auto r = run_ranks(
      2,
      [&](World& w) {
        Trained t(w, Strategy::FullShard, 13, 1);
        Snapshots snaps(w.shared_from_this(), *t.model, t.opt.get(), options_in(dir, "rejoin"));
        t.register_with(snaps);
        require(snaps.restore() == -1, "a fresh start restored a step");
        t.step();
        snaps.after_step(1);
        const auto start = std::chrono::steady_clock::now();
        std::string message;
        try {
          snaps.rejoin();
        } catch (const shardtorch::Error& e) {
          message = e.what();
        }
        const auto waited = std::chrono::steady_clock::now() - start;
        require(message.find("for a replacement of the lost rank to join: start it with SHARDTORCH_REJOIN=1") !=
                    std::string::npos,
                "rejoin() without a replacement: '" + message + "'");
        require(waited < std::chrono::seconds(10), "rejoin() waited past its timeout");
      },
      shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(2)));
  ASSERT_TRUE(r.ok) << r.summary();
}

// Every second step is also published to fallback_dir in the background;
// with every snapshot in memory gone, restore() loads the newest one
// persisted, with each rank's own registered state. The memory report
// counts the snapshots' bytes as bytes_kept() does.
// NoShard: every rank holds every parameter, written once.
class SnapshotPersist : public ::testing::TestWithParam<Strategy> {};

TEST_P(SnapshotPersist, APersistedStepServesWhenMemoryIsGone) {
  const Strategy strategy = GetParam();
  const TempDir dir("shardtorch-snapshots");
  auto r = run_ranks(2, [&](World& w) {
    SnapshotOptions o = options_in(dir / "shm", "persist");
    o.fallback_dir = dir / "ckpt";
    o.persist_every = 2;
    Values at2;
    {
      Trained t(w, strategy, 13, 1);
      t.data_position = 100 * w.rank();  // each rank's own
      Snapshots snaps(w.shared_from_this(), *t.model, t.opt.get(), o);
      t.register_with(snaps);
      for (int64_t s = 1; s <= 3; ++s) {
        t.step();
        snaps.after_step(s);
        if (s == 2) at2 = t.values();
        require(t.sharded->memory().cur(shardtorch::Mem::Snapshots) > 0, "the memory report counts no snapshot");
      }
    }  // the persist of step 2 is done: the destructor waited for it
    w.barrier();
    if (w.rank() == 0) files::remove_all(dir / "shm");  // every node's memory lost
    w.barrier();
    Trained again(w, strategy, 13, 2);
    Snapshots snaps(w.shared_from_this(), *again.model, again.opt.get(), o);
    again.register_with(snaps);
    CapturedWarnings warnings;
    const int64_t step = restore_capturing(snaps, warnings);
    require(step == 2, "restored step " + std::to_string(step) + ", expected the persisted 2");
    require(again.data_position == 100 * w.rank() + 2,
            "the registered state is " + std::to_string(again.data_position) + ", not this rank's");
    require_same(again.values(), at2, "loaded from the persisted checkpoint");
    if (w.rank() == 0) require(warnings.any_with("loaded the sharded checkpoint"), "the fallback said nothing");
    const int64_t counted = again.sharded->memory().cur(shardtorch::Mem::Snapshots);
    again.step();
    snaps.after_step(3);
    snaps.wait();  // the copy held for the buddy, received since, counts from here
    require(again.sharded->memory().cur(shardtorch::Mem::Snapshots) == snaps.bytes_kept() && counted == 0,
            "the memory report counts " + std::to_string(again.sharded->memory().cur(shardtorch::Mem::Snapshots)) +
                " bytes of snapshots (" + std::to_string(counted) + " before any), bytes_kept() " +
                std::to_string(snaps.bytes_kept()));
    snaps.finish();
    require(again.sharded->memory().cur(shardtorch::Mem::Snapshots) == 0, "finish() left snapshot bytes counted");
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(strategy) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Snapshots, SnapshotPersist, ::testing::Values(Strategy::FullShard, Strategy::NoShard),
                         StrategyName());

// A persist that fails (the directory cannot be made) is a warning on the
// program's thread at the next snapshot; training goes on.
TEST(Snapshots, APersistThatFailsWarnsAndTrainingGoesOn) {
  const TempDir dir("shardtorch-snapshots");
  const std::string blocker = dir / "a-file";
  std::ofstream(blocker) << "not a directory";
  auto r = run_ranks(2, [&](World& w) {
    SnapshotOptions o = options_in(dir / "shm", "fails");
    o.fallback_dir = blocker + "/ckpt";
    o.persist_every = 1;
    Trained t(w, Strategy::FullShard, 13, 1);
    Snapshots snaps(w.shared_from_this(), *t.model, t.opt.get(), o);
    CapturedWarnings warnings;
    {
      c10::WarningUtils::WarningHandlerGuard guard(&warnings);
      for (int64_t s = 1; s <= 2; ++s) {
        t.step();
        snaps.after_step(s);
      }
    }
    if (w.rank() == 0)
      require(warnings.any_with("step 1 could not be persisted to '" + blocker + "/ckpt'"),
              "no warning says the persist failed");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// plan_memory(snapshots) against bytes_kept() once two generations of this
// rank's own and of the copy it keeps are there: within 5 % on the example
// GPT at world 2, FullShard and NoShard.
TEST(Snapshots, ThePlannerPredictsTheirBytesWithinFivePercent) {
  const TempDir dir("shardtorch-snapshots");
  for (Strategy s : {Strategy::FullShard, Strategy::NoShard}) {
    const SnapshotOptions o = options_in(dir / shardtorch::strategy_name(s), "plan");
    auto r = run_ranks(2, [&](World& w) {
      gpt::Config c;
      c.d_model = 64;
      torch::manual_seed(0);
      gpt::GPT model(c);
      shardtorch::PlanOptions plan;
      plan.options = strategy_options(s, 2);
      plan.world_size = 2;
      plan.snapshots = true;
      const int64_t predicted =
          shardtorch::plan_memory(shardtorch::unit_specs(*model), plan).of(shardtorch::Mem::Snapshots);
      shardtorch::shard(model, w, plan.options);
      auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-3));
      const auto tokens = gpt_tokens().narrow(0, w.rank() * (kBatch / 2), kBatch / 2);
      {
        Snapshots snaps(w.shared_from_this(), *model, opt.get(), o);
        for (int64_t step = 1; step <= 4; ++step) {
          opt->zero_grad();
          gpt::lm_loss(model(tokens), tokens).backward();
          opt->step();
          snaps.after_step(step);
        }
      }  // waits for the copy in flight
      Snapshots kept(w.shared_from_this(), *model, opt.get(), o);
      const int64_t measured = kept.bytes_kept();
      require(
          measured > 0 && std::abs(static_cast<double>(predicted - measured)) <= 0.05 * static_cast<double>(measured),
          "planned " + std::to_string(predicted) + " bytes of snapshots, kept " + std::to_string(measured));
      kept.finish();
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
}

}  // namespace
