// Checkpoints of pipelined models (shardtorch/pipeline_checkpoint.h): the
// example GPT trained at pp=2 x dp=2 (GPipe) saves a full state dict, a
// sharded checkpoint with its AdamW state and a Hugging Face layout; each
// loads at pp=1 x dp=4, at pp=4 x dp=1 and into the unsplit GPT bitwise, the
// optimizer state moving with it, and what those save loads back at
// pp=2 x dp=2; the unsplit GPT's checkpoints load into an interleaved
// pipeline; checkpoints of another model, and a tied weight that a file holds
// twice or not at all, are handled on every stage alike.
#include <gtest/gtest.h>

#include <optional>

#include "checkpoint_helpers.h"
#include "models.h"
#include "progress_helpers.h"
#include "shardtorch/dcp_checkpoint.h"
#include "shardtorch/snapshot.h"

using namespace testmodels;
using shardtorch::DeviceMesh;
using shardtorch::HfSaveOptions;
using shardtorch::Pipeline;
using shardtorch::PipelineOptions;
using shardtorch::Schedule;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;
using Values = std::map<std::string, torch::Tensor>;

namespace {

gpt::Config config() {
  gpt::Config c;
  c.vocab = 32;
  c.seq_len = 8;
  c.d_model = 16;
  c.n_head = 2;
  c.n_layer = 6;  // 8 layers: embed, 6 blocks, head
  return c;
}

// As the pipeline's parity tests: norm biases away from zero (parameters are
// compared relative to their scale after training) and a frozen norm.
void prepare(gpt::GPT& m) {
  torch::NoGradGuard no_grad;
  m->ln_f->bias.normal_(0.0, 0.1);
  for (auto& b : m->block_list)
    for (auto* ln : {&b->ln1, &b->ln2}) (*ln)->bias.normal_(0.0, 0.1);
  for (auto& p : m->block_list[1]->ln1->parameters()) p.set_requires_grad(false);
}

torch::Tensor tokens() {
  torch::manual_seed(321);
  return torch::randint(0, config().vocab, {kBatch, config().seq_len}, torch::kLong);
}

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-3).eps(1e-6); }

torch::Tensor lm(const torch::Tensor& logits, const torch::Tensor& t) { return gpt::lm_loss(logits, t); }

// Every parameter under each of its names, and every buffer, whole.
Values full_values(torch::nn::Module& m) {
  auto summon = shardtorch::summon_full_params(m);
  Values out;
  for (auto& item : m.named_parameters()) out[item.key()] = item.value().detach().clone();
  for (auto& item : m.named_buffers()) out[item.key()] = item.value().clone();
  return out;
}

// The same of a model that is not sharded.
Values plain_values(torch::nn::Module& m) {
  Values out;
  for (auto& item : m.named_parameters()) out[item.key()] = item.value().detach().clone();
  for (auto& item : m.named_buffers()) out[item.key()] = item.value().clone();
  return out;
}

// Every parameter moved away from its value (collective), so that a load
// that leaves one out shows.
void scramble(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  auto summon = shardtorch::summon_full_params(m, shardtorch::SummonOptions().writeback(true));
  for (auto& p : m.parameters()) p.add_(1.0);
}

// `got` (a stage's, or the whole model's) equals `want` where it has names;
// `whole`: it has all of them.
void require_bitwise(const Values& got, const Values& want, const std::string& what, bool whole = false) {
  require(!got.empty(), what + ": nothing to compare");
  if (whole)
    require(got.size() == want.size(),
            what + ": " + std::to_string(got.size()) + " tensors, expected " + std::to_string(want.size()));
  for (const auto& [n, g] : got) {
    auto it = want.find(n);
    require(it != want.end(), what + ": '" + n + "' is not in the model that saved");
    require(g.scalar_type() == it->second.scalar_type() && g.sizes() == it->second.sizes() &&
                torch::equal(g.cpu(), it->second),
            what + ": '" + n + "' differs");
  }
}

void require_close(const Values& got, const Values& want, double tol, const std::string& what) {
  Values subset;
  for (const auto& [n, g] : got) {
    require(want.count(n) > 0, what + ": '" + n + "' is not in the model that saved");
    subset[n] = want.at(n);
  }
  expect_close_map(got, subset, tol, what);
}

struct Layout {
  int pp, dp;
  Strategy strategy;
  Schedule schedule = Schedule::OneFOneB;
  int chunks = 1;  // per pipeline rank (Interleaved1F1B: 2)
};

// The layout the checkpoints of pipeline_saved() are written at.
const Layout kSaver{2, 2, Strategy::FullShard, Schedule::GPipe};

std::string layout_name(const Layout& l) {
  return "pp=" + std::to_string(l.pp) + " dp=" + std::to_string(l.dp) + " " + shardtorch::strategy_name(l.strategy) +
         " " + shardtorch::schedule_name(l.schedule) + (l.chunks > 1 ? " chunks=" + std::to_string(l.chunks) : "");
}

