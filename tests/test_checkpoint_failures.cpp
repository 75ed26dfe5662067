// Checkpoint failures: every rank fails alike, naming the rank and the
// problem, and nothing is half-done (no model, optimizer or checkpoint on
// disk changes).
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "checkpoint/dcp_metadata.h"
#include "checkpoint_helpers.h"
#include "dcp_helpers.h"
#include "models.h"
#include "shardtorch/checkpoint.h"
#include "shardtorch/dcp_checkpoint.h"

using namespace testmodels;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

// MLP (FullShard unless told) with SGD and momentum, one step taken, so there
// are parameters, a buffer and optimizer state to compare before and after.
struct Trained {
  MLP model;
  std::unique_ptr<shardtorch::ShardedOptimizer> opt;
  Trained(World& w, int64_t hidden = 13, bool extra = false, Strategy s = Strategy::FullShard, unsigned seed = 0) {
    torch::manual_seed(seed);
    model = MLP(hidden, extra);
    shardtorch::shard(model, w, strategy_options(s, w.size()));
    opt = shardtorch::SGD(*model, torch::optim::SGDOptions(0.1).momentum(0.9));
    opt->zero_grad();
    model(torch::ones({2, 7}) * (1 + w.rank())).sum().backward();
    opt->step();
  }
  std::map<std::string, at::Tensor> values() {
    auto out = shardtorch::full_parameters(*model);
    for (const auto& item : model->named_buffers()) out[item.key()] = item.value().clone();
    for (const auto& [key, s] : opt->inner().state()) {
      auto* m = dynamic_cast<torch::optim::SGDParamState*>(s.get());
      out["momentum@" + std::to_string(reinterpret_cast<uintptr_t>(key))] = m->momentum_buffer().clone();
    }
    return out;
  }
};

void require_unchanged(const std::map<std::string, at::Tensor>& before, const std::map<std::string, at::Tensor>& after,
                       const std::string& what) {
  require(before.size() == after.size(), what + ": the set of tensors changed");
  for (const auto& [k, v] : before) require(at::equal(after.at(k), v), what + ": '" + k + "' changed");
}

// Runs a load that must fail; requires that it changed nothing of `t`
// (parameters, buffers, optimizer state) and returns its message.
std::string failing_load(Trained& t, const std::function<void()>& load) {
  const auto before = t.values();
  std::string e = message_of(load);
  require(!e.empty(), "the load succeeded");
  require_unchanged(before, t.values(), "after the failed load");
  return e;
}

}  // namespace

// A problem only one rank can see (its own shard file) fails every rank, and
// no rank's model or optimizer changes: they used to load on the ranks that
// did not read the bad file, and carry on alone.
TEST(CheckpointFailures, AShardOnlyOneRankReadsFailsEveryRankAndChangesNothing) {
  const TempDir dir;
  const std::string ckpt = (dir / "ckpt").string();
  auto saved = run_ranks(2, [&](World& w) {
    Trained t(w);
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), ckpt, 1);
  });
  ASSERT_TRUE(saved.ok) << saved.summary();
  files::resize_file(Path(ckpt) / "rank-1.safetensors", 100);
  auto r = run_ranks(2, [&](World& w) {
    Trained t(w, 13, false, Strategy::FullShard, /*seed=*/7);
    std::string e = failing_load(t, [&] { shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), ckpt); });
    require(
        e.find("rank 1: ") != std::string::npos && e.find("'rank-1.safetensors' has 100 bytes") != std::string::npos,
        "expected every rank to name rank 1 and its truncated file, got: " + e);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// The same for full state dicts: rank 1's file has a tensor of another shape;
