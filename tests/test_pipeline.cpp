// Pipeline parallelism: schedules as data, and pipelined training of the
// example GPT against single-process training (losses, first gradients,
// final parameters), over pipeline x data-parallel meshes.
#include <gtest/gtest.h>

#include <csignal>
#include <exception>
#include <fstream>
#include <iterator>
#include <optional>
#include <thread>

#include "captured_warnings.h"
#include "models.h"
#include "rank_errors.h"
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

TEST(PipelineSchedule, ForwardPlansRunEveryMicrobatchThroughEveryStageInOrder) {
  for (auto [p, v, m] : {std::tuple{2, 1, 4}, std::tuple{4, 2, 3}, std::tuple{1, 3, 2}}) {
    const auto plan = pl::make_forward_plan(p, v, m);
    pl::simulate(plan);  // finishes: throws otherwise
    for (int r = 0; r < p; ++r) {
      std::vector<std::string> want;
      for (int mb = 0; mb < m; ++mb)
        for (int c = 0; c < v; ++c) want.push_back("F" + std::to_string(c * p + r) + "." + std::to_string(mb));
      std::vector<std::string> got;
      for (const auto& a : plan.compute(r)) got.push_back(a.str());
      EXPECT_EQ(got, want);
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

// The loss of the reference's final parameters on the batch (what evaluate() must give after training).
double reference_eval_loss = 0;

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
    auto r = testref::train_reference(*model, opt, kSteps, [&](int) { return gpt::lm_loss(model(x), x); });
    torch::NoGradGuard no_grad;
    reference_eval_loss = gpt::lm_loss(model(x), x).item<double>();
    return r;
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
  const TempDir dir("shardtorch-pipeline-timeline");
  const std::string timeline_file = dir / "timeline.json";
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
    CapturedWarnings warnings;
    std::optional<Pipeline> built;
    {
      c10::WarningUtils::WarningHandlerGuard guard(&warnings);
      built.emplace(gpt::pipeline_layers(model), mesh, opts);
    }
    Pipeline& pipe = *built;
    // A strategy that shards nothing (dp 1) is pointed out, once, by rank 0.
    const bool pointless = c.dp == 1 && c.strategy != Strategy::NoShard && w.rank() == 0;
    require(warnings.any_with("over a data-parallel group of one rank shards nothing") == pointless,
            pointless ? "no warning that the strategy shards nothing" : "a warning that the strategy shards nothing");
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
    // Evaluation of the trained pipeline: the reference's loss with its final parameters.
    auto eval =
        pipe.evaluate(pipe.is_first_stage() ? mine : torch::Tensor(), pipe.is_last_stage() ? mine : torch::Tensor(),
                      [](const torch::Tensor& logits, const torch::Tensor& t) { return gpt::lm_loss(logits, t); })
            .reshape({1})
            .clone();
    mesh->group("dp")->comm().all_reduce(eval, c10d::ReduceOp::SUM, "test: the evaluation's loss");
    const double e_loss = eval.item<double>() / c.dp;
    require(std::abs(e_loss - reference_eval_loss) <= 1e-5 * std::abs(reference_eval_loss),
            "evaluate() gives " + std::to_string(e_loss) + ", the reference's final loss is " +
                std::to_string(reference_eval_loss));
    // The timeline is now the evaluation's: forwards only, each of this
    // rank's stages once per micro-batch, written with schedule "forward".
    int forwards = 0;
    for (const auto& e : pipe.timeline()) {
      require(e.action.kind != shardtorch::pipeline::ActionKind::Backward, "a backward in evaluate()'s timeline");
      forwards += e.action.kind == shardtorch::pipeline::ActionKind::Forward;
    }
    require(forwards == c.chunks * c.microbatches,
            "evaluate()'s timeline holds " + std::to_string(forwards) + " forwards");
    pipe.write_timeline(timeline_file);
    if (w.rank() == 0) {
      std::ifstream in(timeline_file);
      std::string head(std::istreambuf_iterator<char>(in), {});
      require(head.rfind("{\"schedule\": \"forward\"", 0) == 0,
              "evaluate()'s timeline is written as " + head.substr(0, 40));
    }
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

// ---------------------------------------------------------------- composition

enum class Variant { Clip, Accumulate, RecomputeOffloadFused };

const char* variant_name(Variant v) {
  switch (v) {
    case Variant::Clip:
      return "clipping";
    case Variant::Accumulate:
      return "accumulation over two steps";
    case Variant::RecomputeOffloadFused:
      return "activation checkpointing, CPU offload and the fused AdamW";
  }
  return "?";
}

constexpr double kMaxNorm = 0.05;  // below the GPT's gradient norm here: every step clips

// Single process: the variant's training on the whole batch.
testref::Run variant_reference(Variant v, std::vector<double>* norms) {
  torch::manual_seed(0);
  gpt::GPT model(pipe_config());
  prepare(model);
  std::vector<torch::Tensor> trainable;
  for (auto& p : unique_tensors(*model))
    if (p.requires_grad()) trainable.push_back(p);
  torch::optim::AdamW opt(trainable, adamw());
  auto x = tokens();
  testref::Run run;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    double loss = 0;
    if (v == Variant::Accumulate) {
      for (int half = 0; half < 2; ++half) {
        auto xs = x.narrow(0, half * kBatch / 2, kBatch / 2);
        auto l = gpt::lm_loss(model(xs), xs) / 2;
        l.backward();
        loss += l.item<double>();
      }
    } else {
      auto l = gpt::lm_loss(model(x), x);
      l.backward();
      loss = l.item<double>();
    }
    run.losses.push_back(loss);
    if (v == Variant::Clip) norms->push_back(torch::nn::utils::clip_grad_norm_(trainable, kMaxNorm));
    if (s == 0)
      for (auto& [n, p] : unique_params(*model))
        if (p.grad().defined()) run.first_grads[n] = p.grad().detach().clone();
    opt.step();
  }
  run.final_params = snapshot(*model);
  return run;
}

class PipelineComposition : public ::testing::TestWithParam<Variant> {};

TEST_P(PipelineComposition, TrainsLikeOneProcess) {
  const Variant v = GetParam();
  std::vector<double> want_norms;
  const auto ref = variant_reference(v, &want_norms);
  const auto x = tokens();
  auto r = run_ranks(4, [&](World& w) {
    auto mesh = DeviceMesh::create(w.shared_from_this(), {{"pp", 2}, {"dp", 2}});
    torch::manual_seed(0);
    gpt::GPT model = shardtorch::deferred([&] { return gpt::GPT(pipe_config()); });
    prepare(model);
    auto shard = shardtorch::ShardOptions();
    if (v == Variant::RecomputeOffloadFused) shard.activation_checkpointing(true).cpu_offload(true);
    Pipeline pipe(gpt::pipeline_layers(model), mesh, PipelineOptions().microbatches(2).shard(shard));
    auto opt = v == Variant::RecomputeOffloadFused
                   ? shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(pipe.module(), adamw())
                   : shardtorch::AdamW(pipe.module(), adamw());
    const int64_t per = kBatch / 2, d = mesh->coordinate("dp");
    auto mine = x.narrow(0, d * per, per);
    auto run = [&](const torch::Tensor& rows, double scale) {
      auto loss = pipe.step(
          pipe.is_first_stage() ? rows : torch::Tensor(), pipe.is_last_stage() ? rows : torch::Tensor(),
          [scale](const torch::Tensor& logits, const torch::Tensor& t) { return gpt::lm_loss(logits, t) * scale; });
      auto global = loss.reshape({1}).clone();
      mesh->group("dp")->comm().all_reduce(global, c10d::ReduceOp::SUM, "test: the step's loss");
      return global.item<double>() / 2;
    };
    testref::Run got;
    for (int s = 0; s < kSteps; ++s) {
      opt->zero_grad();
      double loss = 0;
      if (v == Variant::Accumulate) {
        // Each data-parallel rank's rows in two halves, as the reference's halves of the whole batch.
        pipe.sharded().set_requires_gradient_sync(false);
        loss += run(x.narrow(0, d * per / 2, per / 2), 0.5);
        pipe.sharded().set_requires_gradient_sync(true);
        loss += run(x.narrow(0, kBatch / 2 + d * per / 2, per / 2), 0.5);
      } else {
        loss = run(mine, 1.0);
      }
      got.losses.push_back(loss);
      if (v == Variant::Clip) {
        const double norm = pipe.clip_grad_norm(kMaxNorm);
        require(std::abs(norm - want_norms[s]) <= 1e-5 * want_norms[s],
                "step " + std::to_string(s) + ": gradient norm " + std::to_string(norm) + ", the reference's " +
                    std::to_string(want_norms[s]));
      }
      if (s == 0) got.first_grads = testref::full_gradients(pipe.module());
      opt->step();
    }
    got.final_params = testref::full_parameters(pipe.module());
    for (auto* m : {&got.first_grads, &got.final_params})
      if (m->count("head.weight") && !m->count("tok_emb.weight")) {
        (*m)["tok_emb.weight"] = (*m)["head.weight"];
        m->erase("head.weight");
      }
    testref::expect_same_run(got, ref, 1e-5, variant_name(v), /*subset=*/true);
  });
  EXPECT_TRUE(r.ok) << variant_name(v) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Variants, PipelineComposition,
                         ::testing::Values(Variant::Clip, Variant::Accumulate, Variant::RecomputeOffloadFused),
                         [](const auto& info) {
                           switch (info.param) {
                             case Variant::Clip:
                               return std::string("Clip");
                             case Variant::Accumulate:
                               return std::string("Accumulate");
                             default:
                               return std::string("RecomputeOffloadFused");
                           }
                         });

// ---------------------------------------------------------------- failures

TEST(PipelineFailures, RanksThatBuildDifferentPipelinesFailBeforeAnyTransfer) {
  auto r = run_ranks(2, [](World& w) {
    auto mesh = DeviceMesh::create(w.shared_from_this(), {{"pp", 2}});
    torch::manual_seed(0);
    gpt::GPT model = shardtorch::deferred([&] { return gpt::GPT(pipe_config()); });
    Pipeline pipe(gpt::pipeline_layers(model), mesh, PipelineOptions().microbatches(w.rank() == 1 ? 2 : 4));
  });
  ASSERT_FALSE(r.ok);
  for (const auto& m : errors_of(r)) {
    EXPECT_NE(m.find("the ranks build different pipelines"), std::string::npos) << m;
    EXPECT_NE(m.find("4 micro-batches"), std::string::npos) << m;  // rank 0's line
    EXPECT_NE(m.find("2 micro-batches"), std::string::npos) << m;  // rank 1's
  }
  // Split points that differ are named as the program gave them.
  auto split = run_ranks(2, [](World& w) {
    auto mesh = DeviceMesh::create(w.shared_from_this(), {{"pp", 2}});
    torch::manual_seed(0);
    gpt::GPT model = shardtorch::deferred([&] { return gpt::GPT(pipe_config()); });
    Pipeline pipe(gpt::pipeline_layers(model), mesh,
                  PipelineOptions().split_at({w.rank() == 1 ? "blocks.2" : "blocks.1"}));
  });
  ASSERT_FALSE(split.ok);
  for (const auto& m : errors_of(split))
    EXPECT_NE(m.find("'stages begin at layers: 0 'embed' 2 'blocks.1'' on rank 0 but 'stages begin at layers: 0 "
                     "'embed' 3 'blocks.2'' on rank 1"),
              std::string::npos)
        << m;
}

// Mistakes in naming what the pipeline is built from say what there is:
// the layers a split point can name, the mesh's dimensions and the option
// that names them, and, for the model whose layers a Pipeline took, that
// its module() is the model to pass.
TEST(PipelineFailures, AWrongNameSaysWhatThereIs) {
  auto r = run_ranks(2, [](World& w) {
    torch::manual_seed(0);
    auto mistake = [&](const std::function<void()>& f, const std::string& want) {
      try {
        f();
      } catch (const shardtorch::Error& e) {
        require(std::string(e.what()).find(want) != std::string::npos,
                "'" + want + "' is not in: " + std::string(e.what()));
        return;
      }
      require(false, "no error; expected: " + want);
    };
    auto mesh = DeviceMesh::create(w.shared_from_this(), {{"pp", 2}});
    gpt::GPT model = shardtorch::deferred([&] { return gpt::GPT(pipe_config()); });
    mistake([&] { Pipeline(gpt::pipeline_layers(model), mesh, PipelineOptions().split_at({"block.2"})); },
            "split_at names layer 'block.2', which is not one of the layers ('embed', 'blocks.0', 'blocks.1'");
    auto named = DeviceMesh::create(w.shared_from_this(), {{"stage", 2}});
    mistake([&] { Pipeline(gpt::pipeline_layers(model), named, PipelineOptions()); },
            "has no dimension 'pp' for the stages (it has 'stage'); name it in PipelineOptions::pp_dim");
    Pipeline pipe(gpt::pipeline_layers(model), mesh, PipelineOptions().microbatches(2));
    mistake([&] { shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-3)); },
            "this module is not the root of a sharded model, but its submodule 'blocks.");
    mistake([&] { shardtorch::shard(model, w); }, "a shardtorch::Pipeline was built from its layers");
  });
  EXPECT_TRUE(r.ok) << r.summary();
}

