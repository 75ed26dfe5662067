// CPU offload: offloaded training equals training without offload, bit for
// bit, for every sharding strategy at world sizes 1-3 (with accumulation,
// clipping, mixed precision, prefetch and the fused CPU AdamW); the state
// lives where docs/offload.md says;
// checkpoints move freely between offloaded and device-resident models.
#include <gtest/gtest.h>

#include <functional>

#include "../src/runtime/flat_param.h"
#include "models.h"
#include "shardtorch/optim/cpu_adam.h"

using namespace testmodels;
using shardtorch::Mem;
using shardtorch::ShardOptions;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

struct Recipe {
  int steps = 3;
  int micro = 2;      // micro-batches per step, gradient sync on the last only
  double clip = 0.5;  // small enough that every step clips
  bool bf16 = false;
  bool fused = false;  // shardtorch::FusedAdamW instead of torch::optim::AdamW
  bool prefetch = false;
  bool overlap = false;  // ShardedOptimizer::overlap_with_backward (needs fused, no clip)
  double lr = 1e-2;
};

ShardOptions options_for(Strategy s, int world, const Recipe& r, bool offload) {
  auto o = strategy_options(s, world).cpu_offload(offload).prefetch(r.prefetch);
  if (r.bf16) o.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16).output_dtype(at::kFloat));
  return o;
}

std::map<std::string, torch::Tensor> train(World& w, Strategy s, const Recipe& r, bool offload) {
  auto x = gpt_tokens();
  torch::manual_seed(0);
  auto model = gpt::GPT(gpt::Config{});
  auto sm = shardtorch::shard(model, w, options_for(s, w.size(), r, offload));
  auto adamw = torch::optim::AdamWOptions(r.lr).weight_decay(0.01);
  auto opt = r.fused ? shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*model, adamw)
                     : shardtorch::AdamW(*model, adamw);
  if (r.overlap) opt->overlap_with_backward();
  const int64_t per = kBatch / w.size(), mb = per / r.micro;
  for (int step = 0; step < r.steps; ++step) {
    opt->zero_grad();
    for (int k = 0; k < r.micro; ++k) {
      sm.set_requires_gradient_sync(k == r.micro - 1);
      auto xs = x.narrow(0, w.rank() * per + k * mb, mb);
      (gpt::lm_loss(model(xs), xs) / r.micro).backward();
    }
    if (r.clip > 0) shardtorch::clip_grad_norm(*model, r.clip);
    opt->step();
  }
  return shardtorch::full_parameters(*model);
}

const Strategy kSharded[] = {Strategy::FullShard, Strategy::ShardGradOp, Strategy::OptimizerOnly,
                             Strategy::HybridShard};

}  // namespace

class OffloadParity : public ::testing::TestWithParam<std::tuple<Strategy, int>> {};

TEST_P(OffloadParity, EqualsTrainingWithoutOffloadBitwise) {
  auto [strategy, world] = GetParam();
  // fp32; bf16; then bf16 again with prefetch and the fused CPU AdamW (on
  // both sides: the optimizer is not what is compared).
  for (int variant : {0, 1, 2}) {
    Recipe recipe;
    recipe.bf16 = variant >= 1;
    recipe.prefetch = recipe.fused = variant == 2;
    const std::string what = std::string("offloaded ") + shardtorch::strategy_name(strategy) +
                             (recipe.bf16 ? " bf16" : " fp32") +
                             (recipe.prefetch ? " with prefetch and FusedAdamW" : "");
    auto r = run_ranks(world, [&](World& w) {
      auto want = train(w, strategy, recipe, false);
      auto got = train(w, strategy, recipe, true);
      double err = expect_close_map(got, want, 0.0, what);
      require(err == 0.0, "not bitwise");
    });
    ASSERT_TRUE(r.ok) << what << "\n" << r.summary();
  }
}