// A pipelined GPT on this rank, built deferred, with its AdamW and its
// pipeline's rows of the batch.
struct Piped {
  std::shared_ptr<DeviceMesh> mesh;
  gpt::GPT model{nullptr};
  std::unique_ptr<Pipeline> pipe;
  std::unique_ptr<shardtorch::ShardedOptimizer> opt;
  torch::Tensor rows;

  Piped(World& w, const Layout& l) {
    mesh = DeviceMesh::create(w.shared_from_this(), {{"pp", l.pp}, {"dp", l.dp}});
    torch::manual_seed(0);
    model = shardtorch::deferred([&] { return gpt::GPT(config()); });
    prepare(model);
    pipe = std::make_unique<Pipeline>(gpt::pipeline_layers(model), mesh,
                                      PipelineOptions()
                                          .schedule(l.schedule)
                                          .chunks_per_rank(l.chunks)
                                          .microbatches(l.chunks > 1 ? 2 * l.pp : 3)  // interleaved: a multiple of pp
                                          .shard(strategy_options(l.strategy, l.dp)));
    opt = shardtorch::AdamW(pipe->module(), adamw());
    const int64_t per = kBatch / l.dp;
    rows = tokens().narrow(0, mesh->coordinate("dp") * per, per);
  }
  void train(int steps) {
    for (int s = 0; s < steps; ++s) {
      opt->zero_grad();
      pipe->step(pipe->is_first_stage() ? rows : torch::Tensor(), pipe->is_last_stage() ? rows : torch::Tensor(), lm);
      opt->step();
    }
  }
  Values values() { return full_values(pipe->module()); }
  // Whether this rank writes its stages' values for the parent (one per stage).
  bool reports() const { return mesh->coordinate("dp") == 0; }
  std::string stage() const { return std::to_string(mesh->coordinate("pp")); }
};

// The GPT unsplit, sharded over the world, with its AdamW and rows.
struct Unsplit {
  gpt::GPT model{nullptr};
  std::unique_ptr<shardtorch::ShardedOptimizer> opt;
  torch::Tensor rows;

  Unsplit(World& w, Strategy s, const gpt::Config& c = config()) {
    torch::manual_seed(0);
    model = gpt::GPT(c);
    prepare(model);
    shardtorch::shard(model, w, strategy_options(s, w.size()));
    opt = shardtorch::AdamW(*model, adamw());
    const int64_t per = kBatch / w.size();
    rows = tokens().narrow(0, w.rank() * per, per);
  }
  void train(int steps) {
    for (int s = 0; s < steps; ++s) {
      opt->zero_grad();
      lm(model(rows), rows).backward();
      opt->step();
    }
  }
};

// Checkpoints in the three formats after two steps, the values saved (every
// name of the unsplit model), and the values after a third step.
struct Saved {
  TempDir dir{"shardtorch-pipeline-ckpt"};
  std::string full, sharded, hf, dcp;
  Values truth, next;
  std::string error;  // of the run that saved, if it failed
};

// The parent's: the files "PREFIX*.safetensors" the ranks wrote, merged.
Values merge_files(const std::string& dir, const std::string& prefix) {
  Values out;
  for (const auto& f : files::list_directory(dir))
    if (f.rfind(prefix, 0) == 0)
      for (auto& [n, t] : shardtorch::checkpoint::load_file(dir + "/" + f)) out[n] = t;
  return out;
}

void init(Saved& s) {
  s.full = s.dir / "model.safetensors";
  s.sharded = s.dir / "sharded";
  s.hf = s.dir / "hf";
  s.dcp = s.dir / "dcp";
}

// Saved by the GPT pipelined at kSaver.
const Saved& pipeline_saved() {
  static Saved s = [] {
    Saved s;
    init(s);
    auto r = run_ranks(4, [&](World& w) {
      Piped p(w, kSaver);
      p.train(2);
      // Each save reports its progress on every rank: the two without
      // options to the library-wide callback.
      std::vector<shardtorch::ProgressUpdate> full, sharded, hf;
      shardtorch::set_progress_callback(collect_into(full));
      shardtorch::save_full_state_dict(*p.pipe, s.full, {{"step", "2"}});
      shardtorch::set_progress_callback(collect_into(sharded));
      shardtorch::save_sharded_checkpoint(*p.pipe, p.opt.get(), s.sharded, 2, {{"epoch", "1"}});
      shardtorch::set_progress_callback(nullptr);
      shardtorch::save_hf_checkpoint(*p.pipe, s.hf,
                                     HfSaveOptions().max_file_bytes(8 * 1024).progress(collect_into(hf)));
      shardtorch::save_dcp_checkpoint(*p.pipe, p.opt.get(), s.dcp);
      const std::string at = "rank " + std::to_string(w.rank()) + " (stage " + p.stage() + ")";
      require_progress(full, "save_full_state_dict", at);
      require_progress(sharded, "save_sharded_checkpoint", at);
      require_progress(hf, "save_hf_checkpoint", at);
      auto v = p.values();
      if (p.reports())
        shardtorch::checkpoint::save_file(s.dir / ("truth-" + p.stage() + ".safetensors"), {v.begin(), v.end()});
      p.train(1);
      v = p.values();
      if (p.reports())
        shardtorch::checkpoint::save_file(s.dir / ("next-" + p.stage() + ".safetensors"), {v.begin(), v.end()});
    });
    if (!r.ok) s.error = r.summary();
    s.truth = merge_files(s.dir, "truth-");
    s.next = merge_files(s.dir, "next-");
    return s;
  }();
  return s;
}

