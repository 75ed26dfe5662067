// Sharded checkpoints: saved at one world size and strategy they load bitwise
// at another and resume training exactly; killed writers leave the old
// checkpoint or the new; the application's state travels in the index.
#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>

#include "checkpoint_helpers.h"
#include "models.h"
#include "shardtorch/checkpoint.h"
#include "shardtorch/optim/cpu_adam.h"

using namespace testmodels;
using shardtorch::ShardOptions;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {
// Trains the GPT `steps` Adam steps on `world` ranks (FullShard) from the
// fixed seed; every rank sees its slice of the batch.
void train_steps(World& w, gpt::GPT& model, shardtorch::ShardedOptimizer& opt, const torch::Tensor& x, int steps) {
  const int64_t per = kBatch / w.size();
  auto xs = x.narrow(0, w.rank() * per, per);
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    gpt::lm_loss(model(xs), xs).backward();
    opt.step();
  }
}

// FullShard at 4 ranks, Adam at `lr`, 3 steps from seed 0, then a sharded
// checkpoint of step 3 in `ckpt`.
shardtorch::testing::RunResult save_after_three_steps_at_four(const std::string& ckpt, double lr,
                                                              const torch::Tensor& x) {
  return run_ranks(4, [&](World& w) {
    torch::manual_seed(0);
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w);
    auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(lr));
    train_steps(w, model, *opt, x, 3);
    shardtorch::save_sharded_checkpoint(*model, opt.get(), ckpt, 3);
  });
}

// Loads `from` (saved at `step`) into a GPT of other initial values on
// `world` ranks under `options`, with Adam, saves what those ranks hold to
// `to`, and requires every tensor there to equal `saved` bitwise.
void reload_and_compare(int world, const ShardOptions& options, const std::string& from, const std::string& to,
                        int64_t step, const std::map<std::string, at::Tensor>& saved) {
  auto r = run_ranks(world, [&](World& w) {
    torch::manual_seed(99);
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w, options);
    auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
    require(shardtorch::load_sharded_checkpoint(*model, opt.get(), from) == step, "wrong step");
    shardtorch::save_sharded_checkpoint(*model, opt.get(), to, step);
  });
  ASSERT_TRUE(r.ok) << to << "\n" << r.summary();
  auto got = shardtorch::read_sharded_checkpoint(to);
  ASSERT_EQ(got.size(), saved.size()) << to;
  for (auto& [k, t] : saved) EXPECT_TRUE(at::equal(got.at(k), t)) << k << " differs in " << to;
}

}  // namespace

TEST(ShardedCheckpoint, SavedAtFourLoadsBitwiseAtOneTwoThreeAndEight) {
  const TempDir dir;
  const std::string ckpt = (dir / "step-3").string();
  auto x = gpt_tokens();
  auto save = save_after_three_steps_at_four(ckpt, 1e-2, x);
  ASSERT_TRUE(save.ok) << save.summary();
  auto saved = shardtorch::read_sharded_checkpoint(ckpt);
  ASSERT_TRUE(saved.count("tok_emb.weight|param") && saved.count("tok_emb.weight|exp_avg_sq")) << "kinds missing";
  {
    torch::manual_seed(0);
    auto shapes = gpt::GPT(gpt::Config{});
    int checked = 0;
    for (const auto& item : shapes->named_parameters())  // a tied parameter is saved under one of its names
      for (const char* kind : {"|param", "|exp_avg", "|exp_avg_sq"})
        if (saved.count(item.key() + kind)) {
          EXPECT_EQ(saved.at(item.key() + kind).sizes(), item.value().sizes()) << item.key() << kind;
          ++checked;
        }
    EXPECT_EQ(checked, static_cast<int>(saved.size())) << "entries that are not parameters' or their state";
  }
  for (int world : {1, 2, 3, 8})  // what each world size holds after loading, saved again
    reload_and_compare(world, ShardOptions(), ckpt, (dir / ("again-" + std::to_string(world))).string(), 3, saved);
}

