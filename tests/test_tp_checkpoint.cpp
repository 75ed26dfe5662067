// Checkpoints of a tensor-parallel model: the example GPT trained at
// tp 2 x dp 2 saves under the unsplit model's names and shapes, and what it
// saved loads at other layouts (tp 1 x dp 4, tp 4 x dp 1, the unsplit model)
// bitwise.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>

#include "reference.h"
#include "shardtorch/dcp_checkpoint.h"
#include "shardtorch/hf_checkpoint.h"
#include "shardtorch/log.h"
#include "shardtorch/checkpoint/safetensors.h"
#include "shardtorch/pipeline_checkpoint.h"
#include "shardtorch/snapshot.h"
#include "temp_dir.h"
#include "tp_helpers.h"

using namespace testmodels;
using namespace tptest;
using shardtorch::DeviceMesh;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

constexpr int kSteps = 2;
torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-3).eps(1e-6); }

// A layout of the example GPT: split over tp (none: the unsplit model),
// sharded over dp.
struct Layout {
  int tp, dp;
  Strategy strategy;
  bool split = true;
  bool sequence_parallel = false;
  bool deferred = false;  // built deferred, its construction skipped (the checkpoint gives the values)
};

std::string describe(const Layout& l) {
  return (l.split ? "tp " + std::to_string(l.tp) + " x " : std::string("unsplit, ")) + "dp " + std::to_string(l.dp) +
         " " + shardtorch::strategy_name(l.strategy) + (l.deferred ? " deferred" : "");
}

// One rank's model at `l`: built from seed 0, split, sharded.
struct Built {
  std::shared_ptr<DeviceMesh> mesh;
  gpt::GPT model{nullptr};
  std::map<std::string, torch::Tensor> params;  // its own tensors, for their placements
  std::shared_ptr<World> tp() const { return (*mesh)["tp"]; }
};

Built build(World& w, const Layout& l) {
  Built b;
  b.mesh = DeviceMesh::create(w.shared_from_this(), {{"dp", l.dp}, {"tp", l.tp}});
  torch::manual_seed(0);
  if (l.deferred) {
    b.model = shardtorch::deferred([] { return gpt::GPT(tp_config()); });
    shardtorch::skip_deferred_init(*b.model);
  } else {
    b.model = gpt::GPT(tp_config());
    prepare(b.model);
  }
  if (l.split) shardtorch::parallelize(*b.model, b.tp(), gpt::tp_plan(tp_config(), l.sequence_parallel));
  shardtorch::shard(b.model, (*b.mesh)["dp"], strategy_options(l.strategy, l.dp));
  b.params = own_params(*b.model);
  return b;
}

// kSteps of AdamW on this rank's share of the batch.
void train(Built& b, shardtorch::ShardedOptimizer& opt, const Layout& l) {
  const auto x = tokens();
  const int64_t per = kBatch / l.dp, d = b.mesh->coordinate("dp");
  auto mine = x.narrow(0, d * per, per);
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    auto logits = b.model(mine);
    (l.split ? gpt::lm_loss_tp(logits, mine, b.tp()) : gpt::lm_loss(logits, mine)).backward();
    opt.step();
  }
}

// Collective over the mesh: the model's parameters, whole, by name.
std::map<std::string, torch::Tensor> whole_params(Built& b) {
  return whole(testref::full_parameters(*b.model), b.params, *b.tp());
}

// Every tensor of the file, by name.
std::map<std::string, torch::Tensor> file_tensors(const std::string& path) {
  shardtorch::checkpoint::Reader reader(path);
  std::map<std::string, torch::Tensor> out;
  for (const auto& n : reader.names()) out[n] = reader.read(n);
  return out;
}

// Every tensor of `got` is in `want`, bitwise (`want` may hold more: a tied
// parameter's other names).
void require_bitwise(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want,
                     const std::string& what) {
  require(!got.empty(), what + ": nothing to compare");
  for (const auto& [n, t] : got) {
    auto it = want.find(n);
    require(it != want.end(), what + ": '" + n + "' is not in the checkpoint");
    require(it->second.sizes() == t.sizes(), what + ": '" + n + "' has the wrong shape");
    require(torch::equal(it->second.to(t.scalar_type()), t), what + ": '" + n + "' differs");
  }
}

const Layout kSaver{2, 2, Strategy::FullShard};

// The example GPT pipelined at pp 2 x dp 1 x tp 2 on this rank, split by
// `plan`, its stages under `strategy`, with its AdamW.
struct TpPiped {
  std::shared_ptr<DeviceMesh> mesh;
  gpt::GPT model{nullptr};
  std::unique_ptr<shardtorch::Pipeline> pipe;
  std::unique_ptr<shardtorch::ShardedOptimizer> opt;

  TpPiped(World& w, const shardtorch::TpPlan& plan, Strategy strategy = Strategy::FullShard) {
    mesh = DeviceMesh::create(w.shared_from_this(), {{"pp", 2}, {"dp", 1}, {"tp", 2}});
    torch::manual_seed(0);
    model = gpt::GPT(tp_config());
    shardtorch::parallelize(*model, (*mesh)["tp"], plan);
    pipe = std::make_unique<shardtorch::Pipeline>(
        gpt::pipeline_layers(model), mesh,
        shardtorch::PipelineOptions().microbatches(2).shard(shardtorch::ShardOptions().strategy(strategy)));
    opt = shardtorch::AdamW(pipe->module(), adamw());
  }
  // This stage's parameters, whole, are `saved`'s (the tied head the token
  // embedding's, saved once), bitwise.
  void require_saved(const std::map<std::string, torch::Tensor>& saved, const std::string& what) {
    const auto got = whole(testref::full_parameters(pipe->module()), own_params(pipe->module()), *(*mesh)["tp"]);
    require(!got.empty(), what + ": no parameters on this stage");
    for (const auto& [n, t] : got) {
      const std::string name = n == "head.weight" ? "tok_emb.weight" : n;
      require(saved.count(name) && torch::equal(t, saved.at(name)), what + ": '" + n + "' differs");
    }
  }
};

