// The fused CPU Adam/AdamW equals torch::optim's within 1e-6 relative.
#include <gtest/gtest.h>

#include "shardtorch/error.h"
#include "models.h"
#include "shardtorch/optim/cpu_adam.h"
#include "../cuda/adam_math.h"

using namespace testmodels;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

// How far the fused optimizer's state for `b` is from torch::optim's for `a`
// (rel_err of each moment).
struct StateGap {
  int64_t ref_step, fused_step;
  double exp_avg, exp_avg_sq;
};
template <class State>
StateGap state_gap(torch::optim::Optimizer& ref, const torch::Tensor& a, torch::optim::Optimizer& fused,
                   const torch::Tensor& b) {
  auto& rs = static_cast<State&>(*ref.state().at(a.unsafeGetTensorImpl()));
  auto& fs = static_cast<State&>(*fused.state().at(b.unsafeGetTensorImpl()));
  return {rs.step(), fs.step(), rel_err(fs.exp_avg(), rs.exp_avg()), rel_err(fs.exp_avg_sq(), rs.exp_avg_sq())};
}

}  // namespace

// With one intra-op thread and with two (in a rank: the suite's parent
// process starts no threads, docs/testing.md).
TEST(FusedCpuAdam, AdamWMatchesTorchWithinOneMillionth) {
  for (int threads : {1, 2}) {
    auto r = run_ranks(
        1,
        [&](World&) {
          require(at::get_num_threads() == threads, "ATen runs " + std::to_string(at::get_num_threads()) + " threads");
          torch::manual_seed(0);
          const int64_t n = 100003;  // not a multiple of any vector width
          auto p0 = torch::randn({n});
          auto a = p0.clone().requires_grad_(true), b = p0.clone().requires_grad_(true);
          auto opts = torch::optim::AdamWOptions(1e-2).weight_decay(0.1).betas({0.9, 0.95}).eps(1e-6);
          torch::optim::AdamW ref({a}, opts);
          shardtorch::FusedAdamW fused({b}, opts);
          step_both(ref, a, fused, b, 10, /*grad_growth=*/1.0);
          // Relative to each tensor's scale (largest |difference| / largest |value|),
          // parameters and both moments. Not element by element: near zero, one
          // rounding of a differently ordered fp32 operation (torch updates exp_avg
          // with lerp, we multiply and add) is a large fraction of the element;
          // measured, element by element down to 1/1000 of the scale: 4e-6 for the
          // parameters, 4e-5 for exp_avg.
          const double params = rel_err(b.detach(), a.detach());
          require(params <= 1e-6, "parameters " + std::to_string(params) + " apart");
          auto gap = state_gap<torch::optim::AdamWParamState>(ref, a, fused, b);
          require(gap.ref_step == gap.fused_step, "steps differ");
          require(gap.exp_avg <= 1e-6 && gap.exp_avg_sq <= 1e-6,
                  "moments " + std::to_string(gap.exp_avg) + " and " + std::to_string(gap.exp_avg_sq) + " apart");
        },
        shardtorch::testing::RunOptions().threads(threads));
    ASSERT_TRUE(r.ok) << threads << " threads: " << r.summary();
  }
  std::cout << "  fused Adam runs the " << shardtorch::fused_adam_isa() << " variant here\n";
}

TEST(FusedCpuAdam, AdamWithCoupledWeightDecayMatchesTorch) {
  torch::manual_seed(1);
  const int64_t n = 4097;
  auto p0 = torch::randn({n});
  auto a = p0.clone().requires_grad_(true), b = p0.clone().requires_grad_(true);
  auto opts = torch::optim::AdamOptions(3e-3).weight_decay(0.01);
  torch::optim::Adam ref({a}, opts);
  shardtorch::FusedAdam fused({b}, opts);
  step_both(ref, a, fused, b, 7);
  EXPECT_LE(rel_err(b.detach(), a.detach()), 1e-6);
  auto gap = state_gap<torch::optim::AdamParamState>(ref, a, fused, b);
  EXPECT_EQ(gap.ref_step, gap.fused_step);
  EXPECT_LE(gap.exp_avg, 1e-6);
  EXPECT_LE(gap.exp_avg_sq, 1e-6);
}