// NoShard: the ranks share the writing of the replicated parameters and
// their optimizer state (largest first, each to the rank with the least so
// far) instead of rank 0 writing the whole model while the others wait in a
// collective; the checkpoint moves to FullShard at another world size and
// back to NoShard bitwise, optimizer state included.
TEST(ShardedCheckpoint, NoShardSpreadsTheWritingAndMovesBetweenStrategiesBitwise) {
  const TempDir dir;
  const std::string ckpt = (dir / "no-shard").string(), full = (dir / "full").string(),
                    again = (dir / "again").string();
  auto x = gpt_tokens();
  auto save = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w, ShardOptions().strategy(Strategy::NoShard));
    auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
    train_steps(w, model, *opt, x, 2);
    shardtorch::save_sharded_checkpoint(*model, opt.get(), ckpt, 2);
    train_steps(w, model, *opt, x, 1);
    const auto uninterrupted = shardtorch::full_parameters(*model);
    // Resumed, the optimizer steps on (its state has the parameters'
    // shapes) exactly as the uninterrupted run did.
    torch::manual_seed(7);
    auto resumed = gpt::GPT(gpt::Config{});
    shardtorch::shard(resumed, w, ShardOptions().strategy(Strategy::NoShard));
    auto opt2 = shardtorch::Adam(*resumed, torch::optim::AdamOptions(1e-2));
    require(shardtorch::load_sharded_checkpoint(*resumed, opt2.get(), ckpt) == 2, "wrong step");
    train_steps(w, resumed, *opt2, x, 1);
    for (const auto& [n, t] : shardtorch::full_parameters(*resumed))
      require(at::equal(t, uninterrupted.at(n)), n + " differs from the uninterrupted run after resuming");
  });
  ASSERT_TRUE(save.ok) << save.summary();
  auto saved = shardtorch::read_sharded_checkpoint(ckpt);
  int64_t largest = 0, total = 0;  // bytes of a parameter with its two moments
  for (const auto& [key, t] : saved)
    if (key.size() > 6 && key.compare(key.size() - 6, 6, "|param") == 0) {
      largest = std::max<int64_t>(largest, 3 * t.nbytes());
      total += 3 * t.nbytes();
    }
  const int64_t size0 = files::file_size(Path(ckpt) / "rank-0.safetensors"),
                size1 = files::file_size(Path(ckpt) / "rank-1.safetensors");
  EXPECT_LT(largest, total / 4) << "the test needs a model of many comparable parameters";
  EXPECT_LE(std::abs(size0 - size1), largest + 16384) << "rank 0 wrote " << size0 << " bytes, rank 1 " << size1
                                                      << " (the largest parameter and its state: " << largest << ")";
  reload_and_compare(3, ShardOptions().strategy(Strategy::FullShard), ckpt, full, 2, saved);
  reload_and_compare(3, ShardOptions().strategy(Strategy::NoShard), full, again, 2, saved);
}

// HybridShard with two replica groups (4 ranks, shard groups of 2): the two
// groups share the writing of the ranges they hold alike (each range once:
// loading refuses one saved twice), each rank loads the ranges of its
// shard-group rank, and the checkpoint moves to and from FullShard bitwise.
TEST(ShardedCheckpoint, HybridShardWithTwoReplicaGroupsRoundTripsBitwise) {
  const TempDir dir;
  const std::string ckpt = (dir / "step-3").string();
  auto x = gpt_tokens();
  auto save = save_after_three_steps_at_four(ckpt, 1e-2, x);
  ASSERT_TRUE(save.ok) << save.summary();
  auto saved = shardtorch::read_sharded_checkpoint(ckpt);
  const std::string hybrid = (dir / "hybrid").string(), full = (dir / "full").string();
  reload_and_compare(4, ShardOptions().strategy(Strategy::HybridShard).hybrid_shard_size(2), ckpt, hybrid, 3, saved);
  auto index = std::ifstream(Path(hybrid) / "index.json");
  std::stringstream text;
  text << index.rdbuf();
  for (int rank = 0; rank < 4; ++rank) {
    const std::regex wrote("\"kind\":\"param\"[^}]*\"file\":\"rank-" + std::to_string(rank) + "\\.safetensors\"");
    EXPECT_TRUE(std::regex_search(text.str(), wrote)) << "rank " << rank << " wrote no parameter range";
  }
  reload_and_compare(2, ShardOptions().strategy(Strategy::FullShard), hybrid, full, 3, saved);
}