// The saver's full state dict, written once for the suite.
class TpFullStateDict : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("shardtorch-tp-ckpt");
    auto r = run_ranks(4, [&](World& w) {
      Built b = build(w, kSaver);
      auto opt = shardtorch::AdamW(*b.model, adamw());
      train(b, *opt, kSaver);
      shardtorch::ProgressUpdate last;
      shardtorch::set_progress_callback([&](const shardtorch::ProgressUpdate& u) { last = u; });
      shardtorch::save_full_state_dict(*b.model, path());
      shardtorch::set_progress_callback(nullptr);
      if (w.rank() == 0)
        std::ofstream(progress_path()) << last.operation << ' ' << last.finished << ' ' << last.bytes_done << ' '
                                       << last.bytes_total;
    });
    ASSERT_TRUE(r.ok) << r.summary();
  }
  static void TearDownTestSuite() { delete dir_; }
  static std::string path() { return *dir_ / "full.safetensors"; }
  static std::string progress_path() { return *dir_ / "progress.txt"; }  // rank 0's last update of the save
  static TempDir* dir_;
};
TempDir* TpFullStateDict::dir_ = nullptr;

// Rank 0, which writes the file, reports its bytes of the tensors' total,
// every tensor's (it reported a total of 0, not known, and only its own
// count of tensors).
TEST_F(TpFullStateDict, RankZeroReportsTheBytesOfEveryTensorItWrites) {
  std::ifstream in(progress_path());
  std::string operation;
  bool finished = false;
  int64_t done = -1, total = -1;
  in >> operation >> finished >> done >> total;
  int64_t bytes = 0;
  for (const auto& [name, t] : file_tensors(path())) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  EXPECT_EQ(operation, "save_full_state_dict");
  EXPECT_TRUE(finished);
  EXPECT_GT(bytes, 0);
  EXPECT_EQ(total, bytes);
  EXPECT_GE(done, bytes);  // the file's bytes: the header too
}

// The unsplit model's names and shapes; its values those of one process
// trained the same way (a slice in the wrong place would be far off).
TEST_F(TpFullStateDict, HoldsTheUnsplitModelsNamesShapesAndValues) {
  torch::manual_seed(0);
  gpt::GPT ref(tp_config());
  prepare(ref);
  auto params = unique_tensors(*ref);
  torch::optim::AdamW opt(params, adamw());
  const auto x = tokens();
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    gpt::lm_loss(ref(x), x).backward();
    opt.step();
  }
  const auto saved = file_tensors(path());
  for (const auto& item : ref->named_parameters()) {
    auto it = saved.find(item.key());
    ASSERT_NE(it, saved.end()) << item.key();
    ASSERT_EQ(it->second.sizes(), item.value().sizes()) << item.key();
    const double scale = item.value().abs().max().item<double>() + 1e-12;
    EXPECT_LE((it->second - item.value()).abs().max().item<double>() / scale, 1e-5) << item.key();
  }
  for (const auto& item : ref->named_buffers()) EXPECT_TRUE(saved.count(item.key())) << item.key();
  EXPECT_EQ(saved.size(), ref->named_parameters().size() + ref->named_buffers().size());
}

// Every layout reads back exactly what was saved, also into a model built
// deferred (each rank then allocates only its slices' shards).
TEST_F(TpFullStateDict, LoadsBitwiseAtOtherLayoutsAndIntoTheUnsplitModel) {
  const auto saved = file_tensors(path());
  for (const Layout& l : {Layout{2, 2, Strategy::ShardGradOp, true, true}, Layout{1, 4, Strategy::FullShard},
                          Layout{4, 1, Strategy::NoShard}, Layout{2, 2, Strategy::FullShard, true, false, true},
                          Layout{1, 1, Strategy::NoShard, false}, Layout{1, 2, Strategy::FullShard, false}}) {
    auto r = run_ranks(l.tp * l.dp, [&](World& w) {
      Built b = build(w, l);
      shardtorch::load_full_state_dict(*b.model, path());
      require_bitwise(whole_params(b), saved, describe(l));
    });
    EXPECT_TRUE(r.ok) << describe(l) << ": " << r.summary();
  }
}

// Saved at another layout, the file is the same bytes of tensors.
TEST_F(TpFullStateDict, ARoundTripThroughAnotherLayoutSavesTheSameTensors) {
  const Layout l{4, 1, Strategy::NoShard};
  auto r = run_ranks(4, [&](World& w) {
    Built b = build(w, l);
    shardtorch::load_full_state_dict(*b.model, path());
    shardtorch::save_full_state_dict(*b.model, *dir_ / "again.safetensors");
  });
  ASSERT_TRUE(r.ok) << r.summary();
  const auto again = file_tensors(*dir_ / "again.safetensors");
  EXPECT_EQ(again.size(), file_tensors(path()).size());
  auto rr = run_ranks(1, [&](World&) { require_bitwise(again, file_tensors(path()), "tp 4 x dp 1's save"); });
  EXPECT_TRUE(rr.ok) << rr.summary();
}

// 3-D: pipeline stages of the split model load the file and save it again,
// every rank of pp 2 x dp 1 x tp 2 taking part.
TEST_F(TpFullStateDict, PipelineStagesOfTheSplitModelLoadAndSaveTheSameTensors) {
  auto r = run_ranks(4, [&](World& w) {
    TpPiped p(w, gpt::tp_plan(tp_config(), /*sequence_parallel=*/true));
    shardtorch::load_full_state_dict(*p.pipe, path());
    shardtorch::save_full_state_dict(*p.pipe, *dir_ / "pipeline.safetensors");
  });
  ASSERT_TRUE(r.ok) << r.summary();
  const auto saved = file_tensors(path()), again = file_tensors(*dir_ / "pipeline.safetensors");
  EXPECT_EQ(again.size(), saved.size());
  auto rr = run_ranks(1, [&](World&) { require_bitwise(again, saved, "pp 2 x dp 1 x tp 2's save"); });
  EXPECT_TRUE(rr.ok) << rr.summary();
}