// neither rank changes anything (under ShardGradOp the replicated full
// parameters would otherwise disagree with the master shards).
TEST(CheckpointFailures, AFullStateDictOneRankCannotLoadFailsEveryRankAndChangesNothing) {
  const TempDir dir;
  const std::string good = (dir / "good.safetensors").string(), bad = (dir / "bad.safetensors").string();
  auto saved = run_ranks(1, [&](World& w) {
    Trained t(w, 13, false, Strategy::FullShard, 3);
    shardtorch::save_full_state_dict(*t.model, good);
  });
  ASSERT_TRUE(saved.ok) << saved.summary();
  auto sd = shardtorch::checkpoint::load_file(good);
  sd["l3.lin.bias"] = at::zeros({4});
  shardtorch::checkpoint::save_file(bad, std::vector<std::pair<std::string, at::Tensor>>(sd.begin(), sd.end()));
  auto r = run_ranks(2, [&](World& w) {
    Trained t(w, 13, false, Strategy::ShardGradOp);
    std::string e = failing_load(t, [&] { shardtorch::load_full_state_dict(*t.model, w.rank() == 1 ? bad : good); });
    require(e.find("rank 1: ") != std::string::npos && e.find("'l3.lin.bias' has shape [4]") != std::string::npos,
            "expected every rank to name rank 1 and the mis-shaped bias, got: " + e);
    // Afterwards the good file loads on both ranks.
    shardtorch::load_full_state_dict(*t.model, good);
    auto loaded = shardtorch::full_parameters(*t.model);
    for (const auto& [n, v] : shardtorch::checkpoint::load_file(good))
      if (loaded.count(n)) require(at::equal(loaded.at(n), v), n + " did not load after the failure");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// One checkpoint read through a different path on each rank (a copy per
// node) loads with the collective check on: the check's fingerprint names
// the loader's collectives without the path.
TEST(CheckpointFailures, RanksReadingOneCheckpointThroughDifferentPathsLoadItWithTheCheckOn) {
  const TempDir dir;
  const std::string a = (dir / "a").string(), b = (dir / "b").string();
  const std::string full = (dir / "full.safetensors").string(), full_b = (dir / "full-b.safetensors").string();
  auto saved = run_ranks(2, [&](World& w) {
    Trained t(w);
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), a, 1);
    shardtorch::save_full_state_dict(*t.model, full);
  });
  ASSERT_TRUE(saved.ok) << saved.summary();
  ASSERT_EQ(::symlink(a.c_str(), b.c_str()), 0);
  ASSERT_EQ(::symlink(full.c_str(), full_b.c_str()), 0);
  auto r = run_ranks(
      2,
      [&](World& w) {
        Trained t(w, 13, false, Strategy::FullShard, 7);
        shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), w.rank() ? b : a);
        shardtorch::load_full_state_dict(*t.model, w.rank() ? full_b : full);
      },
      shardtorch::testing::RunOptions().check_collectives(true));
  ASSERT_TRUE(r.ok) << r.summary();
}

// Ranks that read different checkpoints (a copy per node, one of them stale)
// fail alike instead of training on shards from two steps.
TEST(CheckpointFailures, RanksReadingDifferentCheckpointsFailAlike) {
  const TempDir dir;
  const std::string a = (dir / "a").string(), b = (dir / "b").string();
  auto saved = run_ranks(2, [&](World& w) {
    Trained t(w);
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), a, 1);
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), b, 2);
  });
  ASSERT_TRUE(saved.ok) << saved.summary();
  auto r = run_ranks(2, [&](World& w) {
    Trained t(w, 13, false, Strategy::FullShard, 7);
    std::string e =
        failing_load(t, [&] { shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), w.rank() ? b : a); });
    require(e.find("rank 1 read step 2") != std::string::npos && e.find("rank 0 read step 1") != std::string::npos,
            "expected both ranks to name the two steps, got: " + e);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Shapes are recorded in the index and checked: a resized model, or a
