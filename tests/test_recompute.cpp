// Activation checkpointing (ShardOptions::activation_checkpointing): a unit
// keeps only its inputs and recomputes its activations in backward. Training
// must not change by a bit, under every strategy; the activations kept must
// shrink; no all-gather may be added.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

#include <c10/core/CPUAllocator.h>

#include <cstring>
#include <mutex>
#include <unordered_map>

#include "models.h"

using namespace testmodels;
using shardtorch::ShardOptions;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

constexpr double kTol = 1e-5;

// A unit with dropout (random draws the recomputation must repeat) that
// returns a tuple (the outputs to re-attach are found inside it).
struct DropLayerImpl : torch::nn::Module {
  DropLayerImpl(int64_t in, int64_t out) : lin(register_module("lin", torch::nn::Linear(in, out))) {}
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x) {
    auto h = torch::dropout(torch::gelu(lin(x)), 0.3, is_training());
    return {h, h.sum(-1, /*keepdim=*/true)};
  }
  torch::nn::Linear lin;
};
SHARDTORCH_MODULE(DropLayer);

struct DropNetImpl : torch::nn::Module {
  DropNetImpl()
      : a(register_module("a", DropLayer(6, 16))),
        b(register_module("b", DropLayer(16, 16))),
        out(register_module("out", torch::nn::Linear(17, 4))) {}
  torch::Tensor forward(torch::Tensor x) {  // x needs no gradient: unit a's inputs need none
    auto [h1, s1] = a(x);
    auto [h2, s2] = b(h1);
    return out(torch::cat({h2, s1 * s2}, -1));
  }
  DropLayer a, b;
  torch::nn::Linear out;
};
SHARDTORCH_MODULE(DropNet);

// A unit with batch norm: its forward updates the running statistics and
// the batch count, which the recomputation must not update a second time.
struct NormBlockImpl : torch::nn::Module {
  NormBlockImpl()
      : lin(register_module("lin", torch::nn::Linear(8, 8))),
        norm(register_module("norm", torch::nn::BatchNorm1d(8))) {}
  torch::Tensor forward(torch::Tensor x) { return x + torch::gelu(norm(lin(x))); }
  torch::nn::Linear lin;
  torch::nn::BatchNorm1d norm;
};
SHARDTORCH_MODULE(NormBlock);

struct NormNetImpl : torch::nn::Module {
  NormNetImpl()
      : a(register_module("a", NormBlock())),
        b(register_module("b", NormBlock())),
        out(register_module("out", torch::nn::Linear(8, 3))) {}
  torch::Tensor forward(torch::Tensor x) { return out(b(a(x))); }
  NormBlock a, b;
  torch::nn::Linear out;
};
SHARDTORCH_MODULE(NormNet);

// Wide residual blocks: activations (batch x 512 per block) dwarf the
// parameters, so what checkpointing saves shows.
struct WideImpl : torch::nn::Module {
  WideImpl()
      : up(register_module("up", torch::nn::Linear(32, 512))),
        down(register_module("down", torch::nn::Linear(512, 32))) {}
  torch::Tensor forward(torch::Tensor x) { return x + down(torch::gelu(up(x))); }
  torch::nn::Linear up, down;
};
SHARDTORCH_MODULE(Wide);

struct TowerImpl : torch::nn::Module {
  explicit TowerImpl(int n) : head(register_module("head", torch::nn::Linear(32, 1))) {
    for (int i = 0; i < n; ++i) blocks.push_back(register_module("b" + std::to_string(i), Wide()));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks) x = b(x);
    return head(x).pow(2).mean();
  }
  std::vector<Wide> blocks;
  torch::nn::Linear head;
};
SHARDTORCH_MODULE(Tower);

// A unit whose forward can plant a gradient hook that throws: an exception
// from inside the nested backward that recomputes it.
struct FlakyImpl : torch::nn::Module {
  FlakyImpl() : lin(register_module("lin", torch::nn::Linear(6, 6))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto y = torch::tanh(lin(x));
    if (fail && c10::GradMode::is_enabled()) {
      y.register_hook([](torch::Tensor g) -> torch::Tensor { throw std::runtime_error("hook failed inside unit f"); });
    }
    return y;
  }
  torch::nn::Linear lin;
  bool fail = false;
};
SHARDTORCH_MODULE(Flaky);