// One more step of `l`'s training (as train()'s).
void one_step(Built& b, shardtorch::ShardedOptimizer& opt, const Layout& l) {
  const auto x = tokens();
  const int64_t per = kBatch / l.dp, d = b.mesh->coordinate("dp");
  auto mine = x.narrow(0, d * per, per);
  opt.zero_grad();
  auto logits = b.model(mine);
  (l.split ? gpt::lm_loss_tp(logits, mine, b.tp()) : gpt::lm_loss(logits, mine)).backward();
  opt.step();
}

void save_tensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors) {
  std::vector<std::pair<std::string, torch::Tensor>> list(tensors.begin(), tensors.end());
  shardtorch::checkpoint::save_file(path, list);
}

// Both hold the same keys, each bitwise the same.
void require_same(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want,
                  const std::string& what) {
  require(got.size() == want.size(),
          what + ": " + std::to_string(got.size()) + " tensors, not " + std::to_string(want.size()));
  require_bitwise(got, want, what);
}

// The saver's sharded checkpoint (with user state) and DCP checkpoint, both
// with AdamW's state, after kSteps; its parameters whole then, and after one
// more step. Written once, by the first suite that reads them.
class TpSaved : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!dir_) {
      dir_ = std::make_unique<TempDir>("shardtorch-tp-saved");
      auto r = run_ranks(4, [&](World& w) {
        Built b = build(w, kSaver);
        auto opt = shardtorch::AdamW(*b.model, adamw());
        train(b, *opt, kSaver);
        shardtorch::save_sharded_checkpoint(*b.model, opt.get(), ckpt(), kSteps, {{"data", "tp"}});
        const auto report = shardtorch::save_dcp_checkpoint(*b.model, opt.get(), dcp());
        require(report.files.size() == 4, std::to_string(report.files.size()) + " data files, not one per rank");
        const auto saved = whole_params(b);
        one_step(b, *opt, kSaver);
        const auto after = whole_params(b);
        if (w.rank() == 0) save_tensors(saved_path(), saved), save_tensors(after_path(), after);
      });
      if (!r.ok) error_ = r.summary();
    }
    ASSERT_EQ(error_, "") << "the saver's run";
  }
  static std::string ckpt() { return *dir_ / "ckpt"; }
  static std::string dcp() { return *dir_ / "dcp"; }
  static std::string saved_path() { return *dir_ / "saved.safetensors"; }
  static std::string after_path() { return *dir_ / "after.safetensors"; }
  static std::unique_ptr<TempDir> dir_;
  static std::string error_;
};
std::unique_ptr<TempDir> TpSaved::dir_;
std::string TpSaved::error_;

class TpShardedCheckpoint : public TpSaved {};

// The index records the unsplit model's shapes, and its entries are ranges
// of the whole tensors: read back, the parameters are the saver's, whole.
TEST_F(TpShardedCheckpoint, HoldsTheUnsplitModelsNamesShapesAndValues) {
  torch::manual_seed(0);
  gpt::GPT ref(tp_config());
  const auto read = shardtorch::read_sharded_checkpoint(ckpt());
  std::map<std::string, torch::Tensor> params;
  size_t states = 0;
  for (const auto& [key, t] : read) {
    const auto bar = key.find('|');
    const std::string name = key.substr(0, bar), kind = key.substr(bar + 1);
    if (kind == "param") params[name] = t;
    if (kind == "exp_avg") ++states;
  }
  for (const auto& item : ref->named_parameters()) {
    auto it = read.find(item.key() + "|param");
    if (it == read.end()) continue;  // a tied name saved under its other name
    EXPECT_EQ(it->second.sizes(), item.value().sizes()) << item.key();
  }
  for (const auto& item : ref->named_buffers()) {
    ASSERT_TRUE(read.count(item.key() + "|buffer")) << item.key();
    EXPECT_EQ(read.at(item.key() + "|buffer").sizes(), item.value().sizes()) << item.key();
  }
  const auto saved = file_tensors(saved_path());
  EXPECT_EQ(states, saved.size());
  auto r = run_ranks(1, [&](World&) { require_same(params, saved, "the checkpoint's parameters"); });
  EXPECT_TRUE(r.ok) << r.summary();
}

// A model split over a tensor-parallel group of one holds each parameter
// whole: its checkpoint has as many entries as the unsplit model's (a
// rowwise weight was saved as one entry per row), and loads back bitwise.
TEST_F(TpShardedCheckpoint, AGroupOfOneSavesWholeRangesLikeTheUnsplitModel) {
  const TempDir dir("shardtorch-tp-one");
  const std::string split = dir / "split", unsplit = dir / "unsplit";
  auto r = run_ranks(2, [&](World& w) {
    for (bool is_split : {true, false}) {
      Layout l{1, 2, Strategy::FullShard};
      l.split = is_split;
      Built b = build(w, l);
      auto opt = shardtorch::AdamW(*b.model, adamw());
      train(b, *opt, l);
      shardtorch::save_sharded_checkpoint(*b.model, opt.get(), is_split ? split : unsplit, kSteps);
      if (!is_split) continue;
      const auto before = whole_params(b);
      Built again = build(w, l);
      auto opt2 = shardtorch::AdamW(*again.model, adamw());
      shardtorch::load_sharded_checkpoint(*again.model, opt2.get(), split);
      require_bitwise(whole_params(again), before, "loaded at tp 1");
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
  auto entries = [](const std::string& ckpt) {
    std::ifstream in(ckpt + "/index.json");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    size_t n = 0;
    for (size_t at = text.find("\"tensor\""); at != std::string::npos; at = text.find("\"tensor\"", at + 1)) ++n;
    return n;
  };
  EXPECT_GT(entries(unsplit), 0u);
  EXPECT_EQ(entries(split), entries(unsplit));
}

// A row-wise split weight's slice is saved as blocks of rows, not as an
// entry per row (an index of a large model ran to millions of entries): at
// tp 2 x dp 2, each rank's piece of a slice is at most a partial first row,
// whole rows and a partial last row, so each weight and each moment has at
// most 12 entries, whatever its number of rows.
TEST_F(TpShardedCheckpoint, ARowwiseSplitWeightIsSavedInBlocksOfRowsNotAnEntryPerRow) {
  std::ifstream in(ckpt() + "/index.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"format_version\":2"), std::string::npos) << text.substr(0, 200);
  EXPECT_NE(text.find("\"rows\":"), std::string::npos);
  torch::manual_seed(0);
  gpt::GPT ref(tp_config());
  const int64_t rows = ref->named_parameters()["blocks.0.fc2.weight"].size(0);
  ASSERT_GT(rows, 12);
  for (const std::string name : {"blocks.0.proj.weight", "blocks.1.fc2.weight"})
    for (const std::string kind : {"param", "exp_avg", "exp_avg_sq"}) {
      const std::string key = "\"name\":\"" + name + "\",\"kind\":\"" + kind + "\"";
      size_t n = 0;
      for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at + 1)) ++n;
      EXPECT_GE(n, 2u) << name << " " << kind;
      EXPECT_LE(n, 12u) << name << " " << kind;
    }
}