// Saved by the unsplit GPT, FullShard over 2 ranks.
const Saved& unsplit_saved() {
  static Saved s = [] {
    Saved s;
    init(s);
    auto r = run_ranks(2, [&](World& w) {
      Unsplit u(w, Strategy::FullShard);
      u.train(2);
      shardtorch::save_full_state_dict(*u.model, s.full, {{"step", "2"}});
      shardtorch::save_sharded_checkpoint(*u.model, u.opt.get(), s.sharded, 2, {{"epoch", "1"}});
      shardtorch::save_hf_checkpoint(*u.model, s.hf, HfSaveOptions().max_file_bytes(8 * 1024));
      shardtorch::save_dcp_checkpoint(*u.model, u.opt.get(), s.dcp);
      auto v = full_values(*u.model);
      if (w.rank() == 0) shardtorch::checkpoint::save_file(s.dir / "truth.safetensors", {v.begin(), v.end()});
      u.train(1);
      v = full_values(*u.model);
      if (w.rank() == 0) shardtorch::checkpoint::save_file(s.dir / "next.safetensors", {v.begin(), v.end()});
    });
    if (!r.ok) s.error = r.summary();
    s.truth = merge_files(s.dir, "truth");
    s.next = merge_files(s.dir, "next");
    return s;
  }();
  return s;
}

// Every (tensor, kind) of two sharded checkpoints, bitwise: the parameters
// and every moment of AdamW.
void expect_same_sharded(const std::string& got_dir, const std::string& want_dir) {
  const auto got = shardtorch::read_sharded_checkpoint(got_dir);
  const auto want = shardtorch::read_sharded_checkpoint(want_dir);
  EXPECT_EQ(got.size(), want.size());
  for (const auto& [key, w] : want) {
    auto it = got.find(key);
    ASSERT_NE(it, got.end()) << key << " is not in " << got_dir;
    EXPECT_TRUE(it->second.sizes() == w.sizes() && torch::equal(it->second, w)) << key << " differs in " << got_dir;
  }
}

