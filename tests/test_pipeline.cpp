// Pipeline parallelism: schedules as data, and pipelined training of the
// example GPT against single-process training (losses, first gradients,
// final parameters), over pipeline x data-parallel meshes.
#include <gtest/gtest.h>

#include "models.h"
#include "reference.h"

using namespace testmodels;
using shardtorch::DeviceMesh;
using shardtorch::Pipeline;
using shardtorch::PipelineOptions;
using shardtorch::Schedule;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;
namespace pl = shardtorch::pipeline;

namespace {

// ---------------------------------------------------------------- schedules

TEST(PipelineSchedule, EveryPlanFinishesWithTheBubbleTheTheoryGives) {
  int plans = 0;
  for (int p = 1; p <= 6; ++p)
    for (int v = 1; v <= 3; ++v)
      for (int m = 1; m <= 12; ++m)
        for (auto s : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved1F1B}) {
          if ((s == Schedule::Interleaved1F1B) != (v > 1) || (v > 1 && m % p != 0)) continue;
          const auto plan = pl::make_plan(s, p, v, m);
          const auto sim = pl::simulate(plan, 1.0, 2.0);
          const double theory = pl::theoretical_bubble(plan);
          // Rank 0 idles exactly the theory's share; no rank idles more.
          EXPECT_NEAR(sim.bubble[0], theory, 1e-12) << plan.str();
          for (double b : sim.bubble) EXPECT_LE(b, theory + 1e-12) << plan.str();
          if (s == Schedule::OneFOneB)  // 1F1B bounds the micro-batches in flight by the stages after a rank
            for (int r = 0; r < p; ++r) EXPECT_LE(sim.peak_in_flight[r], std::min(m, p - r)) << plan.str();
          if (s == Schedule::GPipe)
            for (int r = 0; r < p; ++r) EXPECT_EQ(sim.peak_in_flight[r], m);
          ++plans;
        }
  EXPECT_EQ(plans, 202);  // the grid above
}

TEST(PipelineSchedule, EveryMicrobatchRunsOnceAndEveryTransferHasItsPeer) {
  for (auto [s, p, v, m] :
       {std::tuple{Schedule::GPipe, 3, 1, 5}, std::tuple{Schedule::OneFOneB, 4, 1, 8},
        std::tuple{Schedule::Interleaved1F1B, 2, 3, 4}, std::tuple{Schedule::Interleaved1F1B, 1, 2, 3}}) {
    pl::PlanOptions o;
    o.gathers = true;
    o.tied = true;
    const auto plan = pl::make_plan(s, p, v, m, o);
    std::map<std::string, int> seen;
    for (int r = 0; r < p; ++r) {
      std::map<std::pair<int, int>, size_t> forward_at;
      const auto& acts = plan.actions[r];
      ASSERT_EQ(acts.front().kind, pl::ActionKind::Unshard);
      ASSERT_EQ(acts.back().kind, pl::ActionKind::SyncTied);
      int reduces = 0;
      for (size_t i = 0; i < acts.size(); ++i) {
        const auto& a = acts[i];
        ++seen[a.str()];
        if (a.kind == pl::ActionKind::Forward) {
          EXPECT_EQ(plan.rank_of(a.stage), r);
          forward_at[{a.stage, a.microbatch}] = i;
        }
        if (a.kind == pl::ActionKind::Backward) {
          ASSERT_TRUE(forward_at.count({a.stage, a.microbatch})) << a.str() << " before its forward";
          reduces += a.reduce;
        }
        // A send's receive is on the peer's rank; a stage's neighbour on the same rank needs none.
        if (a.kind == pl::ActionKind::SendActivation || a.kind == pl::ActionKind::SendGradient) {
          EXPECT_NE(plan.rank_of(a.peer_stage), r);
          pl::Action recv = a;
          recv.kind =
              a.kind == pl::ActionKind::SendActivation ? pl::ActionKind::RecvActivation : pl::ActionKind::RecvGradient;
          recv.stage = a.peer_stage;
          recv.peer_stage = a.stage;
          const auto& peer = plan.actions[plan.rank_of(a.peer_stage)];
          EXPECT_EQ(std::count(peer.begin(), peer.end(), recv), 1) << a.str() << " has no receive " << recv.str();
        }
      }
      EXPECT_EQ(reduces, 1) << "rank " << r << ": the last backward alone reduces";
    }
    for (int st = 0; st < p * v; ++st)
      for (int mb = 0; mb < m; ++mb) {
        EXPECT_EQ(seen["F" + std::to_string(st) + "." + std::to_string(mb)], 1);
        const std::string b = "B" + std::to_string(st) + "." + std::to_string(mb);
        EXPECT_EQ(seen[b] + seen[b + "+reduce"], 1);
      }
  }
}

