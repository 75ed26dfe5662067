// Deferred construction (shardtorch/deferred.h): nothing allocated while
// constructing, values bitwise those of eager construction, shard() makes
// one unit at a time, clear errors.
#include <gtest/gtest.h>

#include <malloc.h>

#include <fstream>
#include <string>

#include "models.h"
#include "shardtorch/deferred.h"

using namespace testmodels;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

// A field of /proc/self/status in kB (VmRSS, VmSize, VmHWM).
int64_t status_kb(const std::string& field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  throw std::runtime_error("no " + field + " in /proc/self/status");
}

// Every built-in module the issue names, and a user module initialising in
// its constructor in ways the built-ins do not (a computed parameter, an
// orthogonal init, a view written in place, integer and list buffers).
struct UserInitImpl : torch::nn::Module {
  UserInitImpl() {
    scaled = register_parameter("scaled", torch::randn({5, 7}) * 0.02);
    ortho = register_parameter("ortho", torch::empty({6, 4}));
    rows = register_parameter("rows", torch::empty({4, 3}));
    steps = register_buffer("steps", torch::tensor(3, torch::kLong));
    table = register_buffer("table", torch::tensor({1.5, -2.0, 4.0}));
    ramp = register_buffer("ramp", torch::arange(6).to(torch::kFloat));
    torch::NoGradGuard no_grad;
    torch::nn::init::orthogonal_(ortho);
    torch::nn::init::xavier_normal_(rows);
    rows[1].fill_(0.5);  // an in-place write through a view
    rows.mul_(2.0);
  }
  torch::Tensor scaled, ortho, rows, steps, table, ramp;
};
TORCH_MODULE(UserInit);

struct ZooImpl : torch::nn::Module {
  ZooImpl()
      : lin(register_module("lin", torch::nn::Linear(9, 5))),
        emb(register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(11, 4).padding_idx(2)))),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})))),
        c1(register_module("c1", torch::nn::Conv1d(torch::nn::Conv1dOptions(3, 4, 3)))),
        c2(register_module("c2", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 3, {3, 2})))),
        c3(register_module("c3", torch::nn::Conv3d(torch::nn::Conv3dOptions(2, 2, 2)))),
        bn1(register_module("bn1", torch::nn::BatchNorm1d(4))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(3))),
        mha(register_module("mha", torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(8, 2)))),
        mha_kv(register_module("mha_kv",
                               torch::nn::MultiheadAttention(
                                   torch::nn::MultiheadAttentionOptions(8, 2).kdim(5).vdim(6).add_bias_kv(true)))),
        user(register_module("user", UserInit())) {}
  torch::nn::Linear lin;
  torch::nn::Embedding emb;
  torch::nn::LayerNorm ln;
  torch::nn::Conv1d c1;
  torch::nn::Conv2d c2;
  torch::nn::Conv3d c3;
  torch::nn::BatchNorm1d bn1;
  torch::nn::BatchNorm2d bn2;
  torch::nn::MultiheadAttention mha, mha_kv;
  UserInit user;
};
TORCH_MODULE(Zoo);

std::map<std::string, torch::Tensor> all_tensors(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (auto& item : m.named_parameters())
    if (item.value().defined()) out[item.key()] = item.value();
  for (auto& item : m.named_buffers())
    if (item.value().defined()) out[item.key()] = item.value();
  return out;
}

// Throws naming the first tensor that is not bitwise equal (dtype, shape, values).
void require_bitwise(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want,
                     const std::string& what) {
  require(got.size() == want.size(),
          what + ": " + std::to_string(got.size()) + " tensors, expected " + std::to_string(want.size()));
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    require(it != got.end(), what + ": missing " + name);
    const auto& g = it->second;
    require(!shardtorch::is_deferred(g), what + ": " + name + " still deferred");
    require(g.scalar_type() == w.scalar_type() && g.sizes() == w.sizes() && g.device() == w.device(),
            what + ": " + name + " differs in dtype, shape or device");
    require(torch::equal(g, w),
            what + ": " + name + " is not bitwise equal (max |diff| " +
                std::to_string((g.to(torch::kDouble) - w.to(torch::kDouble)).abs().max().item<double>()) + ")");
  }
}