// At `l`: the three checkpoints of the pipeline at kSaver load bitwise
// (each after the parameters were moved away), the sharded one with the
// optimizer state; saved again, it holds what was saved; one more step
// continues the run that saved (bitwise at its own layout). Returns the
// directory of the sharded checkpoint saved again at `l`.
std::string expect_loads_at(const Layout& l) {
  const auto& s = pipeline_saved();
  EXPECT_EQ(s.error, "");
  if (!s.error.empty()) return "";
  const std::string again = s.dir / ("again-pp" + std::to_string(l.pp) + "-dp" + std::to_string(l.dp));
  auto r = run_ranks(4, [&](World& w) {
    Piped p(w, l);
    const std::string at = " loaded at " + layout_name(l);
    std::vector<shardtorch::ProgressUpdate> full, hf, sharded;  // each load's progress, on every rank
    const std::string rank = "rank " + std::to_string(w.rank()) + at;
    scramble(p.pipe->module());
    shardtorch::load_full_state_dict(*p.pipe, s.full, shardtorch::LoadOptions().progress(collect_into(full)));
    require_bitwise(p.values(), s.truth, "full state dict" + at);
    require_progress(full, "load_full_state_dict", rank);
    scramble(p.pipe->module());
    shardtorch::load_hf_checkpoint(*p.pipe, s.hf, shardtorch::HfLoadOptions().progress(collect_into(hf)));
    require_bitwise(p.values(), s.truth, "Hugging Face checkpoint" + at);
    require_progress(hf, "load_hf_checkpoint", rank);
    scramble(p.pipe->module());
    std::map<std::string, std::string> user;
    const int64_t step = shardtorch::load_sharded_checkpoint(*p.pipe, p.opt.get(), s.sharded, &user,
                                                             shardtorch::LoadOptions().progress(collect_into(sharded)));
    require_progress(sharded, "load_sharded_checkpoint", rank);
    require(step == 2 && user == std::map<std::string, std::string>{{"epoch", "1"}}, "step or user state" + at);
    require_bitwise(p.values(), s.truth, "sharded checkpoint" + at);
    // The pipeline's DCP checkpoint, AdamW's state too: the sharded
    // checkpoint saved again below holds what the DCP checkpoint loaded.
    scramble(p.pipe->module());
    p.opt->inner().state().clear();
    const auto dcp_report = shardtorch::load_dcp_checkpoint(*p.pipe, p.opt.get(), s.dcp);
    require(dcp_report.unexpected.empty() && dcp_report.missing.empty(), "DCP checkpoint: names unmatched" + at);
    require_bitwise(p.values(), s.truth, "DCP checkpoint" + at);
    if (l.pp == 1) {
      // One pipeline rank holds the whole model: its DCP checkpoint is the
      // unsplit model's, optimizer state included (the step below reads it).
      const std::string dcp = s.dir / "dcp-pp1";
      shardtorch::save_dcp_checkpoint(p.pipe->module(), p.opt.get(), dcp);
      Unsplit u(w, Strategy::FullShard);
      shardtorch::load_dcp_checkpoint(*u.model, u.opt.get(), dcp);
      require_bitwise(full_values(*u.model), s.truth, "the unsplit model from the DCP checkpoint" + at, true);
      scramble(p.pipe->module());
      p.opt->inner().state().clear();  // AdamW's state must come back from the DCP checkpoint
      shardtorch::load_dcp_checkpoint(p.pipe->module(), p.opt.get(), dcp);
      require_bitwise(p.values(), s.truth, "DCP checkpoint" + at);
    }
    shardtorch::save_sharded_checkpoint(*p.pipe, p.opt.get(), again, step, user);
    p.train(1);
    if (l.pp == kSaver.pp && l.dp == kSaver.dp && l.strategy == kSaver.strategy && l.schedule == kSaver.schedule)
      require_bitwise(p.values(), s.next, "the step after the load" + at);
    else  // the reductions' order differs: rounding
      require_close(p.values(), s.next, 2e-5, "the step after the load" + at);
  });
  EXPECT_TRUE(r.ok) << layout_name(l) << ": " << r.summary();
  expect_same_sharded(again, s.sharded);
  return again;
}

// The sharded checkpoint in `dir` (pipeline_saved()'s, saved again at another
// layout) loads back at kSaver, and the next step is the saving run's, bitwise.
void expect_continues_at_the_saver(const std::string& dir) {
  const auto& s = pipeline_saved();
  auto r = run_ranks(4, [&](World& w) {
    Piped p(w, kSaver);
    scramble(p.pipe->module());
    shardtorch::load_sharded_checkpoint(*p.pipe, p.opt.get(), dir);
    require_bitwise(p.values(), s.truth, "loaded back at " + layout_name(kSaver));
    p.train(1);
    require_bitwise(p.values(), s.next, "the step after loading back at " + layout_name(kSaver));
  });
  EXPECT_TRUE(r.ok) << r.summary();
}

TEST(PipelineCheckpoint, SavedAtPp2Dp2ItContinuesBitwiseAtTheSameLayout) { expect_loads_at(kSaver); }

TEST(PipelineCheckpoint, SavedAtPp2Dp2ItLoadsAtPp1Dp4AndBack) {
  const std::string again = expect_loads_at({1, 4, Strategy::NoShard});
  if (!HasFailure()) expect_continues_at_the_saver(again);
}

TEST(PipelineCheckpoint, SavedAtPp2Dp2ItLoadsAtPp4Dp1AndBack) {
  const std::string again = expect_loads_at({4, 1, Strategy::FullShard});
  if (!HasFailure()) expect_continues_at_the_saver(again);
}

