// Communication hooks (shardtorch/comm_hooks.h): what a hook is given, that
// the built-in all-reduce hook trains like the built-in reduction, and that a
// failing hook fails backward with an error naming the rank and the bucket.
// Parity with PyTorch DDP's own hooks: tests/python/comm_hook_parity.py.
#include <gtest/gtest.h>

#include <ATen/core/jit_type.h>

#include <atomic>
#include <optional>

#include "models.h"

using namespace testmodels;
using shardtorch::ShardOptions;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

torch::Tensor batch_x() {
  torch::manual_seed(7);
  return torch::randn({kBatch, 7});
}
torch::Tensor batch_y() {
  torch::manual_seed(8);
  return torch::randn({kBatch, 3});
}

// This rank's slice of the batch.
std::pair<torch::Tensor, torch::Tensor> rank_batch(World& w) {
  const int64_t per = kBatch / w.size();
  return {batch_x().narrow(0, w.rank() * per, per), batch_y().narrow(0, w.rank() * per, per)};
}

using HookFactory = std::function<std::unique_ptr<shardtorch::CommHook>(shardtorch::ShardedModel&)>;

// Trains the test MLP for `steps` SGD steps on this rank's slice, with the
// hook `make_hook` returns (none if null); returns the full parameters.
std::map<std::string, torch::Tensor> train(World& w, ShardOptions opts, const HookFactory& make_hook, int steps = 3,
                                           double lr = 0.1) {
  torch::manual_seed(0);
  MLP model;
  auto sm = shardtorch::shard(model, w, opts);
  if (make_hook) sm.register_comm_hook(make_hook(sm));
  const auto dtype = opts.mixed_precision().param_dtype();
  std::optional<shardtorch::GradScaler> scaler;  // fp16 trains only through one
  if (dtype == at::kHalf) scaler.emplace(*model, shardtorch::GradScalerOptions().init_scale(1024));
  auto opt = shardtorch::SGD(*model, torch::optim::SGDOptions(lr));
  auto [x, y] = rank_batch(w);
  if (dtype) x = x.to(*dtype);
  for (int s = 0; s < steps; ++s) {
    opt->zero_grad();
    auto loss = torch::mse_loss(model(x).to(at::kFloat), y);
    if (!scaler) {
      loss.backward();
      opt->step();
      continue;
    }
    scaler->scale(loss).backward();
    require(scaler->step(*opt), "an fp16 step was skipped");
  }
  return shardtorch::full_parameters(*model);
}

void expect_equal(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want,
                  const std::string& what) {
  require(got.size() == want.size(), what + ": parameter counts differ");
  for (const auto& [name, t] : want)
    require(torch::equal(got.at(name), t),
            what + ": " + name + " differs by " + std::to_string((got.at(name) - t).abs().max().item<double>()));
}

// Records every bucket it is given, then all-reduces it as the built-in hook.
struct RecordingHook : shardtorch::AllReduceHook {
  using AllReduceHook::AllReduceHook;
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    buffers.push_back(bucket.getBuffer().clone());
    outputs.push_back(bucket.getBuffer());  // reduced in place by the time backward returns
    indices.push_back(bucket.getIndex());
    last.push_back(bucket.isLast());
    params.push_back(bucket.getParameters());
    gradients.push_back(bucket.getGradients());
    return AllReduceHook::runHook(bucket);
  }
  std::vector<at::Tensor> buffers, outputs;
  std::vector<size_t> indices;
  std::vector<bool> last;
  std::vector<std::vector<at::Tensor>> params, gradients;
};

// allreduce_hook, refusing a bucket of another dtype than `want`.
struct DtypeCheckingHook : shardtorch::AllReduceHook {
  DtypeCheckingHook(shardtorch::HookGroup g, at::ScalarType want) : AllReduceHook(std::move(g)), want(want) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    require(
        bucket.getBuffer().scalar_type() == want,
        "the hook got a bucket of " + shardtorch::describe(bucket.getBuffer()) + ", expected " + c10::toString(want));
    return AllReduceHook::runHook(bucket);
  }
  at::ScalarType want;
};

