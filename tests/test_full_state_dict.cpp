// Full state dicts: saved at one world size and strategy they load bitwise at
// another; saving holds one unit's parameters at a time; a killed writer
// leaves the old file or the new; bad entries are refused by name.
#include <gtest/gtest.h>

#include <unistd.h>

#include <csignal>
#include <fstream>

#include "../src/checkpoint/reader_access.h"
#include "checkpoint_helpers.h"
#include "counting_allocator.h"
#include "models.h"
#include "shardtorch/checkpoint.h"

using namespace testmodels;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

class FullStateDict : public ::testing::TestWithParam<Strategy> {};

TEST_P(FullStateDict, SavedAtFourLoadsBitwiseAtOneTwoAndThree) {
  const Strategy load_strategy = GetParam();
  const TempDir dir;
  const std::string path = (dir / "gpt.safetensors").string();
  auto x = gpt_tokens();
  auto save = run_ranks(4, [&](World& w) {
    torch::manual_seed(0);
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w);
    auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
    auto xs = x.narrow(0, w.rank() * 3, 3);
    for (int s = 0; s < 2; ++s) {  // move away from the initial values
      opt->zero_grad();
      gpt::lm_loss(model(xs), xs).backward();
      opt->step();
    }
    auto full = shardtorch::full_parameters(*model);
    shardtorch::save_full_state_dict(*model, path, {{"step", "2"}});
    if (w.rank() == 0)
      shardtorch::checkpoint::save_file((dir / "expected.safetensors").string(),
                                        std::vector<std::pair<std::string, at::Tensor>>(full.begin(), full.end()));
  });
  ASSERT_TRUE(save.ok) << save.summary();
  auto expected = shardtorch::checkpoint::load_file((dir / "expected.safetensors").string());
  shardtorch::checkpoint::Reader header(path);
  EXPECT_EQ(shardtorch::checkpoint::ReaderAccess::header(header).metadata.at("step"), "2");
  EXPECT_EQ(shardtorch::checkpoint::ReaderAccess::header(header).metadata.at("shardtorch_world_size"), "4");
  EXPECT_EQ(shardtorch::checkpoint::ReaderAccess::header(header).metadata.at("format"),
            "pt");  // what Hugging Face's loaders require
  for (int world : {1, 2, 3}) {
    auto r = run_ranks(world, [&](World& w) {
      torch::manual_seed(99);  // different initial values: the load must replace them
      auto model = gpt::GPT(gpt::Config{});
      shardtorch::shard(model, w, strategy_options(load_strategy, world));
      shardtorch::load_full_state_dict(*model, path);
      auto got = shardtorch::full_parameters(*model);
      require(got.size() == expected.size(), "parameter count differs");
      for (auto& [n, t] : expected) require(at::equal(got.at(n), t), "'" + n + "' differs after loading");
      // and the model computes with them: one more step works
      auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
      auto xs = x.narrow(0, 0, 2);
      gpt::lm_loss(model(xs), xs).backward();
      opt->step();
    });
    ASSERT_TRUE(r.ok) << "load at world " << world << "\n" << r.summary();
  }
}

INSTANTIATE_TEST_SUITE_P(LoadedAs, FullStateDict, ::testing::ValuesIn(kAllStrategies),
                         [](const auto& info) { return std::string(shardtorch::strategy_name(info.param)); });

// The full state dict is gathered one flat parameter at a time: measured at
// the CPU allocator, saving a 16-block GPT holds at most a few blocks' worth
// at once on any rank, never the whole model. Ours is one gathered flat
// parameter; c10d's Gloo all-gather stages its output too (measured: three
// flat parameters' bytes at the peak).
TEST(FullStateDict, SavingHoldsOneUnitsParametersAtATimeNotTheModel) {
  const TempDir dir;
  const std::string path = (dir / "deep.safetensors").string();
  const gpt::Config cfg{64, 16, 128, 4, 16};
  auto r = run_ranks(2, [&](World& w) {
    auto model = gpt::GPT(cfg);
    auto sm = shardtorch::shard(model, w);
    int64_t whole = 0, largest = 0;
    for (const auto& u : sm.units()) {
      for (const auto& l : u.layouts) {
        whole += l.padded_numel() * 4;
        largest = std::max(largest, l.padded_numel() * 4);
      }
    }
    CountingCPUAllocator counting;  // installed for this scope, in this rank's process
    shardtorch::save_full_state_dict(*model, path);
    const int64_t held = counting.peak();
    if (w.rank() == 0) {
      std::printf("  save_full_state_dict: peak %lld B allocated; largest flat %lld B, whole model %lld B\n",
                  static_cast<long long>(held), static_cast<long long>(largest), static_cast<long long>(whole));
    }
    require(largest * 8 < whole, "the model is too shallow for this test");
    require(held <= 4 * largest, "rank " + std::to_string(w.rank()) + " held " + std::to_string(held) +
                                     " bytes at once while saving; one flat parameter is at most " +
                                     std::to_string(largest) + " of the model's " + std::to_string(whole));
  });
  ASSERT_TRUE(r.ok) << r.summary();
  auto plain = gpt::GPT(cfg);  // every name written: one entry per parameter name (tied ones under each) and buffer
  EXPECT_EQ(shardtorch::checkpoint::ReaderAccess::header(shardtorch::checkpoint::Reader(path)).tensors.size(),
            plain->named_parameters().size() + plain->named_buffers().size());
}