// Loaded at the saver's layout, training goes on as if never stopped.
TEST_F(TpShardedCheckpoint, ResumesBitwiseAtTheSameLayout) {
  const auto after = file_tensors(after_path());
  auto r = run_ranks(4, [&](World& w) {
    Built b = build(w, kSaver);
    auto opt = shardtorch::AdamW(*b.model, adamw());
    std::map<std::string, std::string> user;
    require(shardtorch::load_sharded_checkpoint(*b.model, opt.get(), ckpt(), &user) == kSteps, "the saved step");
    require(user.at("data") == "tp", "the saved user state");
    one_step(b, *opt, kSaver);
    require_bitwise(whole_params(b), after, "one step after the load");
  });
  EXPECT_TRUE(r.ok) << r.summary();
}

// Every layout loads the parameters and the optimizer's state bitwise: its
// own save of them is the same tensors.
TEST_F(TpShardedCheckpoint, LoadsBitwiseAtOtherLayoutsAndIntoTheUnsplitModel) {
  const auto saved = file_tensors(saved_path());
  const auto all = shardtorch::read_sharded_checkpoint(ckpt());
  int k = 0;
  for (const Layout& l :
       {Layout{1, 4, Strategy::FullShard}, Layout{4, 1, Strategy::NoShard}, Layout{1, 1, Strategy::NoShard, false}}) {
    const std::string again = *dir_ / ("again-" + std::to_string(k++));
    auto r = run_ranks(l.tp * l.dp, [&](World& w) {
      Built b = build(w, l);
      auto opt = shardtorch::AdamW(*b.model, adamw());
      shardtorch::load_sharded_checkpoint(*b.model, opt.get(), ckpt());
      require_bitwise(whole_params(b), saved, describe(l));
      shardtorch::save_sharded_checkpoint(*b.model, opt.get(), again, kSteps);
    });
    ASSERT_TRUE(r.ok) << describe(l) << ": " << r.summary();
    auto rr = run_ranks(1, [&](World&) { require_same(shardtorch::read_sharded_checkpoint(again), all, describe(l)); });
    EXPECT_TRUE(rr.ok) << describe(l) << ": " << rr.summary();
  }
}

// Pipeline stages split over tp (pp 2 x tp 2) load it, each stage its
// parameters bitwise and its optimizer state, and save it again the same.
TEST_F(TpShardedCheckpoint, LoadsIntoTensorParallelPipelineStagesAndSavesTheSameAgain) {
  const auto saved = file_tensors(saved_path());
  const auto all = shardtorch::read_sharded_checkpoint(ckpt());
  const std::string again = *dir_ / "again-pipeline";
  auto r = run_ranks(4, [&](World& w) {
    TpPiped p(w, gpt::tp_plan(tp_config()));
    shardtorch::load_sharded_checkpoint(*p.pipe, p.opt.get(), ckpt());
    p.require_saved(saved, "pp 2 x tp 2");
    shardtorch::save_sharded_checkpoint(*p.pipe, p.opt.get(), again, kSteps);
  });
  ASSERT_TRUE(r.ok) << r.summary();
  auto rr = run_ranks(1, [&](World&) { require_same(shardtorch::read_sharded_checkpoint(again), all, "pp 2 x tp 2"); });
  EXPECT_TRUE(rr.ok) << rr.summary();
}

// Every tensor of the Hugging Face layout in `dir`, by name; each in one file.
std::map<std::string, torch::Tensor> hf_tensors_in(const std::string& dir) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& f : files::list_directory(dir)) {
    if (f.rfind("model-", 0) != 0) continue;
    for (auto& [n, t] : file_tensors(dir + "/" + f)) require(out.emplace(n, t).second, n + " in two files");
  }
  return out;
}

// The saver's Hugging Face layout (in files of at most 16 KiB) after kSteps,
// and its parameters whole then.
class TpHfCheckpoint : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("shardtorch-tp-hf");
    auto r = run_ranks(4, [&](World& w) {
      Built b = build(w, kSaver);
      auto opt = shardtorch::AdamW(*b.model, adamw());
      train(b, *opt, kSaver);
      auto report = shardtorch::save_hf_checkpoint(*b.model, hf(), shardtorch::HfSaveOptions().max_file_bytes(16384));
      require(report.files.size() >= 2, "only " + std::to_string(report.files.size()) + " files");
      const auto saved = whole_params(b);
      if (w.rank() == 0) save_tensors(saved_path(), saved);
    });
    ASSERT_TRUE(r.ok) << r.summary();
  }
  static void TearDownTestSuite() { delete dir_; }
  static std::string hf() { return *dir_ / "hf"; }
  static std::string saved_path() { return *dir_ / "saved.safetensors"; }
  static TempDir* dir_;
};
TempDir* TpHfCheckpoint::dir_ = nullptr;