std::map<std::string, torch::Tensor> clone_all(const std::map<std::string, torch::Tensor>& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [n, t] : m) out[n] = t.detach().clone();
  return out;
}

}  // namespace

// A model of about 4 GB built under the guard: neither resident nor virtual
// memory grows (the naive route, Meta in the included keys, reserved the
// parameters' bytes). The control allocation shows the measure sees them.
TEST(Deferred, ConstructionAllocatesNothing) {
  {
    const int64_t before = status_kb("VmSize");
    auto t = torch::empty({8192, 8192});  // 256 MiB, untouched
    const int64_t grown = status_kb("VmSize") - before;
    ASSERT_GE(grown, 250 * 1024) << "the control allocation of 256 MiB grew VmSize by " << grown << " kB only";
  }
  const int64_t size0 = status_kb("VmSize"), rss0 = status_kb("VmRSS");
  shardtorch::DeferredInit guard;
  torch::nn::ModuleList big;
  for (int i = 0; i < 12; ++i) big->push_back(torch::nn::Linear(8192, 8192));
  big->push_back(torch::nn::Embedding(50000, 4096));
  big->push_back(torch::nn::Conv2d(torch::nn::Conv2dOptions(256, 256, 3)));
  big->push_back(torch::nn::BatchNorm2d(256));
  big->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({4096})));
  big->push_back(torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(2048, 16)));
  const int64_t size1 = status_kb("VmSize"), rss1 = status_kb("VmRSS");
  int64_t bytes = 0, deferred = 0, total = 0;
  for (auto& t : big->parameters()) {
    bytes += t.nbytes();
    deferred += shardtorch::is_deferred(t);
    ++total;
  }
  for (auto& t : big->buffers()) deferred += shardtorch::is_deferred(t), ++total;
  EXPECT_GT(bytes, int64_t(3) << 30);
  EXPECT_EQ(deferred, total);
  EXPECT_LT(size1 - size0, 64 * 1024) << "VmSize grew by " << (size1 - size0) << " kB for " << (bytes >> 20) << " MiB";
  EXPECT_LT(rss1 - rss0, 64 * 1024) << "VmRSS grew by " << (rss1 - rss0) << " kB";
  EXPECT_GT(guard.recorded_ops(), 12 * 4);  // factories and initialisers recorded
  auto w = big->parameters()[0];
  EXPECT_EQ(w.sizes(), (std::vector<int64_t>{8192, 8192}));
  EXPECT_TRUE(w.requires_grad());
}

// Materialised values equal eager construction from the same seed, bit for
// bit, for every built-in module and the user module, and the deferred
// construction left the generator where it was.
TEST(Deferred, MaterializeIsBitwiseEager) {
  torch::manual_seed(7);
  Zoo eager;
  auto want = clone_all(all_tensors(*eager));
  const auto after_eager = torch::randn({4});

  torch::manual_seed(7);
  Zoo lazy = shardtorch::deferred([] { return Zoo(); });
  const auto after_deferred = torch::randn({4});
  EXPECT_EQ(shardtorch::count_deferred(*lazy), static_cast<int64_t>(want.size()));
  shardtorch::materialize(lazy);
  EXPECT_EQ(shardtorch::count_deferred(*lazy), 0);
  require_bitwise(all_tensors(*lazy), want, "materialized Zoo");
  // The generator: not advanced by deferred construction (docs/large-models.md).
  torch::manual_seed(7);
  EXPECT_TRUE(torch::equal(after_deferred, torch::randn({4})));
  EXPECT_FALSE(torch::equal(after_eager, after_deferred));
  // The module's members are the materialised tensors (identity kept).
  EXPECT_TRUE(torch::equal(lazy->lin->weight, want.at("lin.weight")));
  EXPECT_TRUE(lazy->lin->weight.requires_grad());
  EXPECT_TRUE(lazy->lin->weight.is_leaf());
  auto out = lazy->lin(torch::ones({2, 9}));
  EXPECT_TRUE(torch::equal(out, eager->lin(torch::ones({2, 9}))));
}