// Flat parameters of two dtypes: the file lays the double ones out first
// (aligned), yet the writer gathers the flats in the order the other ranks
// do. Gathering in file order paired rank 0's all-gather of l2 with the
// others' of l1.
TEST(FullStateDict, FlatParametersOfTwoDtypesAreGatheredInTheOrderOfEveryRank) {
  const TempDir dir;
  const std::string path = (dir / "mixed.safetensors").string();
  auto r = run_ranks(
      2,
      [&](World& w) {
        torch::manual_seed(0);
        MLP m;
        m->l2->to(torch::kDouble);
        shardtorch::shard(m, w);
        auto full = shardtorch::full_parameters(*m);
        shardtorch::save_full_state_dict(*m, path);
        if (w.rank() != 0) return;
        shardtorch::checkpoint::Reader file(path);
        for (const auto& rec : shardtorch::checkpoint::ReaderAccess::header(file).tensors)
          require((shardtorch::checkpoint::ReaderAccess::header(file).data_start + rec.begin) %
                          shardtorch::checkpoint::dtype_size(rec.dtype) ==
                      0,
                  "'" + rec.name + "' is not aligned");
        for (const auto& [n, t] : full) require(at::equal(file.read(n), t), "'" + n + "' differs in the file");
        require(file.read("l2.lin.weight").scalar_type() == at::kDouble, "l2 is not double in the file");
      },
      shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(10)));
  ASSERT_TRUE(r.ok) << r.summary();
}

// The same for the full state dict's single file, killed at each point of
// its write on rank 0, the writer; the temporary files the killed writes
// leave are removed by the next write that completes (on the same host,
// whose process is gone: not a live writer's).
TEST(FullStateDict, AWriterKilledAtEachPointLeavesTheOldFileOrTheNew) {
  const TempDir dir;
  const std::string path = (dir / "model.safetensors").string();
  const gpt::Config cfg{};
  auto leftovers = [&] {
    int n = 0;
    for (const auto& name : files::list_directory(dir)) n += name.rfind(".model.safetensors.tmp-", 0) == 0;
    return n;
  };
  auto save = [&](int seed, const char* kill_at) {
    return run_ranks(
        2,
        [&](World& w) {
          torch::manual_seed(seed);
          auto model = gpt::GPT(cfg);
          shardtorch::shard(model, w);
          if (kill_at && w.rank() == 0) die_at(kill_at);
          shardtorch::save_full_state_dict(*model, path, {{"seed", std::to_string(seed)}});
        },
        crash_run());
  };
  for (const char* point : {"file partly written", "file written", "file synced", "file renamed"}) {
    auto first = save(1, nullptr);
    ASSERT_TRUE(first.ok) << first.summary();
    auto killed = save(2, point);
    ASSERT_EQ(killed.ranks[0].signal, SIGKILL) << point << ": the write never reached it\n" << killed.summary();
    ASSERT_FALSE(killed.ranks[1].timed_out) << point << ": rank 1 hung\n" << killed.summary();
    const bool renamed = std::string(point) == "file renamed";
    auto file = shardtorch::checkpoint::load_file(path);  // validates the whole file
    EXPECT_EQ(shardtorch::checkpoint::ReaderAccess::header(shardtorch::checkpoint::Reader(path)).metadata.at("seed"),
              renamed ? "2" : "1")
        << point;
    torch::manual_seed(renamed ? 2 : 1);
    auto want = gpt::GPT(cfg);
    for (auto& [n, t] : unique_params(*want)) EXPECT_TRUE(at::equal(file.at(n), t)) << point << ": '" << n << "'";
    EXPECT_EQ(leftovers(), renamed ? 0 : 1) << point;
  }
  // Beside them: a live writer's file (this process), another host's, and
  // one of a process that cannot exist (above any pid_max).
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string prefix = ".model.safetensors.tmp-";
  const Path live = dir / (prefix + host + "-" + std::to_string(::getpid()));
  const Path elsewhere = dir / (prefix + "another-host-1");
  std::ofstream(live) << "x";
  std::ofstream(elsewhere) << "x";
  std::ofstream(dir / (prefix + host + "-4194305")) << "x";
  EXPECT_EQ(leftovers(), 3);
  auto last = save(3, nullptr);
  ASSERT_TRUE(last.ok) << last.summary();
  EXPECT_EQ(leftovers(), 2) << "only the live writer's and the other host's temporary files should be left";
  EXPECT_TRUE(files::exists(live) && files::exists(elsewhere));
}