// In-memory snapshots of a pipelined model over the mesh's World: the
// default buddy map keeps rank 1's copy (stage 0) on rank 2 (stage 1), whose
// own model differs. With rank 1's own snapshot gone, a new pipeline
// restores it from that copy and continues bitwise; with that copy gone too,
// restoring fails naming rank 1 and its buddy.
TEST(PipelineCheckpoint, SnapshotsRestoreAStagesRankFromItsBuddyOnAnotherStage) {
  const TempDir dir("shardtorch-pipeline-snapshots");
  auto r = run_ranks(4, [&](World& w) {
    shardtorch::SnapshotOptions o;
    o.dir = dir;
    o.job = "pipeline";
    Values at2, at3;
    {
      Piped p(w, kSaver);
      shardtorch::Snapshots snaps(w.shared_from_this(), p.pipe->module(), p.opt.get(), o);
      require(snaps.buddies()[1] == 2, "rank 1's buddy is " + std::to_string(snaps.buddies()[1]) + ", not rank 2");
      for (int64_t s = 1; s <= 2; ++s) {
        p.train(1);
        snaps.after_step(s);
      }
      snaps.wait();
      at2 = p.values();
      p.train(1);
      at3 = p.values();
    }
    if (w.rank() == 1) files::remove_all(shardtorch::detail::own_snapshot_path(o, 1, 2));
    {  // a process of its own would hold the job's files alone: one Snapshots at a time
      Piped again(w, kSaver);
      scramble(again.pipe->module());
      shardtorch::Snapshots snaps(w.shared_from_this(), again.pipe->module(), again.opt.get(), o);
      const int64_t step = snaps.restore();
      require(step == 2, "restored step " + std::to_string(step) + ", expected 2");
      require_bitwise(again.values(), at2, "restored");
      again.train(1);
      require_bitwise(again.values(), at3, "the step after the restore");
    }
    // Rank 1 lost with every copy of it: the error names it and its buddy.
    w.barrier();
    if (w.rank() == 0)
      for (const auto& name : files::list_directory(dir))
        if (name.find("-r1-") != std::string::npos) files::remove_all(files::join(dir, name));
    w.barrier();
    Piped third(w, kSaver);
    shardtorch::Snapshots lost(w.shared_from_this(), third.pipe->module(), third.opt.get(), o);
    std::string error;
    try {
      lost.restore();
    } catch (const shardtorch::Error& e) {
      error = e.what();
    }
    require(error.find("no step is in memory on every rank (newest seen: 2; rank(s) 1 have it neither in their own "
                       "snapshot nor in their buddy's (rank(s) 2) copy") != std::string::npos,
            "the error without memory: '" + error + "'");
    lost.finish();
  });
  EXPECT_TRUE(r.ok) << r.summary();
}

// The pipeline's full state dict holds what the unsplit model's does (every
// name, the tied weight under both) and its Hugging Face layout the tied
// weight once; both load into a GPT in one process without shardtorch, and
// all four into the unsplit GPT sharded over 4 ranks (the sharded and DCP
// checkpoints with AdamW's state: the sharded checkpoint saved again holds
// what the DCP checkpoint loaded).
TEST(PipelineCheckpoint, SavedAtPp2Dp2ItLoadsIntoTheUnsplitModel) {
  const auto& s = pipeline_saved();
  ASSERT_EQ(s.error, "");
  std::optional<torch::NoGradGuard> no_grad(std::in_place);  // not in the ranks (they train)
  gpt::GPT plain(config());
  std::set<std::string> every, unique;
  for (auto& item : plain->named_parameters()) every.insert(item.key());
  for (auto& [n, t] : unique_params(*plain)) unique.insert(n);
  ASSERT_TRUE(every.count("head.weight") && !unique.count("head.weight"));

  const auto full = shardtorch::checkpoint::load_file(s.full);
  std::set<std::string> in_full;
  for (const auto& [n, t] : full) in_full.insert(n);
  EXPECT_EQ(in_full, every);
  for (auto& item : plain->named_parameters()) item.value().copy_(full.at(item.key()));
  EXPECT_NO_THROW(require_bitwise(plain_values(*plain), s.truth, "the full state dict in one process", true));

  const auto hf = merge_files(s.hf, "model-");
  std::set<std::string> in_hf;
  for (const auto& [n, t] : hf) in_hf.insert(n);
  EXPECT_EQ(in_hf, unique);  // the tied weight once, under its first name
  for (auto& p : plain->parameters()) p.zero_();
  for (auto& [n, p] : unique_params(*plain)) p.copy_(hf.at(n));
  EXPECT_NO_THROW(require_bitwise(plain_values(*plain), s.truth, "the Hugging Face layout in one process", true));
  no_grad.reset();

  const std::string again = s.dir / "again-unsplit";
  auto r = run_ranks(4, [&](World& w) {
    Unsplit u(w, Strategy::FullShard);
    shardtorch::load_full_state_dict(*u.model, s.full);
    require_bitwise(full_values(*u.model), s.truth, "full state dict into the unsplit model", true);
    scramble(*u.model);
    shardtorch::load_hf_checkpoint(*u.model, s.hf);
    require_bitwise(full_values(*u.model), s.truth, "Hugging Face checkpoint into the unsplit model", true);
    scramble(*u.model);
    const int64_t step = shardtorch::load_sharded_checkpoint(*u.model, u.opt.get(), s.sharded);
    require_bitwise(full_values(*u.model), s.truth, "sharded checkpoint into the unsplit model", true);
    scramble(*u.model);
    u.opt->inner().state().clear();  // AdamW's state must come back from the DCP checkpoint
    shardtorch::load_dcp_checkpoint(*u.model, u.opt.get(), s.dcp);
    require_bitwise(full_values(*u.model), s.truth, "DCP checkpoint into the unsplit model", true);
    shardtorch::save_sharded_checkpoint(*u.model, u.opt.get(), again, step);
    u.train(1);
    require_close(full_values(*u.model), s.next, 2e-5, "the step after the load into the unsplit model");
  });
  ASSERT_TRUE(r.ok) << r.summary();
  expect_same_sharded(again, s.sharded);
}