struct FlakyNetImpl : torch::nn::Module {
  FlakyNetImpl() : a(register_module("a", Layer(6, 6, true))), f(register_module("f", Flaky())) {}
  torch::Tensor forward(torch::Tensor x) { return f(a(x)).pow(2).mean(); }
  Layer a;
  Flaky f;
};
SHARDTORCH_MODULE(FlakyNet);

// Units inside a unit, and a unit returning something else than tensors.
struct OuterImpl : torch::nn::Module {
  OuterImpl() : inner(register_module("inner", Layer(6, 6, true))) {}
  torch::Tensor forward(torch::Tensor x) { return inner(x); }
  Layer inner;
};
SHARDTORCH_MODULE(Outer);

struct PairImpl : torch::nn::Module {
  PairImpl() : lin(register_module("lin", torch::nn::Linear(6, 6))) {}
  std::pair<torch::Tensor, double> forward(torch::Tensor x) { return {lin(x), 2.0}; }
  torch::nn::Linear lin;
};
SHARDTORCH_MODULE(Pair);

struct OddNetImpl : torch::nn::Module {
  OddNetImpl() : o(register_module("o", Outer())), p(register_module("p", Pair())) {}
  torch::Tensor forward(torch::Tensor x) {
    auto [y, k] = p(o(x));
    return (y * k).sum();
  }
  Outer o;
  Pair p;
};
SHARDTORCH_MODULE(OddNet);

// A unit with an optional tensor argument (that needs a gradient), one that
// returns its own parameter beside its result, a frozen unit fed by data,
// and one returning a std::pair.
struct MixImpl : torch::nn::Module {
  MixImpl() : lin(register_module("lin", torch::nn::Linear(6, 6))) {}
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, std::optional<torch::Tensor> context) {
    auto y = torch::tanh(lin(x));
    if (context) y = y * torch::sigmoid(*context);
    return {y, lin->bias};
  }
  torch::nn::Linear lin;
};
SHARDTORCH_MODULE(Mix);

// Returns a std::pair of tensors.
struct SplitImpl : torch::nn::Module {
  SplitImpl() : lin(register_module("lin", torch::nn::Linear(6, 6))) {}
  std::pair<torch::Tensor, torch::Tensor> forward(torch::Tensor x) {
    auto y = lin(x);
    return {torch::tanh(y), y * 2};
  }
  torch::nn::Linear lin;
};
SHARDTORCH_MODULE(Split);

struct MixNetImpl : torch::nn::Module {
  MixNetImpl()
      : frozen(register_module("frozen", Layer(6, 6, true))),
        m(register_module("m", Mix())),
        ctx(register_module("ctx", torch::nn::Linear(6, 6))),
        split(register_module("split", Split())) {
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor x) {
    auto [y, bias] = m(frozen(x), std::optional<torch::Tensor>(ctx(x)));
    auto [a, b] = split(y);
    return (a.pow(2).mean() + b.mean() + bias.pow(2).sum());
  }
  Layer frozen;
  Mix m;
  torch::nn::Linear ctx;
  Split split;
};
SHARDTORCH_MODULE(MixNet);

// Misuse: a unit called twice per forward, one that changes its input in place.
struct TwiceImpl : torch::nn::Module {
  TwiceImpl() : l(register_module("l", Layer(6, 6, true))), inplace(register_module("inplace", InPlace())) {}
  torch::Tensor forward(torch::Tensor x) { return twice ? l(l(x)).sum() : inplace(l(x)).sum(); }
  struct InPlaceImpl : torch::nn::Module {
    torch::Tensor forward(torch::Tensor x) { return x.mul_(2); }
  };
  SHARDTORCH_MODULE(InPlace);
  Layer l;
  InPlace inplace;
  bool twice = true;
};
SHARDTORCH_MODULE(Twice);