// A schedule the options cannot run is refused on every rank at
// construction, saying why once (the plan's error, without a second
// "shardtorch: " inside the pipeline's).
TEST(PipelineFailures, AScheduleTheOptionsCannotRunIsRefusedOnEveryRank) {
  auto r = run_ranks(2, [](World& w) {
    auto mesh = DeviceMesh::create(w.shared_from_this(), {{"pp", 2}});
    torch::manual_seed(0);
    gpt::GPT model = shardtorch::deferred([&] { return gpt::GPT(pipe_config()); });
    Pipeline pipe(gpt::pipeline_layers(model), mesh,
                  PipelineOptions().schedule(Schedule::Interleaved1F1B).chunks_per_rank(1).microbatches(4));
  });
  ASSERT_FALSE(r.ok);
  for (const auto& m : errors_of(r)) {
    EXPECT_NE(m.find("shardtorch::Pipeline: the interleaved 1F1B schedule needs at least 2 chunks per rank"),
              std::string::npos)
        << m;
    EXPECT_EQ(m.find("shardtorch: the interleaved"), std::string::npos) << m;
  }
}

TEST(PipelineFailures, AStepWithFewerRowsThanMicrobatchesFailsOnEveryRank) {
  auto r = run_ranks(2, [](World& w) {
    auto mesh = DeviceMesh::create(w.shared_from_this(), {{"pp", 2}});
    torch::manual_seed(0);
    gpt::GPT model = shardtorch::deferred([&] { return gpt::GPT(pipe_config()); });
    Pipeline pipe(gpt::pipeline_layers(model), mesh, PipelineOptions().microbatches(4));
    auto x = tokens().narrow(0, 0, 3);
    pipe.step(x, x, [](const torch::Tensor& l, const torch::Tensor& t) { return gpt::lm_loss(l, t); });
  });
  ASSERT_FALSE(r.ok);
  const auto m = errors_of(r);
  EXPECT_NE(m[0].find("at least 4 rows (one per micro-batch), got Long[3, 8]"), std::string::npos) << m[0];
  EXPECT_NE(m[1].find("rank 0 (the first stage) refused its inputs"), std::string::npos) << m[1];
}

