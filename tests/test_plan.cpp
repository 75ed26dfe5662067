// The memory planner predicts, before anything is sharded, the model-state
// bytes shard() and the optimizer then hold, byte for byte, for every
// strategy, world size, precision and offload policy; its transient estimates
// bound the peaks measured in a step.
#include <gtest/gtest.h>

#include "shardtorch/error.h"
#include "models.h"
#include "shardtorch/mesh.h"
#include "shardtorch/pipeline.h"
#include "shardtorch/plan.h"

using namespace testmodels;
using shardtorch::Mem;
using shardtorch::ShardOptions;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

const Mem kModelState[] = {Mem::ShardedParams, Mem::ReplicatedParams, Mem::Gradients,         Mem::OptimizerState,
                           Mem::HostParams,    Mem::HostGradients,    Mem::HostOptimizerState};
const Mem kTransient[] = {Mem::GatheredParams, Mem::GradStaging, Mem::Buckets};

void expect_same_specs(const std::vector<shardtorch::UnitSpec>& got, const std::vector<shardtorch::UnitSpec>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t u = 0; u < want.size(); ++u) {
    EXPECT_EQ(got[u].name, want[u].name);
    ASSERT_EQ(got[u].flats.size(), want[u].flats.size()) << "unit '" << want[u].name << "'";
    for (size_t f = 0; f < want[u].flats.size(); ++f) {
      EXPECT_EQ(got[u].flats[f].numel, want[u].flats[f].numel) << "unit '" << want[u].name << "' flat " << f;
      EXPECT_EQ(got[u].flats[f].dtype, want[u].flats[f].dtype);
      EXPECT_EQ(got[u].flats[f].trainable, want[u].flats[f].trainable);
    }
  }
}

// Model state measured equals the plan byte for byte; transient peaks stay
// within it; NoShard's fp32 gradient copies peak exactly at the plan and are
// gone after the step (m is taken after one).
void require_plan_holds(const shardtorch::MemorySnapshot& m, const shardtorch::MemoryPlan& plan,
                        const std::string& what) {
  for (Mem c : kModelState) {
    require(m.cur(c) == plan.of(c), what + ": " + shardtorch::mem_name(c) + " measured " + std::to_string(m.cur(c)) +
                                        ", planned " + std::to_string(plan.of(c)));
  }
  for (Mem c : kTransient) {
    require(m.max(c) <= plan.of(c), what + ": peak " + shardtorch::mem_name(c) + " measured " +
                                        std::to_string(m.max(c)) + " above the plan's " + std::to_string(plan.of(c)));
  }
  require(m.max(Mem::MasterGrads) == plan.of(Mem::MasterGrads) && m.cur(Mem::MasterGrads) == 0,
          what + ": master_grads peaked at " + std::to_string(m.max(Mem::MasterGrads)) + " (planned " +
              std::to_string(plan.of(Mem::MasterGrads)) + ") and holds " + std::to_string(m.cur(Mem::MasterGrads)) +
              " after the step");
}

// One Adam step of `model` (7 input features) from a reset peak; rank 0,
// which owns the most, then requires the plan to hold.
template <class M>
void one_step_holds_plan(M& model, shardtorch::ShardedModel& sm, const World& w, const shardtorch::MemoryPlan& plan,
                         const std::string& what) {
  auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
  sm.reset_peak_memory();
  model(torch::randn({4, 7})).square().mean().backward();
  opt->step();
  if (w.rank() != 0) return;
  require_plan_holds(sm.memory(), plan, what);
}

// Units of a linear layer and a batch norm (odd sizes: every flat parameter
// is padded somewhere), under a root with a frozen head bias.
struct NormedImpl : torch::nn::Module {
  NormedImpl(int64_t in, int64_t out)
      : fc(register_module("fc", torch::nn::Linear(in, out))), bn(register_module("bn", torch::nn::BatchNorm1d(out))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::relu(bn(fc(x))); }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
};
SHARDTORCH_MODULE(Normed);