// checkpoint with parameters the model lacks, is refused by name (element
// ranges alone used to let a smaller weight load, scrambled).
TEST(CheckpointFailures, ShapesThatDifferAndUnexpectedTensorsAreRefusedByName) {
  const TempDir dir;
  const std::string wide = (dir / "wide").string(), extra = (dir / "extra").string();
  auto saved = run_ranks(2, [&](World& w) {
    Trained t(w, 13);
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), wide, 1);
    Trained u(w, 12, /*extra=*/true);
    shardtorch::save_sharded_checkpoint(*u.model, u.opt.get(), extra, 1);
  });
  ASSERT_TRUE(saved.ok) << saved.summary();
  auto r = run_ranks(2, [&](World& w) {
    Trained t(w, 12);
    std::string e = failing_load(t, [&] { shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), wide); });
    // The first name, how many more differ, and what to check.
    require(
        e.find("'l1.lin.bias' has shape [13] in the checkpoint but the model's has [12], and ") != std::string::npos &&
            e.find(" more differ ('l1.lin.weight'") != std::string::npos &&
            e.find("; is the model built with the checkpoint's configuration?") != std::string::npos,
        "expected the shape error, got: " + e);
    e = failing_load(t, [&] { shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), extra); });
    require(e.find("unexpected tensor 'extra.") != std::string::npos,
            "expected the unexpected-tensor error, got: " + e);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A checkpoint without optimizer state (saved without the optimizer, or
// before the first step) leaves the optimizer with none: stale moments from
// the run being rolled back used to survive the load.
TEST(CheckpointFailures, ACheckpointWithoutOptimizerStateResetsTheOptimizer) {
  const TempDir dir;
  const std::string ckpt = (dir / "weights-only").string();
  auto r = run_ranks(2, [&](World& w) {
    Trained t(w);
    shardtorch::save_sharded_checkpoint(*t.model, nullptr, ckpt, 0);
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), ckpt + "-full", 0);
    require(!t.opt->inner().state().empty(), "the step should have made optimizer state");
    auto state_bytes = [&] {
      return shardtorch::sharded_model(*t.model).memory().cur(shardtorch::Mem::OptimizerState);
    };
    const int64_t before = state_bytes();
    require(before > 0, "no optimizer state counted after the step");
    shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), ckpt);
    require(t.opt->inner().state().empty(), "optimizer state from before the load survived it");
    require(state_bytes() == 0, "the memory report still counts " + std::to_string(state_bytes()) +
                                    " bytes of optimizer state after a load that left none");
    shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), ckpt + "-full");
    require(state_bytes() == before, "after loading the state back the memory report counts " +
                                         std::to_string(state_bytes()) + " bytes, not " + std::to_string(before));
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Saving: a failure on rank 0 alone (it prepares and publishes the
// directory) fails every rank with rank 0's message instead of leaving the
// others in a barrier; a directory that is not a checkpoint is never
// replaced; a trailing slash names the same checkpoint.
TEST(CheckpointFailures, SaveFailuresOnRankZeroFailEveryRankAndOtherDirectoriesAreKept) {
  const TempDir dir;
  std::ofstream(dir / "a-file") << "x";
  files::create_directories(dir / "logs");
  std::ofstream(dir / "logs" / "train.log") << "step 1\n";
  auto r = run_ranks(2, [&](World& w) {
    Trained t(w);
    std::string e = message_of(
        [&] { shardtorch::save_sharded_checkpoint(*t.model, nullptr, (dir / "a-file" / "ck").string(), 1); });
    require(e.find("save_sharded_checkpoint") != std::string::npos && e.find("rank 0: ") != std::string::npos,
            "expected every rank to fail naming rank 0, got: " + e);
    e = message_of([&] { shardtorch::save_sharded_checkpoint(*t.model, nullptr, (dir / "logs").string(), 1); });
    require(e.find("is not a shardtorch checkpoint") != std::string::npos, "expected a refusal, got: " + e);
    require(files::exists(dir / "logs" / "train.log"), "the directory's files were deleted");
    const std::string slash = (dir / "ck").string() + "/";
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), slash, 1);
    shardtorch::save_dcp_checkpoint(*t.model, t.opt.get(), (dir / "dcp").string());
    // The user's files beside a checkpoint stay with it when a save replaces
    // it; a data file of the checkpoint's own kind (one from a larger world) does not.
    w.barrier();
    if (w.rank() == 0) {
      for (const char* ck : {"ck", "dcp"}) {
        std::ofstream(dir / ck / "notes.txt") << "mine\n";
        files::create_directories(dir / ck / "logs");
        std::ofstream(dir / ck / "logs" / "train.log") << "step 1\n";
      }
      std::ofstream(dir / "ck" / "model.safetensors") << "a full state dict";
      std::ofstream(dir / "ck" / "rank-7.safetensors") << "a world of 8";
      std::ofstream(dir / "dcp" / "__7_0.distcp") << "a world of 8";
    }
    w.barrier();
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), slash, 2);
    shardtorch::save_dcp_checkpoint(*t.model, t.opt.get(), (dir / "dcp").string());
    require(shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), (dir / "ck").string()) == 2, "wrong step");
    shardtorch::load_dcp_checkpoint(*t.model, t.opt.get(), (dir / "dcp").string());
    require(!files::exists(dir / "ck" / ".shardtorch-tmp") && !files::exists(dir / "ck.shardtorch-tmp"),
            "a temporary directory was left");
    for (const char* ck : {"ck", "dcp"}) {
      require(read_text(dir / ck / "notes.txt") == "mine\n" && read_text(dir / ck / "logs" / "train.log") == "step 1\n",
              std::string("the user's files in '") + ck + "' were lost when a save replaced it");
    }
    require(read_text(dir / "ck" / "model.safetensors") == "a full state dict", "the full state dict was lost");
    require(!files::exists(dir / "ck" / "rank-7.safetensors") && !files::exists(dir / "dcp" / "__7_0.distcp"),
            "a data file of the previous checkpoint was kept in the new one");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A failed write of the index (here: the file-size limit, as a full disk
// would) is an error, and the previous checkpoint stays in place (no
// truncated index is published over it).
TEST(CheckpointFailures, AnIndexThatCannotBeWrittenKeepsThePreviousCheckpoint) {
  const TempDir dir;
  const std::string ckpt = (dir / "ckpt").string();
  auto r = run_ranks(1, [&](World& w) {
    Trained t(w);
    shardtorch::save_sharded_checkpoint(*t.model, nullptr, ckpt, 1);
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit limit{64 << 10, 64 << 10};  // the rank file is ~1 KB; the index with this user_state is over 1 MB
    require(::setrlimit(RLIMIT_FSIZE, &limit) == 0, "setrlimit failed");
    std::string e = message_of([&] {
      shardtorch::save_sharded_checkpoint(*t.model, nullptr, ckpt, 2, {{"blob", std::string(1 << 20, 'x')}});
    });
    require(e.find("index.json") != std::string::npos, "expected the failed index write, got: " + e);
    require(shardtorch::load_sharded_checkpoint(*t.model, nullptr, ckpt) == 1, "the previous checkpoint was lost");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// File systems without renameat2's RENAME_EXCHANGE (forced here): the
// previous checkpoint moves aside (DIR.shardtorch-old) while the new one
// moves in; if the writer dies between the two renames, loading finds it
// there, sharded_checkpoint_exists says so, and the next save, even into an
// empty DIR a launcher made meanwhile, removes it only once the new one is
// in place. Directories of the user's named like ours (ck.old, ck.tmp) are
// never touched.
TEST(CheckpointFailures, WithoutAnAtomicExchangeThePreviousCheckpointIsFoundAside) {
  const TempDir dir;
  const std::string ckpt = (dir / "ckpt").string(), aside = ckpt + ".shardtorch-old";
  for (const char* mine : {".old", ".tmp"}) {
    files::create_directories(ckpt + mine);
    std::ofstream(ckpt + mine + "/notes.txt") << "mine\n";
  }
  auto r = run_ranks(2, [&](World& w) {
    ::setenv("SHARDTORCH_CHECKPOINT_NO_EXCHANGE", "1", 1);
    Trained t(w);
    require(!shardtorch::sharded_checkpoint_exists(ckpt), "nothing saved yet");
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), ckpt, 1);
    w.barrier();
    if (w.rank() == 0) std::ofstream(ckpt + "/notes.txt") << "kept\n";
    w.barrier();
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), ckpt, 2);
    require(!files::exists(aside) && !files::exists(ckpt + ".shardtorch-tmp"), "left-overs after a save");
    require(read_text(ckpt + "/notes.txt") == "kept\n", "the user's file in the checkpoint was lost");
    require(shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), ckpt) == 2, "wrong step");
    w.barrier();
    if (w.rank() == 0) files::rename(ckpt, aside);  // as if killed between the two renames
    w.barrier();
    require(shardtorch::sharded_checkpoint_exists(ckpt), "the checkpoint set aside is not reported");
    require(shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), ckpt) == 2,
            "the previous checkpoint was not found");
    require(shardtorch::read_sharded_checkpoint(ckpt).count("l1.lin.weight|param"), "offline reading missed it");
    w.barrier();
    if (w.rank() == 0) files::create_directories(ckpt);  // an empty directory made by a launcher
    w.barrier();
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), ckpt, 3);
    require(shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), ckpt) == 3 && !files::exists(aside),
            "saving after the interruption");
    require(read_text(ckpt + "/notes.txt") == "kept\n", "the user's file in the checkpoint set aside was lost");
    // Any other value than 0 or 1 is an error on every rank, and the checkpoint stays.
    ::setenv("SHARDTORCH_CHECKPOINT_NO_EXCHANGE", "yes", 1);
    std::string error;
    try {
      shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), ckpt, 4);
    } catch (const std::exception& e) {
      error = e.what();
    }
    require(error.find("SHARDTORCH_CHECKPOINT_NO_EXCHANGE='yes' must be 0 or 1") != std::string::npos,
            "a save with SHARDTORCH_CHECKPOINT_NO_EXCHANGE=yes said: '" + error + "'");
    require(shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), ckpt) == 3, "the refused save changed DIR");
  });
  ASSERT_TRUE(r.ok) << r.summary();
  for (const char* mine : {".old", ".tmp"})
    EXPECT_TRUE(files::exists(ckpt + mine + "/notes.txt")) << "the user's " << ckpt + mine << " was touched";
}