// Data-parallel replicas whose first stages get different numbers of rows
// would average gradients of unequal shares (not the whole batch's): every
// rank fails, the first stages naming each replica's rows. An evaluation
// (no gradients) takes them.
TEST(PipelineFailures, ReplicasWithDifferentRowsFailOnEveryRank) {
  auto r = run_ranks(4, [](World& w) {
    auto mesh = DeviceMesh::create(w.shared_from_this(), {{"pp", 2}, {"dp", 2}});
    torch::manual_seed(0);
    gpt::GPT model = shardtorch::deferred([&] { return gpt::GPT(pipe_config()); });
    Pipeline pipe(gpt::pipeline_layers(model), mesh, PipelineOptions().microbatches(2));
    auto x = tokens().narrow(0, 0, mesh->coordinate("dp") == 0 ? 4 : 6);
    auto lm = [](const torch::Tensor& l, const torch::Tensor& t) { return gpt::lm_loss(l, t); };
    pipe.evaluate(x, x, lm);  // no gradients to average: each pipeline's loss is its own
    pipe.step(x, x, lm);
  });
  ASSERT_FALSE(r.ok);
  const auto m = errors_of(r);
  for (int k : {0, 1})  // the first stage: ranks 0 and 1 (pp 0, dp 0 and 1)
    EXPECT_NE(m[k].find("the data-parallel replicas' first stages got different numbers of rows (4 on rank 0, 6 on "
                        "rank 1)"),
              std::string::npos)
        << m[k];
  for (int k : {2, 3}) EXPECT_NE(m[k].find("(the first stage) refused its inputs"), std::string::npos) << m[k];
}