// Counts the bytes of CPU tensors alive and their peak. The context is the
// data pointer itself (some callers use raw_allocate), so sizes are kept in
// a map.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) { self_ = this; }
  c10::DataPtr allocate(size_t n) override {
    void* p = base_->raw_allocate(n);
    {
      std::lock_guard<std::mutex> lock(mu_);
      sizes_[p] = static_cast<int64_t>(n);
      cur_ += static_cast<int64_t>(n);
      peak_ = std::max(peak_, cur_);
    }
    return {p, p, &CountingAllocator::release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  int64_t current() {
    std::lock_guard<std::mutex> lock(mu_);
    return cur_;
  }
  int64_t peak() {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = cur_;
  }

 private:
  static void release(void* p) {
    {
      std::lock_guard<std::mutex> lock(self_->mu_);
      auto it = self_->sizes_.find(p);
      if (it != self_->sizes_.end()) {
        self_->cur_ -= it->second;
        self_->sizes_.erase(it);
      }
    }
    self_->base_->raw_deallocate(p);
  }
  static inline CountingAllocator* self_ = nullptr;
  c10::Allocator* base_;
  std::mutex mu_;
  std::unordered_map<void*, int64_t> sizes_;
  int64_t cur_ = 0, peak_ = 0;
};

void require_bitwise(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want,
                     const std::string& what) {
  require(got.size() == want.size(), what + ": parameter count");
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    require(it != got.end(), what + ": missing " + name);
    require(torch::equal(it->second, w), what + ": '" + name + "' differs (max |diff| " +
                                             std::to_string((it->second - w).abs().max().item<double>()) + ")");
  }
}

struct Run {
  std::map<std::string, torch::Tensor> params;
  int64_t all_gathers = 0;  // during the training steps
};

// The GPT trained with `micro` micro-batches per step (no sync on all but the last).
Run train_gpt(World& w, const torch::Tensor& x, ShardOptions opts, int micro = 1) {
  torch::manual_seed(0);
  auto model = gpt::GPT(gpt::Config{});
  auto sm = shardtorch::shard(model, w, opts);
  auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
  const int64_t per = kBatch / w.size(), mb = per / micro;
  const int64_t gathers0 = sm.comm_stats().all_gather.calls;
  for (int s = 0; s < 4; ++s) {
    opt->zero_grad();
    for (int k = 0; k < micro; ++k) {
      sm.set_requires_gradient_sync(k == micro - 1);
      auto xs = x.narrow(0, w.rank() * per + k * mb, mb);
      (gpt::lm_loss(model(xs), xs) / micro).backward();
    }
    opt->step();
  }
  Run r;
  r.all_gathers = sm.comm_stats().all_gather.calls - gathers0;
  shardtorch::FullParams full(*model);
  r.params = snapshot(*model);
  return r;
}

std::map<std::string, torch::Tensor> gpt_reference(const torch::Tensor& x) {
  torch::manual_seed(0);
  auto model = gpt::GPT(gpt::Config{});
  torch::optim::Adam opt(unique_tensors(*model), torch::optim::AdamOptions(1e-3));
  return train_in_one_process(*model, opt, 4, [&] { return gpt::lm_loss(model(x), x); });
}

}  // namespace

class Recompute : public ::testing::TestWithParam<std::tuple<Strategy, int>> {};