// Multiplies the bucket by `factor`, reducing nothing.
struct ScaleHook : c10d::CppCommHookInterface<double> {
  explicit ScaleHook(double factor) : CppCommHookInterface<double>(factor) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    return shardtorch::completed_future(bucket.getBuffer() * state_);
  }
};

// Fails in one of three ways on its first `failures` calls, then all-reduces.
enum class Failure { FutureError, WrongShape, ThrowsInCallback };
struct FailingHook : shardtorch::AllReduceHook {
  FailingHook(shardtorch::HookGroup g, Failure how, int failures)
      : AllReduceHook(std::move(g)), how(how), left(failures) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    if (left <= 0) return AllReduceHook::runHook(bucket);
    --left;
    switch (how) {
      case Failure::FutureError: {
        auto f = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
        f->setError(std::make_exception_ptr(std::runtime_error("the replica group voted this step down")));
        return f;
      }
      case Failure::WrongShape:
        return shardtorch::completed_future(at::zeros({3}));
      case Failure::ThrowsInCallback:  // the callback runs on a Gloo thread: its exception must not escape there
        return AllReduceHook::runHook(bucket)->then(
            [](c10::ivalue::Future&) -> c10::IValue { throw std::runtime_error("decompression failed"); },
            c10::TensorType::get());
    }
    return {};
  }
  Failure how;
  int left;
};

}  // namespace