TEST(ShardedCheckpoint, ResumingAtAnotherWorldSizeContinuesTheReferenceTraining) {
  const TempDir dir;
  const std::string ckpt = (dir / "ckpt").string();
  auto x = gpt_tokens();
  // The reference: 5 steps in one process on the full batch.
  torch::manual_seed(0);
  auto ref = gpt::GPT(gpt::Config{});
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-3));
  auto want = train_in_one_process(*ref, ref_opt, 5, [&] { return gpt::lm_loss(ref(x), x); });
  auto first = save_after_three_steps_at_four(ckpt, 1e-3, x);
  ASSERT_TRUE(first.ok) << first.summary();
  auto second = run_ranks(2, [&](World& w) {
    torch::manual_seed(7);
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w, ShardOptions().strategy(Strategy::ShardGradOp));
    auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
    shardtorch::load_sharded_checkpoint(*model, opt.get(), ckpt);
    train_steps(w, model, *opt, x, 2);
    auto got = shardtorch::full_parameters(*model);
    std::map<std::string, torch::Tensor> mine;
    for (auto& [n, t] : want) mine[n] = got.at(n);
    expect_close_map(mine, want, 1e-5, "resumed at 2 ranks after saving at 4");
  });
  ASSERT_TRUE(second.ok) << second.summary();
}