// Parity first: single-process training, and the same strategy without
// checkpointing bit for bit, with as many all-gathers.
TEST_P(Recompute, TrainsBitwiseAsWithoutCheckpointing) {
  auto [strategy, world] = GetParam();
  auto x = gpt_tokens();
  auto want = gpt_reference(x);
  auto r = run_ranks(world, [&](World& w) {
    const std::string what = std::string(shardtorch::strategy_name(strategy)) + " checkpointed";
    auto plain = train_gpt(w, x, strategy_options(strategy, world));
    auto ckpt = train_gpt(w, x, strategy_options(strategy, world).activation_checkpointing(true));
    expect_close_map(ckpt.params, want, kTol, what);
    require_bitwise(ckpt.params, plain.params, what + " vs not checkpointed");
    require(ckpt.all_gathers == plain.all_gathers, what + ": " + std::to_string(ckpt.all_gathers) + " all-gathers, " +
                                                       std::to_string(plain.all_gathers) + " without checkpointing");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST_P(Recompute, AccumulatesMicroBatchesAsWithoutCheckpointing) {
  auto [strategy, world] = GetParam();
  auto x = gpt_tokens();
  auto r = run_ranks(world, [&](World& w) {
    auto plain = train_gpt(w, x, strategy_options(strategy, world), 2);
    auto ckpt = train_gpt(w, x, strategy_options(strategy, world).activation_checkpointing(true), 2);
    require_bitwise(ckpt.params, plain.params, std::string(shardtorch::strategy_name(strategy)) + " accumulating");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// The options that touch gathering and reduction: prefetch (the learned
// order is not disturbed by recomputation), CPU offload, bf16 mixed precision.
TEST(Recompute, CombinesWithPrefetchOffloadAndMixedPrecision) {
  auto x = gpt_tokens();
  auto bf16 = shardtorch::MixedPrecision().param_dtype(at::kBFloat16).output_dtype(at::kFloat);
  const std::vector<std::pair<std::string, ShardOptions>> cases = {
      {"prefetch", ShardOptions().prefetch(true)},
      {"offload", ShardOptions().cpu_offload(true).prefetch(true)},
      {"bf16", ShardOptions().mixed_precision(bf16)},
      {"bf16 no_shard", ShardOptions().strategy(Strategy::NoShard).mixed_precision(bf16)},
      {"hybrid bf16", ShardOptions().strategy(Strategy::HybridShard).hybrid_shard_size(2).mixed_precision(bf16)},
  };
  for (const auto& [what, opts] : cases) {
    auto r = run_ranks(2, [&](World& w) {
      auto plain = train_gpt(w, x, opts);
      auto ckpt_opts = opts;
      auto ckpt = train_gpt(w, x, ckpt_opts.activation_checkpointing(true));
      require_bitwise(ckpt.params, plain.params, what);
      require(ckpt.all_gathers == plain.all_gathers, what + ": " + std::to_string(ckpt.all_gathers) + " all-gathers, " +
                                                         std::to_string(plain.all_gathers) + " without checkpointing");
    });
    ASSERT_TRUE(r.ok) << what << ": " << r.summary();
  }
}

// Dropout masks are drawn again when recomputing: the generator's state is
// replayed (and restored after, so later draws do not shift). The first unit
// takes an input that needs no gradient; its parameters must still get theirs.
TEST_P(Recompute, DropoutAndInputsWithoutGradientsTrainAsWithoutCheckpointing) {
  auto [strategy, world] = GetParam();
  auto r = run_ranks(world, [&](World& w) {
    auto train = [&](bool ckpt) {
      torch::manual_seed(0);
      DropNet net;
      auto sm = shardtorch::shard(net, w, strategy_options(strategy, world).activation_checkpointing(ckpt));
      auto opt = shardtorch::Adam(*net, torch::optim::AdamOptions(1e-2));
      torch::manual_seed(100 + w.rank());  // each rank its own data and masks
      for (int s = 0; s < 3; ++s) {
        opt->zero_grad();
        net(torch::randn({5, 6})).pow(2).mean().backward();
        opt->step();
      }
      shardtorch::FullParams full(*net);
      auto p = snapshot(*net);
      p["<next draw>"] = torch::rand({4});  // the generator is where it would be without checkpointing
      return p;
    };
    auto plain = train(false);
    auto ckpt = train(true);
    require_bitwise(ckpt, plain, std::string(shardtorch::strategy_name(strategy)) + " with dropout");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Batch norm's running statistics and batch count are updated once per
// step, as without checkpointing, not again by the recomputation; the
// gradients are unchanged (in training, batch norm normalises with the
// batch's own statistics).
TEST_P(Recompute, BatchNormStatisticsAreUpdatedOncePerStep) {
  auto [strategy, world] = GetParam();
  auto r = run_ranks(world, [&](World& w) {
    auto train = [&](bool ckpt) {
      torch::manual_seed(0);
      NormNet net;
      auto sm = shardtorch::shard(net, w, strategy_options(strategy, world).activation_checkpointing(ckpt));
      auto opt = shardtorch::Adam(*net, torch::optim::AdamOptions(1e-2));
      torch::manual_seed(100 + w.rank());
      for (int s = 0; s < 3; ++s) {
        opt->zero_grad();
        net(torch::randn({6, 8}) * (1 + s)).pow(2).mean().backward();
        opt->step();
      }
      shardtorch::FullParams full(*net);
      auto p = snapshot(*net);
      for (const auto& item : net->named_buffers()) p["buffer " + item.key()] = item.value().clone();
      return p;
    };
    auto plain = train(false);
    auto ckpt = train(true);
    const std::string what = std::string(shardtorch::strategy_name(strategy)) + " with batch norm";
    require(plain.at("buffer a.norm.num_batches_tracked").item<int64_t>() == 3,
            what + ": " + std::to_string(plain.at("buffer a.norm.num_batches_tracked").item<int64_t>()) +
                " batches counted without checkpointing in 3 steps");
    require_bitwise(ckpt, plain, what);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

INSTANTIATE_TEST_SUITE_P(EveryStrategy, Recompute,
                         ::testing::Combine(::testing::ValuesIn(kAllStrategies), ::testing::Values(1, 2, 3)),
                         [](const auto& info) {
                           return std::string(shardtorch::strategy_name(std::get<0>(info.param))) + "_" +
                                  std::to_string(std::get<1>(info.param)) + "ranks";
                         });

class Autocast : public ::testing::TestWithParam<Strategy> {};

// A forward under autocast computes in bf16; backward runs after the user
// has left the autocast region, so the recomputation must replay the region's
// state or its matmuls run in fp32 and the gradients differ.
TEST_P(Autocast, AutocastRegionIsReplayed) {
  auto x = gpt_tokens();
  const Strategy strategy = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    auto train = [&](bool ckpt, bool autocast, bool backward_inside = false) {
      torch::manual_seed(0);
      auto model = gpt::GPT(gpt::Config{});
      shardtorch::shard(model, w, strategy_options(strategy, 2).activation_checkpointing(ckpt));
      auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
      const int64_t per = kBatch / w.size();
      auto xs = x.narrow(0, w.rank() * per, per);
      for (int s = 0; s < 3; ++s) {
        opt->zero_grad();
        at::Tensor loss;
        {
          at::autocast::set_autocast_enabled(at::kCPU, autocast);
          at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
          loss = gpt::lm_loss(model(xs), xs);
          if (backward_inside) {
            loss.backward();
            require(at::autocast::is_autocast_enabled(at::kCPU) &&
                        at::autocast::get_autocast_dtype(at::kCPU) == at::kBFloat16 &&
                        at::autocast::is_autocast_cache_enabled(),
                    "the recomputation left the thread's autocast state changed");
          }
          at::autocast::set_autocast_enabled(at::kCPU, false);
          at::autocast::clear_cache();
        }
        if (!backward_inside) {
          loss.backward();
          require(!at::autocast::is_autocast_enabled(at::kCPU) && at::autocast::is_autocast_cache_enabled(),
                  "the recomputation left the thread's autocast state changed");
        }
        opt->step();
      }
      shardtorch::FullParams full(*model);
      return snapshot(*model);
    };
    const std::string what = std::string(shardtorch::strategy_name(strategy)) + " under autocast";
    auto plain = train(false, true);
    require_bitwise(train(true, true), plain, what);
    // Backward inside the region: the recomputation must not reuse casts
    // cached by another run.
    require_bitwise(train(true, true, true), train(false, true, true), what + ", backward inside the region");
    // Not vacuous: autocast changes the result.
    auto fp32 = train(false, false);
    require(!torch::equal(fp32.at("blocks.0.fc1.weight"), plain.at("blocks.0.fc1.weight")),
            what + ": autocast changed nothing");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Recompute, Autocast, ::testing::Values(Strategy::FullShard, Strategy::NoShard),
                         StrategyName());

class UnusualUnits : public ::testing::TestWithParam<Strategy> {};

// An optional tensor argument is a differentiable input; a parameter
// returned as it is stays a leaf that trains; a frozen unit fed by data costs
// no extra all-gather. NoShard too: a parameter returned by a FullShard unit
// would be freed after its forward (checkpointed or not).
TEST_P(UnusualUnits, OptionalArgumentsReturnedParametersAndFrozenUnits) {
  const shardtorch::Strategy strategy = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    auto train = [&](bool ckpt) {
      torch::manual_seed(0);
      MixNet net;
      auto sm = shardtorch::shard(net, w, ShardOptions().strategy(strategy).activation_checkpointing(ckpt));
      require(!ckpt || (net->m->checkpoint_label() == "m" && net->frozen->checkpoint_label() == "frozen" &&
                        net->split->checkpoint_label() == "split"),
              "the units are not checkpointed");
      auto opt = shardtorch::Adam(*net, torch::optim::AdamOptions(1e-2));
      const int64_t gathers0 = sm.comm_stats().all_gather.calls;
      for (int s = 0; s < 3; ++s) {
        opt->zero_grad();
        net(torch::full({3, 6}, 0.2 * (s + 1) - w.rank())).backward();
        opt->step();
      }
      const int64_t gathers = sm.comm_stats().all_gather.calls - gathers0;
      shardtorch::FullParams full(*net);
      auto p = snapshot(*net);
      p["<all-gathers>"] = torch::tensor({gathers});
      return p;
    };
    auto plain = train(false);
    auto ckpt = train(true);
    require(!torch::equal(plain.at("m.lin.bias"), ckpt.at("ctx.bias")), "sanity: distinct parameters");
    require_bitwise(ckpt, plain, shardtorch::strategy_name(strategy));
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(strategy) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Recompute, UnusualUnits, ::testing::Values(Strategy::NoShard, Strategy::ShardGradOp),
                         StrategyName());

TEST(Recompute, MisuseIsAClearError) {
  auto r = run_ranks(1, [&](World& w) {
    auto has = [](const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; };
    auto error_of = [](auto f) -> std::string {
      try {
        f();
      } catch (const std::exception& e) {
        return e.what();
      }
      return "";
    };
    Twice net;
    auto sm = shardtorch::shard(net, w, ShardOptions().activation_checkpointing(true));
    std::string e = error_of([&] { net(torch::randn({2, 6})).backward(); });
    require(has(e, "checkpointed unit 'l' ran its forward again"), "unit called twice: " + e);
    // The refused forward had gathered 'l' again: it is freed, not left for the next forward.
    require(sm.memory().gathered_units == 0 && sm.memory().cur(shardtorch::Mem::GatheredParams) == 0,
            "the refused forward left " + std::to_string(sm.memory().gathered_units) + " unit(s) gathered");
    net->twice = false;
    e = error_of([&] { net(torch::randn({2, 6})).backward(); });
    require(has(e, "checkpointed unit 'inplace' modified its input 0"), "in-place input: " + e);

    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w, ShardOptions().activation_checkpointing(true));
    auto x = gpt_tokens().narrow(0, 0, 2);
    e = error_of([&] {
      auto loss = gpt::lm_loss(model(x), x);
      torch::autograd::grad({loss}, {model->tok_emb->weight});
    });
    require(has(e, "torch::autograd::grad (or backward with inputs) is not supported"), "autograd::grad: " + e);
    // A forward whose graph was dropped does not count as pending.
    { auto unused = model(x); }
    gpt::lm_loss(model(x), x).backward();
    // Last, on a model of its own: after a failed create_graph backward the
    // engine keeps that backward's queued work (holding its graph) until the
    // thread's next backward.
    auto other = gpt::GPT(gpt::Config{});
    shardtorch::shard(other, w, ShardOptions().activation_checkpointing(true));
    e = error_of([&] { gpt::lm_loss(other(x), x).backward({}, /*retain_graph=*/true, /*create_graph=*/true); });
    // The root's parameters (embeddings, final norm) get their gradients before the
    // checkpointed blocks recompute: the general create_graph error comes first.
    require(
        has(e, "arrived in a backward with create_graph") || has(e, "create_graph (double backward) is not supported"),
        "create_graph: " + e);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Checkpointing under a sharded and a replicated strategy.
class Checkpointed : public ::testing::TestWithParam<Strategy> {};

// Memory: without checkpointing every block's activations stay alive from
// forward to backward; with it only each block's input does, plus one
// block's recomputation at a time.
TEST_P(Checkpointed, KeepsOnlyUnitInputsBetweenForwardAndBackward) {
  const shardtorch::Strategy strategy = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    static CountingAllocator counting(c10::GetCPUAllocator());
    c10::SetCPUAllocator(&counting, /*priority=*/255);
    auto extra = [&](bool ckpt) {  // peak bytes above the start of the step
      torch::manual_seed(0);
      Tower tower(8);
      shardtorch::shard(tower, w, ShardOptions().strategy(strategy).activation_checkpointing(ckpt));
      auto x = torch::randn({256, 32});
      for (int s = 0; s < 2; ++s) {  // the second step: buckets and staging already sized
        for (auto& p : tower->parameters()) p.mutable_grad().reset();
        counting.reset_peak();
        const int64_t base = counting.current();
        tower(x).backward();
        if (s == 1) return counting.peak() - base;
      }
      return int64_t{0};
    };
    const int64_t plain = extra(false), ckpt = extra(true);
    // Per block: 256 x (32 + 512 + 512) floats of activations, about 1 MiB.
    require(plain > 6 * (1 << 20),
            "without checkpointing the step's peak rose by only " + std::to_string(plain) + " B");
    require(ckpt * 2 < plain, std::string(shardtorch::strategy_name(strategy)) +
                                  ": with checkpointing the peak rose by " + std::to_string(ckpt) + " B, without by " +
                                  std::to_string(plain) + " B");
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(strategy) << ": " << r.summary();
}

// An exception from inside the recomputing backward (a hook in the unit)
// reaches the caller; the model recovers as from any failed backward and
// trains on as if that step had not happened.
TEST_P(Checkpointed, AFailureInsideTheRecomputationIsCleanedUp) {
  const shardtorch::Strategy strategy = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    auto train = [&](bool with_failure) {
      torch::manual_seed(0);
      FlakyNet net;
      auto sm = shardtorch::shard(net, w, ShardOptions().strategy(strategy).activation_checkpointing(true));
      auto opt = shardtorch::Adam(*net, torch::optim::AdamOptions(1e-2));
      for (int s = 0; s < 4; ++s) {
        auto x = torch::full({3, 6}, 0.1 * (s + 1) + w.rank());
        opt->zero_grad();
        if (s == 1) {
          if (!with_failure) continue;
          net->f->fail = true;
          bool threw = false;
          try {
            net(x).backward();
          } catch (const std::exception& e) {
            threw = std::string(e.what()).find("hook failed inside unit f") != std::string::npos;
          }
          net->f->fail = false;
          require(threw, "the hook's exception did not reach the caller");
          continue;
        }
        net(x).backward();
        opt->step();
      }
      shardtorch::FullParams full(*net);
      return snapshot(*net);
    };
    auto clean = train(false);
    auto failed = train(true);
    require_bitwise(failed, clean, std::string(shardtorch::strategy_name(strategy)) + " after a failed step");
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(strategy) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Recompute, Checkpointed, ::testing::Values(Strategy::FullShard, Strategy::NoShard),
                         StrategyName());

// Evaluation (no grad mode) of a checkpointed model runs the units as
// usual: no node, nothing left gathered, and the logits of the model in one
// process without the library, bitwise; a forward in grad mode (the
// checkpointing path) computes the same.
TEST(Recompute, EvaluationIsUnchanged) {
  auto x = gpt_tokens().narrow(0, 0, 4);
  torch::manual_seed(0);
  auto ref = gpt::GPT(gpt::Config{});
  torch::Tensor want;
  {
    torch::NoGradGuard no_grad;
    want = ref(x);
  }
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto model = gpt::GPT(gpt::Config{});
    auto sm = shardtorch::shard(model, w, ShardOptions().activation_checkpointing(true));
    torch::Tensor eval;
    {
      torch::NoGradGuard no_grad;
      eval = model(x);
    }
    require(!eval.requires_grad() && !eval.grad_fn(), "an evaluation forward made an autograd node");
    require(sm.memory().gathered_units == 0, "units left gathered after an evaluation forward");
    require(torch::equal(eval, want),
            "evaluation differs from the model in one process by " + std::to_string(rel_err(eval, want)) + " relative");
    auto trained = model(x);
    require(trained.requires_grad(), "a forward in grad mode made no node");
    require(torch::equal(trained.detach(), eval), "a forward in grad mode differs from evaluation");
    trained.square().mean().backward();
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(Recompute, WhatCannotBeCheckpointedIsAClearError) {
  auto r = run_ranks(1, [&](World& w) {
    auto error = [&](auto make, ShardOptions o) -> std::string {
      auto model = make();
      try {
        shardtorch::shard(model, w, o);
      } catch (const std::exception& e) {
        return e.what();
      }
      return "";
    };
    auto has = [](const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; };
    auto gpt = [] { return gpt::GPT(gpt::Config{}); };
    auto odd = [] { return OddNet(); };
    std::string e = error(gpt, ShardOptions().activation_checkpointing_for("", true));
    require(has(e, "root unit cannot be checkpointed"), "root: " + e);
    e = error(gpt, ShardOptions().activation_checkpointing_for("blocks.7", true));
    require(has(e, "activation_checkpointing_for('blocks.7') names no unit") && has(e, "(its units: 'blocks.0', ") &&
                has(e, "declared shardtorch::Sharded<Impl>"),
            "unknown unit: " + e);
    e = error(gpt, ShardOptions().activation_checkpointing_for("head", true));
    require(has(e, "parameter 'weight' is shared with another unit"), "tied head: " + e);
    e = error(odd, ShardOptions().activation_checkpointing_for("o", true));
    require(has(e, "unit 'o' has units inside it (first: 'o.inner')"), "enclosing unit: " + e);

    // The global option takes the leaves only: the GPT's blocks but not its
    // tied head, OddNet's inner layer but not the unit around it.
    for (auto strategy : {Strategy::FullShard, Strategy::NoShard}) {
      auto model = OddNet();
      shardtorch::shard(model, w, ShardOptions().strategy(strategy).activation_checkpointing(true));
      const std::string name = shardtorch::strategy_name(strategy);
      require(model->o->inner->checkpoint_label() == "o.inner", name + ": inner layer not checkpointed");
      require(model->o->checkpoint_label() == "?", name + ": enclosing unit checkpointed");
      // The unit returning a number beside its tensor cannot give its outputs
      // back: an error at its forward.
      bool threw = false;
      try {
        model(torch::randn({2, 6}));
      } catch (const std::exception& ex) {
        threw = has(ex.what(), "unit 'p' is checkpointed") && has(ex.what(), "returns something other than tensors");
      }
      require(threw, name + ": a checkpointed unit returning a number did not fail clearly");
      torch::NoGradGuard no_grad;  // without grad mode nothing is checkpointed
      model(torch::randn({2, 6}));
    }
    auto g = gpt::GPT(gpt::Config{});
    shardtorch::shard(g, w, ShardOptions().activation_checkpointing(true));
    require(g->block_list[0]->checkpoint_label() == "blocks.0" && g->head->checkpoint_label() == "?",
            "the global option should take the blocks and leave the tied head");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}