// The files hold the unsplit model's tensors, whole, each once (the tied
// head under the embedding's name): its parameters the saver's, its buffers.
TEST_F(TpHfCheckpoint, HoldsTheUnsplitModelsNamesShapesAndValues) {
  torch::manual_seed(0);
  gpt::GPT ref(tp_config());
  const auto held = hf_tensors_in(hf());
  const auto saved = file_tensors(saved_path());
  auto r = run_ranks(1, [&](World&) { require_bitwise(held, saved, "the Hugging Face layout"); });
  EXPECT_TRUE(r.ok) << r.summary();
  for (const auto& item : ref->named_parameters())
    if (held.count(item.key())) EXPECT_EQ(held.at(item.key()).sizes(), item.value().sizes()) << item.key();
  for (const auto& item : ref->named_buffers()) {
    ASSERT_TRUE(held.count(item.key())) << item.key();
    EXPECT_EQ(held.at(item.key()).sizes(), item.value().sizes()) << item.key();
  }
  EXPECT_EQ(held.size(), saved.size() + ref->named_buffers().size());
}

// Every layout loads it bitwise, a slice reading only its own elements.
TEST_F(TpHfCheckpoint, LoadsBitwiseAtOtherLayoutsAndIntoTheUnsplitModel) {
  const auto saved = file_tensors(saved_path());
  int64_t whole_bytes = 0;
  for (const auto& [n, t] : hf_tensors_in(hf())) whole_bytes += t.nbytes();
  for (const Layout& l : {Layout{1, 4, Strategy::FullShard}, Layout{4, 1, Strategy::NoShard},
                          Layout{2, 2, Strategy::ShardGradOp, true, true}, Layout{1, 1, Strategy::NoShard, false}}) {
    auto r = run_ranks(l.tp * l.dp, [&](World& w) {
      Built b = build(w, l);
      auto report = shardtorch::load_hf_checkpoint(*b.model, hf());
      require_bitwise(whole_params(b), saved, describe(l));
      if (l.split && l.tp == 4)
        require(report.bytes_read < whole_bytes / 2, describe(l) + ": read " + std::to_string(report.bytes_read) +
                                                         " of " + std::to_string(whole_bytes) + " bytes");
    });
    EXPECT_TRUE(r.ok) << describe(l) << ": " << r.summary();
  }
}

// A split parameter the name mapping leaves out is left out at every tp
// rank: the save completes, the others are the saver's.
TEST_F(TpHfCheckpoint, ASplitParameterTheMappingLeavesOutIsLeftOutAtEveryTpRank) {
  const std::string out = *dir_ / "without-fc1";
  auto r = run_ranks(4, [&](World& w) {
    Built b = build(w, kSaver);
    shardtorch::load_hf_checkpoint(*b.model, hf());
    shardtorch::save_hf_checkpoint(*b.model, out, shardtorch::HfSaveOptions().map_name([](const std::string& n) {
      return n == "blocks.1.fc1.weight" ? std::optional<std::string>() : std::optional<std::string>(n);
    }));
  });
  ASSERT_TRUE(r.ok) << r.summary();
  auto held = hf_tensors_in(out), all = hf_tensors_in(hf());
  EXPECT_FALSE(held.count("blocks.1.fc1.weight"));
  EXPECT_EQ(held.size() + 1, all.size());
  all.erase("blocks.1.fc1.weight");
  auto rr = run_ranks(1, [&](World&) { require_bitwise(held, all, "the save without blocks.1.fc1.weight"); });
  EXPECT_TRUE(rr.ok) << rr.summary();
}

// The example GPT's default configuration split over `tp` and sharded over `dp`.
Built build_default_gpt(World& w, int tp, int dp, Strategy strategy) {
  Built b;
  b.mesh = DeviceMesh::create(w.shared_from_this(), {{"dp", dp}, {"tp", tp}});
  torch::manual_seed(0);  // parallelize() requires the ranks' copies alike
  b.model = gpt::GPT(gpt::Config{});
  if (tp > 1) shardtorch::parallelize(*b.model, b.tp(), gpt::tp_plan(gpt::Config{}));
  shardtorch::shard(b.model, (*b.mesh)["dp"], strategy_options(strategy, dp));
  b.params = own_params(*b.model);
  return b;
}

// Interop: the checkpoint Python wrote (tests/python/write_hf_checkpoint.py)
// loads at tp 2 x dp 2 bitwise as into the unsplit model. Run by the ctest
// checkpoint.hf_checkpoint_from_python, which writes it first and sets
// SHARDTORCH_HF_INTEROP_DIR.
TEST(TpHfInterop, DISABLED_LoadsWhatPythonWrote) {
  const char* dir_env = std::getenv("SHARDTORCH_HF_INTEROP_DIR");
  ASSERT_NE(dir_env, nullptr) << "set SHARDTORCH_HF_INTEROP_DIR (tests/python/write_hf_checkpoint.py writes it)";
  for (const std::string sub : {"fp32", "bf16"}) {
    const std::string hf = std::string(dir_env) + "/" + sub;
    auto r = run_ranks(1, [&](World& w) {
      Built b = build_default_gpt(w, 1, 1, Strategy::NoShard);
      shardtorch::load_hf_checkpoint(*b.model, hf);
      save_tensors(hf + "-unsplit.safetensors", testref::full_parameters(*b.model));
    });
    ASSERT_TRUE(r.ok) << sub << ", unsplit: " << r.summary();
    const auto want = file_tensors(hf + "-unsplit.safetensors");
    r = run_ranks(4, [&](World& w) {
      Built b = build_default_gpt(w, 2, 2, Strategy::FullShard);
      shardtorch::load_hf_checkpoint(*b.model, hf);
      require_same(whole_params(b), want, sub + " at tp 2 x dp 2");
    });
    EXPECT_TRUE(r.ok) << sub << ", tp 2 x dp 2: " << r.summary();
  }
}

// The saver's DCP checkpoint, read against its sharded one (TpSaved).
class TpDcpCheckpoint : public TpSaved {};