TEST(ShardedCheckpoint, MissingShardsNewerFormatsAndMixedStepsAreClearErrors) {
  const TempDir dir;
  const std::string ckpt = (dir / "ckpt").string();
  auto save = run_ranks(2, [&](World& w) {
    auto model = MLP();
    shardtorch::shard(model, w);
    auto opt = shardtorch::SGD(*model, torch::optim::SGDOptions(0.1).momentum(0.9));
    model(torch::ones({2, 7})).sum().backward();
    opt->step();
    shardtorch::save_sharded_checkpoint(*model, opt.get(), ckpt, 1);
    shardtorch::save_sharded_checkpoint(*model, opt.get(), ckpt + "-other", 2);
    opt->step();  // other values, the same step number and sizes
    shardtorch::save_sharded_checkpoint(*model, opt.get(), ckpt + "-twin", 1);
  });
  ASSERT_TRUE(save.ok) << save.summary();
  auto load_error = [&](const std::string& path) {
    std::string msg;
    auto r = run_ranks(1, [&](World& w) {
      auto model = MLP();
      shardtorch::shard(model, w);
      auto opt = shardtorch::SGD(*model, torch::optim::SGDOptions(0.1).momentum(0.9));
      shardtorch::load_sharded_checkpoint(*model, opt.get(), path);
    });
    return r.ok ? std::string() : r.ranks[0].message;
  };
  EXPECT_EQ(load_error(ckpt), "");  // intact: loads at 1 rank
  auto copy = [&](const std::string& name) {
    files::copy_tree(ckpt, dir / name);
    return (dir / name).string();
  };
  auto missing = copy("missing");
  files::remove(Path(missing) / "rank-1.safetensors");
  EXPECT_NE(load_error(missing).find("shard file 'rank-1.safetensors' is missing"), std::string::npos)
      << load_error(missing);
  auto mixed = copy("mixed");
  files::copy_file(Path(ckpt + "-other") / "rank-1.safetensors", Path(mixed) / "rank-1.safetensors");
  std::string e = load_error(mixed);
  EXPECT_NE(e.find("'rank-1.safetensors' is from step 2 but the index is for step 1"), std::string::npos) << e;
  auto newer = copy("newer");
  {
    std::ifstream in(Path(newer) / "index.json");
    std::stringstream ss;
    ss << in.rdbuf();
    std::string text = ss.str();
    text.replace(text.find("\"format_version\":1"), 18, "\"format_version\":7");
    std::ofstream(Path(newer) / "index.json") << text;
  }
  EXPECT_NE(load_error(newer).find("format version 7 is newer"), std::string::npos) << load_error(newer);
  auto truncated = copy("truncated");
  files::resize_file(Path(truncated) / "rank-0.safetensors", 100);
  EXPECT_NE(load_error(truncated).find("'rank-0.safetensors' has 100 bytes"), std::string::npos)
      << load_error(truncated);
  // An index that claims more elements than its file holds, or a tensor the
  // file does not have: errors before anything is allocated or read.
  auto edit_index = [&](const std::string& name, const std::regex& from, const std::string& to) {
    auto p = copy(name);
    std::ifstream in(Path(p) / "index.json");
    std::stringstream ss;
    ss << in.rdbuf();
    std::string text = std::regex_replace(ss.str(), from, to, std::regex_constants::format_first_only);
    require(text != ss.str(), "the index edit matched nothing");
    std::ofstream(Path(p) / "index.json", std::ios::trunc) << text;
    return p;
  };
  auto claims_more = edit_index("claims-more", std::regex("\"end\":[0-9]+"), "\"end\":999999999999");
  for (const auto& e : {load_error(claims_more), message_of([&] { shardtorch::read_sharded_checkpoint(claims_more); })})
    EXPECT_NE(e.find("is saved as elements [0, 999999999999) but has shape"), std::string::npos) << e;
  // The first parameter range listed twice, the second time as a tensor its
  // file lacks (renaming the tensor alone would leave the file's own
  // unlisted, refused as such: NotACheckpoint.BothReadersRefuseATensorWhose...).
  auto renamed = edit_index(
      "renamed", std::regex("\\{(\"name\":\"[^\"]+\",\"kind\":\"param\",\"begin\":0,[^{}]*),\"tensor\":\"[^\"]+\"\\}"),
      "$&,{$1,\"tensor\":\"nothing|param|0\"}");
  for (const auto& e : {load_error(renamed), message_of([&] { shardtorch::read_sharded_checkpoint(renamed); })})
    EXPECT_NE(e.find("has no tensor 'nothing|param|0', which the index lists"), std::string::npos) << e;
  // Rank 1's part of a parameter that rank 0 starts (l1's weight straddles
  // the middle of its unit's flat parameter), moved one element back: the
  // lengths still add up to the parameter's, but its first element is saved
  // twice and its last never. Then the same part listed as momentum: the
  // parameter's end is missing (and the momentum's saved twice), and the
  // offline reader must not hand back a shorter tensor. (A made-up kind is
  // refused with the index.)
  const std::regex straddling(
      "\"kind\":\"param\",\"begin\":([1-9][0-9]*),\"end\":([0-9]+)(,\"step\":[0-9]+,"
      "\"file\":\"rank-1\\.safetensors\")");
  std::smatch m;
  std::string index_text;
  {
    std::ifstream in(Path(ckpt) / "index.json");
    std::stringstream ss;
    ss << in.rdbuf();
    index_text = ss.str();
  }
  ASSERT_TRUE(std::regex_search(index_text, m, straddling)) << "no parameter starts on rank 0 and ends on rank 1";
  const int64_t b = std::stoll(m[1].str()), e_ = std::stoll(m[2].str());
  auto shifted =
      edit_index("overlapping", straddling,
                 "\"kind\":\"param\",\"begin\":" + std::to_string(b - 1) + ",\"end\":" + std::to_string(e_ - 1) + "$3");
  for (const auto& e : {load_error(shifted), message_of([&] { shardtorch::read_sharded_checkpoint(shifted); })})
    EXPECT_NE(e.find("elements [" + std::to_string(b - 1) + ", " + std::to_string(b) + ") of '"), std::string::npos)
        << e;
  EXPECT_NE(load_error(shifted).find("saved more than once"), std::string::npos) << load_error(shifted);
  auto cut = edit_index("cut", straddling, "\"kind\":\"momentum_buffer\",\"begin\":$1,\"end\":$2$3");
  for (const auto& e : {load_error(cut), message_of([&] { shardtorch::read_sharded_checkpoint(cut); })})
    EXPECT_NE(e.find("elements [" + std::to_string(b) + ", " + std::to_string(e_) + ") of '"), std::string::npos) << e;
  EXPECT_NE(load_error(cut).find("are not all saved"), std::string::npos) << load_error(cut);
  // A shard of another run at the same step, of the same size: only the
  // checksum tells them apart.
  auto twin = copy("twin");
  files::copy_file(Path(ckpt + "-twin") / "rank-1.safetensors", Path(twin) / "rank-1.safetensors");
  ASSERT_EQ(files::file_size(Path(twin) / "rank-1.safetensors"), files::file_size(Path(ckpt) / "rank-1.safetensors"));
  e = load_error(twin);
  EXPECT_NE(e.find("'rank-1.safetensors' does not match its checksum in the index"), std::string::npos) << e;
}