// overlap_with_backward: the update of each flat parameter runs on the host
// thread during the backward; training is bitwise the same as stepping after
// it, and the update did happen before step() (the optimizer has state then).
TEST_P(OffloadParity, OverlappingTheStepWithBackwardChangesNothing) {
  auto [strategy, world] = GetParam();
  for (bool bf16 : {false, true}) {
    Recipe recipe;
    recipe.bf16 = bf16;
    recipe.prefetch = recipe.fused = true;
    recipe.clip = 0;
    const std::string what = std::string("offloaded ") + shardtorch::strategy_name(strategy) +
                             (bf16 ? " bf16" : " fp32") + " with the step overlapping backward";
    auto r = run_ranks(world, [&](World& w) {
      auto want = train(w, strategy, recipe, true);
      recipe.overlap = true;
      auto got = train(w, strategy, recipe, true);
      double err = expect_close_map(got, want, 0.0, what);
      require(err == 0.0, "not bitwise");

      torch::manual_seed(0);
      auto model = gpt::GPT(gpt::Config{});
      auto sm = shardtorch::shard(model, w, options_for(strategy, w.size(), recipe, true));
      auto opt = shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*model, torch::optim::AdamWOptions(1e-2));
      opt->overlap_with_backward();
      auto x = gpt_tokens().narrow(0, 0, 2);
      gpt::lm_loss(model(x), x).backward();
      require(!opt->inner().state().empty(), "the backward did not step the optimizer");
      opt->step();
    });
    ASSERT_TRUE(r.ok) << what << "\n" << r.summary();
  }
}

INSTANTIATE_TEST_SUITE_P(Sharded, OffloadParity,
                         ::testing::Combine(::testing::ValuesIn(kSharded), ::testing::Values(1, 2, 3)),
                         [](const ::testing::TestParamInfo<OffloadParity::ParamType>& info) {
                           return std::string(shardtorch::strategy_name(std::get<0>(info.param))) + "_world" +
                                  std::to_string(std::get<1>(info.param));
                         });