// Loaded at the saver's layout, training goes on as if never stopped.
TEST_F(TpDcpCheckpoint, ResumesBitwiseAtTheSameLayout) {
  const auto saved = file_tensors(saved_path()), after = file_tensors(after_path());
  auto r = run_ranks(4, [&](World& w) {
    Built b = build(w, kSaver);
    auto opt = shardtorch::AdamW(*b.model, adamw());
    const auto report = shardtorch::load_dcp_checkpoint(*b.model, opt.get(), dcp());
    require(report.unexpected.empty() && report.missing.empty(), "names the model does not match");
    require_bitwise(whole_params(b), saved, "the parameters loaded");
    one_step(b, *opt, kSaver);
    require_bitwise(whole_params(b), after, "one step after the load");
  });
  EXPECT_TRUE(r.ok) << r.summary();
}

// The metadata holds the unsplit shapes, and a split weight as a few boxes
// of the whole tensor: the row-wise split proj.weight (split by columns) is
// each tp rank's columns of the rows its shards hold, not one chunk per row.
TEST_F(TpDcpCheckpoint, HoldsTheUnsplitShapesAndASplitWeightInAFewChunks) {
  torch::manual_seed(0);
  gpt::GPT ref(tp_config());
  std::map<std::string, shardtorch::checkpoint::DcpEntryInfo> entries;
  for (const auto& e : shardtorch::checkpoint::DcpReader(dcp()).entries()) entries[e.name] = e;
  for (const auto& item : ref->named_parameters()) {
    ASSERT_TRUE(entries.count("model." + item.key())) << item.key();
    EXPECT_EQ(entries.at("model." + item.key()).shape, item.value().sizes().vec()) << item.key();
  }
  for (const std::string kind : {"model.", "optim.state."}) {
    const std::string name = kind + "blocks.0.proj.weight" + (kind == "model." ? "" : ".exp_avg");
    ASSERT_TRUE(entries.count(name)) << name;
    EXPECT_GE(entries.at(name).chunks, 2) << name;
    EXPECT_LE(entries.at(name).chunks, 4) << name;  // tp 2, each rank's columns of at most 2 row ranges
  }
}

// Every layout, the unsplit model among them, loads the parameters and
// AdamW's state bitwise: its sharded checkpoint then holds what the saver's
// did. The unsplit model's own DCP checkpoint (each tensor in the row blocks
// of its shards) loads back into the split model the same.
TEST_F(TpDcpCheckpoint, LoadsBitwiseAtOtherLayoutsAndIntoTheUnsplitModelAndBack) {
  const auto saved = file_tensors(saved_path());
  const auto all = shardtorch::read_sharded_checkpoint(ckpt());
  const std::string unsplit_dcp = *dir_ / "unsplit-dcp";
  struct Case {
    Layout l;
    std::string from;
  };
  int k = 0;
  for (const Case& c : {Case{{1, 4, Strategy::FullShard}, dcp()}, Case{{4, 1, Strategy::NoShard}, dcp()},
                        Case{{1, 2, Strategy::FullShard, false}, dcp()},
                        Case{{2, 2, Strategy::ShardGradOp, true, true}, unsplit_dcp}}) {
    const std::string what = describe(c.l) + (c.from == dcp() ? "" : " from the unsplit model's DCP checkpoint");
    const std::string again = *dir_ / ("dcp-again-" + std::to_string(k++));
    auto r = run_ranks(c.l.tp * c.l.dp, [&](World& w) {
      Built b = build(w, c.l);
      auto opt = shardtorch::AdamW(*b.model, adamw());
      shardtorch::load_dcp_checkpoint(*b.model, opt.get(), c.from);
      require_bitwise(whole_params(b), saved, what);
      shardtorch::save_sharded_checkpoint(*b.model, opt.get(), again, kSteps);
      if (!c.l.split) shardtorch::save_dcp_checkpoint(*b.model, opt.get(), unsplit_dcp);
    });
    ASSERT_TRUE(r.ok) << what << ": " << r.summary();
    auto rr = run_ranks(1, [&](World&) { require_same(shardtorch::read_sharded_checkpoint(again), all, what); });
    EXPECT_TRUE(rr.ok) << what << ": " << rr.summary();
  }
}

// 3-D: pipeline stages split over tp (pp 2 x dp 1 x tp 2) load it, each
// stage its parameters and AdamW's state, and save a DCP checkpoint that
// every layout reads as the saver's.
TEST_F(TpDcpCheckpoint, LoadsIntoTensorParallelPipelineStagesAndSavesTheSameAgain) {
  const auto saved = file_tensors(saved_path());
  const auto all = shardtorch::read_sharded_checkpoint(ckpt());
  const std::string pipeline_dcp = *dir_ / "pipeline-dcp", again = *dir_ / "again-from-pipeline";
  auto r = run_ranks(4, [&](World& w) {
    TpPiped p(w, gpt::tp_plan(tp_config()));
    const auto report = shardtorch::load_dcp_checkpoint(*p.pipe, p.opt.get(), dcp());
    require(report.unexpected.empty(), "a stage found the other stage's names unexpected");
    p.require_saved(saved, "pp 2 x tp 2");
    shardtorch::save_dcp_checkpoint(*p.pipe, p.opt.get(), pipeline_dcp);
  });
  ASSERT_TRUE(r.ok) << r.summary();
  r = run_ranks(2, [&](World& w) {
    Built b = build(w, Layout{1, 2, Strategy::FullShard, false});
    auto opt = shardtorch::AdamW(*b.model, adamw());
    shardtorch::load_dcp_checkpoint(*b.model, opt.get(), pipeline_dcp);
    require_bitwise(whole_params(b), saved, "the unsplit model from the pipeline's DCP checkpoint");
    shardtorch::save_sharded_checkpoint(*b.model, opt.get(), again, kSteps);
  });
  ASSERT_TRUE(r.ok) << r.summary();
  auto rr = run_ranks(1, [&](World&) { require_same(shardtorch::read_sharded_checkpoint(again), all, "pp 2 x tp 2"); });
  EXPECT_TRUE(rr.ok) << rr.summary();
}