struct NormedNetImpl : torch::nn::Module {
  NormedNetImpl()
      : a(register_module("a", Normed(7, 13))),
        b(register_module("b", Normed(13, 11))),
        head(register_module("head", torch::nn::Linear(11, 3))) {
    head->bias.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor x) { return head(b(a(x))); }
  Normed a, b;
  torch::nn::Linear head;
};
SHARDTORCH_MODULE(NormedNet);

}  // namespace

TEST(Plan, GptShapeArithmeticEqualsTheWalkOfAConstructedModel) {
  for (gpt::Config c : {gpt::Config{}, gpt::Config{97, 33, 48, 6, 3}}) {
    auto model = gpt::GPT(c);
    expect_same_specs(gpt::unit_specs(c), shardtorch::unit_specs(*model));
  }
  // A sharded model plans the same as before, under mixed precision too: the
  // dtype planned from is the masters', not the bf16 the parameters compute
  // in (which planned model state at half its size).
  for (Strategy s : {Strategy::FullShard, Strategy::NoShard}) {
    for (bool bf16 : {false, true}) {
      auto r = run_ranks(2, [&](World& w) {
        auto model = gpt::GPT(gpt::Config{});
        auto before = shardtorch::unit_specs(*model);
        auto opts = strategy_options(s, 2);
        if (bf16) opts.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16));
        shardtorch::shard(model, w, opts);
        require(!bf16 || model->ln_f->weight.scalar_type() == at::kBFloat16, "the model does not compute in bf16");
        auto after = shardtorch::unit_specs(*model);
        require(after.size() == before.size(), "unit count changed when the model was sharded");
        for (size_t u = 0; u < before.size(); ++u) {
          require(after[u].flats.size() == before[u].flats.size(), "flat count of unit " + before[u].name);
          for (size_t f = 0; f < before[u].flats.size(); ++f) {
            const auto &a = after[u].flats[f], &b = before[u].flats[f];
            require(a.numel == b.numel && a.dtype == b.dtype && a.trainable == b.trainable,
                    "unit '" + before[u].name + "' flat " + std::to_string(f) + " planned as " +
                        std::to_string(a.numel) + " " + c10::toString(a.dtype) + " after sharding, " +
                        std::to_string(b.numel) + " " + c10::toString(b.dtype) + " before");
          }
        }
        const auto o = shardtorch::PlanOptions{opts, 2, 2};
        require(shardtorch::plan_memory(after, o).model_state() == shardtorch::plan_memory(before, o).model_state(),
                "the plan of the sharded model differs");
      });
      EXPECT_TRUE(r.ok) << shardtorch::strategy_name(s) << (bf16 ? " bf16" : " fp32") << "\n" << r.summary();
    }
  }
  auto mlp = MLP();
  auto specs = shardtorch::unit_specs(*mlp);
  ASSERT_EQ(specs.size(), 4u);  // the root (a unit without parameters), l1, l2, l3
  EXPECT_TRUE(specs[0].flats.empty());
  ASSERT_EQ(specs[2].name, "l2");
  ASSERT_EQ(specs[2].flats.size(), 2u);  // l2: a trainable flat and one of its frozen bias
  EXPECT_EQ(specs[2].flats[0].numel, 13 * 5);
  EXPECT_EQ(specs[2].flats[1].numel, 5);
  EXPECT_FALSE(specs[2].flats[1].trainable);
}