TEST(FullStateDictErrors, MissingMisShapedAndUnexpectedEntriesNameTheFileAndParameter) {
  const TempDir dir;
  auto r = run_ranks(1, [&](World& w) {
    auto model = MLP();
    shardtorch::shard(model, w);
    const std::string good = (dir / "good.safetensors").string();
    shardtorch::save_full_state_dict(*model, good);
    auto sd = shardtorch::checkpoint::load_file(good);
    auto expect_error = [&](std::map<std::string, at::Tensor> edited, const std::string& needle) {
      const std::string p = (dir / "edited.safetensors").string();
      shardtorch::checkpoint::save_file(p,
                                        std::vector<std::pair<std::string, at::Tensor>>(edited.begin(), edited.end()));
      try {
        shardtorch::load_full_state_dict(*model, p);
      } catch (const std::exception& e) {
        require(std::string(e.what()).find(needle) != std::string::npos &&
                    std::string(e.what()).find(p) != std::string::npos,
                "wrong message: " + std::string(e.what()));
        return;
      }
      throw std::runtime_error("no error for " + needle);
    };
    auto missing = sd;
    missing.erase("l2.lin.weight");
    expect_error(missing, "no entry for parameter 'l2.lin.weight'");
    auto shaped = sd;
    shaped["l1.lin.bias"] = at::zeros({14});
    expect_error(
        shaped,
        "'l1.lin.bias' has shape [14] in the file but the model's parameter has shape [13] (is the model built "
        "with the checkpoint's configuration?)");
    auto extra = sd;
    extra["l9.weight"] = at::zeros({1});
    expect_error(extra, "unexpected tensor 'l9.weight'");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A full state dict holds a tied parameter under each of its names. Values
// that differ under them (a file of a model that did not tie them, or one
// edited) are refused on every rank, naming both names, with the model
// unchanged, unless LoadOptions::tied_from names the one to load from. Only
// the last element differs: under FullShard one rank's shard holds it.
// Before: loaded from the first name without a word.
TEST(FullStateDictErrors, ATiedPairHoldingDifferentValuesIsRefusedUnlessTiedFromSaysWhichWins) {
  const TempDir dir;
  const std::string saved = (dir / "gpt.safetensors").string(), edited = (dir / "edited.safetensors").string();
  for (Strategy strategy : {Strategy::FullShard, Strategy::NoShard}) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      auto model = gpt::GPT(gpt::Config{});
      shardtorch::shard(model, w, strategy_options(strategy, 2));
      shardtorch::save_full_state_dict(*model, saved);
      auto sd = shardtorch::checkpoint::load_file(saved);
      at::Tensor head = sd.at("head.weight").clone();
      const int64_t last = head.numel() - 1;
      head.view({-1})[last] += 1;
      if (w.rank() == 0) {
        sd["head.weight"] = head;
        shardtorch::checkpoint::save_file(edited,
                                          std::vector<std::pair<std::string, at::Tensor>>(sd.begin(), sd.end()));
      }
      w.barrier();
      const auto before = shardtorch::full_parameters(*model);
      auto refused = [&](const shardtorch::LoadOptions& options, const std::vector<std::string>& needles) {
        try {
          shardtorch::load_full_state_dict(*model, edited, options);
        } catch (const shardtorch::Error& e) {
          for (const auto& n : needles)
            require(std::string(e.what()).find(n) != std::string::npos, "'" + n + "' is not in: " + e.what());
          for (const auto& [n, t] : shardtorch::full_parameters(*model))
            require(at::equal(t, before.at(n)), "'" + n + "' changed by a refused load");
          return;
        }
        throw std::runtime_error("no error for " + needles.front());
      };
      refused({}, {"'tok_emb.weight' and 'head.weight' are one tied parameter of the model, but the checkpoint holds "
                   "different values under them (the first at element " +
                       std::to_string(last) + ")",
                   "LoadOptions().tied_from({\"head.weight\"})", edited});
      refused(shardtorch::LoadOptions().tied_from({"ln_f.weight"}),
              {"'ln_f.weight', which is no name of a tied parameter of the model"});
      refused(shardtorch::LoadOptions().tied_from({"tok_emb.weight", "head.weight"}),
              {"two names of one tied parameter"});
      // Either name wins when named; the other is not compared.
      shardtorch::load_full_state_dict(*model, edited, shardtorch::LoadOptions().tied_from({"head.weight"}));
      require(at::equal(shardtorch::full_parameters(*model).at("tok_emb.weight"), head), "not loaded from head.weight");
      shardtorch::load_full_state_dict(*model, edited, shardtorch::LoadOptions().tied_from({"tok_emb.weight"}));
      require(at::equal(shardtorch::full_parameters(*model).at("head.weight"), sd.at("tok_emb.weight")),
              "not loaded from tok_emb.weight");
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(strategy) << "\n" << r.summary();
  }
}