// A pipeline whose second stage has no split parameter (only the first
// block's MLP is split over tp): that stage's tensors are whole on both tp
// ranks and saved once, at tp rank 0, in DCP and sharded checkpoints alike;
// both read back as the saver's.
TEST_F(TpDcpCheckpoint, AStageWithoutASplitParameterIsSavedOnce) {
  const auto saved = file_tensors(saved_path());
  const auto all = shardtorch::read_sharded_checkpoint(ckpt());
  const std::string pipeline_dcp = *dir_ / "partly-split-dcp", pipeline_sharded = *dir_ / "partly-split-sharded",
                    again = *dir_ / "again-from-partly-split";
  auto r = run_ranks(4, [&](World& w) {
    TpPiped p(w,
              shardtorch::TpPlan()
                  .add("blocks.0.fc1", shardtorch::TpStyle::colwise())
                  .add("blocks.0.fc2", shardtorch::TpStyle::rowwise()),
              Strategy::NoShard);
    shardtorch::load_dcp_checkpoint(*p.pipe, p.opt.get(), dcp());
    shardtorch::save_dcp_checkpoint(*p.pipe, p.opt.get(), pipeline_dcp);
    shardtorch::save_sharded_checkpoint(*p.pipe, p.opt.get(), pipeline_sharded, kSteps);
  });
  ASSERT_TRUE(r.ok) << r.summary();
  auto rr = run_ranks(1, [&](World&) {
    require_same(shardtorch::read_sharded_checkpoint(pipeline_sharded), all, "the partly split pipeline's");
  });
  EXPECT_TRUE(rr.ok) << rr.summary();
  r = run_ranks(2, [&](World& w) {
    Built b = build(w, Layout{1, 2, Strategy::FullShard, false});
    auto opt = shardtorch::AdamW(*b.model, adamw());
    shardtorch::load_dcp_checkpoint(*b.model, opt.get(), pipeline_dcp);
    require_bitwise(whole_params(b), saved, "the unsplit model from the partly split pipeline's DCP checkpoint");
    shardtorch::save_sharded_checkpoint(*b.model, opt.get(), again, kSteps);
  });
  ASSERT_TRUE(r.ok) << r.summary();
  rr = run_ranks(1, [&](World&) {
    require_same(shardtorch::read_sharded_checkpoint(again), all, "the partly split pipeline's DCP checkpoint");
  });
  EXPECT_TRUE(rr.ok) << rr.summary();
}