// With torch::optim's AdamW, and with the fused CPU optimizers (whose state
// the loader must recognise too), resident and offloaded.
TEST(ShardedCheckpoint, ResumeAtTheSameWorldSizeIsBitwiseEqualToAnUninterruptedRun) {
  struct Variant {
    std::string optimizer;
    bool offload;
  };
  for (const Variant& v : {Variant{"AdamW", false}, Variant{"FusedAdamW", true}, Variant{"FusedAdam", false}}) {
    const std::string what = v.optimizer + (v.offload ? ", offloaded" : "");
    const TempDir dir;
    const std::string ckpt = (dir / "ckpt").string();
    auto x = gpt_tokens();
    auto setup = [&](World& w, uint64_t seed) {
      torch::manual_seed(seed);
      auto model = gpt::GPT(gpt::Config{});
      shardtorch::shard(model, w, ShardOptions().cpu_offload(v.offload));
      auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
      std::unique_ptr<shardtorch::ShardedOptimizer> opt;
      if (v.optimizer == "AdamW") opt = shardtorch::AdamW(*model, adamw);
      if (v.optimizer == "FusedAdamW") opt = shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*model, adamw);
      if (v.optimizer == "FusedAdam")
        opt = shardtorch::ShardedOptimizer::make<shardtorch::FusedAdam>(
            *model, torch::optim::AdamOptions(1e-2).weight_decay(0.1));
      return std::make_pair(model, std::move(opt));
    };
    const std::string straight = (dir / "straight.safetensors").string();
    auto a = run_ranks(2, [&](World& w) {
      auto [model, opt] = setup(w, 0);
      train_steps(w, model, *opt, x, 3);
      shardtorch::save_sharded_checkpoint(*model, opt.get(), ckpt, 3);
      train_steps(w, model, *opt, x, 3);
      shardtorch::save_full_state_dict(*model, straight);
    });
    ASSERT_TRUE(a.ok) << what << "\n" << a.summary();
    const std::string resumed = (dir / "resumed.safetensors").string();
    auto b = run_ranks(2, [&](World& w) {
      auto [model, opt] = setup(w, 42);  // different initial values: everything must come from the checkpoint
      require(shardtorch::load_sharded_checkpoint(*model, opt.get(), ckpt) == 3, "wrong step");
      train_steps(w, model, *opt, x, 3);
      shardtorch::save_full_state_dict(*model, resumed);
    });
    ASSERT_TRUE(b.ok) << what << "\n" << b.summary();
    auto s = shardtorch::checkpoint::load_file(straight), r = shardtorch::checkpoint::load_file(resumed);
    ASSERT_EQ(s.size(), r.size());
    for (auto& [n, t] : s) EXPECT_TRUE(at::equal(t, r.at(n))) << what << ": " << n << " differs after resuming";
  }
}

TEST(ShardedCheckpoint, AWriterKilledAtRandomPointsLeavesALoadableCheckpoint) {
  const TempDir dir;
  const std::string ckpt = (dir / "latest").string();
  const std::string full = (dir / "latest.safetensors").string();
  // A first complete checkpoint of each kind.
  auto first = run_ranks(1, [&](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w);
    shardtorch::save_sharded_checkpoint(*model, nullptr, ckpt, 0);
    shardtorch::save_full_state_dict(*model, full, {{"step", "0"}});
  });
  ASSERT_TRUE(first.ok) << first.summary();
  std::srand(12345);
  int interrupted = 0;
  for (int round = 0; round < 8; ++round) {
    // A writer that saves new steps over the same paths in a loop, killed
    // after a random delay (the parent's time limit kills it: SIGKILL).
    const auto delay = std::chrono::milliseconds(20 + std::rand() % 200);
    auto r = run_ranks(
        1,
        [&](World& w) {
          torch::manual_seed(round);
          auto model = gpt::GPT(gpt::Config{});
          shardtorch::shard(model, w);
          for (int step = 1;; ++step) {
            shardtorch::save_sharded_checkpoint(*model, nullptr, ckpt, 100 * (round + 1) + step);
            shardtorch::save_full_state_dict(*model, full, {{"step", std::to_string(step)}});
          }
        },
        shardtorch::testing::RunOptions().timeout(delay).stacks_on_timeout(false));
    interrupted += r.ranks[0].timed_out;
    // Whatever is on disk now loads completely.
    auto sharded = shardtorch::read_sharded_checkpoint(ckpt);
    EXPECT_TRUE(sharded.count("tok_emb.weight|param")) << "round " << round;
    auto whole = shardtorch::checkpoint::load_file(full);
    EXPECT_TRUE(whole.count("tok_emb.weight")) << "round " << round;
    auto check = run_ranks(1, [&](World& w) {
      auto model = gpt::GPT(gpt::Config{});
      shardtorch::shard(model, w);
      shardtorch::load_sharded_checkpoint(*model, nullptr, ckpt);
      shardtorch::load_full_state_dict(*model, full);
    });
    EXPECT_TRUE(check.ok) << "round " << round << "\n" << check.summary();
  }
  EXPECT_EQ(interrupted, 8) << "every writer should have been killed mid-loop";
}