// Two steps of a 2-stage pipeline whose last layer (stage 1's) calls `fail`
// in its third forward of the second step: micro-batch 2.
// `caught`: rank 1's program catches the error of its step and returns.
shardtorch::testing::RunResult stage_one_fails(const std::function<void()>& fail, bool caught = false) {
  return run_ranks(
      2,
      [&](World& w) {
        auto mesh = DeviceMesh::create(w.shared_from_this(), {{"pp", 2}});
        torch::manual_seed(0);
        gpt::GPT model = shardtorch::deferred([&] { return gpt::GPT(pipe_config()); });
        auto layers = gpt::pipeline_layers(model);
        // The last layer (stage 1's) throws in its third forward of the second step: micro-batch 2.
        auto calls = std::make_shared<int>(0);
        auto inner = layers.back().forward;
        layers.back().forward = [inner, calls, &fail](const at::Tensor& x) {
          if (++*calls == 4 + 3) fail();
          return inner(x);
        };
        Pipeline pipe(layers, mesh, PipelineOptions().microbatches(4));
        auto x = tokens();
        try {
          for (int s = 0; s < 2; ++s)
            pipe.step(x, x, [](const torch::Tensor& l, const torch::Tensor& t) { return gpt::lm_loss(l, t); });
        } catch (const std::exception&) {
          if (!caught || w.rank() != 1) throw;
        }
      },
      shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(60)));
}