// Two intra-op threads, in a rank.
TEST(FusedCpuAdam, WritesTheBf16CopyInTheSamePass) {
  auto r = run_ranks(
      1,
      [](World&) {
        const int64_t n = 70001;  // several parallel chunks, each of many blocks, the last block partial
        torch::manual_seed(4);
        auto p = torch::randn({n}), g = torch::randn({n}), m = torch::randn({n}), v = torch::rand({n});
        p[0] = std::nanf("");  // stays NaN, and inf stays inf: both must round as ATen rounds them
        p[1] = INFINITY;
        p[2] = -INFINITY;
        auto p2 = p.clone(), m2 = m.clone(), v2 = v.clone();
        auto low = torch::full({n}, 7.0, torch::kBFloat16);
        const shardtorch::AdamStep s{1e-3, 0.9, 0.999, 1e-8, 0.01, 3, true};
        shardtorch::fused_adam_cpu(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                                   n, s, low.data_ptr<at::BFloat16>());
        shardtorch::fused_adam_cpu(p2.data_ptr<float>(), g.data_ptr<float>(), m2.data_ptr<float>(),
                                   v2.data_ptr<float>(), n, s);
        // What ATen's conversion gives: NaN where it gives NaN (ATen's own scalar
        // and vector conversions give NaNs of different bits), bit for bit elsewhere.
        auto want = p.to(torch::kBFloat16);
        require(at::equal(low.isnan(), want.isnan()), "NaN in other places than ATen's conversion");
        require(at::equal(low.view(at::kShort).masked_fill(low.isnan(), 0),
                          want.view(at::kShort).masked_fill(want.isnan(), 0)),
                "the bf16 copy differs from ATen's conversion");
        // Writing the copy changes nothing else.
        require(at::equal(p.view(at::kInt), p2.view(at::kInt)) && at::equal(m, m2) && at::equal(v, v2),
                "writing the copy changed the parameters or the moments");
      },
      shardtorch::testing::RunOptions().threads(2));
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(FusedCpuAdam, RefusesAmsgrad) {
  auto a = torch::randn({4}).requires_grad_(true);
  shardtorch::FusedAdam opt({a}, torch::optim::AdamOptions(1e-3).amsgrad(true));
  a.mutable_grad() = torch::ones({4});
  EXPECT_THROW(opt.step(), shardtorch::Error);
}

// A refused step changes nothing: a first group that could step is not
// stepped before a later group is found wrong. Bad options are refused
// (beta2 = 1 would divide by a zero bias correction and write NaN).
TEST(FusedCpuAdam, ARefusedStepChangesNothing) {
  auto a = torch::randn({4}).requires_grad_(true), b = torch::randn({4}).requires_grad_(true);
  const auto a0 = a.detach().clone();
  shardtorch::FusedAdamW opt(
      {torch::optim::OptimizerParamGroup({a}),
       torch::optim::OptimizerParamGroup(
           {b}, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1e-3).amsgrad(true)))},
      torch::optim::AdamWOptions(1e-3));
  a.mutable_grad() = torch::ones({4});
  b.mutable_grad() = torch::ones({4});
  EXPECT_THROW(opt.step(), shardtorch::Error);
  EXPECT_TRUE(at::equal(a.detach(), a0)) << "the first group was stepped before the refusal";
  EXPECT_TRUE(opt.state().empty()) << "state was created before the refusal";
  auto c = torch::randn({4}).requires_grad_(true);
  const auto c0 = c.detach().clone();
  shardtorch::FusedAdamW bad({c}, torch::optim::AdamWOptions(1e-3).betas({0.9, 1.0}));
  c.mutable_grad() = torch::ones({4});
  try {
    bad.step();
    ADD_FAILURE() << "beta2 = 1 was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("0 <= betas < 1"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(at::equal(c.detach(), c0));
}