TEST(CommHooks, NoShardAllReduceHookTrainsBitwiseLikeTheBuiltInReduction) {
  auto r = run_ranks(2, [](World& w) {
    // Small buckets: several per step, and the unused-parameter flag goes on its own.
    const auto opts = ShardOptions().strategy(Strategy::NoShard).bucket_mb(0.0002);
    auto want = train(w, opts, nullptr);
    auto got =
        train(w, opts, [](shardtorch::ShardedModel& sm) { return shardtorch::allreduce_hook(sm.comm_hook_group()); });
    expect_equal(got, want, "NoShard with allreduce_hook");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(CommHooks, NoShardHookIsGivenEachBucketsLocalGradientsAndItsParameters) {
  auto r = run_ranks(2, [](World& w) {
    torch::manual_seed(0);
    MLP model;
    auto sm = shardtorch::shard(model, w, ShardOptions().strategy(Strategy::NoShard).bucket_mb(0.0002));
    auto owned = std::make_unique<RecordingHook>(sm.comm_hook_group());
    RecordingHook* hook = owned.get();
    sm.register_comm_hook(std::move(owned));
    auto [x, y] = rank_batch(w);
    torch::mse_loss(model(x), y).backward();

    const size_t n = hook->buffers.size();
    require(n >= 2, "expected several buckets, the hook saw " + std::to_string(n));
    std::set<const void*> seen;
    for (size_t b = 0; b < n; ++b) {
      require(hook->indices[b] == b, "bucket indices out of order");
      require(hook->last[b] == (b + 1 == n), "isLast() wrong for bucket " + std::to_string(b));
      int64_t numel = 0;
      require(hook->params[b].size() == hook->gradients[b].size(), "parameters and gradients differ in number");
      for (size_t i = 0; i < hook->params[b].size(); ++i) {
        const auto& p = hook->params[b][i];
        require(seen.insert(p.unsafeGetTensorImpl()).second, "a parameter in two buckets");
        require(hook->gradients[b][i].sizes() == p.sizes(), "a gradient view of another shape than its parameter");
        numel += p.numel();
      }
      require(hook->buffers[b].numel() == numel, "the bucket holds more than its gradients (the flag?)");
      // What the hook saw was this rank's own gradient: the mean over the
      // ranks of what each saw is the reduced gradient.
      at::Tensor mean = hook->buffers[b].clone();
      w.comm().all_reduce(mean, c10d::ReduceOp::SUM, "test");
      mean.div_(w.size());
      std::vector<at::Tensor> grads;
      for (const auto& p : hook->params[b]) grads.push_back(p.grad().reshape({-1}));
      require(torch::allclose(at::cat(grads), mean, 0, 0), "reduced gradients are not the mean of what the hook saw");
    }
    size_t trainable = 0;
    for (const auto& p : model->parameters()) trainable += p.requires_grad();
    require(seen.size() == trainable, "not every trainable parameter reached the hook");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(CommHooks, RegisteringASecondHookIsRefused) {
  auto r = run_ranks(2, [](World& w) {
    MLP model;
    auto sm = shardtorch::shard(model, w, ShardOptions().strategy(Strategy::NoShard));
    sm.register_comm_hook(shardtorch::allreduce_hook(sm.comm_hook_group()));
    try {
      sm.register_comm_hook(shardtorch::allreduce_hook(sm.comm_hook_group()));
      require(false, "a second hook was taken");
    } catch (const shardtorch::Error& e) {
      require(std::string(e.what()).find("has a communication hook already") != std::string::npos, e.what());
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A hook failing in each way fails backward on every rank with the rank, the
// bucket and (for a wrong shape) both shapes; the next step, after zero_grad,
// trains as if the failed one never happened.
class HookFailures : public ::testing::TestWithParam<std::tuple<Strategy, Failure>> {};

TEST_P(HookFailures, ReachTheCallerOfBackwardNamingRankAndBucket) {
  const auto [strategy, how] = GetParam();
  auto r = run_ranks(2, [strategy = strategy, how = how](World& w) {
    const auto opts = ShardOptions().strategy(strategy);
    auto want = train(w, opts, nullptr, /*steps=*/2);
    torch::manual_seed(0);
    MLP model;
    auto sm = shardtorch::shard(model, w, opts);
    sm.register_comm_hook(std::make_unique<FailingHook>(sm.comm_hook_group(), how, 1));
    auto opt = shardtorch::SGD(*model, torch::optim::SGDOptions(0.1));
    auto [x, y] = rank_batch(w);
    std::string message;
    try {
      torch::mse_loss(model(x), y).backward();
    } catch (const std::exception& e) {
      message = e.what();
    }
    require(!message.empty(), "backward did not fail");
    const std::string rank = "rank " + std::to_string(w.rank());
    require(message.find(rank) != std::string::npos, "no rank in: " + message);
    require(message.find("communication hook for") != std::string::npos, "no bucket in: " + message);
    if (strategy == Strategy::NoShard)
      require(message.find("gradient bucket 0") != std::string::npos, "no bucket index in: " + message);
    else
      require(message.find("unit '") != std::string::npos, "no unit in: " + message);
    switch (how) {
      case Failure::FutureError:
        require(message.find("the replica group voted this step down") != std::string::npos, message);
        break;
      case Failure::WrongShape:
        require(message.find("holds Float[3], expected a tensor of the bucket's shape [") != std::string::npos,
                message);
        break;
      case Failure::ThrowsInCallback:
        require(message.find("decompression failed") != std::string::npos, message);
        break;
    }
    // Recovery: the same two steps as the reference.
    for (int s = 0; s < 2; ++s) {
      opt->zero_grad();
      torch::mse_loss(model(x), y).backward();
      opt->step();
    }
    expect_equal(shardtorch::full_parameters(*model), want, "after the failed backward");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

INSTANTIATE_TEST_SUITE_P(CommHooks, HookFailures,
                         ::testing::Combine(::testing::Values(Strategy::NoShard, Strategy::FullShard),
                                            ::testing::Values(Failure::FutureError, Failure::WrongShape,
                                                              Failure::ThrowsInCallback)));

TEST(CommHooks, HybridShardAllReduceHookTrainsLikeTheBuiltInAllReduceAcrossReplicas) {
  auto r = run_ranks(4, [](World& w) {
    const auto opts = ShardOptions().strategy(Strategy::HybridShard).hybrid_shard_size(2).bucket_mb(0.0002);
    auto want = train(w, opts, nullptr);
    auto got = train(w, opts, [](shardtorch::ShardedModel& sm) {
      require(sm.comm_hook_group() && sm.comm_hook_group()->getSize() == 2, "the hook group is not the replica group");
      return shardtorch::allreduce_hook(sm.comm_hook_group());
    });
    expect_equal(got, want, "HybridShard with allreduce_hook");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(CommHooks, HybridShardHookIsGivenTheShardGroupsMeanOfThisRanksShard) {
  auto r = run_ranks(4, [](World& w) {
    torch::manual_seed(0);
    MLP model;
    auto sm = shardtorch::shard(model, w, ShardOptions().strategy(Strategy::HybridShard).hybrid_shard_size(2));
    auto owned = std::make_unique<RecordingHook>(sm.comm_hook_group());
    RecordingHook* hook = owned.get();
    sm.register_comm_hook(std::move(owned));
    auto [x, y] = rank_batch(w);
    torch::mse_loss(model(x), y).backward();
    // This rank's trainable shard elements: each reduce-scatter output holds pieces of them.
    int64_t shard_numel = 0;
    for (const auto& u : sm.units())
      for (size_t f = 0; f < u.layouts.size(); ++f)
        if (!u.frozen[f]) shard_numel += u.layouts[f].shard_numel();
    int64_t seen = 0;
    for (size_t b = 0; b < hook->buffers.size(); ++b) {
      require(hook->indices[b] == b && !hook->last[b], "index or isLast() wrong");
      require(hook->params[b].empty(), "sharded buckets list no parameters");
      int64_t pieces = 0;
      for (const auto& g : hook->gradients[b]) pieces += g.numel();
      require(pieces == hook->buffers[b].numel(), "the pieces do not cover the bucket");
      seen += hook->buffers[b].numel();
      // What the hook returned (it reduced its bucket in place) is the mean
      // of its inputs across the replica group.
      std::vector<at::Tensor> across{hook->buffers[b].clone()};
      sm.comm_hook_group()->allreduce(across)->wait();
      require(torch::equal(across[0].div_(2), hook->outputs[b]), "the result is not the replicas' mean");
    }
    require(seen == shard_numel, "the hook saw " + std::to_string(seen) + " elements, this rank's shards hold " +
                                     std::to_string(shard_numel));
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(CommHooks, FullShardHookRunsOnTheReduceScatterOutput) {
  auto r = run_ranks(2, [](World& w) {
    const auto opts = ShardOptions().strategy(Strategy::FullShard).bucket_mb(0.0002);
    auto want = train(w, opts, nullptr);
    // No replicas: the built-in hook has no group and returns the world's mean as it is.
    auto same = train(w, opts, [](shardtorch::ShardedModel& sm) {
      require(!sm.comm_hook_group(), "FullShard has no group across replicas");
      return shardtorch::allreduce_hook(sm.comm_hook_group());
    });
    expect_equal(same, want, "FullShard with allreduce_hook");
    // A hook doubling the gradients, at half the learning rate, takes the same steps.
    auto doubled = train(
        w, opts, [](shardtorch::ShardedModel&) { return std::make_unique<ScaleHook>(2.0); }, 3, 0.05);
    expect_equal(doubled, want, "FullShard with gradients doubled by a hook at half the learning rate");
    auto sgo = train(
        w, ShardOptions().strategy(Strategy::ShardGradOp),
        [](shardtorch::ShardedModel&) { return std::make_unique<ScaleHook>(2.0); }, 3, 0.05);
    expect_equal(sgo, train(w, ShardOptions().strategy(Strategy::ShardGradOp), nullptr), "ShardGradOp, doubled");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(CommHooks, OptimizerOnlyHookRunsOnTheAllReducedWholeGradient) {
  auto r = run_ranks(2, [](World& w) {
    const auto opts = ShardOptions().strategy(Strategy::OptimizerOnly);
    {
      // What the hook gets: whole flat gradients, already the world's mean
      // (the ranks' own gradients differ: their batches do).
      torch::manual_seed(0);
      MLP model;
      auto sm = shardtorch::shard(model, w, opts);
      require(!sm.comm_hook_group(), "OptimizerOnly has no group across replicas");
      auto hook = std::make_unique<RecordingHook>(sm.comm_hook_group());
      RecordingHook* seen = hook.get();
      sm.register_comm_hook(std::move(hook));
      auto [x, y] = rank_batch(w);
      torch::mse_loss(model(x), y).backward();
      require(!seen->buffers.empty(), "the hook was never called");
      int64_t elements = 0, params = 0;
      for (const auto& b : seen->buffers) {
        auto first = b.clone();
        w.comm().broadcast(first, 0, "compare");
        require(torch::equal(b, first), "the hook's buckets differ between the ranks: not all-reduced before it");
        elements += b.numel();
      }
      for (const auto& p : model->parameters()) params += p.requires_grad() ? p.numel() : 0;
      require(elements >= params, "the hook saw " + std::to_string(elements) + " elements, fewer than the model's " +
                                      std::to_string(params) + ": not whole gradients");
    }
    auto want = train(w, opts, nullptr);
    auto same =
        train(w, opts, [](shardtorch::ShardedModel& sm) { return shardtorch::allreduce_hook(sm.comm_hook_group()); });
    expect_equal(same, want, "OptimizerOnly with allreduce_hook");
    // A hook doubling the gradients, at half the learning rate, takes the same steps.
    auto doubled = train(
        w, opts, [](shardtorch::ShardedModel&) { return std::make_unique<ScaleHook>(2.0); }, 3, 0.05);
    expect_equal(doubled, want, "OptimizerOnly with gradients doubled by a hook at half the learning rate");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Under mixed precision the hook gets the bucket in the dtype the built-in
// reduction uses (reduce_dtype, else param_dtype), and what it returns goes
// back into the gradients as the built-in reduction's result does.
TEST(CommHooks, AllReduceHookTrainsBitwiseLikeTheBuiltInReductionUnderMixedPrecision) {
  auto r = run_ranks(4, [](World& w) {
    // The MLP's buffer in param_dtype too: an fp32 one would promote the input to fp32.
    const auto mp =
        shardtorch::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat).buffer_dtype(at::kBFloat16);
    for (auto opts :
         {ShardOptions().strategy(Strategy::NoShard).bucket_mb(0.0002).mixed_precision(mp),
          ShardOptions().strategy(Strategy::HybridShard).hybrid_shard_size(2).mixed_precision(mp),
          ShardOptions()
              .strategy(Strategy::FullShard)
              .mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kHalf).buffer_dtype(at::kHalf))}) {
      auto want = train(w, opts, nullptr);
      const auto mp = opts.mixed_precision();
      const at::ScalarType bucket = mp.reduce_dtype().value_or(*mp.param_dtype());
      auto got = train(w, opts, [bucket](shardtorch::ShardedModel& sm) {
        return std::make_unique<DtypeCheckingHook>(sm.comm_hook_group(), bucket);
      });
      expect_equal(got, want, std::string("mixed precision, ") + shardtorch::strategy_name(opts.strategy()));
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Hooks that differ across ranks (or a hook on some ranks only) would issue
// different collectives: the first backward fails on every rank at once,
// naming both ranks and both hooks, instead of pairing mismatched
// collectives (an abort inside Gloo) or silently training apart.
TEST(CommHooks, DifferentHooksOnDifferentRanksFailEveryRankNamingBoth) {
  struct Case {
    Strategy strategy;
    int ranks;
    bool last_has_none;  // the last rank registers no hook (else the bf16 one)
  };
  for (const Case c :
       {Case{Strategy::NoShard, 2, false}, Case{Strategy::NoShard, 2, true}, Case{Strategy::FullShard, 2, false},
        Case{Strategy::HybridShard, 4, false}, Case{Strategy::HybridShard, 4, true}}) {
    SCOPED_TRACE(std::string(shardtorch::strategy_name(c.strategy)) + (c.last_has_none ? ", no hook" : ", bf16"));
    const auto t0 = std::chrono::steady_clock::now();
    auto r = run_ranks(
        c.ranks,
        [c](World& w) {
          torch::manual_seed(0);
          MLP model;
          auto opts = ShardOptions().strategy(c.strategy);
          if (c.strategy == Strategy::HybridShard) opts.hybrid_shard_size(2);
          auto sm = shardtorch::shard(model, w, opts);
          const bool last = w.rank() + 1 == w.size();
          if (!last) sm.register_comm_hook(shardtorch::allreduce_hook(sm.comm_hook_group()));
          if (last && !c.last_has_none) sm.register_comm_hook(shardtorch::bf16_compress_hook(sm.comm_hook_group()));
          auto [x, y] = rank_batch(w);
          std::string message;
          try {
            torch::mse_loss(model(x), y).backward();
          } catch (const shardtorch::Error& e) {
            message = e.what();
          }
          require(!message.empty(), "backward did not fail with shardtorch::Error");
          const std::string other = c.last_has_none ? "no hook" : "shardtorch::CompressHook(BFloat16)";
          for (const std::string& want :
               {"shardtorch: rank " + std::to_string(w.rank()) + ": the ranks have different communication hooks: ",
                std::string("rank 0 has shardtorch::AllReduceHook, rank ") + std::to_string(w.size() - 1) + " has " +
                    other,
                std::string("register the same kind of hook on every rank")})
            require(message.find(want) != std::string::npos, "'" + want + "' is not in: " + message);
        },
        shardtorch::testing::RunOptions()
            .collective_timeout(std::chrono::seconds(60))
            .timeout(std::chrono::seconds(90)));
    EXPECT_TRUE(r.ok) << r.summary();
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0)
        << "the ranks should fail at once, not after the collective timeout";
  }
}

// comm_stats() counts what the library handed to the hook: one call per
// bucket (NoShard) or reduce-scatter output (sharded), their bytes in the
// bucket's dtype, and the time until their futures completed; nothing
// without a hook.
TEST(CommHooks, CommStatsCountTheBucketsHandedToTheHook) {
  auto r = run_ranks(4, [](World& w) {
    const auto mp =
        shardtorch::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat).buffer_dtype(at::kBFloat16);
    for (auto opts : {ShardOptions().strategy(Strategy::NoShard).bucket_mb(0.0002),
                      ShardOptions().strategy(Strategy::HybridShard).hybrid_shard_size(2).bucket_mb(0.0002),
                      ShardOptions().strategy(Strategy::FullShard).bucket_mb(0.0002).mixed_precision(mp)}) {
      const std::string what = shardtorch::strategy_name(opts.strategy());
      torch::manual_seed(0);
      MLP model;
      auto sm = shardtorch::shard(model, w, opts);
      auto owned = std::make_unique<RecordingHook>(sm.comm_hook_group());
      RecordingHook* hook = owned.get();
      auto [x, y] = rank_batch(w);
      if (auto dtype = opts.mixed_precision().param_dtype()) x = x.to(*dtype);
      torch::mse_loss(model(x).to(at::kFloat), y).backward();  // no hook yet
      require(sm.comm_stats().comm_hook.calls == 0 && sm.comm_stats().comm_hook.bucket_bytes == 0,
              what + ": hook calls counted without a hook");
      sm.register_comm_hook(std::move(owned));
      for (int step = 0; step < 2; ++step) torch::mse_loss(model(x).to(at::kFloat), y).backward();
      const auto stats = sm.comm_stats().comm_hook;
      int64_t bytes = 0;
      for (const auto& b : hook->buffers) bytes += static_cast<int64_t>(b.nbytes());
      require(hook->buffers.size() >= 2, what + ": expected several buckets");
      require(stats.calls == static_cast<int64_t>(hook->buffers.size()), what + ": " + std::to_string(stats.calls) +
                                                                             " hook calls counted, the hook saw " +
                                                                             std::to_string(hook->buffers.size()));
      require(stats.bucket_bytes == bytes, what + ": " + std::to_string(stats.bucket_bytes) +
                                               " bucket bytes counted, the hook saw " + std::to_string(bytes));
      require(stats.seconds > 0, what + ": no time counted");
      if (opts.mixed_precision().reduce_dtype())  // fp32 buckets of bf16 parameters: 4 bytes an element
        for (const auto& b : hook->buffers)
          require(b.scalar_type() == at::kFloat, what + ": a bucket of " + shardtorch::describe(b));
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}
