// What is not a checkpoint is refused by every reader, at once and by name:
// a FIFO or a directory where a file should be (never waited on), names and
// metadata that are not UTF-8, dtypes that would be cast with loss, and
// indexes with impossible values or entries taken out. The offline reader
// and the loader refuse alike.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <fstream>
#include <regex>
#include <sstream>

#include "checkpoint_helpers.h"
#include "models.h"
#include "shardtorch/checkpoint.h"

using namespace testmodels;
using shardtorch::World;
using shardtorch::checkpoint::SafetensorsError;
using shardtorch::testing::run_ranks;

namespace {

// A unit with a parameter and an integer buffer (a step counter, an index
// table) whose dtypes a test chooses.
struct CountedImpl : torch::nn::Module {
  explicit CountedImpl(at::ScalarType count_dtype = at::kLong, double count = 5,
                       at::ScalarType param_dtype = at::kFloat)
      : l(register_module("l", Layer(4, 3, true))) {
    l->to(param_dtype);
    counts = register_buffer("counts", torch::full({2}, count, torch::TensorOptions().dtype(count_dtype)));
  }
  torch::Tensor forward(torch::Tensor x) { return l(x); }
  Layer l;
  torch::Tensor counts;
};
SHARDTORCH_MODULE(Counted);

// What `f` throws as a SafetensorsError (the library's checkpoint error);
// another exception type, or none, is reported as such.
std::string checkpoint_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const SafetensorsError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not a SafetensorsError: ") + e.what();
  }
  return "no error";
}

void require_has(const std::string& text, const std::string& needle) {
  require(text.find(needle) != std::string::npos, "'" + needle + "' is not in: " + text);
}

// Runs `body` in a process of its own that is killed after 30 s: a reader
// that blocks fails the test instead of hanging it.
void bounded(const std::function<void()>& body) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      1, [&](World&) { body(); }, shardtorch::testing::RunOptions().timeout(std::chrono::seconds(30)));
  ASSERT_TRUE(r.ok) << (r.ranks[0].timed_out ? "a reader blocked (killed after 30 s)\n" : "") << r.summary();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
}

void make_fifo(const std::string& p) {
  files::remove(p);
  require(::mkfifo(p.c_str(), 0600) == 0, "mkfifo " + p + " failed");
}

// A sharded checkpoint of the MLP from 2 ranks (FullShard, SGD with
// momentum, one step), saved at step 1.
std::string saved_mlp(const Path& dir) {
  const std::string ckpt = (dir / "ckpt").string();
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto model = MLP();
    shardtorch::shard(model, w);
    auto opt = shardtorch::SGD(*model, torch::optim::SGDOptions(0.1).momentum(0.9));
    model(torch::ones({2, 7}) * (1 + w.rank())).sum().backward();
    opt->step();
    shardtorch::save_sharded_checkpoint(*model, opt.get(), ckpt, 1);
  });
  require(r.ok, r.summary());
  return ckpt;
}

// The message of loading `ckpt` into the MLP at 1 rank (empty: it loaded).
std::string mlp_load_error(const std::string& ckpt) {
  auto r = run_ranks(
      1,
      [&](World& w) {
        auto model = MLP();
        shardtorch::shard(model, w);
        auto opt = shardtorch::SGD(*model, torch::optim::SGDOptions(0.1).momentum(0.9));
        shardtorch::load_sharded_checkpoint(*model, opt.get(), ckpt);
      },
      shardtorch::testing::RunOptions().timeout(std::chrono::seconds(30)));
  if (r.ok) return "";
  return r.ranks[0].timed_out ? "the load blocked" : r.ranks[0].message;
}

// A copy of `ckpt` as `name` beside it, its index.json edited by `edit`.
std::string with_index(const std::string& ckpt, const std::string& name,
                       const std::function<std::string(std::string)>& edit) {
  const std::string copy = files::join(files::parent_path(ckpt), name);
  files::remove_all(copy);
  files::copy_tree(ckpt, copy);
  const std::string before = read_text(copy + "/index.json");
  const std::string after = edit(before);
  require(after != before, name + ": the edit changed nothing");
  std::ofstream(copy + "/index.json", std::ios::trunc) << after;
  return copy;
}