TEST(PipelineSchedule, UnsupportedCombinationsAreRefusedByName) {
  auto message = [](auto f) {
    try {
      f();
    } catch (const shardtorch::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message([] { pl::make_plan(Schedule::OneFOneB, 2, 2, 4); }).find("for several use interleaved_1f1b"),
            std::string::npos);
  EXPECT_NE(message([] { pl::make_plan(Schedule::Interleaved1F1B, 2, 1, 4); }).find("at least 2 chunks"),
            std::string::npos);
  EXPECT_NE(message([] { pl::make_plan(Schedule::Interleaved1F1B, 4, 2, 6); }).find("multiple of the pipeline ranks"),
            std::string::npos);
  EXPECT_EQ(shardtorch::parse_schedule("1F1B"), Schedule::OneFOneB);
  EXPECT_EQ(shardtorch::parse_schedule("interleaved-1f1b"), Schedule::Interleaved1F1B);
  EXPECT_THROW(shardtorch::parse_schedule("zb"), shardtorch::Error);
}

// ---------------------------------------------------------------- training parity

gpt::Config pipe_config() {
  gpt::Config c;
  c.vocab = 32;
  c.seq_len = 8;
  c.d_model = 16;
  c.n_head = 2;
  c.n_layer = 6;  // 8 layers: embed, 6 blocks, head
  return c;
}

// A stage with frozen parameters: block 1's first norm. And norm biases away
// from zero, where they start: parameters are compared relative to their
// largest magnitude, which for a bias three small steps from zero is the
// size of a step, and an element whose gradient is within rounding of zero
// (block 4's ln2.bias has one at 4e-5 of the others) takes a step set by
// the rounding.
void prepare(gpt::GPT& m) {
  torch::NoGradGuard no_grad;
  for (auto* ln : {&m->ln_f}) (*ln)->bias.normal_(0.0, 0.1);
  for (auto& b : m->block_list)
    for (auto* ln : {&b->ln1, &b->ln2}) (*ln)->bias.normal_(0.0, 0.1);
  for (auto& p : m->block_list[1]->ln1->parameters()) p.set_requires_grad(false);
}

torch::Tensor tokens() {
  torch::manual_seed(321);
  return torch::randint(0, pipe_config().vocab, {kBatch, pipe_config().seq_len}, torch::kLong);
}

constexpr int kSteps = 3;
// AdamW with eps 1e-6: an element whose gradient is within float rounding
// of zero (summed over micro-batches in another order than over the whole
// batch) would otherwise take an update set by the rounding; the gradients
// themselves are compared after the first backward.
torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-3).eps(1e-6); }

const testref::Run& reference() {
  static const testref::Run run = [] {
    torch::manual_seed(0);
    gpt::GPT model(pipe_config());
    prepare(model);
    std::vector<torch::Tensor> trainable;
    for (auto& p : unique_tensors(*model))
      if (p.requires_grad()) trainable.push_back(p);
    torch::optim::AdamW opt(trainable, adamw());
    auto x = tokens();
    return testref::train_reference(*model, opt, kSteps, [&](int) { return gpt::lm_loss(model(x), x); });
  }();
  return run;
}

struct PipeCase {
  Schedule schedule;
  int pp, dp, chunks;
  Strategy strategy;
  std::vector<std::string> split;  // empty: balanced
  int microbatches = 4;
};

std::string case_name(const PipeCase& c) {
  std::string s = std::string(shardtorch::schedule_name(c.schedule)) + " pp" + std::to_string(c.pp) + " dp" +
                  std::to_string(c.dp) + " x" + std::to_string(c.chunks) + " " + shardtorch::strategy_name(c.strategy);
  return s + (c.split.empty() ? " balanced" : " split") + " m" + std::to_string(c.microbatches);
}