// A GPT split over tensor-parallel ranks: the shape arithmetic gives one
// rank's slices, and planned over the data-parallel ranks it is that rank's
// memory (model state exact, transients bounded) at tp 2 x dp 2.
TEST(Plan, ATensorParallelGptPlansItsSlicesOverTheDataParallelRanks) {
  const gpt::Config cfg{66, 16, 24, 4, 3};  // vocabulary, heads and widths split in two; odd flats padded
  for (Strategy s : {Strategy::FullShard, Strategy::NoShard}) {
    const auto opts = strategy_options(s, 2).bucket_mb(0.01);
    const auto plan = shardtorch::plan_memory(gpt::unit_specs(cfg, 2), {opts, 2, 2});
    auto r = run_ranks(4, [&](World& w) {
      auto mesh = shardtorch::DeviceMesh::create(w.shared_from_this(), {{"dp", 2}, {"tp", 2}});
      torch::manual_seed(0);
      auto model = gpt::GPT(cfg);
      shardtorch::parallelize(*model, (*mesh)["tp"], gpt::tp_plan(cfg));
      const auto specs = shardtorch::unit_specs(*model), want = gpt::unit_specs(cfg, 2);
      require(specs.size() == want.size(), "unit count");
      for (size_t u = 0; u < specs.size(); ++u)
        for (size_t f = 0; f < specs[u].flats.size(); ++f)
          require(f < want[u].flats.size() && specs[u].flats[f].numel == want[u].flats[f].numel,
                  "unit '" + specs[u].name + "': the split model's flat " + std::to_string(f) + " holds " +
                      std::to_string(specs[u].flats[f].numel) + " elements, the shape arithmetic says otherwise");
      auto sm = shardtorch::shard(model, (*mesh)["dp"], opts);
      auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-3));
      auto x = torch::randint(cfg.vocab, {2, cfg.seq_len}, torch::kLong);
      sm.reset_peak_memory();
      gpt::lm_loss_tp(model(x), x, (*mesh)["tp"]).backward();
      opt->step();
      if ((*mesh)["dp"]->rank() == 0) require_plan_holds(sm.memory(), plan, shardtorch::strategy_name(s));
    });
    EXPECT_TRUE(r.ok) << shardtorch::strategy_name(s) << "\n" << r.summary();
  }
}

class PlanVsMeasured : public ::testing::TestWithParam<std::tuple<Strategy, int>> {};

TEST_P(PlanVsMeasured, ModelStateIsExactAndTransientEstimatesBoundThePeaks) {
  auto [strategy, world] = GetParam();
  enum Precision { kFp32, kBf16, kFp32ComputeBf16Reduce };
  struct Variant {
    Precision precision;
    bool offload;
  };
  // Every variant in one run of the ranks, one model after another: a run's
  // start costs about as much as a variant's step.
  auto r = run_ranks(world, [strategy = strategy, world = world](World& w) {
    for (Variant v : {Variant{kFp32, false}, Variant{kBf16, false}, Variant{kFp32, true}, Variant{kBf16, true},
                      Variant{kFp32ComputeBf16Reduce, false}}) {
      if (v.offload && strategy == Strategy::NoShard) continue;  // refused (Offload.NoShardRefuses...)
      const char* precision[] = {" fp32", " bf16", " fp32 compute, bf16 reduce"};
      const std::string what = std::string(shardtorch::strategy_name(strategy)) + " world " + std::to_string(world) +
                               precision[v.precision] + (v.offload ? " offloaded" : "");
      auto opts = strategy_options(strategy, world).cpu_offload(v.offload).bucket_mb(0.01);
      if (v.precision == kBf16)
        opts.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16).output_dtype(at::kFloat));
      // NoShard keeps masters even when param_dtype is the parameters' own
      // dtype; the plan missed them (4 bytes a parameter).
      if (v.precision == kFp32ComputeBf16Reduce)
        opts.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kFloat).reduce_dtype(at::kBFloat16));
      gpt::Config cfg{67, 16, 24, 4, 3};  // odd sizes: every flat parameter is padded somewhere
      auto plan = shardtorch::plan_memory(gpt::unit_specs(cfg), {opts, world, 2});
      torch::manual_seed(0);
      auto model = gpt::GPT(cfg);
      auto sm = shardtorch::shard(model, w, opts);
      auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-3));
      auto x = torch::randint(cfg.vocab, {2, cfg.seq_len}, torch::kLong);
      sm.reset_peak_memory();
      gpt::lm_loss(model(x), x).backward();
      opt->step();
      if (w.rank() == 0) require_plan_holds(sm.memory(), plan, what);  // the plan is for rank 0, which owns the most
    }
  });
  EXPECT_TRUE(r.ok) << r.summary();
}