std::string replace_first(const std::string& text, const std::string& pattern, const std::string& with) {
  return std::regex_replace(text, std::regex(pattern), with, std::regex_constants::format_first_only);
}

}  // namespace

// ---------------------------------------------------------------- a FIFO or a directory where a file should be

// Opening a FIFO to read waits for a writer: the safetensors reader (and
// load_file over it) used to open before it looked, and block forever.
TEST(NotACheckpoint, TheSafetensorsReaderRefusesAFifoADirectoryAndADeviceWithoutBlocking) {
  const TempDir dir;
  const std::string fifo = (dir / "model.safetensors").string();
  make_fifo(fifo);
  bounded([&] {
    for (const auto& [path, kind] : std::vector<std::pair<std::string, std::string>>{
             {fifo, "a FIFO"}, {dir.string(), "a directory"}, {"/dev/null", "a character device"}}) {
      std::string e = checkpoint_error([&] { shardtorch::checkpoint::Reader r(path); });
      require_has(e, "safetensors file '" + path + "': cannot open: is " + kind + ", not a regular file");
      e = checkpoint_error([&] { shardtorch::checkpoint::load_file(path); });
      require_has(e, "is " + kind + ", not a regular file");
    }
  });
}

TEST(NotACheckpoint, LoadFullStateDictRefusesAFifoWithoutBlocking) {
  const TempDir dir;
  const std::string fifo = (dir / "model.safetensors").string();
  make_fifo(fifo);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      2,
      [&](World& w) {
        auto model = MLP();
        shardtorch::shard(model, w);
        const auto before = shardtorch::full_parameters(*model);
        const std::string e = checkpoint_error([&] { shardtorch::load_full_state_dict(*model, fifo); });
        require_has(e, "rank 0: safetensors file '" + fifo + "': cannot open: is a FIFO, not a regular file");
        for (const auto& [n, v] : shardtorch::full_parameters(*model))
          require(at::equal(v, before.at(n)), n + " changed");
      },
      shardtorch::testing::RunOptions().timeout(std::chrono::seconds(30)));  // a blocked reader is killed
  ASSERT_TRUE(r.ok) << r.summary();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
}

// The index and every shard file: a FIFO index used to block the loader in
// its open (the shard files were checked with stat already).
TEST(NotACheckpoint, LoadShardedCheckpointRefusesAFifoIndexOrShardWithoutBlocking) {
  const TempDir dir;
  const std::string ckpt = saved_mlp(dir);
  for (const std::string file : {"index.json", "rank-1.safetensors"}) {
    const std::string copy = (dir / ("fifo-" + file)).string();
    files::copy_tree(ckpt, copy);
    make_fifo(copy + "/" + file);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string e = mlp_load_error(copy);  // killed after 30 s if it blocks
    EXPECT_NE(e.find("rank 0: "), std::string::npos) << e;
    EXPECT_NE(e.find(file + "'"), std::string::npos) << e;
    EXPECT_NE(e.find("is a FIFO, not a regular file"), std::string::npos) << e;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
  }
}

TEST(NotACheckpoint, ReadShardedCheckpointRefusesAFifoIndexOrShardWithoutBlocking) {
  const TempDir dir;
  const std::string ckpt = saved_mlp(dir);
  for (const std::string file : {"index.json", "rank-0.safetensors"}) {
    const std::string copy = (dir / ("fifo-" + file)).string();
    files::copy_tree(ckpt, copy);
    make_fifo(copy + "/" + file);
    bounded([&] {
      const std::string e = checkpoint_error([&] { shardtorch::read_sharded_checkpoint(copy); });
      require_has(e, copy);
      require_has(e, file + "'");
      require_has(e, "is a FIFO, not a regular file");
    });
  }
}