// A writer killed (SIGKILL) at each named point of a save, on each rank that
// reaches it: what is on disk then loads as the previous checkpoint up to
// the point where the new one is published, and as the new one from there,
// bitwise, and the next save over it succeeds. Both publishing paths: the
// atomic exchange, and the two renames with the previous checkpoint aside.
TEST(ShardedCheckpoint, AWriterKilledAtEachPointOfASaveLeavesTheOldOrTheNewCheckpoint) {
  struct Case {
    const char* point;
    int victim;
    bool exchange;
    bool published;  // the new checkpoint is in place at this point
  };
  std::vector<Case> cases;
  for (const char* p : {"file partly written", "file written", "file synced", "file renamed"})
    for (int victim : {0, 1}) cases.push_back({p, victim, true, false});
  // Once the reports are gathered, rank 0 holds all it needs: it publishes
  // the complete new checkpoint without rank 1, then fails.
  cases.push_back({"reports gathered", 0, true, false});
  cases.push_back({"reports gathered", 1, true, true});
  cases.push_back({"staging directory created", 0, true, false});
  cases.push_back({"index written", 0, true, false});
  cases.push_back({"exchanged", 0, true, true});
  cases.push_back({"published", 0, true, true});
  cases.push_back({"previous moved aside", 0, false, false});
  cases.push_back({"new moved in", 0, false, true});
  cases.push_back({"published", 0, false, true});

  const TempDir dir;
  const gpt::Config cfg{};
  auto params_of = [&](int seed) {
    torch::manual_seed(seed);
    auto m = gpt::GPT(cfg);
    std::map<std::string, at::Tensor> out;
    for (auto& [n, t] : unique_params(*m)) out[n] = t.detach().clone();
    return out;
  };
  const auto old_params = params_of(1), new_params = params_of(2);
  const std::string pristine = (dir / "pristine").string();
  auto first = run_ranks(2, [&](World& w) {
    torch::manual_seed(1);
    auto model = gpt::GPT(cfg);
    shardtorch::shard(model, w);
    shardtorch::save_sharded_checkpoint(*model, nullptr, pristine, 1);
  });
  ASSERT_TRUE(first.ok) << first.summary();

  for (size_t c = 0; c < cases.size(); ++c) {
    const Case k = cases[c];
    const std::string what = std::string("killed rank ") + std::to_string(k.victim) + " at '" + k.point + "'" +
                             (k.exchange ? "" : " (renames, no exchange)");
    const std::string ckpt = (dir / ("case" + std::to_string(c))).string();
    files::copy_tree(pristine, ckpt);
    auto killed = run_ranks(
        2,
        [&](World& w) {
          if (!k.exchange) ::setenv("SHARDTORCH_CHECKPOINT_NO_EXCHANGE", "1", 1);
          torch::manual_seed(2);
          auto model = gpt::GPT(cfg);
          shardtorch::shard(model, w);
          if (w.rank() == k.victim) die_at(k.point);
          shardtorch::save_sharded_checkpoint(*model, nullptr, ckpt, 2);
        },
        crash_run());
    ASSERT_EQ(killed.ranks[k.victim].signal, SIGKILL) << what << ": the save never reached the point\n"
                                                      << killed.summary();
    ASSERT_FALSE(killed.ranks[1 - k.victim].timed_out) << what << ": the other rank hung\n" << killed.summary();

    auto check = run_ranks(2, [&](World& w) {
      torch::manual_seed(99);
      auto model = gpt::GPT(cfg);
      shardtorch::shard(model, w);
      const int64_t step = shardtorch::load_sharded_checkpoint(*model, nullptr, ckpt);
      const auto& want = k.published ? new_params : old_params;
      require(step == (k.published ? 2 : 1), what + ": loaded step " + std::to_string(step));
      auto got = shardtorch::full_parameters(*model);
      for (const auto& [n, t] : want) require(at::equal(got.at(n), t), what + ": '" + n + "' is neither as saved");
      shardtorch::save_sharded_checkpoint(*model, nullptr, ckpt, 3);  // the next save goes over whatever is left
      require(shardtorch::load_sharded_checkpoint(*model, nullptr, ckpt) == 3, what + ": the next save did not land");
      require(!files::exists(ckpt + ".shardtorch-old") && !files::exists(ckpt + ".shardtorch-tmp"),
              what + ": the next save left a previous or unfinished checkpoint beside it");
    });
    EXPECT_TRUE(check.ok) << what << "\n" << check.summary();
  }
}