// Checkpoints carry the state of Adam, AdamW and SGD; another optimizer's
// state would be lost, so passing one is a clear error on save and on load
// (loading used to reset its state, and Adagrad then failed in step()).
TEST(CheckpointFailures, AnOptimizerWhoseStateIsNotCarriedIsRefused) {
  const TempDir dir;
  const std::string ckpt = (dir / "ckpt").string();
  auto r = run_ranks(2, [&](World& w) {
    Trained t(w);
    shardtorch::save_sharded_checkpoint(*t.model, nullptr, ckpt, 1);
    auto adagrad =
        shardtorch::ShardedOptimizer::make<torch::optim::Adagrad>(*t.model, torch::optim::AdagradOptions(0.1));
    for (auto* call : {"save", "load"}) {
      std::string e = message_of([&] {
        if (std::string(call) == "save")
          shardtorch::save_sharded_checkpoint(*t.model, adagrad.get(), ckpt, 2);
        else
          shardtorch::load_sharded_checkpoint(*t.model, adagrad.get(), ckpt);
      });
      require(e.find("carry the state of Adam, AdamW and SGD") != std::string::npos,
              std::string(call) + ": expected the refusal, got: " + e);
    }
    require(shardtorch::load_sharded_checkpoint(*t.model, nullptr, ckpt) == 1,
            "the refused save replaced the checkpoint");
    t.model(torch::ones({2, 7})).sum().backward();
    adagrad->step();  // its state intact
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A slow file system: rank 0's last write and fsync of a full state dict,
// or one rank's shard file, take longer than the collective timeout (1 s
// here). The others wait for them under WorldOptions::file_timeout (30
// minutes) instead of failing in the next collective; the collectives after
// the checkpoint get their own timeout back.
TEST(CheckpointFailures, ASlowWriterIsWaitedForUnderTheFileTimeout) {
  const TempDir dir;
  auto r = run_ranks(
      2,
      [&](World& w) {
        MLP m{nullptr};
        std::unique_ptr<shardtorch::ShardedOptimizer> opt;
        {
          // The set-up's collectives are not the scenario: a rank late to them on a loaded machine must not time out.
          shardtorch::Comm::TimeoutAtLeast setup(w.comm(), std::chrono::seconds(60));
          torch::manual_seed(0);
          m = MLP();
          shardtorch::shard(m, w);
          opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
        }
        const int slow = 0;
        for (int round = 0; round < 2; ++round) {
          // Rank `slow` takes 2 s over its file, once written: the stall is the
          // scenario, twice the collective timeout.
          shardtorch::checkpoint::set_crash_hook([&](const std::string& p) {
            if (p == "file written" && w.rank() == slow) std::this_thread::sleep_for(std::chrono::milliseconds(2000));
          });
          if (round == 0) {
            shardtorch::save_full_state_dict(*m, (dir / "full.safetensors").string());
          } else {
            shardtorch::save_sharded_checkpoint(*m, opt.get(), (dir / "sharded").string(), 1);
          }
          shardtorch::checkpoint::set_crash_hook(nullptr);
          require(w.comm().timeout() == std::chrono::seconds(1), "the collective timeout was not restored");
        }
        // And without the allowance, the same wait fails naming the collective (a stall three times the
        // timeout: rank 0 must time out even if it comes late to the wait).
        std::string e = "no error";
        shardtorch::checkpoint::set_crash_hook([&](const std::string& p) {
          if (p == "file written" && w.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(3000));
        });
        try {
          shardtorch::checkpoint::save_file((dir / ("plain" + std::to_string(w.rank()))).string(),
                                            {{"x", torch::ones({2})}});
          auto flag = torch::zeros({1});
          w.comm().all_reduce(flag, c10d::ReduceOp::SUM, "after a slow write");
        } catch (const std::exception& err) {
          e = err.what();
        }
        shardtorch::checkpoint::set_crash_hook(nullptr);
        require(w.rank() == 1 || e.find("after a slow write") != std::string::npos, "rank 0: " + e);
      },
      shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(1)));
  ASSERT_TRUE(r.ok) << r.summary();
}

// A rank that dies after every file was written and reported: rank 0 still
// publishes the checkpoint, and its error (the agreement after it fails) says
// that the checkpoint is complete, which it is.
TEST(CheckpointFailures, ARankLostAfterItsFilesWereReportedLeavesAPublishedCheckpointRankZeroNames) {
  const TempDir dir;
  for (const bool dcp : {false, true}) {
    const std::string ck = (dir / (dcp ? "dcp" : "sharded")).string();
    auto r = run_ranks(2, [&](World& w) {
      Trained t(w);
      if (w.rank() == 1)
        shardtorch::checkpoint::set_crash_hook([](const std::string& p) {
          if (p == "reports gathered") std::_Exit(3);
        });
      const std::string e = message_of([&] {
        if (dcp)
          shardtorch::save_dcp_checkpoint(*t.model, t.opt.get(), ck);
        else
          shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), ck, 1);
      });
      require(e.find("rank 0 had published the checkpoint '" + ck + "' before this failure: it is complete") !=
                  std::string::npos,
              "rank 0: " + e);
    });
    ASSERT_EQ(r.ranks.size(), 2u);
    EXPECT_EQ(r.ranks[0].exit_code, 0) << r.summary();
    EXPECT_EQ(r.ranks[1].exit_code, 3) << r.summary();
    if (dcp)
      EXPECT_TRUE(files::exists(ck + "/.metadata"));
    else
      EXPECT_TRUE(shardtorch::read_sharded_checkpoint(ck).count("l1.lin.weight|param")) << ck;
  }
}