INSTANTIATE_TEST_SUITE_P(All, PlanVsMeasured,
                         ::testing::Combine(::testing::ValuesIn(kAllStrategies), ::testing::Values(1, 2, 3, 4)),
                         [](const ::testing::TestParamInfo<PlanVsMeasured::ParamType>& info) {
                           return std::string(shardtorch::strategy_name(std::get<0>(info.param))) + "_world" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(Plan, ShardingDividesModelStateByTheWorldSizeUpToPadding) {
  auto units = gpt::unit_specs(gpt::Config{1000, 128, 256, 8, 4});
  auto ddp = shardtorch::plan_memory(units, {ShardOptions().strategy(Strategy::NoShard), 8, 2});
  auto zero3 = shardtorch::plan_memory(units, {ShardOptions().strategy(Strategy::FullShard), 8, 2});
  const int64_t psi = ddp.params;
  EXPECT_EQ(ddp.model_state(), 16 * psi);  // fp32 params, gradients and two Adam moments
  EXPECT_GE(zero3.model_state(), 16 * psi / 8);
  EXPECT_LE(zero3.model_state(), 16 * psi / 8 + 16 * 8 * static_cast<int64_t>(units.size()));  // padding < N per flat
  auto off = shardtorch::plan_memory(units, {ShardOptions().cpu_offload(true), 8, 2});
  EXPECT_EQ(off.host(), zero3.model_state());
  EXPECT_EQ(off.device_peak(), zero3.of(Mem::GatheredParams) + zero3.of(Mem::GradStaging) + zero3.of(Mem::Buckets));
  // Under mixed precision NoShard keeps ZeRO's 16 bytes per parameter (bf16
  // parameters and buckets, fp32 masters and moments); the masters' fp32
  // gradients are transient.
  auto bf16 = shardtorch::MixedPrecision().param_dtype(at::kBFloat16);
  auto ddp_bf16 =
      shardtorch::plan_memory(units, {ShardOptions().strategy(Strategy::NoShard).mixed_precision(bf16), 8, 2});
  EXPECT_EQ(ddp_bf16.model_state(), 16 * psi);
  EXPECT_EQ(ddp_bf16.of(Mem::MasterGrads), 4 * psi);
  EXPECT_EQ(ddp_bf16.device_peak(), 20 * psi);
  EXPECT_THROW(
      shardtorch::plan_memory(units, {ShardOptions().strategy(Strategy::HybridShard).hybrid_shard_size(3), 8, 2}),
      shardtorch::Error);
}

class Measured : public ::testing::TestWithParam<Strategy> {};

TEST_P(Measured, FrozenParametersAndUnitsKeptGatheredArePlanned) {
  // The MLP has a frozen bias; under NoShard it is held whole on every rank.
  const shardtorch::Strategy s = GetParam();
  for (bool bf16 : {false, true}) {
    auto opts = strategy_options(s, 2).reshard_after_forward(false);
    if (bf16) opts.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16).buffer_dtype(at::kBFloat16));
    const std::string what = std::string(shardtorch::strategy_name(s)) + (bf16 ? " bf16" : " fp32");
    auto probe = MLP();
    auto plan = shardtorch::plan_memory(shardtorch::unit_specs(*probe), {opts, 2, 2});
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      auto model = MLP();
      auto sm = shardtorch::shard(model, w, opts);
      one_step_holds_plan(model, sm, w, plan, what);
    });
    ASSERT_TRUE(r.ok) << what << "\n" << r.summary();
  }
}