// With the step overlapping backward each sharded unit's update reads the
// host copy of its reduced gradient directly: no host gradient is made
// (OptimizerOnly, whose flats keep whole gradients, still makes them), and
// the optimizer stepped during the backward.
TEST(Offload, TheStepOverlappingBackwardKeepsNoHostGradients) {
  auto r = run_ranks(2, [](World& w) {
    auto x = gpt_tokens().narrow(0, w.rank() * 2, 2);
    for (Strategy s : {Strategy::FullShard, Strategy::ShardGradOp, Strategy::HybridShard, Strategy::OptimizerOnly})
      for (bool bf16 : {false, true}) {
        const std::string name = std::string(shardtorch::strategy_name(s)) + (bf16 ? " bf16" : " fp32");
        torch::manual_seed(0);
        auto model = gpt::GPT(gpt::Config{});
        auto options = strategy_options(s, 2).cpu_offload(true);
        if (bf16)
          options.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16).output_dtype(at::kFloat));
        auto sm = shardtorch::shard(model, w, options);
        auto opt = shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*model, torch::optim::AdamWOptions(1e-2));
        opt->overlap_with_backward();
        for (int step = 0; step < 2; ++step) {
          opt->zero_grad();
          sm.reset_peak_memory();
          gpt::lm_loss(model(x), x).backward();
          require(!opt->inner().state().empty(), name + ": the backward did not step the optimizer");
          const auto m = sm.memory();
          if (s == Strategy::OptimizerOnly) {
            require(m.cur(Mem::HostGradients) > 0, name + ": no host gradients");
          } else {
            require(m.max(Mem::HostGradients) == 0,
                    name + ": host gradients of " + std::to_string(m.max(Mem::HostGradients)) + " bytes");
          }
          opt->step();
        }
      }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(Offload, FusedCpuAdamWOnOffloadedShardsMatchesSingleProcessTraining) {
  // The reference: torch::optim::AdamW over the whole model in one process.
  auto x = gpt_tokens();
  torch::manual_seed(0);
  auto ref = gpt::GPT(gpt::Config{});
  torch::optim::AdamW ref_opt(unique_tensors(*ref), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  auto want = train_in_one_process(*ref, ref_opt, 3, [&] { return gpt::lm_loss(ref(x), x); });
  Recipe recipe;
  recipe.micro = 1;
  recipe.clip = 0;
  recipe.fused = true;
  recipe.lr = 1e-3;
  auto r = run_ranks(3, [&](World& w) {
    auto got = train(w, Strategy::FullShard, recipe, true);
    std::map<std::string, torch::Tensor> mine;
    for (auto& [n, t] : want) mine[n] = got.at(n);
    double err = expect_close_map(mine, want, 1e-5, "offloaded FullShard with FusedAdamW at 3 ranks");
    std::printf("rank %d: largest relative error vs single process %.3g\n", w.rank(), err);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(Offload, MastersGradientsAndOptimizerStateAreCountedInHostMemory) {
  auto r = run_ranks(2, [](World& w) {
    auto x = gpt_tokens();
    for (Strategy s : {Strategy::FullShard, Strategy::ShardGradOp}) {
      torch::manual_seed(0);
      auto model = gpt::GPT(gpt::Config{});
      auto sm = shardtorch::shard(model, w, ShardOptions().strategy(s).cpu_offload(true));
      auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));
      const std::string name = shardtorch::strategy_name(s);
      int64_t shard_bytes = 0;
      for (const auto& u : sm.units())
        for (const auto& l : u.layouts) shard_bytes += l.shard_numel() * 4;
      auto m = sm.memory();
      require(m.cur(Mem::HostParams) == shard_bytes, name + ": host_params " + std::to_string(m.cur(Mem::HostParams)) +
                                                         " != shards " + std::to_string(shard_bytes));
      require(m.cur(Mem::ShardedParams) == 0, name + ": sharded_params left on the device");
      auto xs = x.narrow(0, w.rank() * 6, 6);
      gpt::lm_loss(model(xs), xs).backward();
      m = sm.memory();
      require(m.cur(Mem::Gradients) == 0, name + ": gradients on the device after backward");
      require(m.cur(Mem::HostGradients) == shard_bytes,
              name + ": host_gradients " + std::to_string(m.cur(Mem::HostGradients)));
      opt->step();
      m = sm.memory();
      require(m.cur(Mem::OptimizerState) == 0, name + ": optimizer state on the device");
      int64_t owned = 0;  // elements of parameters this rank optimizes (its shards less padding)
      for (const auto& piece : opt->views().pieces()) owned += piece.length;
      require(m.cur(Mem::HostOptimizerState) == 2 * 4 * owned,
              name + ": host_optimizer_state " + std::to_string(m.cur(Mem::HostOptimizerState)) +
                  " != exp_avg + exp_avg_sq of " + std::to_string(owned) + " elements");
      // Every optimized tensor and its state are CPU tensors.
      for (const auto& g : opt->inner().param_groups())
        for (const auto& p : g.params()) require(p.device().is_cpu(), name + ": a master is not in host memory");
      if (s == Strategy::FullShard) {
        require(m.cur(Mem::GatheredParams) == 0, "full_shard: gathered parameters left after the step");
      } else {
        require(m.cur(Mem::ReplicatedParams) > 0, "shard_grad_op: the replicated compute copy is missing");
      }
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(Offload, NoShardRefusesOffloadNamingTheAlternative) {
  auto r = run_ranks(1, [](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    try {
      shardtorch::shard(model, w, ShardOptions().strategy(Strategy::NoShard).cpu_offload(true));
    } catch (const std::exception& e) {
      std::string msg = e.what();
      require(msg.find("cpu_offload") != std::string::npos && msg.find("OptimizerOnly") != std::string::npos,
              "unhelpful error: " + msg);
      return;
    }
    require(false, "NoShard with cpu_offload was accepted");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(Offload, CheckpointsMoveBetweenOffloadedAndResidentModelsBitwise) {
  const TempDir dir("shardtorch-offload");
  auto x = gpt_tokens();
  auto save = [&](int world, bool offload, const std::string& where, bool load_first, const std::string& from) {
    return run_ranks(world, [&](World& w) {
      torch::manual_seed(load_first ? 5 : 0);
      auto model = gpt::GPT(gpt::Config{});
      auto sm = shardtorch::shard(model, w, ShardOptions().cpu_offload(offload));
      auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));
      if (load_first) {
        shardtorch::load_sharded_checkpoint(*model, opt.get(), from);
      } else {
        const int64_t per = kBatch / w.size();
        for (int s = 0; s < 2; ++s) {
          opt->zero_grad();
          auto xs = x.narrow(0, w.rank() * per, per);
          gpt::lm_loss(model(xs), xs).backward();
          opt->step();
        }
      }
      shardtorch::save_sharded_checkpoint(*model, opt.get(), where, 2);
      shardtorch::save_full_state_dict(*model, where + ".safetensors");  // gathered from host masters when offloaded
    });
  };
  const std::string a = (dir / "offloaded").string(), b = (dir / "resident").string(), c = (dir / "back").string();
  auto r1 = save(2, true, a, false, "");
  ASSERT_TRUE(r1.ok) << r1.summary();
  auto r2 = save(3, false, b, true, a);  // offloaded at 2 -> resident at 3
  ASSERT_TRUE(r2.ok) << r2.summary();
  auto r3 = save(1, true, c, true, b);  // resident at 3 -> offloaded at 1
  ASSERT_TRUE(r3.ok) << r3.summary();
  auto first = shardtorch::read_sharded_checkpoint(a);
  ASSERT_TRUE(first.count("tok_emb.weight|exp_avg")) << "optimizer state missing";
  for (const auto& p : {b, c}) {
    auto again = shardtorch::read_sharded_checkpoint(p);
    ASSERT_EQ(again.size(), first.size()) << p;
    for (auto& [k, v] : first) EXPECT_TRUE(at::equal(again.at(k), v)) << k << " differs in " << p;
  }
  // The full state dicts too: saved offloaded (a, c) and resident (b), bitwise alike.
  auto whole = shardtorch::checkpoint::load_file(a + ".safetensors");
  ASSERT_TRUE(whole.count("tok_emb.weight")) << "the full state dict lacks the embedding";
  for (const auto& p : {b, c}) {
    auto again = shardtorch::checkpoint::load_file(p + ".safetensors");
    ASSERT_EQ(again.size(), whole.size()) << p;
    for (auto& [k, v] : whole) EXPECT_TRUE(at::equal(again.at(k), v)) << k << " differs in " << p << ".safetensors";
  }
}

TEST(Offload, GradScalerAndSummonWithGradsMatchResidentTrainingAndWritebackReachesTheHostMasters) {
  auto r = run_ranks(2, [](World& w) {
    auto x = gpt_tokens();
    auto xs = x.narrow(0, w.rank() * 6, 6);
    auto run = [&](bool offload) {
      torch::manual_seed(0);
      auto model = gpt::GPT(gpt::Config{});
      shardtorch::shard(
          model, w,
          ShardOptions().cpu_offload(offload).mixed_precision(
              shardtorch::MixedPrecision().param_dtype(at::kHalf).reduce_dtype(at::kFloat).output_dtype(at::kFloat)));
      shardtorch::GradScaler scaler(*model, shardtorch::GradScalerOptions().init_scale(1024));
      auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
      for (int s = 0; s < 3; ++s) {
        opt->zero_grad();
        scaler.scale(gpt::lm_loss(model(xs), xs)).backward();
        require(scaler.step(*opt), "a clean fp16 step was skipped");
      }
      opt->zero_grad();
      gpt::lm_loss(model(xs), xs).backward();
      std::map<std::string, torch::Tensor> grads;
      {
        shardtorch::FullParams full(*model, shardtorch::SummonOptions().with_grads(true));
        for (const auto& [n, p] : unique_params(*model)) grads[n] = p.grad().clone();
      }
      return std::make_pair(shardtorch::full_parameters(*model), grads);
    };
    auto want = run(false), got = run(true);
    require(expect_close_map(got.first, want.first, 0.0, "fp16 + GradScaler, offloaded") == 0.0, "params not bitwise");
    require(expect_close_map(got.second, want.second, 0.0, "summoned gradients, offloaded") == 0.0,
            "grads not bitwise");

    torch::manual_seed(0);
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w, ShardOptions().cpu_offload(true));
    {
      shardtorch::FullParams full(*model, shardtorch::SummonOptions().writeback(true));
      torch::NoGradGuard no_grad;
      model->ln_f->weight.fill_(0.25);
    }
    auto after = shardtorch::full_parameters(*model);
    require(at::equal(after.at("ln_f.weight"), torch::full({32}, 0.25)), "the edit did not reach the host master");
    {
      shardtorch::FullParams full(*model);  // the next gather copies the edited master to the device
      require(at::equal(model->ln_f->weight, torch::full({32}, 0.25)), "the gathered parameter misses the edit");
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

namespace {
// An optimizer that writes the parameters through Tensor::data(), whose
// version counter is not the parameter's: only ShardedOptimizer's own
// bookkeeping can tell that the masters changed.
class DataSgd : public torch::optim::Optimizer {
 public:
  DataSgd(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::SGDOptions o)
      : torch::optim::Optimizer(std::move(groups), std::make_unique<torch::optim::SGDOptions>(o)) {}
  at::Tensor step(LossClosure = nullptr) override {
    torch::NoGradGuard no_grad;
    for (auto& g : param_groups_)
      for (auto& p : g.params())
        if (p.grad().defined()) p.data().sub_(p.grad() * static_cast<torch::optim::SGDOptions&>(g.options()).lr());
    return {};
  }
};
}  // namespace

class LowPrecisionCopies : public ::testing::TestWithParam<Strategy> {};

// Under bf16 offload each master has a bf16 copy in host memory, which the
// copy to the device sends. The fused CPU AdamW writes it in its pass, so it
// is never made again; any other change of the masters (another optimizer,
// even one writing through Tensor::data(), an edit by hand, a checkpoint
// load) makes it again before the next gather, and training, edits and loads
// give exactly what they give without offload. (Writeback summons are
// refused under mixed precision.)
TEST_P(LowPrecisionCopies, TheMastersBf16CopiesAreWrittenByTheFusedStepAndMadeAgainAfterAnyOtherChange) {
  const TempDir dir("shardtorch-lowcopy");
  const std::string saved = (dir / "init.safetensors").string();
  {
    torch::manual_seed(7);
    auto other = gpt::GPT(gpt::Config{});  // weights unlike seed 0's
    auto r = run_ranks(1, [&](World& w) {
      shardtorch::shard(other, w);
      shardtorch::save_full_state_dict(*other, saved);
    });
    ASSERT_TRUE(r.ok) << r.summary();
  }
  enum class Opt { Fused, Torch, Data };
  const shardtorch::Strategy s = GetParam();
  for (Opt kind : {Opt::Fused, Opt::Torch, Opt::Data}) {
    const std::string what = std::string(shardtorch::strategy_name(s)) + (kind == Opt::Fused   ? " FusedAdamW"
                                                                          : kind == Opt::Torch ? " torch AdamW"
                                                                                               : " SGD through data()");
    auto r = run_ranks(2, [&](World& w) {
      auto x = gpt_tokens();
      auto xs = x.narrow(0, w.rank() * 6, 6);
      // Trains 3 steps, halves the masters, then loads `saved`: the losses
      // of every forward, and the parameters.
      // `remade`: how often the bf16 copies were made in steps 2 and 3, and
      // how many flat parameters there are (each has one).
      auto run = [&](bool offload, std::pair<int64_t, int64_t>* remade) {
        torch::manual_seed(0);
        auto model = gpt::GPT(gpt::Config{});
        auto sm =
            shardtorch::shard(model, w,
                              ShardOptions().strategy(s).cpu_offload(offload).mixed_precision(
                                  shardtorch::MixedPrecision().param_dtype(at::kBFloat16).output_dtype(at::kFloat)));
        std::unique_ptr<shardtorch::ShardedOptimizer> opt;
        if (kind == Opt::Fused)
          opt = shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*model, torch::optim::AdamWOptions(1e-2));
        if (kind == Opt::Torch) opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));
        if (kind == Opt::Data) opt = shardtorch::ShardedOptimizer::make<DataSgd>(*model, torch::optim::SGDOptions(0.5));
        int64_t flats = 0;
        if (offload) {
          int64_t shard_elems = 0;
          for (const auto& u : sm.units())
            for (const auto& l : u.layouts) shard_elems += l.shard_numel(), ++flats;
          const int64_t host = sm.memory().cur(Mem::HostParams);
          require(host == shard_elems * (4 + 2), what + ": host_params " + std::to_string(host) +
                                                     " != fp32 masters and their bf16 copies, " +
                                                     std::to_string(shard_elems * 6));
        }
        std::vector<torch::Tensor> losses;
        auto forward = [&] {
          auto loss = gpt::lm_loss(model(xs), xs);
          losses.push_back(loss.detach());
          return loss;
        };
        int64_t after_first = 0;
        for (int step = 0; step < 3; ++step) {
          opt->zero_grad();
          forward().backward();
          opt->step();
          if (step == 0) after_first = shardtorch::testing::low_copy_refreshes();
        }
        if (remade) *remade = {shardtorch::testing::low_copy_refreshes() - after_first, flats};
        const std::string ckpt = (dir / ("ckpt-" + std::to_string(static_cast<int>(kind)) + "-" +
                                         std::to_string(static_cast<int>(s)) + (offload ? "-off" : "-res")))
                                     .string();
        auto* saved_opt = kind == Opt::Data ? nullptr : opt.get();  // checkpoints carry no DataSgd state
        shardtorch::save_sharded_checkpoint(*model, saved_opt, ckpt, 3);
        torch::NoGradGuard no_grad;
        // An edit of the masters the optimizer optimizes, by hand.
        for (auto& p : opt->inner().param_groups()[0].params()) p.mul_(0.5);
        forward();
        shardtorch::load_full_state_dict(*model, saved);
        forward();
        // A sharded checkpoint's reader writes the masters too: the next
        // forward computes with what it loaded (the step-3 masters).
        shardtorch::load_sharded_checkpoint(*model, saved_opt, ckpt);
        forward();
        return std::make_pair(losses, shardtorch::full_parameters(*model));
      };
      std::pair<int64_t, int64_t> remade;
      auto want = run(false, nullptr);
      auto got = run(true, &remade);
      for (size_t i = 0; i < want.first.size(); ++i)
        require(at::equal(got.first[i], want.first[i]),
                what + ": loss " + std::to_string(i) +
                    " differs with offload: " + std::to_string(got.first[i].item<double>()) + " vs " +
                    std::to_string(want.first[i].item<double>()));
      require(expect_close_map(got.second, want.second, 0.0, what) == 0.0, what + ": parameters not bitwise");
      // Fused: never made again; otherwise once per flat and step.
      const auto [times, flats] = remade;
      const int64_t want_times = kind == Opt::Fused ? 0 : 2 * flats;
      require(times == want_times, what + ": the bf16 copies of " + std::to_string(flats) +
                                       " flat parameters were made " + std::to_string(times) +
                                       " times in two steps, expected " + std::to_string(want_times));
    });
    ASSERT_TRUE(r.ok) << what << "\n" << r.summary();
  }
}

INSTANTIATE_TEST_SUITE_P(Offload, LowPrecisionCopies, ::testing::Values(Strategy::FullShard, Strategy::ShardGradOp),
                         StrategyName());

// What the masters' bf16 copies are for: the same gathers move half the
// bytes to the device under bf16 as under fp32 (counted on the CPU too).
TEST(Offload, UnderBf16TheCopiesToTheDeviceMoveHalfTheBytesOfFp32) {
  auto r = run_ranks(2, [](World& w) {
    auto x = gpt_tokens();
    auto xs = x.narrow(0, w.rank() * 6, 6);
    for (Strategy s : {Strategy::FullShard, Strategy::ShardGradOp, Strategy::HybridShard}) {
      std::vector<int64_t> to_device;
      int64_t shard_bytes_fp32 = 0;
      for (bool bf16 : {false, true}) {
        torch::manual_seed(0);
        auto model = gpt::GPT(gpt::Config{});
        auto o = strategy_options(s, 2).cpu_offload(true);
        if (bf16) o.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16).output_dtype(at::kFloat));
        auto sm = shardtorch::shard(model, w, o);
        auto opt = shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*model, torch::optim::AdamWOptions(1e-2));
        shard_bytes_fp32 = 0;
        for (const auto& u : sm.units())
          for (const auto& l : u.layouts) shard_bytes_fp32 += l.shard_numel() * 4;
        for (int step = 0; step < 2; ++step) {
          opt->zero_grad();
          gpt::lm_loss(model(xs), xs).backward();
          opt->step();
        }
        to_device.push_back(sm.stats().offload.to_device_bytes);
        require(sm.stats().offload.to_host_bytes > 0,
                std::string(shardtorch::strategy_name(s)) + ": no gradient copied to host memory");
      }
      const std::string name = shardtorch::strategy_name(s);
      require(to_device[0] >= 2 * shard_bytes_fp32,
              name + ": fp32 sent " + std::to_string(to_device[0]) +
                  " bytes to the device in two steps, less than the shards twice");
      require(2 * to_device[1] == to_device[0], name + ": bf16 sent " + std::to_string(to_device[1]) + " bytes, fp32 " +
                                                    std::to_string(to_device[0]) + ": not half");
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

namespace {
// Runs `f`, which must throw an error whose message contains `needle`.
void expect_throws_with(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
  } catch (const std::exception& e) {
    require(std::string(e.what()).find(needle) != std::string::npos,
            "expected an error with '" + needle + "', got: " + e.what());
    return;
  }
  throw std::runtime_error("expected an error with '" + needle + "', nothing was thrown");
}
}  // namespace

TEST(Offload, OverlapWithBackwardRefusesWhatWouldChangeTheUpdate) {
  auto r = run_ranks(2, [](World& w) {
    auto x = gpt_tokens().narrow(0, 2 * w.rank(), 2);
    auto options = [&](bool offload) { return strategy_options(Strategy::FullShard, w.size()).cpu_offload(offload); };
    torch::manual_seed(0);
    auto resident = gpt::GPT(gpt::Config{});
    auto resident_sm = shardtorch::shard(resident, w, options(false));
    auto fused =
        shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*resident, torch::optim::AdamWOptions(1e-2));
    expect_throws_with([&] { fused->overlap_with_backward(); }, "cpu_offload(true)");

    torch::manual_seed(0);
    auto model = gpt::GPT(gpt::Config{});
    auto sm = shardtorch::shard(model, w, options(true));
    {
      auto torch_opt =
          shardtorch::ShardedOptimizer::make<torch::optim::AdamW>(*model, torch::optim::AdamWOptions(1e-2));
      expect_throws_with([&] { torch_opt->overlap_with_backward(); }, "FusedAdamW");
    }
    auto opt = shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*model, torch::optim::AdamWOptions(1e-2));
    opt->overlap_with_backward();
    gpt::lm_loss(model(x), x).backward();
    // The update used the unclipped gradients: clipping now would be a lie.
    expect_throws_with([&] { shardtorch::clip_grad_norm(*model, 0.5); }, "overlap_with_backward");
    // A forward before step() would compute with parameters already updated.
    expect_throws_with([&] { gpt::lm_loss(model(x), x).backward(); }, "call opt->step() first");
    // Nor are the gradients there to read: the update consumed them.
    expect_throws_with([&] { shardtorch::full_gradients(*model); },
                       "the optimizer consumed the gradients during that backward");
    expect_throws_with([&] { gpt::lm_loss(model(x), x).backward(); }, "unit '<root>': flat Float");  // the first
    opt->zero_grad();
    opt->step();
    // After step() training goes on, also after that failure.
    for (int i = 0; i < 2; ++i) {
      opt->zero_grad();
      gpt::lm_loss(model(x), x).backward();
      opt->step();
    }
    opt->overlap_with_backward(false);
    opt->zero_grad();
    gpt::lm_loss(model(x), x).backward();
    shardtorch::clip_grad_norm(*model, 0.5);  // allowed again without the overlap
    opt->step();
  });
  ASSERT_TRUE(r.ok) << r.summary();
}