// A rank lost inside a save: the others' errors say where it was (inside
// the save, which notes its name as the rank's progress), not only its
// last step, and name it alone: a survivor that gave up and ended before a
// slower one is not taken for the rank at fault.
TEST(CheckpointFailures, ARankLostInsideASaveIsNamedThere) {
  const TempDir dir;
  auto r = run_ranks(4, [&](World& w) {
    Trained t(w);
    shardtorch::checkpoint::set_crash_hook([&](const std::string& p) {
      if (p != "file written") return;
      if (w.rank() == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));  // its progress record is written meanwhile
        std::_Exit(3);
      }
      // Rank 3 arrives last: ranks 0 and 2 have given up (and may have
      // ended) by then, and must not be taken for the rank at fault.
      if (w.rank() == 3) std::this_thread::sleep_for(std::chrono::milliseconds(800));
    });
    const std::string e =
        message_of([&] { shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), (dir / "ck").string(), 1); });
    const auto from = e.find("Peer at fault: ");
    require(from != std::string::npos, "rank " + std::to_string(w.rank()) + " names no peer: " + e);
    const std::string fault = e.substr(from, e.find(" This rank is at", from) - from);
    require(fault.find("rank 1 ") != std::string::npos && fault.find("save_sharded_checkpoint") != std::string::npos,
            "rank " + std::to_string(w.rank()) + ": " + e);
    for (const char* other : {"rank 0 ", "rank 2 ", "rank 3 "})
      require(fault.find(other) == std::string::npos,
              "rank " + std::to_string(w.rank()) + " blames " + other + "as well: " + e);
    if (w.rank() == 3)  // the others gave up before it arrived
      require(e.find("rank 0 failed too") != std::string::npos && e.find("rank 2 failed too") != std::string::npos,
              "rank 3 does not list ranks 0 and 2 as having failed too: " + e);
  });
  ASSERT_EQ(r.ranks.size(), 4u);
  EXPECT_EQ(r.ranks[0].exit_code, 0) << r.summary();
  EXPECT_EQ(r.ranks[1].exit_code, 3) << r.summary();
  EXPECT_EQ(r.ranks[2].exit_code, 0) << r.summary();
  EXPECT_EQ(r.ranks[3].exit_code, 0) << r.summary();
}