TEST_P(Measured, AccumulationWithoutSyncKeepsEveryUnitsStagingAndThePlanSaysSo) {
  gpt::Config cfg{67, 16, 24, 4, 3};  // 4 blocks: more units than the two staged at once without accumulation
  const shardtorch::Strategy s = GetParam();
  const std::string what = shardtorch::strategy_name(s);
  auto opts = strategy_options(s, 2).bucket_mb(0.01);
  auto units = gpt::unit_specs(cfg);
  auto plain = shardtorch::plan_memory(units, {opts, 2, 2});
  auto accum = shardtorch::plan_memory(units, {opts, 2, 2, /*accumulates=*/true});
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto model = gpt::GPT(cfg);
    auto sm = shardtorch::shard(model, w, opts);
    auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-3));
    auto x = torch::randint(cfg.vocab, {4, cfg.seq_len}, torch::kLong);
    sm.reset_peak_memory();
    for (int k = 0; k < 2; ++k) {
      sm.set_requires_gradient_sync(k == 1);
      auto xs = x.narrow(0, 2 * k, 2);
      gpt::lm_loss(model(xs), xs).backward();
    }
    opt->step();
    if (w.rank() != 0) return;
    auto m = sm.memory();
    require_plan_holds(m, accum, what);
    if (s == Strategy::NoShard) {
      require(m.max(Mem::GradStaging) == 0 && accum.of(Mem::GradStaging) == 0, what + " stages no gradients");
    } else {
      // Every unit's staging is alive at once: exactly what the plan says,
      // and more than the plan without accumulation allows.
      require(m.max(Mem::GradStaging) == accum.of(Mem::GradStaging),
              what + ": peak grad_staging " + std::to_string(m.max(Mem::GradStaging)) + ", planned " +
                  std::to_string(accum.of(Mem::GradStaging)));
      require(m.max(Mem::GradStaging) > plain.of(Mem::GradStaging),
              what + ": accumulation should stage more than " + std::to_string(plain.of(Mem::GradStaging)));
    }
  });
  ASSERT_TRUE(r.ok) << what << "\n" << r.summary();
}

// Under bf16 mixed precision batch norm's parameters stay fp32
// (keep_batch_norm_fp32) in flat parameters of their own: the plan has the
// flats shard() made, and the model state it gives them (fp32, not bf16) is
// what the model holds, byte for byte.
TEST_P(Measured, BatchNormKeptInFp32IsPlannedAsShardLaysItOut) {
  const Strategy s = GetParam();
  const std::string what = std::string(shardtorch::strategy_name(s)) + " bf16 with batch norm";
  auto opts = strategy_options(s, 2).bucket_mb(0.01).mixed_precision(
      shardtorch::MixedPrecision().param_dtype(at::kBFloat16).output_dtype(at::kFloat));
  ASSERT_TRUE(opts.mixed_precision().keep_batch_norm_fp32());  // the default
  auto probe = NormedNet();
  const auto specs = shardtorch::unit_specs(*probe);
  const auto plan = shardtorch::plan_memory(specs, {opts, 2, 2});
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto model = NormedNet();
    auto sm = shardtorch::shard(model, w, opts);
    require(model->a->bn->weight.scalar_type() == at::kFloat && model->a->fc->weight.scalar_type() == at::kBFloat16,
            what + ": the batch norm is not kept in fp32 beside a bf16 layer");
    if (s != Strategy::NoShard) {  // NoShard has no flat parameters
      const auto units = sm.units();
      require(units.size() == specs.size(),
              what + ": " + std::to_string(units.size()) + " units, planned " + std::to_string(specs.size()));
      for (size_t u = 0; u < units.size(); ++u) {
        std::string made, planned;
        for (const auto& l : units[u].layouts) made += " " + std::to_string(l.total_numel());
        for (const auto& f : specs[u].flats) planned += " " + std::to_string(f.numel);
        require(made == planned,
                what + ": unit '" + units[u].name + "' has flat parameters of" + made + " elements, planned" + planned);
      }
    }
    one_step_holds_plan(model, sm, w, plan, what);
  });
  ASSERT_TRUE(r.ok) << what << "\n" << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Plan, Measured, ::testing::ValuesIn(kAllStrategies), StrategyName());

TEST(Plan, TheFitSearchFindsTheLargestThatFits) {
  using shardtorch::largest_that_fits;
  auto tens = [](int64_t n) { return 10 * n + 5; };
  EXPECT_EQ(largest_that_fits(tens, 95, 1000), 9);  // 95 fits, 105 does not
  EXPECT_EQ(largest_that_fits(tens, 94, 1000), 8);
  EXPECT_EQ(largest_that_fits(tens, 5, 1000), 0);
  EXPECT_EQ(largest_that_fits(tens, 4, 1000), -1);                                        // not even n = 0
  EXPECT_EQ(largest_that_fits(tens, 1 << 30, 37), 37);                                    // the limit, never past it
  EXPECT_EQ(largest_that_fits([](int64_t) { return int64_t{1}; }, 1, 1 << 20), 1 << 20);  // a peak that stops growing
  // On the GPT, per strategy: n layers fit the budget and n + 1 do not.
  for (auto s : kAllStrategies) {
    auto opts = strategy_options(s, 8);
    opts.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16));
    auto peak = [&](int64_t layers) {
      return shardtorch::plan_memory(gpt::unit_specs(gpt::Config{50257, 1024, 1024, 16, layers}), {opts, 8, 2})
          .device_peak();
    };
    const int64_t budget = int64_t{16} << 30;
    const int64_t n = largest_that_fits(peak, budget, 1 << 20);
    ASSERT_GT(n, 0) << shardtorch::strategy_name(s);
    EXPECT_LE(peak(n), budget) << shardtorch::strategy_name(s);
    EXPECT_GT(peak(n + 1), budget) << shardtorch::strategy_name(s);
  }
}