// A stage that dies mid-step: its peer's error names it, what it was doing,
// and comes when the connection closes, not at the timeout.
TEST(PipelineFailures, AStageThatDiesIsNamedByItsPeerAtOnce) {
  auto r = stage_one_fails([] { throw std::runtime_error("the head ran out of memory (simulated)"); });
  ASSERT_FALSE(r.ok);
  const auto m = errors_of(r);
  EXPECT_NE(m[1].find("the head ran out of memory (simulated)"), std::string::npos) << m[1];
  // Rank 0 waits for a gradient from rank 1 and hears that it is gone, naming where it was.
  EXPECT_NE(m[0].find("rank 1"), std::string::npos) << m[0];
  EXPECT_NE(m[0].find("forward of unit 'blocks.5' (pipeline stage 1 of 2, micro-batch 2 of 4)"), std::string::npos)
      << m[0];
  EXPECT_NE(m[0].find("micro-batch 2 of 4"), std::string::npos) << m[0];
  // ... and the error that ended it (the record says so before its groups close).
  EXPECT_NE(m[0].find("Peer at fault: rank 1 stopped on an error of its own (the head ran out of memory (simulated)): "
                      "its World was destroyed "),
            std::string::npos)
      << m[0];
  EXPECT_NE(m[0].find("the head ran out of memory (simulated)"), std::string::npos) << m[0];
  const auto at = m[0].find("did not complete after ");
  ASSERT_NE(at, std::string::npos) << m[0];
  EXPECT_LT(std::stod(m[0].substr(at + 23)), 30.0) << "rank 0 waited for the timeout: " << m[0];
  // A program that catches its step's error and ends: its peer gives the error too.
  auto c = stage_one_fails([] { throw std::runtime_error("the head ran out of memory (simulated)"); },
                           /*caught=*/true);
  ASSERT_FALSE(c.ok);
  EXPECT_EQ(c.ranks[1].exit_code, 0) << c.summary();
  const auto n = errors_of(c);
  EXPECT_NE(n[0].find("Peer at fault: rank 1 had finished after an error of its own that the program caught (the "
                      "head ran out of memory (simulated))"),
            std::string::npos)
      << n[0];
  EXPECT_NE(n[0].find("the head ran out of memory (simulated)"), std::string::npos) << n[0];
}

// The same when nothing catches the exception (std::terminate, as when it
// leaves main or a thread): the process aborts with its World alive, and its
// peer's error gives the exception's message and where the stage was.
TEST(PipelineFailures, AStageEndedByAnExceptionNothingCaughtIsNamedWithItsMessage) {
  auto r = stage_one_fails(
      [] { std::thread([] { throw std::runtime_error("the head ran out of memory (simulated)"); }).join(); });
  ASSERT_FALSE(r.ok);
  EXPECT_EQ(r.ranks[1].signal, SIGABRT) << r.summary();
  const auto m = errors_of(r);
  EXPECT_NE(m[0].find("Peer at fault: rank 1 is ending on an exception that nothing caught (the head ran out of "
                      "memory (simulated))"),
            std::string::npos)
      << m[0];
  EXPECT_NE(m[0].find("forward of unit 'blocks.5' (pipeline stage 1 of 2, micro-batch 2 of 4)"), std::string::npos)
      << m[0];
  // std::terminate with no exception in flight says so.
  auto t = stage_one_fails([] { std::terminate(); });
  EXPECT_EQ(t.ranks[1].signal, SIGABRT) << t.summary();
  const auto n = errors_of(t);
  EXPECT_NE(n[0].find("Peer at fault: rank 1 is ending in std::terminate, with no exception in flight, "),
            std::string::npos)
      << n[0];
}
}  // namespace