TEST(FusedCpuAdam, ShardedTrainingWithFusedAdamWMatchesSingleProcess) {
  auto x = gpt_tokens();
  auto opts = torch::optim::AdamWOptions(1e-3).weight_decay(0.1);
  torch::manual_seed(0);
  auto ref = gpt::GPT(gpt::Config{});
  torch::optim::AdamW ref_opt(unique_tensors(*ref), opts);
  auto want = train_in_one_process(*ref, ref_opt, 4, [&] { return gpt::lm_loss(ref(x), x); });
  auto r = run_ranks(3, [&](World& w) {
    torch::manual_seed(0);
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w);
    auto opt = shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*model, opts);
    auto xs = x.narrow(0, 4 * w.rank(), 4);
    for (int s = 0; s < 4; ++s) {
      opt->zero_grad();
      gpt::lm_loss(model(xs), xs).backward();
      opt->step();
    }
    shardtorch::FullParams full(*model);
    expect_close_map(snapshot(*model), want, 1e-5, "FusedAdamW over shards");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// shardtorch::Adam(W) pick the fused kernel only for fp32 CUDA shards (the
// CUDA test checks that side); on host shards they are torch::optim's own,
// so that their numerics stay exactly torch::optim's.
TEST(ShardedAdam, HostShardsGetTorchOptimItself) {
  auto r = run_ranks(2, [&](World& w) {
    for (auto strategy : {shardtorch::Strategy::FullShard, shardtorch::Strategy::NoShard}) {
      torch::manual_seed(0);
      auto model = MLP();
      shardtorch::shard(model, w, strategy_options(strategy, 2));
      auto adamw = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-3));
      require(dynamic_cast<torch::optim::AdamW*>(&adamw->inner()) != nullptr,
              std::string("shardtorch::AdamW is not torch::optim::AdamW under ") + shardtorch::strategy_name(strategy));
      auto adam = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
      require(dynamic_cast<torch::optim::Adam*>(&adam->inner()) != nullptr,
              std::string("shardtorch::Adam is not torch::optim::Adam under ") + shardtorch::strategy_name(strategy));
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

class UnsupportedDtype : public ::testing::TestWithParam<shardtorch::Strategy> {};

// Refused when built, on every rank alike: a rank that owns no piece of the
// fp64 parameters would otherwise step, go on to the next collective and
// wait there for ranks that threw in step().
TEST_P(UnsupportedDtype, ParametersItCannotUpdateAreRefusedOnEveryRankWhenItIsBuilt) {
  const shardtorch::Strategy strategy = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto model = MLP();
    model->l3->lin->to(torch::kDouble);
    shardtorch::shard(model, w, strategy_options(strategy, 2));
    try {
      shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*model, torch::optim::AdamWOptions(1e-3));
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      require(msg.find("'l3.lin.weight' is optimized as a Double tensor") != std::string::npos, msg);
      return;
    }
    throw std::runtime_error("FusedAdamW accepted fp64 parameters");
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(strategy) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(FusedCpuAdam, UnsupportedDtype,
                         ::testing::Values(shardtorch::Strategy::FullShard, shardtorch::Strategy::NoShard),
                         StrategyName());

// At the inputs where the estimates are weakest (v = 0: sqrt taken as 0,
// the denominator is eps; subnormal, huge and infinite v; zero, NaN and
// infinite gradients), element by element: the portable variant against the
// host reference of cuda/adam_math.h (the same arithmetic in scalar code),
// on every CPU; with AVX-512, the Newton variant against the exact one.
TEST(FusedCpuAdam, TheNewtonVariantIsWithinAFewUlpOfTheExactUpdateEverywhere) {
  __builtin_cpu_init();
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  auto r = run_ranks(1, [&](World&) {
    const int64_t n = 4099;  // a partial last vector
    torch::manual_seed(6);
    auto p0 = torch::randn({n}), g = torch::randn({n}) * torch::rand({n}).pow(8) * 10;
    auto m0 = torch::randn({n}) * 0.1, v0 = torch::rand({n}).pow(6);
    for (int64_t i = 0; i < 8; ++i) {  // v = 0 with g = 0, subnormal v, huge v
      g[i] = 0.0;
      v0[i] = 0.0;
      v0[8 + i] = 1e-39;
      g[16 + i] = 0.0;
      v0[16 + i] = 1e-44;
      v0[24 + i] = 1e30;
    }
    p0.narrow(0, 40, 2000).zero_();
    g[32] = std::nanf("");
    g[33] = INFINITY;
    v0[34] = INFINITY;  // finite m and g: the exact update leaves the parameter (the estimates made it NaN)
    v0[35] = INFINITY;
    g[35] = 1e25;
    auto run = [&](const char* isa, const shardtorch::AdamStep& s) {
      ::setenv("SHARDTORCH_ADAM_ISA", isa, 1);
      auto p = p0.clone(), m = m0.clone(), v = v0.clone();
      shardtorch::fused_adam_cpu(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n,
                                 s);
      require(shardtorch::fused_adam_isa() == isa,
              std::string("asked for ") + isa + ", ran " + shardtorch::fused_adam_isa());
      return std::make_tuple(p, m, v);
    };
    auto host_reference = [&](const shardtorch::AdamStep& s) {
      auto p = p0.clone(), m = m0.clone(), v = v0.clone();
      const auto c = shardtorch::cuda::adam_coeffs(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.step, s.decoupled);
      for (int64_t i = 0; i < n; ++i)
        shardtorch::cuda::adam_element(p.data_ptr<float>()[i], g.data_ptr<float>()[i], m.data_ptr<float>()[i],
                                       v.data_ptr<float>()[i], c);
      return std::make_tuple(p, m, v);
    };
    // `got` (p, m, v) within a few ulp of `want`, which the test trusts.
    auto expect_near = [&](const std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>& got,
                           const std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>& want,
                           const std::string& what) {
      const auto& [pn, mn, vn] = got;
      const auto& [pe, me, ve] = want;
      require(at::equal(pe.isnan(), pn.isnan()), what + ": NaN in one's parameters only");
      auto ok = pe.isfinite() & pn.isfinite();
      require(at::equal(ok, pe.isfinite()), what + ": a finite parameter in one only");
      // Where p0 = 0 the parameter is the update itself: within 1e-6 of it
      // (a few ulp). Elsewhere the two may round to neighbouring floats.
      auto zero = ok & p0.eq(0);
      auto rel = (pn - pe).masked_select(zero).abs() / pe.masked_select(zero).abs().clamp_min(1e-30);
      require(rel.max().item<double>() <= 1e-6, what + ": update off by " + std::to_string(rel.max().item<double>()));
      // Elsewhere: apart by at most the rounding of p (one ulp, 1.2e-7 of it
      // at most) plus 1e-6 of the update.
      auto bound = pe.abs() * 1.2e-7 + (pe - p0).abs() * 1e-6 + 1e-38;
      auto over = ((pn - pe).abs() / bound).masked_select(ok);
      require(over.max().item<double>() <= 1.0,
              what + ": parameters apart by " + std::to_string(over.max().item<double>()) + " times the bound");
      require(at::equal(vn.isinf(), ve.isinf()), what + ": an infinite v in one only");
      auto finite_v = ok & ve.isfinite();
      require(rel_err(mn.masked_select(finite_v), me.masked_select(finite_v)) <= 1e-6 &&
                  rel_err(vn.masked_select(finite_v), ve.masked_select(finite_v)) <= 1e-6,
              what + ": the moments differ");
      require(pn[34].item<float>() == pe[34].item<float>(), what + ": v = inf: the parameter moved (" +
                                                                std::to_string(pn[34].item<float>()) + " vs " +
                                                                std::to_string(pe[34].item<float>()) + ")");
    };
    for (const auto& s : {shardtorch::AdamStep{1e-3, 0.9, 0.999, 1e-8, 0.01, 7, true},
                          shardtorch::AdamStep{1e-2, 0.8, 0.99, 1e-6, 0.1, 1, false}}) {
      expect_near(run("default", s), host_reference(s), "the portable variant against the host reference");
      if (has512) expect_near(run("avx512-newton", s), run("avx512", s), "avx512-newton against avx512");
    }
    ::unsetenv("SHARDTORCH_ADAM_ISA");
  });
  ASSERT_TRUE(r.ok) << r.summary();
  std::cout << "  checked the portable variant against the host reference"
            << (has512 ? ", and avx512-newton against avx512\n"
                       : "; this CPU has no AVX-512, so the Newton variant was not checked\n");
}

// An override that cannot be honoured (misspelled, or an instruction set
// this CPU lacks) is said, not silently replaced by the automatic choice.
TEST(FusedCpuAdam, AnOverrideThatCannotBeHonouredIsAWarning) {
  auto r = run_ranks(1, [&](World&) {
    ::unsetenv("SHARDTORCH_ADAM_ISA");
    const std::string automatic = shardtorch::fused_adam_isa();
    struct Captured : c10::WarningHandler {
      std::vector<std::string> messages;
      void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
    } warnings;
    c10::WarningUtils::WarningHandlerGuard guard(&warnings);
    ::setenv("SHARDTORCH_ADAM_ISA", "avx-512", 1);
    auto p = torch::zeros({5}), g = torch::ones({5}), m = torch::zeros({5}), v = torch::zeros({5});
    shardtorch::fused_adam_cpu(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), 5,
                               shardtorch::AdamStep{1e-3, 0.9, 0.999, 1e-8, 0.0, 1, true});
    require(shardtorch::fused_adam_isa() == automatic, "ran " + shardtorch::fused_adam_isa() + ", not " + automatic);
    require(warnings.messages.size() == 1, std::to_string(warnings.messages.size()) + " warnings, expected one");
    const std::string want =
        "SHARDTORCH_ADAM_ISA='avx-512' is not one of avx512-newton, avx512, avx2, default; the "
        "fused CPU Adam uses '" +
        automatic + "'";
    require(warnings.messages[0].find(want) != std::string::npos, warnings.messages[0]);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(FusedCpuAdam, EveryInstructionSetVariantMatchesTorch) {
  __builtin_cpu_init();
  std::vector<std::string> isas = {"default"};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isas.push_back("avx2");
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
    isas.push_back("avx512");
    isas.push_back("avx512-newton");
  }
  for (const std::string& isa : isas) {
    auto r = run_ranks(1, [&](World&) {
      ::setenv("SHARDTORCH_ADAM_ISA", isa.c_str(), 1);
      const int64_t n = 50001;
      torch::manual_seed(3);
      auto p0 = torch::randn({n});
      auto a = p0.clone().requires_grad_(true), b = p0.clone().requires_grad_(true);
      auto opts = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
      torch::optim::AdamW ref({a}, opts);
      shardtorch::FusedAdamW fused({b}, opts);
      step_both(ref, a, fused, b, 5);
      std::string ran = shardtorch::fused_adam_isa();
      require(ran == isa, "asked for " + isa + " but ran " + ran);
      require(rel_err(b.detach(), a.detach()) <= 1e-6, ran + " variant differs from torch::optim::AdamW");
      auto gap = state_gap<torch::optim::AdamWParamState>(ref, a, fused, b);
      require(gap.exp_avg <= 1e-6 && gap.exp_avg_sq <= 1e-6,
              ran + " variant's moments differ from torch::optim::AdamW's");
      std::cout << "  asked for " << isa << ", ran " << ran << std::endl;
    });
    ASSERT_TRUE(r.ok) << isa << "\n" << r.summary();
  }
}

// The CUDA kernel's element update (cuda/adam_math.h), run on the host: the
// same update as the CPU kernel within 1e-6 relative over ten steps, Adam and
// AdamW, and the bf16 copy it writes is the CPU kernel's bit for bit whenever
// the parameters agree. The kernel itself is checked against this on a GPU
// (tests/cuda/test_cuda.cpp, bench/bench_cuda_adam.cpp).
TEST(FusedCudaAdamReference, MatchesTheCpuKernelWithinOneMillionth) {
  for (bool decoupled : {true, false}) {
    torch::manual_seed(3);
    const int64_t n = 50021;
    auto p_cpu = torch::randn({n}) * 3, m_cpu = torch::zeros({n}), v_cpu = torch::zeros({n});
    auto p_ref = p_cpu.clone(), m_ref = m_cpu.clone(), v_ref = v_cpu.clone();
    auto low_cpu = torch::empty({n}, torch::kBFloat16);
    std::vector<uint16_t> low_ref(n);
    for (int64_t step = 1; step <= 10; ++step) {
      auto g = torch::randn({n}) * (step % 3 == 0 ? 1e-3 : 2.0);
      shardtorch::AdamStep s{2e-2, 0.9, 0.95, 1e-8, 0.1, step, decoupled};
      shardtorch::fused_adam_cpu(p_cpu.data_ptr<float>(), g.data_ptr<float>(), m_cpu.data_ptr<float>(),
                                 v_cpu.data_ptr<float>(), n, s, low_cpu.data_ptr<at::BFloat16>());
      const auto c = shardtorch::cuda::adam_coeffs(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, step, decoupled);
      float *p = p_ref.data_ptr<float>(), *m = m_ref.data_ptr<float>(), *v = v_ref.data_ptr<float>();
      const float* gp = g.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) {
        shardtorch::cuda::adam_element(p[i], gp[i], m[i], v[i], c);
        low_ref[i] = shardtorch::cuda::bf16_bits(p[i]);
      }
    }
    EXPECT_LE(rel_err(p_ref, p_cpu), 1e-6) << "decoupled " << decoupled;
    EXPECT_LE(rel_err(m_ref, m_cpu), 1e-6) << "decoupled " << decoupled;
    EXPECT_LE(rel_err(v_ref, v_cpu), 1e-6) << "decoupled " << decoupled;
    const auto* bits = reinterpret_cast<const uint16_t*>(low_cpu.data_ptr<at::BFloat16>());
    int64_t same_param = 0, mismatched = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (p_ref.data_ptr<float>()[i] != p_cpu.data_ptr<float>()[i]) continue;
      ++same_param;
      mismatched += bits[i] != low_ref[i];
    }
    // How many come out bitwise equal depends on the CPU kernel's instruction
    // set (over half with AVX-512, about a quarter with AVX2 on an AMD EPYC):
    // enough for the bf16 comparison below to mean something.
    EXPECT_GT(same_param, n / 10) << "parameters bitwise equal, kernel " << shardtorch::fused_adam_isa();
    EXPECT_EQ(mismatched, 0) << "bf16 copies of equal parameters";
  }
}

// The portable variant (the only one on aarch64, and "default" on x86)
// against each vectorised x86 variant this CPU has, directly: parameters and
// moments within 1e-6 relative over five steps of Adam and AdamW, and the
// bf16 copies equal wherever the parameters are.
TEST(FusedCpuAdam, ThePortableVariantMatchesEveryX86Variant) {
  __builtin_cpu_init();
  std::vector<std::string> isas;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isas.push_back("avx2");
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    isas.push_back("avx512");
  if (isas.empty()) GTEST_SKIP() << "no vectorised x86 variant on this CPU";
  auto r = run_ranks(1, [&](World&) {
    const int64_t n = 50001;
    torch::manual_seed(11);
    const auto p0 = torch::randn({n}), g = torch::randn({n});
    auto run = [&](const std::string& isa, bool decoupled) {
      ::setenv("SHARDTORCH_ADAM_ISA", isa.c_str(), 1);
      auto p = p0.clone(), m = torch::zeros({n}), v = torch::zeros({n});
      auto low = torch::empty({n}, at::kBFloat16);
      for (int64_t step = 1; step <= 5; ++step)
        shardtorch::fused_adam_cpu(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                                   n, {1e-2, 0.9, 0.999, 1e-8, 0.1, step, decoupled}, low.data_ptr<at::BFloat16>());
      require(shardtorch::fused_adam_isa() == isa, "asked for " + isa + ", ran " + shardtorch::fused_adam_isa());
      return std::make_tuple(p, m, v, low);
    };
    for (bool decoupled : {true, false}) {
      auto [pd, md, vd, lowd] = run("default", decoupled);
      for (const auto& isa : isas) {
        auto [px, mx, vx, lowx] = run(isa, decoupled);
        require(rel_err(px, pd) <= 1e-6 && rel_err(mx, md) <= 1e-6 && rel_err(vx, vd) <= 1e-6,
                isa + " differs from the portable variant");
        auto same = px.eq(pd);
        require(at::equal(lowx.masked_select(same), lowd.masked_select(same)), isa + ": bf16 copies differ");
      }
    }
    ::unsetenv("SHARDTORCH_ADAM_ISA");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// step_params_with (overlap_with_backward's update straight from the host
// copy of a reduced gradient): the same bits as step_params after the
// gradient was made fp32 and divided, for bf16 and fp32 gradients, with and
// without a divisor, writing the bf16 copy too; what it cannot take it
// refuses, updating nothing.
TEST(FusedCpuAdam, StepsFromBf16AndDividedGradientsAsFromTheirFp32Values) {
  auto r = run_ranks(
      1,
      [](World&) {                // two intra-op threads, in a rank
        const int64_t n = 70001;  // several parallel chunks of many blocks, the last block partial
        torch::manual_seed(5);
        const auto start = torch::randn({n});
        for (auto dtype : {torch::kBFloat16, torch::kFloat})
          for (double divisor : {1.0, 3.0}) {
            const std::string what = std::string(c10::toString(dtype)) + " gradient / " + std::to_string(divisor);
            auto g = torch::randn({n}).to(dtype);
            auto a = start.clone(), b = start.clone();
            auto low_a = torch::zeros({n}, torch::kBFloat16), low_b = torch::zeros({n}, torch::kBFloat16);
            shardtorch::FusedAdamW want({a}, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
            shardtorch::FusedAdamW got({b}, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
            want.write_low_copy(a, low_a);
            got.write_low_copy(b, low_b);
            for (int step = 0; step < 2; ++step) {
              a.mutable_grad() = at::div(g.to(torch::kFloat), divisor);
              want.step_params({a});
              require(got.step_params_with({b}, {g}, divisor), what + ": refused");
              require(!b.grad().defined(), what + ": a gradient was left");
              g = g * 0.5 + torch::randn({n}).to(dtype);
            }
            require(at::equal(a, b), what + ": parameters differ");
            require(at::equal(low_a.view(at::kShort), low_b.view(at::kShort)), what + ": bf16 copies differ");
            auto& sa = static_cast<torch::optim::AdamWParamState&>(*want.state().at(a.unsafeGetTensorImpl()));
            auto& sb = static_cast<torch::optim::AdamWParamState&>(*got.state().at(b.unsafeGetTensorImpl()));
            require(sa.step() == sb.step() && at::equal(sa.exp_avg(), sb.exp_avg()) &&
                        at::equal(sa.exp_avg_sq(), sb.exp_avg_sq()),
                    what + ": the optimizer states differ");
          }
      },
      shardtorch::testing::RunOptions().threads(2));
  ASSERT_TRUE(r.ok) << r.summary();

  auto p = torch::randn({16});
  const auto before = p.clone();
  shardtorch::FusedAdamW opt({p}, torch::optim::AdamWOptions(1e-2));
  EXPECT_FALSE(opt.step_params_with({p}, {torch::randn({16}).to(torch::kHalf)}, 1.0)) << "an fp16 gradient";
  EXPECT_FALSE(opt.step_params_with({p}, {torch::randn({15})}, 1.0)) << "a gradient of another size";
  EXPECT_FALSE(opt.step_params_with({torch::randn({16})}, {torch::randn({16})}, 1.0)) << "a tensor not optimized";
  EXPECT_TRUE(at::equal(p, before));
  EXPECT_TRUE(opt.state().empty());
}