// A pipeline rank plans its own stages (pipeline_unit_specs) with
// PlanOptions::pipelined: its model state exactly, its transient peaks
// bounded, and its device peak (model state plus the transients' peaks)
// within 5 % of the measured one. pp 2 x dp 2, 1F1B over 4 micro-batches;
// the plan is for rank 0 of each dp group, which owns the most.
TEST(Plan, APipelineRankPlansItsStagesPeakWithinFivePercent) {
  gpt::Config cfg{67, 16, 24, 4, 4};
  for (Strategy s : {Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard}) {
    const std::string what = std::string("pipeline stage, ") + shardtorch::strategy_name(s);
    auto shard = ShardOptions().strategy(s).bucket_mb(0.01);
    auto options = shardtorch::PipelineOptions().microbatches(4).shard(shard);
    auto r = run_ranks(4, [&](World& w) {
      auto mesh = shardtorch::DeviceMesh::create(w.shared_from_this(), {{"pp", 2}, {"dp", 2}});
      torch::manual_seed(0);
      gpt::GPT model = shardtorch::deferred([&] { return gpt::GPT(cfg); });
      auto layers = gpt::pipeline_layers(model);
      shardtorch::PlanOptions po{shard, 2, 2};
      po.pipelined = true;
      po.reduces_in_place = true;  // Gloo
      const auto plan =
          shardtorch::plan_memory(shardtorch::pipeline_unit_specs(layers, options, 2, mesh->coordinate("pp")), po);
      shardtorch::Pipeline pipe(std::move(layers), mesh, options);
      auto opt = shardtorch::AdamW(pipe.module(), torch::optim::AdamWOptions(1e-3));
      torch::manual_seed(1);
      const auto tokens = torch::randint(cfg.vocab, {8, cfg.seq_len}, torch::kLong);
      pipe.sharded().reset_peak_memory();
      opt->zero_grad();
      auto loss = [](const at::Tensor& logits, const at::Tensor& t) { return gpt::lm_loss(logits, t); };
      pipe.step(pipe.is_first_stage() ? tokens : at::Tensor(), pipe.is_last_stage() ? tokens : at::Tensor(), loss);
      opt->step();
      if (mesh->coordinate("dp") != 0) return;
      const std::string where = what + ", stage rank " + std::to_string(mesh->coordinate("pp"));
      const auto m = pipe.sharded().memory();
      require_plan_holds(m, plan, where);
      int64_t measured = m.max(Mem::MasterGrads);
      for (Mem c : kModelState)
        if (c != Mem::HostParams && c != Mem::HostGradients && c != Mem::HostOptimizerState) measured += m.cur(c);
      for (Mem c : kTransient) measured += m.max(c);
      const double ratio = static_cast<double>(measured) / static_cast<double>(plan.device_peak());
      std::string transients;
      for (Mem c : kTransient)
        transients += std::string(" ") + shardtorch::mem_name(c) + " " + std::to_string(m.max(c)) + "/" +
                      std::to_string(plan.of(c));
      require(ratio >= 0.95 && ratio <= 1.05, where + ": measured device peak " + std::to_string(measured) +
                                                  " against the plan's " + std::to_string(plan.device_peak()) +
                                                  " (ratio " + std::to_string(ratio) +
                                                  "; peaks measured/planned:" + transients + ")");
    });
    ASSERT_TRUE(r.ok) << what << "\n" << r.summary();
  }
}
