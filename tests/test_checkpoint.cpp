// safetensors files and full state dicts: the reader refuses every malformed
// file with a message naming it, writes are atomic, and a state dict saved at
// one world size and strategy loads bitwise at another.
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "../src/checkpoint/safetensors_format.h"
#include "counting_allocator.h"
#include "models.h"
#include "shardtorch/checkpoint.h"
#include "shardtorch/optim/cpu_adam.h"

using namespace testmodels;
using shardtorch::ShardOptions;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::checkpoint::SafetensorsError;
using shardtorch::testing::run_ranks;

namespace {

void write_raw(const Path& p, const std::string& json, const std::string& data) {
  std::string bytes(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  std::ofstream(p, std::ios::binary) << bytes << json << data;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::string error_of(const Path& p) {
  try {
    shardtorch::checkpoint::Reader r(p.string());
  } catch (const SafetensorsError& e) {
    return e.what();
  }
  return "";
}

// Crash tests: this process dies (SIGKILL) when a checkpoint write reaches
// `point`. The run's limits notice a rank left waiting for a dead one.
void die_at(const std::string& point) {
  shardtorch::checkpoint::set_crash_hook([point](const std::string& p) {
    if (p == point) ::raise(SIGKILL);
  });
}
shardtorch::testing::RunOptions crash_run() {
  return shardtorch::testing::RunOptions().timeout(std::chrono::seconds(60)).collective_timeout(std::chrono::seconds(5));
}

}  // namespace

TEST(Safetensors, RoundTripsDtypesShapesAndMetadata) {
  const TempDir dir;
  auto path = (dir / "t.safetensors").string();
  std::vector<std::pair<std::string, at::Tensor>> ts = {
      {"f32", at::randn({3, 4})},
      {"bf16", at::randn({5}).to(at::kBFloat16)},
      {"i64", at::arange(7, at::kLong)},
      {"scalar", at::full({}, 2.5)},
      {"empty", at::empty({0, 3})},
      {"name with \"quotes\" and \\", at::ones({2}, at::kDouble)},
  };
  shardtorch::checkpoint::save_file(path, ts, {{"step", "42"}});
  shardtorch::checkpoint::Reader r(path);
  EXPECT_EQ(r.header().metadata.at("step"), "42");
  for (auto& [n, t] : ts) {
    auto got = r.read(n);
    EXPECT_EQ(got.scalar_type(), t.scalar_type()) << n;
    EXPECT_TRUE(at::equal(got, t)) << n;
  }
  EXPECT_TRUE(at::equal(r.read_range("i64", 2, 3), at::arange(2, 5, at::kLong)));
  // Every tensor starts at a multiple of its element size in the file (the
  // bf16 tensor's 10 bytes, written in the given order, put the int64 one at
  // 58), for readers that map the file and cast in place.
  EXPECT_EQ(r.header().data_start % 8, 0u);
  for (const auto& rec : r.header().tensors)
    EXPECT_EQ((r.header().data_start + rec.begin) % shardtorch::checkpoint::dtype_size(rec.dtype), 0u) << rec.name;
  EXPECT_THROW(r.read_range("i64", 5, 3), SafetensorsError);
  EXPECT_THROW(r.read("missing"), SafetensorsError);
}

// Every dtype the header check lets through must become an ATen tensor and
// back: a valid file must never pass the checks and then fail while a model
// is half loaded (U16/U32/U64 once did).
TEST(Safetensors, EveryDtypeTheHeaderAcceptsReadsAndWritesAsATen) {
  using shardtorch::checkpoint::dtype_name;
  using shardtorch::checkpoint::dtype_size;
  using shardtorch::checkpoint::scalar_type;
  for (std::string d : {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"}) {
    ASSERT_GT(dtype_size(d), 0u) << d;
    at::ScalarType t = scalar_type(d);
    EXPECT_EQ(dtype_name(t), d);
    EXPECT_EQ(c10::elementSize(t), dtype_size(d)) << d;
  }
  EXPECT_EQ(dtype_size("F8_E4M3"), 0u);  // refused by the header check, so never asked of scalar_type
  const TempDir dir;
  auto path = (dir / "u.safetensors").string();
  std::vector<std::pair<std::string, at::Tensor>> ts;
  for (auto t : {at::kUInt16, at::kUInt32, at::kUInt64})
    ts.push_back({c10::toString(t), at::arange(5, at::kLong).mul(1000).to(t)});
  shardtorch::checkpoint::save_file(path, ts, {});
  shardtorch::checkpoint::Reader r(path);
  for (auto& [n, t] : ts) {
    auto got = r.read(n);
    EXPECT_EQ(got.scalar_type(), t.scalar_type()) << n;
    EXPECT_TRUE(at::equal(got.to(at::kLong), t.to(at::kLong))) << n;
    EXPECT_TRUE(at::equal(r.read_range(n, 1, 3).to(at::kLong), at::arange(1, 4, at::kLong).mul(1000))) << n;
  }
}

TEST(Safetensors, RefusesMalformedFilesNamingFileAndProblem) {
  const TempDir dir;
  auto p = dir / "bad.safetensors";
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  struct Case {
    std::string json, data, expect;
  };
  std::vector<Case> cases = {
      {ok, std::string(4, 'x'), "truncated file"},
      {ok, std::string(12, 'x'), "trailing bytes"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       std::string(12, 'x'), "overlap"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
       std::string(12, 'x'), "gap"},
      {R"({"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,8]}})", std::string(8, 'x'), "overflows"},
      {R"({"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", std::string(8, 'x'), "unknown dtype 'Q7'"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
       std::string(16, 'x'), "duplicate key 'a'"},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, 'x'), "need 12 bytes"},
      {R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", std::string(8, 'x'), "unsupported value"},
      {R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", std::string(8, 'x'), "only integers"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", std::string(8, 'x'), "run backwards"},
      {R"({"a":{"dtype":"F32","shape":[2]}})", std::string(8, 'x'), "missing dtype, shape or data_offsets"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", std::string(8, 'x'), "unexpected end"},
      {R"({"__metadata__":{"k":1}})", "", "is not a string"},
      {R"({"__metadata__":{"k":"\udc00"}})", "", "a low surrogate"},
      {R"({"__metadata__":{"k":"\ud83dx"}})", "", "without its pair"},
  };
  for (const auto& c : cases) {
    write_raw(p, c.json, c.data);
    std::string e = error_of(p);
    EXPECT_NE(e.find(p.string()), std::string::npos) << c.expect << ": " << e;
    EXPECT_NE(e.find(c.expect), std::string::npos) << "expected '" << c.expect << "', got: " << e;
  }
  // A header larger than the file, and larger than the 100 MB limit.
  for (uint64_t n : {uint64_t{1000}, uint64_t{200} * 1000 * 1000}) {
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
    std::ofstream(p, std::ios::binary) << bytes << "{}";
    std::string e = error_of(p);
    EXPECT_NE(e.find(n == 1000 ? "larger than the file" : "exceeds the 100 MB limit"), std::string::npos) << e;
  }
  std::ofstream(p, std::ios::binary) << "abc";
  EXPECT_NE(error_of(p).find("shorter than the 8-byte header length"), std::string::npos);
  EXPECT_NE(error_of(dir / "nope").find("cannot open"), std::string::npos);
}