// Materialising the parameters in another order than they were built (the
// last module first) still gives each its eager values: random operators
// replay from their generator's state, not from the order of replay.
TEST(Deferred, MaterializeOutOfOrderIsBitwiseEager) {
  torch::manual_seed(3);
  Zoo eager;
  auto want = clone_all(all_tensors(*eager));
  torch::manual_seed(3);
  Zoo lazy = shardtorch::deferred([] { return Zoo(); });
  shardtorch::materialize(lazy->user);
  shardtorch::materialize(lazy->mha);
  EXPECT_GT(shardtorch::count_deferred(*lazy), 0);
  shardtorch::materialize(lazy->lin);
  shardtorch::materialize(lazy);
  require_bitwise(all_tensors(*lazy), want, "Zoo materialised last module first");
}

TEST(Deferred, ReadBeforeShardNamesTheParameter) {
  auto mlp = shardtorch::deferred([] { return MLP(); });
  try {
    mlp(torch::ones({2, 7}));
    FAIL() << "a forward of a deferred model ran";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'scale'"), std::string::npos) << msg;  // the first deferred tensor the forward reads
    EXPECT_NE(msg.find("shard()"), std::string::npos) << msg;
  }
  try {
    (void)mlp->l1->lin->weight.sum().item<float>();
    FAIL() << "item() of a deferred tensor returned";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("l1.lin.weight"), std::string::npos) << e.what();
  }
}

struct ReadsAtConstructionImpl : torch::nn::Module {
  ReadsAtConstructionImpl() {
    w = register_parameter("w", torch::randn({4}));
    if (w.sum().item<float>() > 10) w.data().zero_();  // reads values: cannot be deferred
  }
  torch::Tensor w;
};
TORCH_MODULE(ReadsAtConstruction);

TEST(Deferred, ReadingValuesAtConstructionIsAnError) {
  try {
    shardtorch::DeferredInit guard;
    ReadsAtConstruction m;
    FAIL() << "a constructor read a deferred tensor's value";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("during deferred construction"), std::string::npos) << msg;
    EXPECT_NE(msg.find("construct it eagerly"), std::string::npos) << msg;
  }
  // The guard is gone: factories are eager again.
  EXPECT_FALSE(shardtorch::is_deferred(torch::zeros({2})));
  EXPECT_FALSE(torch::zeros({2}).is_meta());
}

namespace {

// One rank: the model built eagerly and deferred from the same seed, each
// sharded with `opts`: the full parameters and buffers equal bit for bit
// after shard(), and again after `steps` AdamW steps on the same data.
template <class Model, class Make, class Loss>
void deferred_parity(World& w, Make make, Loss loss, shardtorch::ShardOptions opts, int steps) {
  torch::manual_seed(0);
  Model eager = make();
  torch::manual_seed(0);
  Model lazy = shardtorch::deferred(make);
  require(shardtorch::count_deferred(*lazy) > 0, "nothing deferred");
  auto se = shardtorch::shard(eager, w, opts);
  auto sl = shardtorch::shard(lazy, w, opts);
  require(shardtorch::count_deferred(*lazy) == 0, "deferred tensors left after shard()");
  auto full = [](Model& m) {
    auto summon = shardtorch::summon_full_params(*m);
    return clone_all(all_tensors(*m));
  };
  require_bitwise(full(lazy), full(eager), "rank " + std::to_string(w.rank()) + ": after shard()");
  // The shards themselves, and what shard() counted.
  require(sl.memory().cur(shardtorch::Mem::ShardedParams) == se.memory().cur(shardtorch::Mem::ShardedParams) &&
              sl.memory().cur(shardtorch::Mem::ReplicatedParams) == se.memory().cur(shardtorch::Mem::ReplicatedParams),
          "memory accounting differs");
  auto oe = shardtorch::AdamW(*eager, torch::optim::AdamWOptions(1e-2));
  auto ol = shardtorch::AdamW(*lazy, torch::optim::AdamWOptions(1e-2));
  for (int s = 0; s < steps; ++s) {
    torch::manual_seed(100 + s);
    oe->zero_grad();
    loss(eager, w, s).backward();
    oe->step();
    torch::manual_seed(100 + s);
    ol->zero_grad();
    loss(lazy, w, s).backward();
    ol->step();
  }
  require_bitwise(full(lazy), full(eager), "rank " + std::to_string(w.rank()) + ": after training");
}

auto make_gpt = [] { return gpt::GPT(gpt::Config{}); };
auto gpt_loss = [](gpt::GPT& m, World& w, int) {
  auto tokens = gpt_tokens();
  const int64_t per = kBatch / w.size();
  auto x = tokens.narrow(0, w.rank() * per, per);
  auto logits = m(x);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).slice(0, 0, -1),
                                              x.reshape({-1}).slice(0, 1));
};
auto make_mlp = [] { return MLP(); };
auto mlp_loss = [](MLP& m, World& w, int s) {
  torch::manual_seed(200 + s);
  auto x = torch::randn({kBatch, 7});
  const int64_t per = kBatch / w.size();
  return m(x.narrow(0, w.rank() * per, per)).square().mean();
};