// The application's own resume state (data-loader position, epoch, ...)
// travels in the index: saved at 2 ranks, read back at 3; ranks that disagree
// fail alike, naming the key; checkpoints saved without it read back empty.
TEST(ShardedCheckpoint, UserStateRoundTripsAtAnotherWorldSizeAndMustAgreeAcrossRanks) {
  const TempDir dir;
  const std::string ckpt = (dir / "ckpt").string(), bare = (dir / "bare").string(), bad = (dir / "bad").string();
  const std::map<std::string, std::string> state{
      {"epoch", "3"}, {"samples_seen", "12000"}, {"rng", "seed=7;offset=42"}};
  auto save = run_ranks(2, [&](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w);
    shardtorch::save_sharded_checkpoint(*model, nullptr, ckpt, 5, state);
    shardtorch::save_sharded_checkpoint(*model, nullptr, bare, 5);
    auto mine = state;
    if (w.rank() == 1) mine["samples_seen"] = "6000";  // a per-rank position: refused
    try {
      shardtorch::save_sharded_checkpoint(*model, nullptr, bad, 5, mine);
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      require(msg.find("'samples_seen'") != std::string::npos && msg.find("user_state") != std::string::npos,
              "the error should name the key: " + msg);
      return;
    }
    throw std::runtime_error("differing user_state was accepted");
  });
  ASSERT_TRUE(save.ok) << save.summary();
  EXPECT_FALSE(files::exists(bad)) << "a refused checkpoint must not be published";
  auto load = run_ranks(3, [&](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w);
    std::map<std::string, std::string> got{{"stale", "x"}};
    require(shardtorch::load_sharded_checkpoint(*model, nullptr, ckpt, &got) == 5, "wrong step");
    require(got == state, "user_state did not round-trip");
    shardtorch::load_sharded_checkpoint(*model, nullptr, bare, &got);
    require(got.empty(), "a checkpoint saved without user_state should read back empty");
  });
  ASSERT_TRUE(load.ok) << load.summary();
  // A non-string value in the index is a clear error, not a crash.
  std::string index;
  {
    std::ifstream in(ckpt + "/index.json");
    std::stringstream ss;
    ss << in.rdbuf();
    index = ss.str();
  }
  const std::string from = "\"epoch\":\"3\"";
  ASSERT_NE(index.find(from), std::string::npos) << index.substr(0, 200);
  index.replace(index.find(from), from.size(), "\"epoch\":3");
  {
    std::ofstream out(ckpt + "/index.json");
    out << index;
  }
  auto malformed = run_ranks(1, [&](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w);
    try {
      shardtorch::load_sharded_checkpoint(*model, nullptr, ckpt);
    } catch (const std::exception& e) {
      require(std::string(e.what()).find("user_state 'epoch' is not a string") != std::string::npos, e.what());
      return;
    }
    throw std::runtime_error("a non-string user_state value was accepted");
  });
  ASSERT_TRUE(malformed.ok) << malformed.summary();
}

class FrozenAndBuffers : public ::testing::TestWithParam<Strategy> {};