// The other way: the unsplit GPT's checkpoints load into an interleaved
// pipeline at pp=2 x dp=2 (two chunks per rank, NoShard inside the stages),
// the tied weight into both ends; the pipeline's own sharded checkpoint then
// holds what the unsplit one did. Its DCP checkpoint loads into the
// pipeline, and into each stage by itself with ignore_unexpected, AdamW's
// state too.
TEST(PipelineCheckpoint, TheUnsplitModelsCheckpointsLoadIntoAPipeline) {
  const auto& s = unsplit_saved();
  ASSERT_EQ(s.error, "");
  const std::string again = s.dir / "again-pipeline";
  auto r = run_ranks(4, [&](World& w) {
    Piped p(w, {2, 2, Strategy::NoShard, Schedule::Interleaved1F1B, 2});
    shardtorch::load_full_state_dict(*p.pipe, s.full);
    require_bitwise(p.values(), s.truth, "the unsplit model's full state dict");
    scramble(p.pipe->module());
    shardtorch::load_hf_checkpoint(*p.pipe, s.hf);
    require_bitwise(p.values(), s.truth, "the unsplit model's Hugging Face checkpoint");
    // The pipeline takes the unsplit model's DCP checkpoint, AdamW's state too.
    scramble(p.pipe->module());
    p.opt->inner().state().clear();
    const auto whole = shardtorch::load_dcp_checkpoint(*p.pipe, p.opt.get(), s.dcp);
    require(whole.unexpected.empty() && whole.missing.empty(), "the pipeline's DCP load left names unmatched");
    require_bitwise(p.values(), s.truth, "the unsplit model's DCP checkpoint, into the pipeline");
    p.train(1);
    require_close(p.values(), s.next, 2e-5, "the step after loading the unsplit model's DCP checkpoint");
    // A stage takes its own tensors and their AdamW state from it when told
    // to ignore the other stages' names.
    scramble(p.pipe->module());
    p.opt->inner().state().clear();  // AdamW's state must come back from the DCP checkpoint
    const auto report = shardtorch::load_dcp_checkpoint(p.pipe->module(), p.opt.get(), s.dcp,
                                                        shardtorch::DcpLoadOptions().ignore_unexpected(true));
    require(!report.unexpected.empty(), "a stage found every name of the unsplit model's DCP checkpoint its own");
    require_bitwise(p.values(), s.truth, "the unsplit model's DCP checkpoint, into each stage");
    p.train(1);
    require_close(p.values(), s.next, 2e-5, "the step after loading the unsplit model's DCP checkpoint by stage");
    scramble(p.pipe->module());
    const int64_t step = shardtorch::load_sharded_checkpoint(*p.pipe, p.opt.get(), s.sharded);
    require_bitwise(p.values(), s.truth, "the unsplit model's sharded checkpoint");
    shardtorch::save_sharded_checkpoint(*p.pipe, p.opt.get(), again, step);
    p.train(1);
    require_close(p.values(), s.next, 2e-5, "the step after loading the unsplit model's checkpoint");
  });
  ASSERT_TRUE(r.ok) << r.summary();
  expect_same_sharded(again, s.sharded);
}