// A full state dict's metadata keys starting shardtorch_ are the library's,
// and "format" is "pt": another value is refused on every rank before any
// collective, naming the key.
TEST(CheckpointFailures, ReservedFullStateDictMetadataIsRefused) {
  const TempDir dir;
  auto r = run_ranks(2, [&](World& w) {
    Trained t(w);
    const std::string path = (dir / "full.safetensors").string();
    std::string e = message_of([&] {
      shardtorch::save_full_state_dict(*t.model, path, {{"shardtorch_strategy", "x"}});
    });
    require(e.find("metadata key 'shardtorch_strategy' is reserved") != std::string::npos,
            "expected a refusal, got: " + e);
    e = message_of([&] { shardtorch::save_full_state_dict(*t.model, path, {{"format", "mine"}}); });
    require(e.find("metadata \"format\" is \"pt\"") != std::string::npos, "expected a refusal, got: " + e);
    require(!files::exists(path), "a refused save wrote the file");
    shardtorch::save_full_state_dict(*t.model, path, {{"format", "pt"}, {"step", "1"}});
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Every rank must save the same step and pass the same optimizer (or none):
// a rank that differed used to publish a checkpoint that no load accepts (a
// file of another step, or ranges without optimizer state) over the good one.
// Now every rank fails naming the other, and the previous checkpoint stays.
TEST(CheckpointFailures, RanksSavingDifferentStepsOrOptimizersFailAndKeepThePreviousCheckpoint) {
  const TempDir dir;
  const std::string ckpt = (dir / "ckpt").string();
  auto r = run_ranks(2, [&](World& w) {
    Trained t(w);
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), ckpt, 1);
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), ckpt + "-copy", 1);
    const int other = 1 - w.rank();
    std::string e = message_of([&] { shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), ckpt, 2 + w.rank()); });
    require(e.find("rank " + std::to_string(other) + ": it saves step " + std::to_string(2 + other) + " but rank " +
                   std::to_string(w.rank()) + " saves step " + std::to_string(2 + w.rank())) != std::string::npos,
            "expected the step mismatch, got: " + e);
    e = message_of(
        [&] { shardtorch::save_sharded_checkpoint(*t.model, w.rank() == 0 ? t.opt.get() : nullptr, ckpt, 2); });
    require(e.find("rank " + std::to_string(other) + ": it saves optimizer " + (other == 0 ? "SGD" : "none")) !=
                std::string::npos,
            "expected the optimizer mismatch, got: " + e);
    w.barrier();
    require(!files::exists(ckpt + ".shardtorch-tmp"), "the refused save left its staging directory");
    require(shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), ckpt) == 1, "the previous checkpoint was lost");
  });
  ASSERT_TRUE(r.ok) << r.summary();
  auto kept = shardtorch::read_sharded_checkpoint(ckpt), copy = shardtorch::read_sharded_checkpoint(ckpt + "-copy");
  ASSERT_EQ(kept.size(), copy.size());
  for (const auto& [k, v] : copy) EXPECT_TRUE(at::equal(kept.at(k), v)) << k << " changed on disk";
}