// A shard that is a directory: the offline reader threw std::runtime_error
// (from a file-size helper) where the loader gave the checkpoint error.
TEST(NotACheckpoint, AShardThatIsADirectoryIsTheCheckpointErrorForBothReaders) {
  const TempDir dir;
  const std::string ckpt = saved_mlp(dir);
  const std::string copy = (dir / "dir-shard").string();
  files::copy_tree(ckpt, copy);
  files::remove(copy + "/rank-1.safetensors");
  files::create_directories(copy + "/rank-1.safetensors");
  const std::string needle =
      "checkpoint '" + copy + "': shard file 'rank-1.safetensors' is a directory, not a regular file";
  const std::string offline = checkpoint_error([&] { shardtorch::read_sharded_checkpoint(copy); });
  EXPECT_NE(offline.find(needle), std::string::npos) << offline;
  const std::string loaded = mlp_load_error(copy);
  EXPECT_NE(loaded.find(needle), std::string::npos) << loaded;
}

// ---------------------------------------------------------------- names and metadata that are not UTF-8

// Python's safetensors refuses such a header; the reader accepted it (a bad
// metadata value loaded silently, a bad name failed for another reason).
TEST(NotACheckpoint, NamesAndMetadataThatAreNotUtf8AreRefusedOnReading) {
  const TempDir dir;
  const std::string p = (dir / "bad.safetensors").string();
  const std::string tensor = R"("t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  struct Bad {
    std::string bytes, shown;
  };
  for (const Bad& bad : {Bad{"\xFF", "\\xFF"}, Bad{"\xC0\x80", "\\xC0\\x80"}, Bad{"\xED\xA0\x80", "\\xED\\xA0\\x80"},
                         Bad{"w\xE2\x82", "w\\xE2\\x82"}}) {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"{\"" + bad.bytes + "\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
         "tensor name '" + bad.shown + "' is not valid UTF-8"},
        {"{\"__metadata__\":{\"note\":\"" + bad.bytes + "\"}," + tensor + "}",
         "__metadata__ value '" + bad.shown + "' of 'note' is not valid UTF-8"},
        {"{\"__metadata__\":{\"" + bad.bytes + "\":\"x\"}," + tensor + "}",
         "__metadata__ key '" + bad.shown + "' is not valid UTF-8"},
    };
    for (const auto& [json, needle] : cases) {
      write_raw(p, json, std::string(4, '\0'));
      const std::string e = checkpoint_error([&] { shardtorch::checkpoint::Reader r(p); });
      EXPECT_NE(e.find("safetensors file '" + p + "': " + needle), std::string::npos) << e;
    }
  }
  // Through load_full_state_dict: a file of the right tensors whose metadata
  // value is not UTF-8 loaded without a word.
  auto r = run_ranks(1, [&](World& w) {
    auto model = MLP();
    shardtorch::shard(model, w);
    const std::string good = (dir / "good.safetensors").string();
    shardtorch::save_full_state_dict(*model, good, {{"note", "fine"}});
    std::string bytes = read_text(good);
    const size_t at = bytes.find("\"fine\"");
    require(at != std::string::npos, "no metadata value in the file");
    bytes.replace(at + 1, 4, "f\xFFne");  // the same length: offsets stay right
    const std::string edited = (dir / "edited.safetensors").string();
    std::ofstream(edited, std::ios::binary) << bytes;
    require_has(checkpoint_error([&] { shardtorch::load_full_state_dict(*model, edited); }),
                "__metadata__ value 'f\\xFFne' of 'note' is not valid UTF-8");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// ---------------------------------------------------------------- dtypes: widening and float to float only

TEST(NotACheckpoint, TheCastRuleAllowsFloatToFloatAndWideningOnly) {
  using shardtorch::checkpoint::is_safe_cast;
  struct Case {
    at::ScalarType from, to;
    bool allowed;
  };
  const std::vector<Case> cases = {
      {at::kFloat, at::kFloat, true},    {at::kFloat, at::kDouble, true},  {at::kDouble, at::kFloat, true},
      {at::kFloat, at::kBFloat16, true}, {at::kHalf, at::kBFloat16, true}, {at::kInt, at::kLong, true},
      {at::kShort, at::kInt, true},      {at::kByte, at::kShort, true},    {at::kByte, at::kUInt16, true},
      {at::kBool, at::kByte, true},      {at::kBool, at::kFloat, true},    {at::kChar, at::kHalf, true},
      {at::kByte, at::kBFloat16, true},  {at::kUInt16, at::kFloat, true},  {at::kInt, at::kDouble, true},
      {at::kFloat, at::kLong, false},    {at::kFloat, at::kInt, false},    {at::kDouble, at::kBool, false},
      {at::kBFloat16, at::kByte, false}, {at::kLong, at::kInt, false},     {at::kInt, at::kShort, false},
      {at::kUInt64, at::kLong, false},   {at::kByte, at::kChar, false},    {at::kChar, at::kByte, false},
      {at::kInt, at::kUInt64, false},    {at::kLong, at::kDouble, false},  {at::kInt, at::kFloat, false},
      {at::kShort, at::kHalf, false},    {at::kByte, at::kBool, false},    {at::kFloat, at::kComplexFloat, false},
  };
  for (const auto& c : cases)
    EXPECT_EQ(is_safe_cast(c.from, c.to), c.allowed) << c10::toString(c.from) << " -> " << c10::toString(c.to);
}

namespace {
// Loads a full state dict or a sharded checkpoint saved from `from` into a
// Counted model (I64 counts of 5, F32 parameter) at 1 rank: the message, or
// "" when it loaded (then `loaded` holds the model's counts and weight).
struct CastCase {
  std::string name;
  std::function<Counted()> from;
  std::function<Counted()> into = [] { return Counted(); };
};

std::string load_counted(const CastCase& c, bool sharded, bool allow_lossy, const Path& dir,
                         std::map<std::string, at::Tensor>& loaded) {
  const std::string path = (dir / (c.name + (sharded ? "-sharded" : ".safetensors"))).string();
  const std::string out = (dir / (c.name + "-loaded.safetensors")).string();
  std::string message;
  auto r = run_ranks(1, [&](World& w) {
    auto source = c.from();
    shardtorch::shard(source, w);
    if (sharded)
      shardtorch::save_sharded_checkpoint(*source, nullptr, path, 1);
    else
      shardtorch::save_full_state_dict(*source, path);
    auto model = c.into();
    shardtorch::shard(model, w);
    const auto options = shardtorch::LoadOptions().allow_lossy_casts(allow_lossy);
    const auto before = shardtorch::full_parameters(*model);
    const at::Tensor counts = model->counts.clone();
    try {
      if (sharded)
        shardtorch::load_sharded_checkpoint(*model, nullptr, path, nullptr, options);
      else
        shardtorch::load_full_state_dict(*model, path, options);
    } catch (const SafetensorsError& e) {
      require(at::equal(model->counts, counts), "a refused load changed the counts");
      for (const auto& [n, v] : shardtorch::full_parameters(*model))
        require(at::equal(v, before.at(n)), n + " changed");
      throw;
    }
    shardtorch::save_full_state_dict(*model, out);  // what it holds now, for the parent
  });
  if (!r.ok) return r.ranks[0].message;
  loaded = shardtorch::checkpoint::load_file(out);
  return "";
}
}  // namespace

// A parameter or buffer saved in another dtype was cast silently, a float
// into an integer buffer too (2.7 became 2). Refused now unless asked for.
TEST(NotACheckpoint, LossyCastsAreRefusedByBothLoadersUnlessAllowed) {
  const TempDir dir;
  const CastCase f64_params{"f64-params", [] { return Counted(at::kLong, 5, at::kDouble); }};
  const CastCase i32_counts{"i32-counts", [] { return Counted(at::kInt, 7); }};
  const CastCase f32_counts{"f32-counts", [] { return Counted(at::kFloat, 2.7); }};
  const CastCase into_i32{"i64-into-i32", [] { return Counted(at::kLong, 3e9); }, [] { return Counted(at::kInt, 1); }};
  for (const bool sharded : {false, true}) {
    const std::string which = sharded ? "sharded: " : "full: ";
    std::map<std::string, at::Tensor> got;
    // Allowed without asking: float to float, an integer into a wider one.
    EXPECT_EQ(load_counted(f64_params, sharded, false, dir, got), "") << which;
    if (!got.empty()) EXPECT_EQ(got.at("l.lin.weight").scalar_type(), at::kFloat) << which;
    EXPECT_EQ(load_counted(i32_counts, sharded, false, dir, got), "") << which;
    if (!got.empty()) EXPECT_TRUE(at::equal(got.at("counts"), torch::full({2}, 7, torch::kLong))) << which;
    // Refused: a float into an integer buffer, an integer into a narrower one.
    std::string e = load_counted(f32_counts, sharded, false, dir, got);
    EXPECT_NE(e.find("'counts'"), std::string::npos) << which << e;
    EXPECT_NE(e.find("F32"), std::string::npos) << which << e;
    EXPECT_NE(e.find("can change values: refused (LoadOptions().allow_lossy_casts(true) casts anyway)"),
              std::string::npos)
        << which << e;
    EXPECT_NE(e.find("the model's " + std::string(sharded ? "is I64" : "buffer is I64")), std::string::npos)
        << which << e;
    e = load_counted(into_i32, sharded, false, dir, got);
    EXPECT_NE(e.find("I64"), std::string::npos) << which << e;
    EXPECT_NE(e.find("I32, and a cast from I64 to I32 can change values"), std::string::npos) << which << e;
    // Opted in: cast as copy_ casts.
    got.clear();
    EXPECT_EQ(load_counted(f32_counts, sharded, true, dir, got), "") << which;
    if (!got.empty()) EXPECT_TRUE(at::equal(got.at("counts"), torch::full({2}, 2, torch::kLong))) << which;
  }
}

// ---------------------------------------------------------------- the sharded index

// Values no save writes are refused, by the loader and the offline reader
// alike, naming index.json and the value.
TEST(NotACheckpoint, AnIndexWithImpossibleValuesIsRefusedByBothReaders) {
  const TempDir dir;
  const std::string ckpt = saved_mlp(dir);
  ASSERT_EQ(mlp_load_error(ckpt), "");
  struct Case {
    std::string name, pattern, with, needle;
  };
  const std::vector<Case> cases = {
      {"world-0", "\"world_size\":2", "\"world_size\":0", "world_size 0 is not a number of ranks"},
      {"world-negative", "\"world_size\":2", "\"world_size\":-2", "world_size -2 is not a number of ranks"},
      {"world-float", "\"world_size\":2", "\"world_size\":2.0", "world_size is 2E0, not an integer"},
      {"world-half", "\"world_size\":2", "\"world_size\":2.5", "world_size is 2.5E0, not an integer"},
      {"world-text", "\"world_size\":2", "\"world_size\":\"2\"", "world_size is \"2\", not an integer"},
      {"strategy", "\"strategy\":\"full_shard\"", "\"strategy\":\"zero9\"", "unknown strategy 'zero9'"},
      {"strategy-alias", "\"strategy\":\"full_shard\"", "\"strategy\":\"zero3\"", "unknown strategy 'zero3'"},
      {"version-0", "\"format_version\":1", "\"format_version\":0", "format_version 0 is not 1 or more"},
      {"format", "\"format\":\"shardtorch sharded checkpoint\"", "\"format\":\"other\"", "format is \"other\""},
      {"kind", "\"kind\":\"momentum_buffer\"", "\"kind\":\"momentum\"", "unknown kind 'momentum'"},
      {"entry-step", "(\"kind\":\"momentum_buffer\",\"begin\":[0-9]+,\"end\":[0-9]+,\"step\":)[0-9]+", "$1-1",
       "negative optimizer step -1"},
      {"file-rank", "\"name\":\"rank-1.safetensors\"", "\"name\":\"rank-2.safetensors\"",
       "file 'rank-2.safetensors' is not rank-R.safetensors for a rank R of the 2 that saved"},
      {"file-name", "\"name\":\"rank-1.safetensors\"", "\"name\":\"notes.txt\"", "file 'notes.txt' is not rank-R"},
      {"file-twice", "\"name\":\"rank-1.safetensors\"", "\"name\":\"rank-0.safetensors\"",
       "file 'rank-0.safetensors' is listed twice"},
      {"size", "(\"name\":\"rank-0.safetensors\",\"size\":)[0-9]+", "$1-8",
       "the size of 'rank-0.safetensors' is negative"},
      {"checksum", "\"checksum\":\"xxh3_64:[0-9a-f]+\"", "\"checksum\":\"md5:0\"", "is not xxh3_64:HEX or fnv1a64:HEX"},
      {"shape", "(\"shapes\":\\{\"[^\"]+\":\\[)([0-9]+)", "$1$2.0", "not an integer"},
      {"rows-0", "(\"kind\":\"param\",\"begin\":[0-9]+,\"end\":[0-9]+)", "$1,\"rows\":0,\"stride\":0",
       "rows 0 is not 1 or more"},
      {"rows-overlap", "(\"kind\":\"param\",\"begin\":[0-9]+,\"end\":[0-9]+)", "$1,\"rows\":2,\"stride\":1",
       "rows 2 of stride 1 from ["},
      {"rows-past-2^63", "(\"kind\":\"param\",\"begin\":[0-9]+,\"end\":[0-9]+)",
       "$1,\"rows\":3,\"stride\":4611686018427387904", "run past 2^63"},
      {"rows-in-format-1", "(\"kind\":\"param\",\"begin\":[0-9]+,\"end\":[0-9]+)", "$1,\"rows\":2,\"stride\":1000000",
       "format_version 1 does not have"},
  };
  for (const auto& c : cases) {
    const std::string copy =
        with_index(ckpt, c.name, [&](std::string t) { return replace_first(t, c.pattern, c.with); });
    const std::string index = copy + "/index.json";
    for (const auto& e : {mlp_load_error(copy), checkpoint_error([&] { shardtorch::read_sharded_checkpoint(copy); })}) {
      EXPECT_NE(e.find("checkpoint index '" + index + "'"), std::string::npos) << c.name << ": " << e;
      EXPECT_NE(e.find(c.needle), std::string::npos) << c.name << ": " << e;
    }
  }
  // Every strategy a save records reads back.
  for (const auto s :
       {shardtorch::Strategy::FullShard, shardtorch::Strategy::ShardGradOp, shardtorch::Strategy::OptimizerOnly,
        shardtorch::Strategy::NoShard, shardtorch::Strategy::HybridShard}) {
    const std::string name = shardtorch::strategy_name(s);
    const std::string copy = with_index(ckpt, "as-" + name, [&](std::string t) {
      return name == "full_shard" ? replace_first(t, "\"world_size\":2", "\"world_size\":2 ")
                                  : replace_first(t, "\"strategy\":\"full_shard\"", "\"strategy\":\"" + name + "\"");
    });
    EXPECT_EQ(checkpoint_error([&] { shardtorch::read_sharded_checkpoint(copy); }), "no error") << name;
  }
}

// A tensor whose entries were taken out of the index: the loader refused
// the directory, the offline reader left the tensor out without a word; and
// with only a parameter's momentum entries gone, the loader too dropped its
// state silently. Both refuse, naming the file and the tensor.
TEST(NotACheckpoint, BothReadersRefuseATensorWhoseEntriesWereTakenOutOfTheIndex) {
  const TempDir dir;
  const std::string ckpt = saved_mlp(dir);
  auto without = [&](const std::string& name, const std::string& kinds) {
    return with_index(ckpt, "without-" + name + "-" + kinds, [&](std::string t) {
      const std::regex entry("\\{\"name\":\"" + std::regex_replace(name, std::regex("\\."), "\\.") + "\",\"kind\":\"(" +
                             kinds + ")\"[^{}]*\\},?");
      t = std::regex_replace(t, entry, "");
      return std::regex_replace(t, std::regex(",\\]"), "]");
    });
  };
  for (const auto& [name, kinds] : std::vector<std::pair<std::string, std::string>>{
           {"l2.lin.weight", "param|momentum_buffer"}, {"l1.lin.weight", "momentum_buffer"}, {"scale", "buffer"}}) {
    const std::string copy = without(name, kinds);
    const std::string needle = "which the index does not list";
    for (const auto& e : {mlp_load_error(copy), checkpoint_error([&] { shardtorch::read_sharded_checkpoint(copy); })}) {
      EXPECT_NE(e.find(name + "|"), std::string::npos) << name << " " << kinds << ": " << e;
      EXPECT_NE(e.find(needle), std::string::npos) << name << " " << kinds << ": " << e;
    }
  }
}