// Frozen parameters (the MLP's l2 bias) are saved and loaded under every
// strategy, NoShard included (loading must not keep the loading model's own
// values, silently). Under bf16 mixed precision they keep their fp32 values
// (not the bf16 copy NoShard computes with, which a checkpoint would round),
// in sharded checkpoints and full state dicts alike. So is the buffer: the saver's `scale` holds values the loader's
// fresh model does not (exact in bf16), so a load that skipped buffers fails.
TEST_P(FrozenAndBuffers, FrozenParametersAndBuffersRoundTrip) {
  const Strategy s = GetParam();
  const at::Tensor scale = at::arange(7, at::kFloat).mul(0.25).add(0.5);
  for (bool bf16 : {false, true}) {
    const std::string what = std::string(shardtorch::strategy_name(s)) + (bf16 ? " bf16" : "");
    auto options = strategy_options(s, 2);
    if (bf16) options.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16));
    const TempDir dir;
    const std::string ckpt = (dir / "ckpt").string(), full = (dir / "full.safetensors").string();
    std::map<std::string, at::Tensor> saved;  // what the ranks save: a fresh seed-0 model's values
    torch::manual_seed(0);
    auto ref = MLP();
    for (auto& item : ref->named_parameters()) saved[item.key()] = item.value().detach().clone();
    require(!at::equal(saved.at("l2.lin.bias"), saved.at("l2.lin.bias").to(at::kBFloat16).to(at::kFloat)),
            "the frozen bias is exact in bf16: the test would not see rounding");
    auto a = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      auto m = MLP();
      m->scale.copy_(scale);
      shardtorch::shard(m, w, options);
      shardtorch::save_sharded_checkpoint(*m, nullptr, ckpt, 0);
      shardtorch::save_full_state_dict(*m, full);
    });
    ASSERT_TRUE(a.ok) << what << "\n" << a.summary();
    auto b = run_ranks(2, [&](World& w) {
      for (bool from_full : {false, true}) {
        torch::manual_seed(1);  // other values everywhere, the frozen bias included
        auto m = MLP();
        require(!at::equal(m->l2->lin->bias, saved.at("l2.lin.bias")), "the seeds give the same frozen bias");
        shardtorch::shard(m, w, options);
        if (from_full) {
          shardtorch::load_full_state_dict(*m, full);
        } else {
          shardtorch::load_sharded_checkpoint(*m, nullptr, ckpt);
        }
        const std::string from = from_full ? "full state dict" : "sharded checkpoint";
        for (auto& [name, t] : shardtorch::full_parameters(*m))
          require(at::equal(t, saved.at(name)), what + ": " + name + " was not loaded exactly from the " + from);
        require(at::equal(m->scale.to(at::kFloat), scale), what + ": the buffer was not loaded from the " + from);
      }
    });
    ASSERT_TRUE(b.ok) << what << "\n" << b.summary();
  }
}

INSTANTIATE_TEST_SUITE_P(ShardedCheckpoint, FrozenAndBuffers, ::testing::ValuesIn(kAllStrategies), StrategyName());

// Optimizer state exists only for parameters that had gradients (here unit b,
// which forward never runs, has none); a checkpoint
// of such a model loads (it used to fail: "not all saved (a missing shard?)"),
// the unused unit still has no state, and training continues bitwise.
TEST(ShardedCheckpoint, ParametersThatNeverHadAGradientLoadWithoutOptimizerState) {
  const TempDir dir;
  const std::string ckpt = (dir / "ckpt").string();
  auto x = torch::randn({4, 6});
  auto r = run_ranks(2, [&](World& w) {
    auto make = [&](uint64_t seed) {
      torch::manual_seed(seed);
      auto m = Sometimes();
      m->use_b = false;
      shardtorch::shard(m, w);
      return m;
    };
    auto step = [&](Sometimes& m, shardtorch::ShardedOptimizer& opt) {
      opt.zero_grad();
      m(x).square().mean().backward();
      opt.step();
    };
    auto m = make(0);
    auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-2));
    step(m, *opt);
    shardtorch::save_sharded_checkpoint(*m, opt.get(), ckpt, 1);
    auto m2 = make(3);
    auto opt2 = shardtorch::Adam(*m2, torch::optim::AdamOptions(1e-2));
    shardtorch::load_sharded_checkpoint(*m2, opt2.get(), ckpt);
    require(opt2->inner().state().size() == opt->inner().state().size(),
            "optimizer state entries: loaded " + std::to_string(opt2->inner().state().size()) + ", saved " +
                std::to_string(opt->inner().state().size()));
    step(m, *opt);
    step(m2, *opt2);
    auto p = shardtorch::full_parameters(*m), q = shardtorch::full_parameters(*m2);
    for (auto& [name, t] : p) require(at::equal(t, q.at(name)), name + " differs after resuming");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}