// Optimizer state of another kind (SGD's momentum, loaded into Adam), and
// Adam's saved without amsgrad loaded into a group with amsgrad (which would
// load, and fail in step() on the missing maximum), are refused before
// anything changes; Adam's with amsgrad on both sides loads and steps.
TEST(CheckpointFailures, OptimizerStateOfAnotherKindOrWithoutAmsgradIsRefused) {
  const TempDir dir;
  const std::string sgd = (dir / "sgd").string(), adam = (dir / "adam").string(), ams = (dir / "ams").string();
  auto r = run_ranks(2, [&](World& w) {
    Trained t(w);  // SGD with momentum, one step
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), sgd, 1);
    auto backward = [&] {
      t.opt->zero_grad();
      t.model(torch::ones({2, 7}) * (1 + w.rank())).sum().backward();
    };
    auto plain = shardtorch::Adam(*t.model, torch::optim::AdamOptions(0.1));
    backward();
    plain->step();
    shardtorch::save_sharded_checkpoint(*t.model, plain.get(), adam, 2);
    auto with_max = shardtorch::Adam(*t.model, torch::optim::AdamOptions(0.1).amsgrad(true));
    const auto params = shardtorch::full_parameters(*t.model);
    std::string e = message_of([&] { shardtorch::load_sharded_checkpoint(*t.model, plain.get(), sgd); });
    require(e.find("holds optimizer state of another kind of optimizer") != std::string::npos,
            "expected the refusal of SGD's state, got: " + e);
    e = message_of([&] { shardtorch::load_sharded_checkpoint(*t.model, with_max.get(), adam); });
    require(
        e.find("is in a parameter group with amsgrad, but the checkpoint has no max_exp_avg_sq") != std::string::npos,
        "expected the refusal of state without amsgrad's maximum, got: " + e);
    require(with_max->inner().state().empty(), "the refused load gave the optimizer state");
    for (const auto& [n, v] : shardtorch::full_parameters(*t.model))
      require(at::equal(v, params.at(n)), n + " changed in a refused load");
    backward();
    with_max->step();
    shardtorch::save_sharded_checkpoint(*t.model, with_max.get(), ams, 3);
    auto resumed = shardtorch::Adam(*t.model, torch::optim::AdamOptions(0.1).amsgrad(true));
    require(shardtorch::load_sharded_checkpoint(*t.model, resumed.get(), ams) == 3, "wrong step");
    backward();
    resumed->step();  // the maximum is there
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A sharded checkpoint of a model that did not tie two parameters holds
// both; loaded into a model that ties them, values that differ are refused
// on every rank naming both names, with nothing changed, unless
// LoadOptions::tied_from names the one that wins (its values and its
// optimizer state are loaded). Before: the first name was taken silently.
TEST(CheckpointFailures, ATiedParameterSavedUntiedWithDifferentValuesIsRefusedUnlessTiedFromSaysWhichWins) {
  const TempDir dir;
  const std::string ckpt = (dir / "ckpt").string();
  for (Strategy strategy : {Strategy::FullShard, Strategy::NoShard}) {
    auto r = run_ranks(2, [&](World& w) {
      auto step = [](Twins& m, shardtorch::ShardedOptimizer& opt) {
        opt.zero_grad();
        m(torch::arange(8).view({2, 4})).square().mean().backward();
        opt.step();
      };
      torch::manual_seed(1);
      Twins untied(false);
      shardtorch::shard(untied, w, strategy_options(strategy, 2));
      auto uopt = shardtorch::Adam(*untied, torch::optim::AdamOptions(1e-2));
      step(untied, *uopt);
      shardtorch::save_sharded_checkpoint(*untied, uopt.get(), ckpt, 1);
      const auto saved = shardtorch::full_parameters(*untied);
      Twins tied(true);
      shardtorch::shard(tied, w, strategy_options(strategy, 2));
      auto opt = shardtorch::Adam(*tied, torch::optim::AdamOptions(1e-2));
      const auto before = shardtorch::full_parameters(*tied);
      const std::string e = message_of([&] { shardtorch::load_sharded_checkpoint(*tied, opt.get(), ckpt); });
      for (const char* needle : {"'emb.weight' and 'head.weight' are one tied parameter of the model, but the "
                                 "checkpoint holds different values under them",
                                 "LoadOptions().tied_from({\"head.weight\"})"})
        require(e.find(needle) != std::string::npos, "'" + std::string(needle) + "' is not in: " + e);
      require(at::equal(shardtorch::full_parameters(*tied).at("emb.weight"), before.at("emb.weight")),
              "a refused load changed the model");
      for (const char* wins : {"head.weight", "emb.weight"}) {
        shardtorch::load_sharded_checkpoint(*tied, opt.get(), ckpt, nullptr,
                                            shardtorch::LoadOptions().tied_from({wins}));
        require(at::equal(shardtorch::full_parameters(*tied).at("emb.weight"), saved.at(wins)),
                std::string("not loaded from ") + wins);
        step(tied, *opt);  // with the optimizer state loaded along
      }
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(strategy) << "\n" << r.summary();
  }
}

// A malformed DCP checkpoint (sample a of tests/data/dcp, broken one way at
// a time): every rank fails at once, naming the problem, with the model and
// the optimizer unchanged, whichever rank would have read the broken part.
TEST(CheckpointFailures, MalformedDcpCheckpointsFailEveryRankWithTheModelUnchanged) {
  namespace dcp = shardtorch::checkpoint::dcp;
  const TempDir dir;
  auto edit_metadata = [](const std::string& ck, const std::function<void(dcp::Metadata&)>& edit) {
    auto md = dcp::parse(read_text(ck + "/.metadata"), "sample");
    edit(md);
    std::ofstream(ck + "/.metadata", std::ios::binary | std::ios::trunc) << dcp::serialize(md);
  };
  auto find = [](dcp::Metadata& md, const std::string& key) -> dcp::Entry& { return md.entries[md.index.at(key)]; };
  struct Case {
    std::string name;
    std::function<void(const std::string&)> breaks;
    std::string expect;
    int64_t hidden = 5;
  };
  const std::vector<Case> cases = {
      {"truncated data file", [](const std::string& ck) { files::resize_file(ck + "/__1_0.distcp", 1000); },
       "'__1_0.distcp', which has 1000 bytes (truncated, or a file of another save)"},
      {"truncated metadata",
       [](const std::string& ck) {
         const std::string m = read_text(ck + "/.metadata");
         std::ofstream(ck + "/.metadata", std::ios::binary | std::ios::trunc) << m.substr(0, m.size() / 2);
       },
       "runs past the end"},
      {"an offset past the end",
       [&](const std::string& ck) {
         edit_metadata(ck, [&](dcp::Metadata& md) { find(md, "model.l1.weight").chunks[0].storage.offset = 29963; });
       },
       "of '__0_0.distcp', which has 29963 bytes"},
      {"a chunk that overlaps another",
       [&](const std::string& ck) {
         edit_metadata(ck, [&](dcp::Metadata& md) { find(md, "model.l0.weight").chunks[1].offsets = {2, 0}; });
       },
       "which overlap"},
      {"a global outside the allow-list",
       [&](const std::string& ck) {
         auto md = dcp::parse(read_text(ck + "/.metadata"), "sample");
         std::string bytes = dcp::serialize(md);
         bytes.replace(bytes.find("ctorch\nSize\n"), 12, "cos\nsystem\n");
         std::ofstream(ck + "/.metadata", std::ios::binary | std::ios::trunc) << bytes;
       },
       "global 'os.system' is not on the allow-list"},
      {"an item that is not a zip",
       [&](const std::string& ck) {
         auto md = dcp::parse(read_text(ck + "/.metadata"), "sample");
         // FSDP2's rows [3, 5) of norm.bias: at 2 ranks here, in rank 1's shard alone.
         const auto& st = find(md, "model.norm.bias").chunks[1].storage;
         std::fstream f(ck + "/" + st.relative_path, std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(static_cast<std::streamoff>(st.offset));
         f.write("XXXX", 4);
       },
       "is not a torch.save zip"},
      {"shapes that disagree with the model", [](const std::string&) {}, "but the model's parameter has shape [6", 6},
  };
  for (const auto& c : cases) {
    const std::string ck = (dir / ("ck" + std::to_string(&c - &cases[0]))).string();
    files::copy_tree(dcp_sample("a_fsdp2_fp32"), ck);
    c.breaks(ck);
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(3);
      DcpMlp m(c.hidden);
      shardtorch::shard(m, w);
      auto opt = shardtorch::AdamW(*m, torch::optim::AdamWOptions(0.1));
      m(torch::ones({2, 4})).sum().backward();
      opt->step();
      auto values = [&] {
        auto out = dcp_full_values(*m);
        for (const auto& piece : opt->views().pieces()) {
          auto& s =
              static_cast<torch::optim::AdamWParamState&>(*opt->inner().state().at(piece.view.unsafeGetTensorImpl()));
          out["exp_avg " + piece.name] = s.exp_avg().clone();
          out["step " + piece.name] = torch::tensor(s.step());
        }
        return out;
      };
      const auto before = values();
      const std::string e = message_of([&] { shardtorch::load_dcp_checkpoint(*m, opt.get(), ck); });
      require(e.find("shardtorch::load_dcp_checkpoint '" + ck + "': rank ") != std::string::npos &&
                  e.find(c.expect) != std::string::npos,
              c.name + ": expected every rank to fail with \"" + c.expect + "\", got: " + e);
      require_unchanged(before, values(), c.name);
    });
    ASSERT_TRUE(r.ok) << c.name << ": " << r.summary();
  }
}