// Names and metadata are UTF-8 both ways, as Python's safetensors has them:
// characters past U+FFFF escaped as a surrogate pair (as JSON writers do)
// read back as themselves; a string that is not UTF-8 is refused on writing
// (Python would refuse the whole file), and nothing is written.
TEST(Safetensors, NamesAndMetadataAreUtf8BothWays) {
  const TempDir dir;
  auto p = dir / "u.safetensors";
  write_raw(p, R"({"__metadata__":{"k":"\ud83d\ude00 \u00e9"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
            std::string(4, '\0'));
  shardtorch::checkpoint::Reader r(p.string());
  EXPECT_EQ(r.header().metadata.at("k"), "\xF0\x9F\x98\x80 \xC3\xA9");  // U+1F600, U+00E9
  const auto q = (dir / "v.safetensors").string();
  const std::string named = "w\xC3\xA9ight \xF0\x9F\x98\x80";
  shardtorch::checkpoint::save_file(q, {{named, at::ones({2})}}, {{"note", "\xE2\x82\xAC"}});
  auto back = shardtorch::checkpoint::load_file(q);
  EXPECT_TRUE(back.count(named)) << "a UTF-8 name did not round-trip";
  for (const std::string bad : {std::string("\xFF"), std::string("\xC0\x80"), std::string("\xED\xA0\x80"),
                                std::string("\xE2\x82")}) {
    const auto b = (dir / "bad.safetensors").string();
    std::string e = message_of([&] { shardtorch::checkpoint::save_file(b, {{"t", at::ones({1})}}, {{"k", bad}}); });
    EXPECT_NE(e.find("is not valid UTF-8"), std::string::npos) << e;
    e = message_of([&] { shardtorch::checkpoint::save_file(b, {{bad, at::ones({1})}}); });
    EXPECT_NE(e.find("is not valid UTF-8"), std::string::npos) << e;
    EXPECT_FALSE(files::exists(b)) << "a refused write left a file";
  }
}