void parity_all_strategies(int world_size) {
  for (auto s : kAllStrategies) {
    auto opts = strategy_options(s, world_size);
    auto r = run_ranks(world_size, [&](World& w) {
      deferred_parity<gpt::GPT>(w, make_gpt, gpt_loss, opts, 3);
      deferred_parity<MLP>(w, make_mlp, mlp_loss, opts, 3);
    });
    EXPECT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
}

}  // namespace

TEST(DeferredShard, ParityWithEagerEveryStrategyWorld1) { parity_all_strategies(1); }
TEST(DeferredShard, ParityWithEagerEveryStrategyWorld2) { parity_all_strategies(2); }

// A rank materialises one unit at a time: the resident peak of shard() is
// this rank's shards plus a few units in passing (a unit replayed, its flat
// buffer, its shard), well under the model's size, which an eager rank holds
// whole before shard() even begins. glibc keeps freed heap memory resident
// (its mmap threshold grows with the sizes freed); a fixed threshold makes
// RSS follow the live bytes.
TEST(DeferredShard, PeakIsUnitsNotModel) {
  auto r = run_ranks(2, [](World& w) {
    mallopt(M_MMAP_THRESHOLD, 64 * 1024);
    gpt::Config c;
    c.d_model = 256;
    c.n_layer = 24;
    c.vocab = 512;
    const int64_t block_bytes = (12 * c.d_model * c.d_model + 10 * c.d_model) * 4;
    const int64_t model_bytes = c.n_layer * block_bytes + (c.vocab + c.seq_len + 2) * c.d_model * 4;
    torch::manual_seed(0);
    auto before = status_kb("VmRSS");
    auto model = shardtorch::deferred([&] { return gpt::GPT(c); });
    require(status_kb("VmRSS") - before < 8 * 1024, "construction grew RSS");
    std::ofstream("/proc/self/clear_refs") << "5";  // VmHWM := VmRSS
    const int64_t base = status_kb("VmHWM");
    auto sm = shardtorch::shard(model, w, shardtorch::ShardOptions().sync_module_states(false));
    const int64_t peak = (status_kb("VmHWM") - base) * 1024;
    // In passing: a unit replayed, its flat buffer and shard, the new process group's buffers.
    const int64_t bound = model_bytes / w.size() + 4 * block_bytes + (2 << 20);
    require(bound < model_bytes, "the test's model is too small to tell");
    require(peak <= bound, "shard() of a deferred model peaked at " + std::to_string(peak >> 10) +
                               " kB over its start; shards + 4 units + 2 MiB is " + std::to_string(bound >> 10) +
                               " kB, the model " + std::to_string(model_bytes >> 10) + " kB");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Values from a checkpoint: a deferred model sharded without replaying its
// construction (skip_deferred_init: zeros) then loaded, at world 2 under
// every strategy, equals an eager model loaded from the same files, bit for
// bit; the loaders read each rank's own ranges (their existing path).
TEST(DeferredShard, LoadsCheckpointsWithoutReplay) {
  const TempDir dir("shardtorch-deferred");
  const std::string full = (dir / "full.safetensors").string(), sharded = (dir / "ck").string();
  auto made = run_ranks(2, [&](World& w) {
    torch::manual_seed(5);
    gpt::GPT m(gpt::Config{});
    auto sm = shardtorch::shard(m, w);
    auto opt = shardtorch::AdamW(*m, torch::optim::AdamWOptions(1e-2));
    opt->zero_grad();
    gpt_loss(m, w, 0).backward();
    opt->step();
    shardtorch::save_full_state_dict(*m, full);
    shardtorch::save_sharded_checkpoint(*m, opt.get(), sharded, 1);
  });
  ASSERT_TRUE(made.ok) << made.summary();
  for (auto s : kAllStrategies) {
    auto opts = strategy_options(s, 2);
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(9);  // another seed: the values must come from the files
      gpt::GPT ref(gpt::Config{});
      shardtorch::shard(ref, w, opts);
      shardtorch::load_full_state_dict(*ref, full);
      std::map<std::string, torch::Tensor> want;
      {
        auto summon = shardtorch::summon_full_params(*ref);
        want = clone_all(all_tensors(*ref));
      }
      for (bool from_full : {true, false}) {
        auto lazy = shardtorch::deferred([] { return gpt::GPT(gpt::Config{}); });
        require(shardtorch::skip_deferred_init(lazy) == shardtorch::count_deferred(*lazy), "not all marked");
        shardtorch::shard(lazy, w, opts);
        {
          auto summon = shardtorch::summon_full_params(*lazy);
          require(lazy->block_list[0]->fc1->weight.abs().sum().item<double>() == 0,
                  "skip_deferred_init: the construction was replayed");
        }
        if (from_full)
          shardtorch::load_full_state_dict(*lazy, full);
        else
          shardtorch::load_sharded_checkpoint(*lazy, nullptr, sharded);
        auto summon = shardtorch::summon_full_params(*lazy);
        require_bitwise(clone_all(all_tensors(*lazy)), want,
                        std::string("rank ") + std::to_string(w.rank()) +
                            (from_full ? ": full state dict" : ": sharded checkpoint"));
      }
    });
    EXPECT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
}

// Materialising inside a live guard would record the replay itself: an error
// that says what to do; after the guard the same call works.
TEST(Deferred, MaterializeInsideTheGuardIsAnError) {
  MLP m = nullptr;
  {
    shardtorch::DeferredInit guard;
    m = MLP();
    try {
      shardtorch::materialize(m);
      FAIL() << "materialize() ran under a live DeferredInit";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("end the guard's scope first"), std::string::npos) << e.what();
    }
  }
  EXPECT_GT(shardtorch::count_deferred(*m), 0);
  shardtorch::materialize(m);
  EXPECT_EQ(shardtorch::count_deferred(*m), 0);
  EXPECT_EQ(m(torch::ones({2, 7})).sizes(), (std::vector<int64_t>{2, 3}));
}

// shard() inside a live guard: an error on every rank, naming it and saying
// what to do, before any collective (whose tensors the guard would make
// deferred: at two ranks this crashed with SIGSEGV, reading a fingerprint
// from meta memory); after the guard the same model shards and trains.
TEST(Deferred, ShardInsideTheGuardIsAnErrorOnEveryRank) {
  auto r = shardtorch::testing::run_ranks(2, [](shardtorch::World& w) {
    MLP m = nullptr;
    {
      shardtorch::DeferredInit guard;
      m = MLP();
      try {
        shardtorch::shard(m, w);
        throw std::runtime_error("shard() ran under a live DeferredInit");
      } catch (const shardtorch::Error& e) {
        const std::string what = e.what();
        const std::string want =
            "shardtorch::shard: rank " + std::to_string(w.rank()) +
            ": called while a shardtorch::DeferredInit lives on this thread; end the guard's scope first";
        if (what.find(want) == std::string::npos) throw std::runtime_error("unexpected error: " + what);
      }
    }
    shardtorch::shard(m, w);
    m(torch::ones({2, 7})).sum().backward();
    // A collective of real tensors inside a guard: the collective check's
    // own buffers stay real (they were deferred: SIGSEGV in the exchange).
    auto t = torch::ones({4});
    {
      shardtorch::DeferredInit guard;
      w.comm().all_reduce(t, c10d::ReduceOp::SUM, "inside a guard");
    }
    if (t[0].item<float>() != 2.0f) throw std::runtime_error("wrong sum inside a guard");
  });
  EXPECT_TRUE(r.ok) << r.summary();
}