// A checkpoint that lacks a tensor of the last stage fails every rank, naming
// it, with no stage changed; a save that fails on one rank (rank 0 writing
// the full state dict, the second stage's writer of the Hugging Face layout,
// a DCP checkpoint whose stages' optimizer groups differ) fails every rank
// and leaves the previous checkpoint as it was.
TEST(PipelineCheckpoint, AProblemOnOneStageFailsEveryRankAndKeepsThePreviousCheckpoint) {
  const auto& s = pipeline_saved();
  ASSERT_EQ(s.error, "");
  TempDir dir("shardtorch-pipeline-ckpt-fail");
  const std::string lacking = dir / "lacking.safetensors", full = dir / "full.safetensors", hf = dir / "hf";
  {
    auto t = shardtorch::checkpoint::load_file(s.full);
    t.erase("blocks.5.fc2.bias");
    shardtorch::checkpoint::save_file(lacking, {t.begin(), t.end()});
  }
  auto r = run_ranks(4, [&](World& w) {
    Piped p(w, kSaver);
    shardtorch::load_full_state_dict(*p.pipe, s.full);
    const Values before = p.values();
    std::string msg = message_of([&] { shardtorch::load_full_state_dict(*p.pipe, lacking); });
    require(msg.find("blocks.5.fc2.bias") != std::string::npos, "a missing tensor: " + msg);
    require_bitwise(p.values(), before, "after a refused load");

    shardtorch::save_full_state_dict(*p.pipe, full);
    shardtorch::save_hf_checkpoint(*p.pipe, hf, HfSaveOptions().max_file_bytes(8 * 1024));
    const auto listing = [&] {
      auto names = files::list_directory(hf);
      std::sort(names.begin(), names.end());
      return names;
    };
    const auto hf_files = listing();
    scramble(p.pipe->module());
    // Rank 0 fails writing the full state dict, rank 2 (the second stage's writer) the Hugging Face layout.
    shardtorch::checkpoint::set_crash_hook([&](const std::string& point) {
      if (point == "file partly written" && w.rank() == 0) throw std::runtime_error("injected");
    });
    msg = message_of([&] { shardtorch::save_full_state_dict(*p.pipe, full); });
    require(msg.find(w.rank() == 0 ? "injected" : "could not write") != std::string::npos, "full state dict: " + msg);
    shardtorch::checkpoint::set_crash_hook([&](const std::string& point) {
      if (point == "file partly written" && w.rank() == 2) throw std::runtime_error("injected");
    });
    msg = message_of([&] { shardtorch::save_hf_checkpoint(*p.pipe, hf, HfSaveOptions().max_file_bytes(8 * 1024)); });
    shardtorch::checkpoint::set_crash_hook(nullptr);
    require(msg.find("injected") != std::string::npos && msg.find("rank 2") != std::string::npos,
            "Hugging Face layout: " + msg);
    require(listing() == hf_files, "the Hugging Face directory changed");
    shardtorch::load_full_state_dict(*p.pipe, full);
    require_bitwise(p.values(), before, "the full state dict kept");
    scramble(p.pipe->module());
    shardtorch::load_hf_checkpoint(*p.pipe, hf);
    require_bitwise(p.values(), before, "the Hugging Face layout kept");
    // A DCP checkpoint holds one list of optimizer groups for the whole
    // model: stages whose optimizers give group 0 other options fail every
    // rank, naming two ranks that differ, and write nothing.
    auto uneven = shardtorch::AdamW(p.pipe->module(), adamw().lr(p.stage() == "0" ? 1e-3 : 2e-3));
    msg = message_of([&] { shardtorch::save_dcp_checkpoint(*p.pipe, uneven.get(), dir / "dcp-uneven"); });
    require(msg.find("the optimizer's group 0 has another 'lr' on rank 2 than on rank 0") != std::string::npos,
            "a DCP save with stages' groups unlike: " + msg);
    require(!files::exists(dir / "dcp-uneven"), "the refused DCP save wrote its directory");
    // The tied weight in another group on each end (the head in a group
    // without weight decay): its copies would drift apart; refused, naming it.
    std::vector<at::Tensor> no_decay;
    for (auto& item : p.pipe->module().named_parameters())
      if (item.key() == "head.weight" || item.key().find("ln1.weight") != std::string::npos)
        no_decay.push_back(item.value());
    auto split_tie = shardtorch::AdamW(p.pipe->module(), adamw(), {{no_decay, adamw().weight_decay(0)}});
    msg = message_of([&] { shardtorch::save_dcp_checkpoint(*p.pipe, split_tie.get(), dir / "dcp-split-tie"); });
    require(msg.find("parameter 'tok_emb.weight' is in the optimizer's group 1 on rank 0 but in group 0 on rank 2") !=
                std::string::npos,
            "a DCP save with the tied weight in two groups: " + msg);
    require(!files::exists(dir / "dcp-split-tie"), "the refused DCP save wrote its directory");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Checkpoints of another GPT (two blocks fewer: only the second stage lacks
// tensors; a wider model: every stage's shapes differ) fail every rank,
// naming what differs, and no stage changes.
TEST(PipelineCheckpoint, AnotherModelsCheckpointFailsEveryStageAndChangesNothing) {
  const auto& s = pipeline_saved();
  ASSERT_EQ(s.error, "");
  TempDir dir("shardtorch-pipeline-ckpt-other");
  const std::string shallow = dir / "shallow.safetensors", wide = dir / "wide";
  {
    auto c = config();
    c.n_layer = 4;
    torch::manual_seed(0);
    gpt::GPT other(c);
    Values v;
    for (auto& item : other->named_parameters()) v[item.key()] = item.value().detach();
    for (auto& item : other->named_buffers()) v[item.key()] = item.value();
    shardtorch::checkpoint::save_file(shallow, {v.begin(), v.end()});
  }
  auto r = run_ranks(4, [&](World& w) {
    auto c = config();
    c.d_model = 2 * c.d_model;
    {
      Unsplit other(w, Strategy::FullShard, c);
      shardtorch::save_sharded_checkpoint(*other.model, other.opt.get(), wide, 0);
      shardtorch::save_dcp_checkpoint(*other.model, other.opt.get(), wide + "-dcp");
    }
    Piped p(w, kSaver);
    shardtorch::load_sharded_checkpoint(*p.pipe, p.opt.get(), s.sharded);
    const Values before = p.values();
    std::string msg = message_of([&] { shardtorch::load_full_state_dict(*p.pipe, shallow); });
    require(msg.find("blocks.4.") != std::string::npos, "a checkpoint without blocks 4 and 5: " + msg);
    require_bitwise(p.values(), before, "after the shallower model's full state dict");
    msg = message_of([&] { shardtorch::load_sharded_checkpoint(*p.pipe, p.opt.get(), wide); });
    require(msg.find("has shape") != std::string::npos, "a wider model's sharded checkpoint: " + msg);
    require_bitwise(p.values(), before, "after the wider model's sharded checkpoint");
    msg = message_of([&] { shardtorch::load_dcp_checkpoint(*p.pipe, p.opt.get(), wide + "-dcp"); });
    require(msg.find("has shape") != std::string::npos, "a wider model's DCP checkpoint: " + msg);
    require_bitwise(p.values(), before, "after the wider model's DCP checkpoint");
    // The optimizer state is the saved one still: the next step is the saving run's.
    p.train(1);
    require_bitwise(p.values(), s.next, "the step after the refused loads");
    // A stage's module by itself is refused on every rank, saying which
    // functions to use (a save would write one stage's over another's).
    for (const bool save : {true, false}) {
      msg = message_of([&] {
        if (save)
          shardtorch::save_dcp_checkpoint(p.pipe->module(), p.opt.get(), dir / "dcp");
        else
          shardtorch::load_dcp_checkpoint(p.pipe->module(), p.opt.get(), dir / "dcp");
      });
      require(msg.find("this model is a Pipeline's stage (pipe.module())") != std::string::npos &&
                  msg.find("(pipe, optimizer, dir) (shardtorch/pipeline_checkpoint.h)") != std::string::npos,
              std::string(save ? "save" : "load") + "_dcp_checkpoint of a stage: " + msg);
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// The tied weight (the token embedding, the head's weight on the last
// stage): a file that holds it under both names with different values loads
// the first name's into both stages, as into the unsplit model, so the tie
// holds; a file that holds it under neither fails every rank, naming it.
TEST(PipelineCheckpoint, TheTiedWeightLoadsTheSameIntoBothStagesOrFailsEveryRank) {
  const auto& s = pipeline_saved();
  ASSERT_EQ(s.error, "");
  TempDir dir("shardtorch-pipeline-ckpt-tied");
  const std::string differing = dir / "differing.safetensors", untied = dir / "untied.safetensors";
  {
    auto t = shardtorch::checkpoint::load_file(s.full);
    t["head.weight"] = torch::zeros_like(t.at("head.weight"));
    shardtorch::checkpoint::save_file(differing, {t.begin(), t.end()});
    t.erase("head.weight");
    t.erase("tok_emb.weight");
    shardtorch::checkpoint::save_file(untied, {t.begin(), t.end()});
  }
  const torch::Tensor embedding = s.truth.at("tok_emb.weight");
  const std::string refused =
      "'tok_emb.weight' and 'head.weight' are one tied parameter of the model, but the "
      "checkpoint holds different values under them";
  // Different values under the tie's two names: refused on every rank (the
  // stages hold the names on different ranks), as by the unsplit model,
  // unless tied_from says which wins; then both stages load that one.
  auto r = run_ranks(4, [&](World& w) {
    Piped p(w, kSaver);
    require(p.pipe->tied_parameters().size() == 1, "the GPT's tie is across the stages");
    const Values before = p.values();
    const std::string e = message_of([&] { shardtorch::load_full_state_dict(*p.pipe, differing); });
    require(e.find(refused) != std::string::npos, "differing values: " + e);
    require_bitwise(p.values(), before, "after the refused load");
    shardtorch::load_full_state_dict(*p.pipe, differing, shardtorch::LoadOptions().tied_from({"tok_emb.weight"}));
    const Values v = p.values();
    for (const char* n : {"tok_emb.weight", "head.weight"})
      if (v.count(n)) require(torch::equal(v.at(n), embedding), std::string(n) + " is not the embedding saved");
    const std::string msg = message_of([&] { shardtorch::load_full_state_dict(*p.pipe, untied); });
    require(msg.find("no entry for parameter 'tok_emb.weight'") != std::string::npos, "no tied weight: " + msg);
    require_bitwise(p.values(), v, "after the refused load");
  });
  ASSERT_TRUE(r.ok) << r.summary();

  // The unsplit model refuses the same file, and reads the same name when told.
  r = run_ranks(1, [&](World& w) {
    Unsplit u(w, Strategy::NoShard);
    const std::string e = message_of([&] { shardtorch::load_full_state_dict(*u.model, differing); });
    require(e.find(refused) != std::string::npos, "the unsplit model: " + e);
    shardtorch::load_full_state_dict(*u.model, differing, shardtorch::LoadOptions().tied_from({"tok_emb.weight"}));
    require(torch::equal(full_values(*u.model).at("head.weight"), embedding), "the unsplit model's head.weight");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

}  // namespace