TEST(Safetensors, AFailedWriteLeavesThePreviousFileIntact) {
  const TempDir dir;
  auto path = (dir / "m.safetensors").string();
  shardtorch::checkpoint::save_file(path, {{"w", at::ones({4})}});
  std::vector<shardtorch::checkpoint::PendingTensor> pending = {
      {"w", at::kFloat, {4}, [] { return at::zeros({4}); }},
      {"v", at::kFloat, {4}, []() -> at::Tensor { throw std::runtime_error("killed while writing"); }},
  };
  EXPECT_THROW(shardtorch::checkpoint::write_file(path, pending), std::runtime_error);
  auto back = shardtorch::checkpoint::load_file(path);
  ASSERT_EQ(back.size(), 1u);
  EXPECT_TRUE(at::equal(back.at("w"), at::ones({4})));
  size_t regular = 0;
  for (const auto& name : files::list_directory(dir)) regular += files::is_regular_file(dir / name);
  EXPECT_EQ(regular, 1u) << "a temporary file was left behind";
}

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
    if (w.rank() == 0) shardtorch::checkpoint::save_file((dir / "expected.safetensors").string(),
                                                          std::vector<std::pair<std::string, at::Tensor>>(full.begin(), full.end()));
  });
  ASSERT_TRUE(save.ok) << save.summary();
  auto expected = shardtorch::checkpoint::load_file((dir / "expected.safetensors").string());
  shardtorch::checkpoint::Reader header(path);
  EXPECT_EQ(header.header().metadata.at("step"), "2");
  EXPECT_EQ(header.header().metadata.at("shardtorch_world_size"), "4");
  EXPECT_EQ(header.header().metadata.at("format"), "pt");  // what Hugging Face's loaders require
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
  EXPECT_EQ(shardtorch::checkpoint::Reader(path).header().tensors.size(),
            plain->named_parameters().size() + plain->named_buffers().size());
}