// The pipelined run of `c`, checked against the reference on every rank (its
// stage's parameters), with the executed actions checked against the plan.
void expect_pipeline_trains_like_one_process(const PipeCase& c) {
  const auto& ref = reference();
  const auto x = tokens();
  auto r = run_ranks(c.pp * c.dp, [&](World& w) {
    auto mesh = DeviceMesh::create(w.shared_from_this(), {{"pp", c.pp}, {"dp", c.dp}});
    torch::manual_seed(0);
    gpt::GPT model = shardtorch::deferred([&] { return gpt::GPT(pipe_config()); });
    prepare(model);
    auto opts = PipelineOptions()
                    .schedule(c.schedule)
                    .microbatches(c.microbatches)
                    .chunks_per_rank(c.chunks)
                    .shard(strategy_options(c.strategy, c.dp))
                    .record_timeline(true);
    if (!c.split.empty()) opts.split_at(c.split);
    Pipeline pipe(gpt::pipeline_layers(model), mesh, opts);
    auto opt = shardtorch::AdamW(pipe.module(), adamw());
    const int64_t per = kBatch / c.dp, d = mesh->coordinate("dp");
    auto mine = x.narrow(0, d * per, per);
    testref::Run got;
    for (int s = 0; s < kSteps; ++s) {
      opt->zero_grad();
      auto loss =
          pipe.step(pipe.is_first_stage() ? mine : torch::Tensor(), pipe.is_last_stage() ? mine : torch::Tensor(),
                    [](const torch::Tensor& logits, const torch::Tensor& t) { return gpt::lm_loss(logits, t); });
      // Every stage returns its pipeline's loss; the batch's is their mean over dp.
      auto global = loss.reshape({1}).clone();
      mesh->group("dp")->comm().all_reduce(global, c10d::ReduceOp::SUM, "test: the step's loss");
      got.losses.push_back(global.item<double>() / c.dp);
      if (s == 0) got.first_grads = testref::full_gradients(pipe.module());
      // The actions ran in the plan's order.
      std::vector<std::string> ran, planned;
      for (const auto& e : pipe.timeline()) ran.push_back(e.action.str());
      for (const auto& a : pipe.plan().actions[mesh->coordinate("pp")]) planned.push_back(a.str());
      require(ran == planned, "the actions ran in another order than planned");
      opt->step();
    }
    got.final_params = testref::full_parameters(pipe.module());
    // The LM head's weight is the token embedding's (the reference names it so).
    for (auto* m : {&got.first_grads, &got.final_params})
      if (m->count("head.weight") && !m->count("tok_emb.weight")) {
        (*m)["tok_emb.weight"] = (*m)["head.weight"];
        m->erase("head.weight");
      }
    const double e = testref::expect_same_run(got, ref, 1e-5, case_name(c), /*subset=*/true);
    if (w.rank() == 0) std::cout << "  " << case_name(c) << ": max relative error " << e << std::endl;
  });
  EXPECT_TRUE(r.ok) << case_name(c) << ": " << r.summary();
}

class PipelineParity : public ::testing::TestWithParam<PipeCase> {};

TEST_P(PipelineParity, TrainsTheGptLikeOneProcess) { expect_pipeline_trains_like_one_process(GetParam()); }

const std::vector<std::string> kUneven2 = {"blocks.1"};                          // 2 layers | 6 layers
const std::vector<std::string> kUneven4 = {"blocks.1", "blocks.2", "blocks.5"};  // 2 | 1 | 3 | 2

INSTANTIATE_TEST_SUITE_P(Meshes, PipelineParity,
                         ::testing::Values(PipeCase{Schedule::GPipe, 2, 1, 1, Strategy::NoShard, kUneven2},
                                           PipeCase{Schedule::GPipe, 2, 2, 1, Strategy::FullShard, {}},
                                           PipeCase{Schedule::OneFOneB, 2, 1, 1, Strategy::FullShard, kUneven2},
                                           PipeCase{Schedule::OneFOneB, 2, 2, 1, Strategy::NoShard, {}},
                                           PipeCase{Schedule::OneFOneB, 2, 2, 1, Strategy::FullShard, kUneven2},
                                           PipeCase{Schedule::OneFOneB, 4, 1, 1, Strategy::NoShard, kUneven4},
                                           PipeCase{Schedule::OneFOneB, 4, 2, 1, Strategy::FullShard, {}},
                                           PipeCase{Schedule::Interleaved1F1B, 2, 1, 2, Strategy::FullShard, kUneven4},
                                           PipeCase{Schedule::Interleaved1F1B, 2, 2, 2, Strategy::NoShard, {}},
                                           PipeCase{Schedule::Interleaved1F1B, 4, 1, 2, Strategy::FullShard, {}, 4},
                                           PipeCase{Schedule::Interleaved1F1B, 4, 2, 2, Strategy::NoShard, {}, 4},
                                           PipeCase{Schedule::Interleaved1F1B, 1, 2, 2, Strategy::FullShard, {}},
                                           PipeCase{Schedule::OneFOneB, 2, 2, 1, Strategy::ShardGradOp, {}},
                                           PipeCase{Schedule::OneFOneB, 2, 2, 1, Strategy::OptimizerOnly, {}},
                                           PipeCase{Schedule::OneFOneB, 2, 4, 1, Strategy::HybridShard, {}, 3},
                                           PipeCase{Schedule::OneFOneB, 2, 1, 1, Strategy::FullShard, {}, 5}),
                         [](const auto& info) {
                           std::string n = case_name(info.param);
                           for (auto& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

}  // namespace