// Interop: PyTorch reads the split model's DCP checkpoint as the unsplit
// model's. Run by the ctest interop.tp_dcp_with_torch, which sets
// SHARDTORCH_TP_DCP_DIR and then compares, with PyTorch's
// dcp_to_torch_save, what this writes there: "tp" (tp 2 x dp 2), "unsplit"
// (the unsplit model at 2 ranks, loaded from it) and "pipeline" (pp 2 x dp 1
// x tp 2, loaded from it).
TEST(TpDcpInterop, DISABLED_WritesTheSameCheckpointAtThreeLayouts) {
  const char* dir_env = std::getenv("SHARDTORCH_TP_DCP_DIR");
  ASSERT_NE(dir_env, nullptr) << "set SHARDTORCH_TP_DCP_DIR";
  const std::string dir = dir_env;
  auto r = run_ranks(4, [&](World& w) {
    Built b = build(w, kSaver);
    auto opt = shardtorch::AdamW(*b.model, adamw());
    train(b, *opt, kSaver);
    shardtorch::save_dcp_checkpoint(*b.model, opt.get(), dir + "/tp");
  });
  ASSERT_TRUE(r.ok) << r.summary();
  r = run_ranks(2, [&](World& w) {
    Built b = build(w, Layout{1, 2, Strategy::FullShard, false});
    auto opt = shardtorch::AdamW(*b.model, adamw());
    shardtorch::load_dcp_checkpoint(*b.model, opt.get(), dir + "/tp");
    shardtorch::save_dcp_checkpoint(*b.model, opt.get(), dir + "/unsplit");
  });
  ASSERT_TRUE(r.ok) << r.summary();
  r = run_ranks(4, [&](World& w) {
    TpPiped p(w, gpt::tp_plan(tp_config(), /*sequence_parallel=*/true));
    shardtorch::load_dcp_checkpoint(*p.pipe, p.opt.get(), dir + "/tp");
    shardtorch::save_dcp_checkpoint(*p.pipe, p.opt.get(), dir + "/pipeline");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// tests/python/dcp/tp_run.py's TpMlp: l0 Linear(4, 6), ReLU, l1 Linear(6, 2).
struct TpMlpImpl : torch::nn::Module {
  TpMlpImpl()
      : l0(register_module("l0", shardtorch::ParallelLinear(4, 6))),
        l1(register_module("l1", shardtorch::ParallelLinear(6, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) { return l1(torch::relu(l0(x))); }
  shardtorch::ParallelLinear l0, l1;
};
SHARDTORCH_MODULE(TpMlp);

// A sharded checkpoint's tensors ("name|kind") under the keys a DCP
// checkpoint holds them by: "model.<name>", "optim.state.<name>.<kind>".
std::map<std::string, torch::Tensor> by_dcp_key(const std::map<std::string, torch::Tensor>& sharded) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [key, t] : sharded) {
    const auto bar = key.find('|');
    const std::string name = key.substr(0, bar), kind = key.substr(bar + 1);
    out[kind == "param" ? "model." + name : "optim.state." + name + "." + kind] = t;
  }
  return out;
}

// Interop with PyTorch's own tensor parallelism (DTensors: tests/python/dcp/tp_run.py,
// run by the ctest interop.tp_dcp_with_torch, which sets SHARDTORCH_TP_DCP_DIR):
// what Python saved split over 2 ranks loads at tp 2 x dp 1, tp 2 x dp 2 and
// into the unsplit model at one rank, the parameters and AdamW's moments
// bitwise, and the next step on Python's next batch is Python's within
// 1e-6; at tp 2 x dp 2 it then saves DCP_DIR/cpp_tp for Python to load.
TEST(TpDcpInterop, DISABLED_LoadsWhatPythonsTensorParallelismSavedAndSavesForIt) {
  const char* dir_env = std::getenv("SHARDTORCH_TP_DCP_DIR");
  ASSERT_NE(dir_env, nullptr) << "set SHARDTORCH_TP_DCP_DIR (tests/python/dcp/tp_run.py save writes it)";
  const std::string dir = dir_env;
  const auto saved = shardtorch::checkpoint::load_file(dir + "/py_tp.saved.safetensors");
  const auto next = shardtorch::checkpoint::load_file(dir + "/py_tp.next.safetensors");
  const torch::Tensor x = shardtorch::checkpoint::load_file(dir + "/batch.safetensors").at("x2");
  std::map<std::string, torch::Tensor> saved_params, next_params;
  for (const auto& [k, v] : saved)
    if (k.rfind("model.", 0) == 0) saved_params[k.substr(6)] = v;
  for (const auto& [k, v] : next) next_params[k.substr(6)] = v;
  struct Case {
    int tp, dp;
  };
  for (const Case c : {Case{2, 1}, Case{2, 2}, Case{1, 1}}) {
    const std::string what = c.tp == 1 ? "the unsplit model" : "tp 2 x dp " + std::to_string(c.dp);
    const std::string loaded = dir + "/loaded-" + std::to_string(c.tp) + "-" + std::to_string(c.dp);
    auto r = run_ranks(c.tp * c.dp, [&](World& w) {
      auto mesh = DeviceMesh::create(w.shared_from_this(), {{"dp", c.dp}, {"tp", c.tp}});
      auto tp = (*mesh)["tp"];
      torch::manual_seed(5);
      TpMlp model;
      if (c.tp > 1)
        shardtorch::parallelize(
            *model, tp,
            shardtorch::TpPlan().add("l0", shardtorch::TpStyle::colwise()).add("l1", shardtorch::TpStyle::rowwise()));
      shardtorch::shard(model, (*mesh)["dp"], strategy_options(Strategy::FullShard, c.dp));
      auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      const auto own = own_params(*model);
      const auto report = shardtorch::load_dcp_checkpoint(*model, opt.get(), dir + "/py_tp");
      require(report.missing.empty() && report.unexpected.empty(), what + ": names unmatched");
      require_same(whole(testref::full_parameters(*model), own, *tp), saved_params, what + ": the parameters loaded");
      shardtorch::save_sharded_checkpoint(*model, opt.get(), loaded, 1);  // its moments, read below
      const int64_t per = x.size(0) / c.dp;
      opt->zero_grad();
      model(x.narrow(0, mesh->coordinate("dp") * per, per)).pow(2).mean().backward();
      opt->step();
      const auto after = whole(testref::full_parameters(*model), own, *tp);
      expect_close_map(after, next_params, 1e-6, what + ": the step after the load");
      if (c.tp == 2 && c.dp == 2) {
        shardtorch::save_dcp_checkpoint(*model, opt.get(), dir + "/cpp_tp");
        const std::string whole_state = dir + "/cpp_tp-sharded";
        shardtorch::save_sharded_checkpoint(*model, opt.get(), whole_state, 2);
        if (w.rank() == 0) {
          const auto expected = by_dcp_key(shardtorch::read_sharded_checkpoint(whole_state));
          require(expected.size() == 12, std::to_string(expected.size()) + " tensors, not 4 parameters x 3");
          save_tensors(dir + "/cpp_tp.expected.safetensors", expected);
        }
      }
    });
    ASSERT_TRUE(r.ok) << what << ": " << r.summary();
    auto rr = run_ranks(1, [&](World&) {
      for (const auto& [key, t] : by_dcp_key(shardtorch::read_sharded_checkpoint(loaded)))
        require(saved.count(key) && torch::equal(saved.at(key), t), what + ": '" + key + "' differs");
    });
    EXPECT_TRUE(rr.ok) << what << ": " << rr.summary();
  }
}

// In-memory snapshots of a split model, taken over the mesh's World (every
// rank its own slices' shards): a new model restores the newest step and
// continues bitwise.
TEST(TpSnapshots, ASplitModelRestoresFromMemoryAndContinuesBitwise) {
  TempDir dir("shardtorch-tp-snapshots");
  auto r = run_ranks(4, [&](World& w) {
    shardtorch::SnapshotOptions o;
    o.dir = dir;
    o.job = "tp";
    std::map<std::string, torch::Tensor> at2, at3;
    {
      Built b = build(w, kSaver);
      auto opt = shardtorch::AdamW(*b.model, adamw());
      shardtorch::Snapshots snaps(w.shared_from_this(), *b.model, opt.get(), o);
      train(b, *opt, kSaver);  // kSteps (2) steps
      snaps.after_step(kSteps);
      at2 = whole_params(b);
      one_step(b, *opt, kSaver);
      at3 = whole_params(b);
    }
    Built again = build(w, Layout{2, 2, Strategy::FullShard, true, false, true});
    auto opt = shardtorch::AdamW(*again.model, adamw());
    shardtorch::Snapshots snaps(w.shared_from_this(), *again.model, opt.get(), o);
    require(snaps.restore() == kSteps, "did not restore step " + std::to_string(kSteps));
    require_bitwise(whole_params(again), at2, "restored");
    one_step(again, *opt, kSaver);
    require_bitwise(whole_params(again), at3, "the step after the restore");
    snaps.finish();
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Over the data-parallel group alone, the ranks of different tp coordinates
// would write the same files: refused, saying what to pass.
TEST(TpSnapshots, OverTheDataParallelGroupAloneTheyAreRefused) {
  TempDir dir("shardtorch-tp-snapshots");
  auto r = run_ranks(4, [&](World& w) {
    shardtorch::SnapshotOptions o;
    o.dir = dir;
    Built b = build(w, kSaver);
    auto opt = shardtorch::AdamW(*b.model, adamw());
    shardtorch::Snapshots snaps((*b.mesh)["dp"], *b.model, opt.get(), o);
  });
  ASSERT_FALSE(r.ok);
  for (const auto& k : r.ranks)
    EXPECT_NE(k.message.find("take the snapshots over the mesh's World"), std::string::npos) << k.message;
}

}  // namespace