// Flat parameters of two dtypes: the file lays the double ones out first
// (aligned), yet the writer gathers the flats in the order the other ranks
// do. Gathering in file order paired rank 0's all-gather of l2 with the
// others' of l1.
TEST(FullStateDict, FlatParametersOfTwoDtypesAreGatheredInTheOrderOfEveryRank) {
  const TempDir dir;
  const std::string path = (dir / "mixed.safetensors").string();
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    MLP m;
    m->l2->to(torch::kDouble);
    shardtorch::shard(m, w);
    auto full = shardtorch::full_parameters(*m);
    shardtorch::save_full_state_dict(*m, path);
    if (w.rank() != 0) return;
    shardtorch::checkpoint::Reader file(path);
    for (const auto& rec : file.header().tensors)
      require((file.header().data_start + rec.begin) % shardtorch::checkpoint::dtype_size(rec.dtype) == 0,
              "'" + rec.name + "' is not aligned");
    for (const auto& [n, t] : full) require(at::equal(file.read(n), t), "'" + n + "' differs in the file");
    require(file.read("l2.lin.weight").scalar_type() == at::kDouble, "l2 is not double in the file");
  }, shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(10)));
  ASSERT_TRUE(r.ok) << r.summary();
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
      shardtorch::checkpoint::save_file(p, std::vector<std::pair<std::string, at::Tensor>>(edited.begin(), edited.end()));
      try {
        shardtorch::load_full_state_dict(*model, p);
      } catch (const std::exception& e) {
        require(std::string(e.what()).find(needle) != std::string::npos && std::string(e.what()).find(p) != std::string::npos,
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
    expect_error(shaped, "'l1.lin.bias' has shape [14] but the model's parameter has [13]");
    auto extra = sd;
    extra["l9.weight"] = at::zeros({1});
    expect_error(extra, "unexpected tensor 'l9.weight'");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// ---------------------------------------------------------------- sharded checkpoints

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
  EXPECT_LE(std::abs(size0 - size1), largest + 16384)
      << "rank 0 wrote " << size0 << " bytes, rank 1 " << size1 << " (the largest parameter and its state: " << largest
      << ")";
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
  EXPECT_NE(load_error(missing).find("shard file 'rank-1.safetensors' is missing"), std::string::npos) << load_error(missing);
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
  EXPECT_NE(load_error(truncated).find("'rank-0.safetensors' has 100 bytes"), std::string::npos) << load_error(truncated);
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
  auto renamed = edit_index("renamed",
                            std::regex("\\{(\"name\":\"[^\"]+\",\"kind\":\"param\",\"begin\":0,[^{}]*),\"tensor\":\"[^\"]+\"\\}"),
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
  const std::regex straddling("\"kind\":\"param\",\"begin\":([1-9][0-9]*),\"end\":([0-9]+)(,\"step\":[0-9]+,"
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
  auto shifted = edit_index("overlapping", straddling,
                            "\"kind\":\"param\",\"begin\":" + std::to_string(b - 1) + ",\"end\":" +
                                std::to_string(e_ - 1) + "$3");
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
        opt = shardtorch::ShardedOptimizer::make<shardtorch::FusedAdam>(*model,
                                                                        torch::optim::AdamOptions(1e-2).weight_decay(0.1));
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
    auto r = run_ranks(1, [&](World& w) {
      torch::manual_seed(round);
      auto model = gpt::GPT(gpt::Config{});
      shardtorch::shard(model, w);
      for (int step = 1;; ++step) {
        shardtorch::save_sharded_checkpoint(*model, nullptr, ckpt, 100 * (round + 1) + step);
        shardtorch::save_full_state_dict(*model, full, {{"step", std::to_string(step)}});
      }
    }, shardtorch::testing::RunOptions().timeout(delay));
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
    auto killed = run_ranks(2, [&](World& w) {
      if (!k.exchange) ::setenv("SHARDTORCH_CHECKPOINT_NO_EXCHANGE", "1", 1);
      torch::manual_seed(2);
      auto model = gpt::GPT(cfg);
      shardtorch::shard(model, w);
      if (w.rank() == k.victim) die_at(k.point);
      shardtorch::save_sharded_checkpoint(*model, nullptr, ckpt, 2);
    }, crash_run());
    ASSERT_EQ(killed.ranks[k.victim].signal, SIGKILL) << what << ": the save never reached the point\n" << killed.summary();
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
    return run_ranks(2, [&](World& w) {
      torch::manual_seed(seed);
      auto model = gpt::GPT(cfg);
      shardtorch::shard(model, w);
      if (kill_at && w.rank() == 0) die_at(kill_at);
      shardtorch::save_full_state_dict(*model, path, {{"seed", std::to_string(seed)}});
    }, crash_run());
  };
  for (const char* point : {"file partly written", "file written", "file synced", "file renamed"}) {
    auto first = save(1, nullptr);
    ASSERT_TRUE(first.ok) << first.summary();
    auto killed = save(2, point);
    ASSERT_EQ(killed.ranks[0].signal, SIGKILL) << point << ": the write never reached it\n" << killed.summary();
    ASSERT_FALSE(killed.ranks[1].timed_out) << point << ": rank 1 hung\n" << killed.summary();
    const bool renamed = std::string(point) == "file renamed";
    auto file = shardtorch::checkpoint::load_file(path);  // validates the whole file
    EXPECT_EQ(shardtorch::checkpoint::Reader(path).header().metadata.at("seed"), renamed ? "2" : "1") << point;
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

// The application's own resume state (data-loader position, epoch, ...)
// travels in the index: saved at 2 ranks, read back at 3; ranks that disagree
// fail alike, naming the key; checkpoints saved without it read back empty.
TEST(ShardedCheckpoint, UserStateRoundTripsAtAnotherWorldSizeAndMustAgreeAcrossRanks) {
  const TempDir dir;
  const std::string ckpt = (dir / "ckpt").string(), bare = (dir / "bare").string(), bad = (dir / "bad").string();
  const std::map<std::string, std::string> state{{"epoch", "3"}, {"samples_seen", "12000"}, {"rng", "seed=7;offset=42"}};
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

// Frozen parameters (the MLP's l2 bias) are saved and loaded under every
// strategy: under NoShard they used to be saved but not loaded (they kept
// the loading model's own values, silently). Under bf16 mixed precision they
// keep their fp32 values (NoShard used to keep only the bf16 copy it computes
// with, so a checkpoint rounded them), in sharded checkpoints and full state
// dicts alike. So is the buffer: the saver's `scale` holds values the loader's
// fresh model does not (exact in bf16), so a load that skipped buffers fails.
TEST(ShardedCheckpoint, FrozenParametersAndBuffersRoundTripUnderEveryStrategy) {
  const at::Tensor scale = at::arange(7, at::kFloat).mul(0.25).add(0.5);
  for (bool bf16 : {false, true}) {
    for (Strategy s : kAllStrategies) {
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
}

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

// A parameter with no elements has an empty flat parameter (or an empty slice
// of one) under every strategy: clipping skips it, summoning and both kinds
// of checkpoint carry it, and loading into a differently initialised model
// reproduces the saved parameters and optimizer state bitwise.
TEST(Checkpoint, AnEmptyParameterGoesThroughClippingSummonAndBothCheckpoints) {
  const TempDir dir;
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  struct Case {
    Strategy s;
    bool offload;
    bool bf16;
  };
  std::vector<Case> cases;
  for (auto s : kAllStrategies) cases.push_back({s, false, false});
  cases.push_back({Strategy::FullShard, true, false});
  cases.push_back({Strategy::FullShard, false, true});
  for (const auto& c : cases) {
    const std::string what = std::string(shardtorch::strategy_name(c.s)) + (c.offload ? "+offload" : "") +
                             (c.bf16 ? "+bf16" : "");
    const auto full = (dir / (what + ".safetensors")).string(), sharded = (dir / what).string();
    auto options = [&] {
      auto o = strategy_options(c.s, 2).cpu_offload(c.offload);
      if (c.bf16) o.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
      return o;
    };
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      WithEmpty m;
      auto sm = shardtorch::shard(m, w, options());
      auto opt = shardtorch::AdamW(*m, torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 2; ++step) {
        opt->zero_grad();
        (m(x.narrow(0, 2 * w.rank(), 2)).square().sum() * 2).backward();
        double norm2 = shardtorch::clip_grad_norm(*m, 1e9);
        double norm_inf = shardtorch::clip_grad_norm(*m, 1e9, INFINITY);
        require(std::isfinite(norm2) && norm2 > 0 && norm_inf > 0 && norm_inf <= norm2, "bad gradient norms");
        opt->step();
      }
      {
        shardtorch::FullParams scope(*m);
        require(m->b->none.sizes() == at::IntArrayRef({0, 3}), "the empty parameter changed shape");
        require(m->b->lin->weight.abs().sum().item<double>() > 0, "summoned weight is zero");
      }
      auto mine = shardtorch::full_parameters(*m);
      require(mine.count("b.none") && mine.at("b.none").numel() == 0, "full_parameters lost the empty parameter");
      shardtorch::save_full_state_dict(*m, full);
      shardtorch::save_sharded_checkpoint(*m, opt.get(), sharded, 2);

      torch::manual_seed(1);
      WithEmpty again;
      shardtorch::shard(again, w, options());
      auto opt2 = shardtorch::AdamW(*again, torch::optim::AdamWOptions(1e-2));
      require(shardtorch::load_sharded_checkpoint(*again, opt2.get(), sharded) == 2, "wrong step");
      auto loaded = shardtorch::full_parameters(*again);
      for (auto& [n, t] : mine) require(at::equal(loaded.at(n), t), n + " differs after the sharded checkpoint");
      // This rank's optimizer state, piece by piece (both models are laid out alike).
      const auto& had = opt->views().pieces();
      const auto& got = opt2->views().pieces();
      require(had.size() == got.size(), "the optimizers have different pieces");
      int compared = 0;
      for (size_t k = 0; k < had.size(); ++k) {
        auto a = opt->inner().state().find(had[k].view.unsafeGetTensorImpl());
        auto b = opt2->inner().state().find(got[k].view.unsafeGetTensorImpl());
        require((a == opt->inner().state().end()) == (b == opt2->inner().state().end()),
                had[k].name + ": optimizer state on one side only");
        if (a == opt->inner().state().end()) continue;
        auto& sa = static_cast<torch::optim::AdamWParamState&>(*a->second);
        auto& sb = static_cast<torch::optim::AdamWParamState&>(*b->second);
        require(sa.step() == sb.step() && at::equal(sa.exp_avg(), sb.exp_avg()) &&
                    at::equal(sa.exp_avg_sq(), sb.exp_avg_sq()),
                had[k].name + ": optimizer state differs after the sharded checkpoint (in its values or its shape)");
        ++compared;
      }
      require(compared > 0, "no optimizer state compared on rank " + std::to_string(w.rank()));
      torch::manual_seed(2);
      WithEmpty third;
      shardtorch::shard(third, w, options());
      shardtorch::load_full_state_dict(*third, full);
      auto from_full = shardtorch::full_parameters(*third);
      for (auto& [n, t] : mine) require(at::equal(from_full.at(n), t), n + " differs after the full state dict");
    });
    ASSERT_TRUE(r.ok) << what << ": " << r.summary();
    auto saved = shardtorch::read_sharded_checkpoint(sharded);
    ASSERT_TRUE(saved.count("b.none|param")) << what << ": the empty parameter is not listed";
    EXPECT_EQ(saved.at("b.none|param").numel(), 0) << what;
    EXPECT_GT(saved.at("b.lin.weight|exp_avg").abs().sum().item<double>(), 0) << what;
  }
}

// ---------------------------------------------------------------- failures: every rank alike, nothing half-done

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
    require(e.find("rank 1: ") != std::string::npos && e.find("'rank-1.safetensors' has 100 bytes") != std::string::npos,
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
    std::string e = failing_load(t, [&] { shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), w.rank() ? b : a); });
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
    require(e.find("'l1.lin.bias' has shape [13] in the checkpoint but the model's has [12]") != std::string::npos,
            "expected the shape error, got: " + e);
    e = failing_load(t, [&] { shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), extra); });
    require(e.find("unexpected tensor 'extra.") != std::string::npos, "expected the unexpected-tensor error, got: " + e);
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
    auto state_bytes = [&] { return shardtorch::sharded_model(*t.model).memory().cur(shardtorch::Mem::OptimizerState); };
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
    std::string e = message_of([&] { shardtorch::save_sharded_checkpoint(*t.model, nullptr, (dir / "a-file" / "ck").string(), 1); });
    require(e.find("save_sharded_checkpoint") != std::string::npos && e.find("rank 0: ") != std::string::npos,
            "expected every rank to fail naming rank 0, got: " + e);
    e = message_of([&] { shardtorch::save_sharded_checkpoint(*t.model, nullptr, (dir / "logs").string(), 1); });
    require(e.find("is not a shardtorch checkpoint") != std::string::npos, "expected a refusal, got: " + e);
    require(files::exists(dir / "logs" / "train.log"), "the directory's files were deleted");
    const std::string slash = (dir / "ck").string() + "/";
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), slash, 1);
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), slash, 2);
    require(shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), (dir / "ck").string()) == 2, "wrong step");
    require(!files::exists(dir / "ck" / ".shardtorch-tmp") && !files::exists(dir / "ck.shardtorch-tmp"),
            "a temporary directory was left");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A failed write of the index (here: the file-size limit, as a full disk
// would) is an error, and the previous checkpoint stays in place (a truncated
// index used to be published over it).
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
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), ckpt, 2);
    require(!files::exists(aside) && !files::exists(ckpt + ".shardtorch-tmp"), "left-overs after a save");
    require(shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), ckpt) == 2, "wrong step");
    w.barrier();
    if (w.rank() == 0) files::rename(ckpt, aside);  // as if killed between the two renames
    w.barrier();
    require(shardtorch::sharded_checkpoint_exists(ckpt), "the checkpoint set aside is not reported");
    require(shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), ckpt) == 2, "the previous checkpoint was not found");
    require(shardtorch::read_sharded_checkpoint(ckpt).count("l1.lin.weight|param"), "offline reading missed it");
    w.barrier();
    if (w.rank() == 0) files::create_directories(ckpt);  // an empty directory made by a launcher
    w.barrier();
    shardtorch::save_sharded_checkpoint(*t.model, t.opt.get(), ckpt, 3);
    require(shardtorch::load_sharded_checkpoint(*t.model, t.opt.get(), ckpt) == 3 && !files::exists(aside),
            "saving after the interruption");
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
    auto adagrad = shardtorch::ShardedOptimizer::make<torch::optim::Adagrad>(*t.model, torch::optim::AdagradOptions(0.1));
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
    require(shardtorch::load_sharded_checkpoint(*t.model, nullptr, ckpt) == 1, "the refused save replaced the checkpoint");
    t.model(torch::ones({2, 7})).sum().backward();
    adagrad->step();  // its state intact
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A full state dict's metadata keys starting shardtorch_ are the library's,
// and "format" is "pt": another value is refused on every rank before any
// collective, naming the key.
// A slow file system: rank 0's last write and fsync of a full state dict,
// or one rank's shard file, take longer than the collective timeout (1 s
// here). The others wait for them under WorldOptions::file_timeout (30
// minutes) instead of failing in the next collective; the collectives after
// the checkpoint get their own timeout back.
TEST(CheckpointFailures, ASlowWriterIsWaitedForUnderTheFileTimeout) {
  const TempDir dir;
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    MLP m;
    shardtorch::shard(m, w);
    auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
    const int slow = 0;
    for (int round = 0; round < 2; ++round) {
      // Rank `slow` takes 2.5 s over its file, once written.
      shardtorch::checkpoint::set_crash_hook([&](const std::string& p) {
        if (p == "file written" && w.rank() == slow) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      });
      if (round == 0) {
        shardtorch::save_full_state_dict(*m, (dir / "full.safetensors").string());
      } else {
        shardtorch::save_sharded_checkpoint(*m, opt.get(), (dir / "sharded").string(), 1);
      }
      shardtorch::checkpoint::set_crash_hook(nullptr);
      require(w.comm().timeout() == std::chrono::seconds(1), "the collective timeout was not restored");
    }
    // And without the allowance, the same wait fails naming the collective.
    std::string e = "no error";
    shardtorch::checkpoint::set_crash_hook([&](const std::string& p) {
      if (p == "file written" && w.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    });
    try {
      shardtorch::checkpoint::save_file((dir / ("plain" + std::to_string(w.rank()))).string(), {{"x", torch::ones({2})}});
      auto flag = torch::zeros({1});
      w.comm().all_reduce(flag, c10d::ReduceOp::SUM, "after a slow write");
    } catch (const std::exception& err) {
      e = err.what();
    }
    shardtorch::checkpoint::set_crash_hook(nullptr);
    require(w.rank() == 1 || e.find("after a slow write") != std::string::npos, "rank 0: " + e);
  }, shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(1)));
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(CheckpointFailures, ReservedFullStateDictMetadataIsRefused) {
  const TempDir dir;
  auto r = run_ranks(2, [&](World& w) {
    Trained t(w);
    const std::string path = (dir / "full.safetensors").string();
    std::string e = message_of([&] { shardtorch::save_full_state_dict(*t.model, path, {{"shardtorch_strategy", "x"}}); });
    require(e.find("metadata key 'shardtorch_strategy' is reserved") != std::string::npos, "expected a refusal, got: " + e);
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
    e = message_of([&] {
      shardtorch::save_sharded_checkpoint(*t.model, w.rank() == 0 ? t.opt.get() : nullptr, ckpt, 2);
    });
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

// Groups that differ in amsgrad: only the amsgrad group's parameters have a
// max_exp_avg_sq. Loading asked whether the checkpoint had any at all and
// then planned one for every parameter, failing with "not all saved (a
// missing shard?)". Each parameter's state now comes back as it was saved.
TEST(Checkpoint, OptimizerStateOfGroupsThatDifferInAmsgradRoundTrips) {
  const TempDir dir;
  for (auto s : {Strategy::FullShard, Strategy::NoShard}) {
    const std::string ckpt = (dir / shardtorch::strategy_name(s)).string();
    auto r = run_ranks(2, [&](World& w) {
      MLP m;
      shardtorch::shard(m, w, strategy_options(s, 2));
      auto make = [&] {
        return shardtorch::Adam(*m, torch::optim::AdamOptions(0.1),
                                {{{m->l1->lin->weight}, torch::optim::AdamOptions(0.1).amsgrad(true)}});
      };
      auto backward = [&](const std::unique_ptr<shardtorch::ShardedOptimizer>& opt) {
        opt->zero_grad();
        m(torch::ones({2, 7}) * (1 + w.rank())).square().sum().backward();
      };
      auto opt = make();
      backward(opt);
      opt->step();
      shardtorch::save_sharded_checkpoint(*m, opt.get(), ckpt, 1);
      auto resumed = make();
      require(shardtorch::load_sharded_checkpoint(*m, resumed.get(), ckpt) == 1, "wrong step");
      auto& a = opt->inner(), &b = resumed->inner();
      int with_max = 0;
      for (size_t g = 0; g < a.param_groups().size(); ++g) {
        for (size_t k = 0; k < a.param_groups()[g].params().size(); ++k) {
          auto* pa = a.param_groups()[g].params()[k].unsafeGetTensorImpl();
          auto* pb = b.param_groups()[g].params()[k].unsafeGetTensorImpl();
          require(a.state().count(pa) == b.state().count(pb), "state present on one side only");
          if (!a.state().count(pa)) continue;
          auto& sa = static_cast<torch::optim::AdamParamState&>(*a.state().at(pa));
          auto& sb = static_cast<torch::optim::AdamParamState&>(*b.state().at(pb));
          require(sa.step() == sb.step() && at::equal(sa.exp_avg(), sb.exp_avg()) &&
                      at::equal(sa.exp_avg_sq(), sb.exp_avg_sq()),
                  "moments differ after the load");
          require(sa.max_exp_avg_sq().defined() == sb.max_exp_avg_sq().defined() &&
                      (!sa.max_exp_avg_sq().defined() || at::equal(sa.max_exp_avg_sq(), sb.max_exp_avg_sq())),
                  "max_exp_avg_sq differs after the load (group " + std::to_string(g) + ")");
          with_max += sa.max_exp_avg_sq().defined();
        }
      }
      require(with_max <= 1, "max_exp_avg_sq outside the amsgrad group");
      backward(resumed);
      resumed->step();
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
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
    require(e.find("is in a parameter group with amsgrad, but the checkpoint has no max_exp_avg_sq") !=
                std::string::npos,
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
