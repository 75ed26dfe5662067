// Parameters a unit's backward still reads after its last trainable
// gradient has arrived: frozen weights beside trainable adapters (LoRA), a
// second output computed from frozen weights, and trainable parameters that a
// backward(inputs=...) leaves out. Under FullShard and HybridShard such a
// unit must stay gathered until its backward has sent the gradient out
// through its inputs.
#include <gtest/gtest.h>

#include <future>

#include "models.h"
#include "reference.h"

using namespace testmodels;
using shardtorch::Mem;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

// A frozen weight with a trainable low-rank adapter beside it, as plain
// products (no transposes between the weights and their accumulators): the
// adapter's accumulators run before the product with the frozen weight
// yields the input's gradient.
struct LoraImpl : torch::nn::Module {
  LoraImpl() {
    w = register_parameter("w", torch::randn({6, 6}) * 0.4, /*requires_grad=*/false);
    a = register_parameter("a", torch::randn({6, 2}) * 0.4);
    b = register_parameter("b", torch::randn({2, 6}) * 0.4);
  }
  torch::Tensor forward(torch::Tensor x) {
    // In this order: the operands of + may be evaluated in either order, and
    // autograd runs the later-recorded product first.
    auto frozen = x.matmul(w);
    return frozen + x.matmul(a).matmul(b);
  }
  torch::Tensor w, a, b;
};
SHARDTORCH_MODULE(Lora);

// Two outputs: one from a frozen weight, one from a trainable one; the root
// uses the frozen one first in forward, so its gradient arrives last.
struct TwoOutImpl : torch::nn::Module {
  TwoOutImpl()
      : frozen(register_module("frozen", torch::nn::Linear(6, 6))),
        trained(register_module("trained", torch::nn::Linear(6, 6))) {
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x) { return {torch::tanh(frozen(x)), trained(x)}; }
  torch::nn::Linear frozen, trained;
};
SHARDTORCH_MODULE(TwoOut);

struct AdaptedImpl : torch::nn::Module {
  AdaptedImpl()
      : first(register_module("first", Layer(6, 6, true))),
        l1(register_module("l1", Lora())),
        two(register_module("two", TwoOut())),
        l2(register_module("l2", Lora())),
        last(register_module("last", Layer(6, 4, false))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto h = l1(first(x));
    auto [f, t] = two(h);
    return last(l2(f * 0.5 + torch::tanh(t)));
  }
  Layer first;
  Lora l1;
  TwoOut two;
  Lora l2;
  Layer last;
};
SHARDTORCH_MODULE(Adapted);

// A unit with frozen parameters only, between trainable ones.
struct FrozenLayerImpl : torch::nn::Module {
  FrozenLayerImpl() : lin(register_module("lin", torch::nn::Linear(6, 6))) {
    for (auto& p : parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(lin(x)); }
  torch::nn::Linear lin;
};
SHARDTORCH_MODULE(FrozenLayer);

struct SandwichImpl : torch::nn::Module {
  SandwichImpl()
      : first(register_module("first", Layer(6, 6, true))),
        frozen(register_module("frozen", FrozenLayer())),
        last(register_module("last", Layer(6, 4, false))) {}
  torch::Tensor forward(torch::Tensor x) { return last(frozen(first(x))); }
  Layer first;
  FrozenLayer frozen;
  Layer last;
};
SHARDTORCH_MODULE(Sandwich);

// An adapter unit taking a second input that is a leaf (a position table the
// root owns, as DETR's decoder layers take their query positions): reached
// through its gradient accumulator, so no hook is left on it, one more at
// every forward.
struct LoraWithPosImpl : torch::nn::Module {
  LoraWithPosImpl()
      : base(register_module("base", torch::nn::Linear(6, 6))),
        a(register_module("a", torch::nn::Linear(torch::nn::LinearOptions(6, 2).bias(false)))),
        b(register_module("b", torch::nn::Linear(torch::nn::LinearOptions(2, 6).bias(false)))) {
    for (auto& p : base->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor x, torch::Tensor pos) {
    auto frozen = base(x);  // recorded first (see Lora)
    return frozen + b(a(x)) + pos;
  }
  torch::nn::Linear base, a, b;
};
SHARDTORCH_MODULE(LoraWithPos);

struct PosNetImpl : torch::nn::Module {
  PosNetImpl() : first(register_module("first", Layer(6, 6, true))), l(register_module("l", LoraWithPos())) {
    pos = register_parameter("pos", torch::randn({6}) * 0.1);
  }
  torch::Tensor forward(torch::Tensor x) { return l(first(x), pos); }
  Layer first;
  LoraWithPos l;
  torch::Tensor pos;
};
SHARDTORCH_MODULE(PosNet);

// first -> adapter, 6 features in and out: a step applies it twice.
struct ChainImpl : torch::nn::Module {
  ChainImpl() : first(register_module("first", Layer(6, 6, true))), l(register_module("l", Lora())) {}
  torch::Tensor forward(torch::Tensor x) { return l(first(x)); }
  Layer first;
  Lora l;
};
SHARDTORCH_MODULE(Chain);

// One tensor feeding four adapter units (an encoder output feeding every
// decoder layer's cross-attention): its gradient is complete only once all
// four backwards are done.
struct FanOutImpl : torch::nn::Module {
  FanOutImpl() : first(register_module("first", Layer(6, 6, true))), last(register_module("last", Layer(6, 4, false))) {
    for (int k = 0; k < 4; ++k) loras.push_back(register_module("lora" + std::to_string(k), Lora()));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = first(x);
    auto sum = loras[0](h);
    for (size_t k = 1; k < loras.size(); ++k) sum = sum + loras[k](h);
    return last(torch::tanh(sum));
  }
  Layer first, last;
  std::vector<Lora> loras;
};
SHARDTORCH_MODULE(FanOut);

// An adapter unit that also reads a tensor it is handed before its forward
// rather than as an argument (a cross-attention memory set on the layer):
// gradient leaves the unit through that tensor as well as through its
// input, and the product that sends it there reads the frozen weight after
// every node leading to the input has run.
struct CrossLoraImpl : torch::nn::Module {
  CrossLoraImpl() {
    w = register_parameter("w", torch::randn({6, 6}) * 0.4, /*requires_grad=*/false);
    a = register_parameter("a", torch::randn({6, 2}) * 0.4);
    b = register_parameter("b", torch::randn({2, 6}) * 0.4);
  }
  torch::Tensor forward(torch::Tensor x) {
    auto cross = memory.matmul(w);  // recorded first: runs last in backward
    return x + cross + x.matmul(a).matmul(b);
  }
  torch::Tensor w, a, b;
  torch::Tensor memory;  // set by the caller before each forward
};
SHARDTORCH_MODULE(CrossLora);

struct CrossNetImpl : torch::nn::Module {
  CrossNetImpl()
      : first(register_module("first", Layer(6, 6, true))),
        l(register_module("l", CrossLora())),
        last(register_module("last", Layer(6, 4, false))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto h = first(x);
    l->memory = torch::tanh(h);
    return last(l(h * 0.5));
  }
  Layer first;
  CrossLora l;
  Layer last;
};
SHARDTORCH_MODULE(CrossNet);

// An adapter unit whose forward computes the frozen product on another
// thread (parallel branches in a forward): the nodes that thread makes count
// their sequence numbers there.
struct ThreadedLoraImpl : torch::nn::Module {
  ThreadedLoraImpl() {
    w = register_parameter("w", torch::randn({6, 6}) * 0.4, /*requires_grad=*/false);
    a = register_parameter("a", torch::randn({6, 2}) * 0.4);
    b = register_parameter("b", torch::randn({2, 6}) * 0.4);
  }
  torch::Tensor forward(torch::Tensor x) {
    auto frozen = threaded ? std::async(std::launch::async, [&] { return x.matmul(w); }).get() : x.matmul(w);
    return frozen + x.matmul(a).matmul(b);
  }
  torch::Tensor w, a, b;
  bool threaded = true;
};
SHARDTORCH_MODULE(ThreadedLora);

struct ThreadedChainImpl : torch::nn::Module {
  ThreadedChainImpl()
      : first(register_module("first", Layer(6, 6, true))),
        l(register_module("l", ThreadedLora())),
        last(register_module("last", Layer(6, 4, false))) {}
  torch::Tensor forward(torch::Tensor x) { return last(l(first(x))); }
  Layer first;
  ThreadedLora l;
  Layer last;
};
SHARDTORCH_MODULE(ThreadedChain);

// An adapter unit that also keeps an auxiliary term of its frozen product
// on the module (a regulariser, a probe), added to the loss outside it: the
// nodes of that term are reached from no output of the unit, and the
// product in it reads the frozen weight after every node the outputs lead
// to has run.
struct AuxLoraImpl : torch::nn::Module {
  AuxLoraImpl() {
    w = register_parameter("w", torch::randn({6, 6}) * 0.4, /*requires_grad=*/false);
    a = register_parameter("a", torch::randn({6, 2}) * 0.4);
    b = register_parameter("b", torch::randn({2, 6}) * 0.4);
  }
  torch::Tensor forward(torch::Tensor x) {
    aux = x.matmul(w).square().sum(1, /*keepdim=*/true);  // per row; recorded first: runs last in backward
    return x + x.matmul(a).matmul(b);
  }
  torch::Tensor w, a, b, aux;
};
SHARDTORCH_MODULE(AuxLora);

struct AuxNetImpl : torch::nn::Module {
  AuxNetImpl()
      : first(register_module("first", Layer(6, 6, true))),
        l(register_module("l", AuxLora())),
        last(register_module("last", Layer(6, 4, false))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto out = last(l(first(x)));
    return out + 0.1 * l->aux;
  }
  Layer first;
  AuxLora l;
  Layer last;
};
SHARDTORCH_MODULE(AuxNet);

// Adapter units returning their two terms as a std::pair, and as a struct of
// the user's own (no tensor shardtorch can hook): the frozen product is read
// after the adapter's gradients are in.
struct PairLoraImpl : torch::nn::Module {
  PairLoraImpl() {
    w = register_parameter("w", torch::randn({6, 6}) * 0.4, /*requires_grad=*/false);
    a = register_parameter("a", torch::randn({6, 2}) * 0.4);
    b = register_parameter("b", torch::randn({2, 6}) * 0.4);
  }
  std::pair<torch::Tensor, torch::Tensor> forward(torch::Tensor x) {
    auto frozen = x.matmul(w);
    return {frozen, x.matmul(a).matmul(b)};
  }
  torch::Tensor w, a, b;
};
SHARDTORCH_MODULE(PairLora);

struct Terms {
  torch::Tensor frozen, adapted;
};
struct StructLoraImpl : PairLoraImpl {
  Terms forward(torch::Tensor x) {
    auto [f, a] = PairLoraImpl::forward(x);
    return {f, a};
  }
};
SHARDTORCH_MODULE(StructLora);

struct PairNetImpl : torch::nn::Module {
  PairNetImpl()
      : first(register_module("first", Layer(6, 6, true))),
        p(register_module("p", PairLora())),
        s(register_module("s", StructLora())),
        last(register_module("last", Layer(6, 4, false))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto [f, a] = p(first(x));
    auto t = s(torch::tanh(f + a));
    return last(t.frozen + t.adapted);
  }
  Layer first;
  PairLora p;
  StructLora s;
  Layer last;
};
SHARDTORCH_MODULE(PairNet);

constexpr int kSteps = 3;

// Trains an M from seed 0 with Adam for kSteps under each of `strategies`,
// each rank on its 4 rows of x, and requires the parameters one process
// reaches on all 8. `ref_setup` adjusts the reference model; `backward`
// runs one rank's forward and backward (and checks what it will).
template <typename M>
void expect_adam_trains_like_torch(
    const std::string& what, std::initializer_list<Strategy> strategies, const std::function<void(M&)>& ref_setup,
    const std::function<void(shardtorch::ShardedModel&, M&, const torch::Tensor&, int)>& backward) {
  torch::manual_seed(3);
  auto x = torch::randn({8, 6});
  torch::manual_seed(0);
  M ref;
  ref_setup(ref);
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  const auto want = testref::train_reference(*ref, ref_opt, kSteps, [&](int) { return ref(x).square().mean(); });
  for (auto s : strategies) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      M m;
      auto sm = shardtorch::shard(m, w, strategy_options(s, 2));
      auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-2));
      const auto got = testref::train_ranks(*m, *opt, kSteps,
                                            [&](int step) { backward(sm, m, x.narrow(0, 4 * w.rank(), 4), step); });
      testref::expect_same_run(got, want, 1e-5, what);
    });
    EXPECT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
}

}  // namespace

class Adapters : public ::testing::TestWithParam<Strategy> {};

TEST_P(Adapters, AdaptersBesideFrozenWeightsTrainLikeTorchUnderEveryStrategy) {
  torch::manual_seed(3);
  auto x = torch::randn({8, 6});
  torch::manual_seed(0);
  Adapted ref;
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  const auto want = testref::train_reference(*ref, ref_opt, kSteps, [&](int) { return ref(x).square().mean(); });
  const shardtorch::Strategy s = GetParam();
  for (bool prefetch : {false, true}) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      Adapted m;
      auto sm = shardtorch::shard(m, w, strategy_options(s, 2).prefetch(prefetch).bucket_mb(1e-4));
      auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-2));
      const auto got = testref::train_ranks(*m, *opt, kSteps, [&](int) {
        (m(x.narrow(0, 4 * w.rank(), 4)).square().mean()).backward();
        require(sm.memory().cur(Mem::GatheredParams) == 0 || s == Strategy::ShardGradOp ||
                    s == Strategy::OptimizerOnly || s == Strategy::NoShard,
                "units left gathered after backward");
      });
      testref::expect_same_run(got, want, 1e-5, "adapters beside frozen weights");
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << (prefetch ? " with prefetch" : "") << ": " << r.summary();
  }
}

// The frozen weights are freed once the gradient of the unit's input is
// complete, not kept to the end of backward: at most the units a plain
// FullShard step keeps (the root, one computing, one prefetched) plus one.
TEST(FrozenParameters, FrozenWeightsAreFreedOnceTheInputGradientIsComplete) {
  auto r = run_ranks(2, [](World& w) {
    torch::manual_seed(0);
    Adapted m;
    auto sm = shardtorch::shard(m, w);
    auto x = torch::randn({4, 6});
    sm.reset_peak_memory();
    m(x).square().mean().backward();
    const int peak = sm.memory().peak_gathered_units;
    require(peak <= 2, "peak of " + std::to_string(peak) + " units gathered (root has none; expected 2 at most)");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Each unit's frozen weights are freed once its own backward has sent the
// gradient out through its input, not once that input's gradient is
// complete: with one input shared by four adapter units that waited for all
// four, keeping them gathered together (a peak of 5 units here). And they
// train like torch.
TEST(FrozenParameters, UnitsSharingAnInputAreFreedOneByOne) {
  torch::manual_seed(3);
  auto x = torch::randn({8, 6});
  torch::manual_seed(0);
  FanOut ref;
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  const auto want = testref::train_reference(*ref, ref_opt, kSteps, [&](int) { return ref(x).square().mean(); });
  for (bool prefetch : {false, true}) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      FanOut m;
      auto sm = shardtorch::shard(m, w, shardtorch::ShardOptions().prefetch(prefetch));
      auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-2));
      const auto got = testref::train_ranks(*m, *opt, kSteps, [&](int step) {
        auto out = m(x.narrow(0, 4 * w.rank(), 4));
        sm.reset_peak_memory();
        out.square().mean().backward();
        // The last unit (kept from forward), one adapter computing, one prefetched.
        const int peak = sm.memory().peak_gathered_units, most = prefetch ? 3 : 2;
        require(peak <= most, "step " + std::to_string(step) + ": a peak of " + std::to_string(peak) +
                                  " units gathered in backward, expected " + std::to_string(most) + " at most");
      });
      testref::expect_same_run(got, want, 1e-5, "adapters sharing an input");
    });
    ASSERT_TRUE(r.ok) << (prefetch ? "with prefetch: " : "") << r.summary();
  }
}

// A unit's frozen weight read on the way to a tensor it captured, not to its
// input: it stays gathered until that product has run (freed once the input's
// gradient was out, the product read a freed weight: 'unit is sharded'), and
// is freed as soon as it has, not kept to the end of backward.
TEST(FrozenParameters, AUnitReadingACapturedTensorStaysGatheredUntilItsGradientIsOut) {
  expect_adam_trains_like_torch<CrossNet>(
      "a captured tensor", {Strategy::FullShard, Strategy::HybridShard}, [](CrossNet&) {},
      [](shardtorch::ShardedModel& sm, CrossNet& m, const torch::Tensor& x, int step) {
        auto out = m(x);
        // When the captured tensor's gradient is out, before `first` gathers
        // for its own backward, nothing is left gathered (`last` is done).
        int gathered = -1;
        m->l->memory.register_hook([&](const torch::Tensor&) { gathered = sm.memory().gathered_units; });
        out.square().mean().backward();
        require(gathered == 0, "step " + std::to_string(step) + ": " + std::to_string(gathered) +
                                   " units gathered once the captured tensor's gradient was out, expected 0");
      });
}

// A unit's forward that makes part of its graph on another thread: whether
// those nodes are inside the unit cannot be told from their sequence
// numbers (a fresh thread's start at 0, 'before' the forward), so that
// forward keeps the unit to the end of backward. Taken for outside, the
// product on the other thread looked like where the gradient leaves, and
// the unit was freed before that product read the frozen weight.
TEST(FrozenParameters, AForwardWithNodesOfAnotherThreadKeepsTheUnitToTheEndOfBackward) {
  expect_adam_trains_like_torch<ThreadedChain>(
      "nodes of another thread", {Strategy::FullShard, Strategy::HybridShard},
      [](ThreadedChain& ref) { ref->l->threaded = false; },
      [](shardtorch::ShardedModel& sm, ThreadedChain& m, const torch::Tensor& x, int step) {
        m(x).square().mean().backward();
        require(sm.memory().gathered_units == 0, "step " + std::to_string(step) + ": " +
                                                     std::to_string(sm.memory().gathered_units) +
                                                     " units gathered after backward");
      });
}

TEST(FrozenParameters, AnAuxiliaryTermKeptOnTheUnitReadsItsFrozenWeightInBackward) {
  expect_adam_trains_like_torch<AuxNet>(
      "an auxiliary term of the frozen weight", {Strategy::FullShard, Strategy::HybridShard}, [](AuxNet&) {},
      [](shardtorch::ShardedModel& sm, AuxNet& m, const torch::Tensor& x, int step) {
        m(x).square().mean().backward();
        require(sm.memory().gathered_units == 0, "step " + std::to_string(step) + ": " +
                                                     std::to_string(sm.memory().gathered_units) +
                                                     " units gathered after backward");
      });
}

TEST(FrozenParameters, UnitsReturningAPairOrAStructTrainLikeTorch) {
  expect_adam_trains_like_torch<PairNet>(
      "a pair and a struct", {Strategy::FullShard, Strategy::HybridShard}, [](PairNet&) {},
      [](shardtorch::ShardedModel&, PairNet& m, const torch::Tensor& x, int) { m(x).square().mean().backward(); });
}

// A frozen backbone fed by data under a trainable head (fine-tuning a head):
// no backward reaches the backbone, so prefetch gathers nothing for it in
// backward (the head, kept from forward, was followed by an all-gather of
// the last backbone block at every step, freed unread at the end).
struct BackboneNet : torch::nn::Module {
  BackboneNet()
      : b0(register_module("b0", Layer(6, 6, true))),
        b1(register_module("b1", Layer(6, 6, true))),
        head(register_module("head", Layer(6, 4, false))) {
    for (auto& p : b0->parameters()) p.set_requires_grad(false);
    for (auto& p : b1->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor x) { return head(b1(b0(x))); }
  Layer b0, b1, head;
};

TEST(FrozenParameters, AFrozenBackboneFedByDataIsNotPrefetchedInBackward) {
  torch::manual_seed(3);
  auto x = torch::randn({8, 6});
  torch::manual_seed(0);
  auto ref = std::make_shared<BackboneNet>();
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  const auto want =
      testref::train_reference(*ref, ref_opt, kSteps, [&](int) { return ref->forward(x).square().mean(); });
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto m = std::make_shared<BackboneNet>();
    auto sm = shardtorch::shard(*m, w, shardtorch::ShardOptions().prefetch(true));
    auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-2));
    const auto got = testref::train_ranks(*m, *opt, kSteps, [&](int step) {
      auto out = m->forward(x.narrow(0, 4 * w.rank(), 4));
      const int64_t before = sm.comm_stats().all_gather.calls;
      out.square().mean().backward();
      const int64_t gathers = sm.comm_stats().all_gather.calls - before;
      // From the second step on the order is known and the head kept from forward.
      require(step == 0 || gathers == 0, "step " + std::to_string(step) + ": " + std::to_string(gathers) +
                                             " all-gathers in backward, expected none");
    });
    testref::expect_same_run(got, want, 1e-5, "a frozen backbone");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// backward(inputs=...) naming one unit's parameters: the others' parameters
// are in the graph but get no gradient, and their weights are still read for
// the gradient flowing through them.
TEST_P(Adapters, ABackwardForSomeParametersOnlyReadsTheOthersWeights) {
  torch::manual_seed(3);
  auto x = torch::randn({8, 6});
  auto inputs_of = [](Adapted& m) { return m->first->parameters(); };
  torch::manual_seed(0);
  Adapted ref;
  torch::optim::SGD ref_opt(unique_tensors(*ref), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < kSteps; ++step) {
    ref_opt.zero_grad();
    ref(x).square().mean().backward({}, std::nullopt, false, inputs_of(ref));
    ref_opt.step();
  }
  auto want = snapshot(*ref);
  const shardtorch::Strategy s = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    Adapted m;
    shardtorch::shard(m, w, strategy_options(s, 2).bucket_mb(1e-4));
    auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));  // a zero gradient changes nothing
    for (int step = 0; step < kSteps; ++step) {
      opt->zero_grad();
      m(x.narrow(0, 4 * w.rank(), 4)).square().mean().backward({}, std::nullopt, false, inputs_of(m));
      opt->step();
    }
    expect_close_map(shardtorch::full_parameters(*m), want, 1e-5, "backward for some parameters only");
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(FrozenParameters, Adapters, ::testing::ValuesIn(kAllStrategies), StrategyName());

class CheckpointedFrozenUnit : public ::testing::TestWithParam<Strategy> {};

// Checkpointed, a unit with only frozen parameters is recomputed in backward
// (its input needs a gradient) and has nothing to reduce: nothing waits for it.
TEST_P(CheckpointedFrozenUnit, ACheckpointedFrozenUnitBetweenTrainableOnesTrainsLikeTorch) {
  torch::manual_seed(3);
  auto x = torch::randn({8, 6});
  torch::manual_seed(0);
  Sandwich ref;
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  const auto want = testref::train_reference(*ref, ref_opt, kSteps, [&](int) { return ref(x).square().mean(); });
  const shardtorch::Strategy s = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    Sandwich m;
    auto sm = shardtorch::shard(m, w, strategy_options(s, 2).activation_checkpointing_for("frozen", true));
    auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-2));
    const auto got = testref::train_ranks(*m, *opt, kSteps,
                                          [&](int) { m(x.narrow(0, 4 * w.rank(), 4)).square().mean().backward(); });
    require(sm.stats().reductions_deferred == 0, std::to_string(sm.stats().reductions_deferred) + " units waited");
    testref::expect_same_run(got, want, 1e-5, "a checkpointed frozen unit");
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(FrozenParameters, CheckpointedFrozenUnit,
                         ::testing::Values(Strategy::FullShard, Strategy::ShardGradOp), StrategyName());

class LeafInput : public ::testing::TestWithParam<Strategy> {};

TEST_P(LeafInput, AnAdapterUnitWithALeafInputTrainsLikeTorchAndCollectsNoHooks) {
  torch::manual_seed(3);
  auto x = torch::randn({8, 6});
  torch::manual_seed(0);
  PosNet ref;
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  const auto want = testref::train_reference(*ref, ref_opt, kSteps, [&](int) { return ref(x).square().mean(); });
  const shardtorch::Strategy s = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    PosNet m;
    shardtorch::shard(m, w, strategy_options(s, 2));
    auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-2));
    // C++ hooks of a tensor are kept in one list behind a single pre-hook.
    auto cpp_hooks = [](const torch::Tensor& t) {
      auto* meta = torch::autograd::impl::get_autograd_meta(t);
      return meta && meta->cpp_hooks_list_ ? meta->cpp_hooks_list_->size() : size_t{0};
    };
    const size_t hooks = cpp_hooks(m->pos);
    const auto got = testref::train_ranks(*m, *opt, kSteps,
                                          [&](int) { m(x.narrow(0, 4 * w.rank(), 4)).square().mean().backward(); });
    require(cpp_hooks(m->pos) == hooks,
            std::to_string(cpp_hooks(m->pos) - hooks) + " hooks piled up on the leaf input");
    testref::expect_same_run(got, want, 1e-5, "a leaf input");
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(FrozenParameters, LeafInput, ::testing::Values(Strategy::FullShard, Strategy::HybridShard),
                         StrategyName());

// Two forwards, one backward through both graphs: the second forward's input
// gradient is complete before the first forward's backward reads the frozen
// weights. With zero_grad() between the forwards, and as truncated
// backpropagation through time (the first graph kept by retain_graph).
TEST(FrozenParameters, TwoForwardsDifferentiatedInOneBackwardTrainLikeTorch) {
  torch::manual_seed(3);
  auto x = torch::randn({8, 6});
  for (bool tbptt : {false, true}) {
    // The loop both sides run: `zero_grad` clears, `part` is the rank's rows.
    auto step = [&](auto& model, auto&& zero_grad, auto&& part) {
      zero_grad();
      auto h1 = model(part(x));
      if (tbptt) {
        h1.square().mean().backward({}, /*retain_graph=*/true);
      } else {
        zero_grad();  // between the forwards: the first forward's graph stays
      }
      auto h2 = model(torch::tanh(h1));
      (tbptt ? h2.square().mean() : h1.square().mean() + h2.square().mean()).backward();
    };
    torch::manual_seed(0);
    Chain ref;
    torch::optim::SGD ref_opt(unique_tensors(*ref), torch::optim::SGDOptions(0.05));
    for (int s = 0; s < kSteps; ++s) {
      step(
          ref, [&] { ref_opt.zero_grad(); }, [](const torch::Tensor& t) { return t; });
      ref_opt.step();
    }
    auto want = snapshot(*ref);
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      Chain m;
      shardtorch::shard(m, w);
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.05));
      for (int s = 0; s < kSteps; ++s) {
        step(
            m, [&] { opt->zero_grad(); }, [&](const torch::Tensor& t) { return t.narrow(0, 4 * w.rank(), 4); });
        opt->step();
      }
      expect_close_map(shardtorch::full_parameters(*m), want, 1e-5, tbptt ? "tbptt" : "two forwards");
    });
    ASSERT_TRUE(r.ok) << (tbptt ? "tbptt: " : "two forwards: ") << r.summary();
  }
}

class RequiresGradChanged : public ::testing::TestWithParam<Strategy> {};

// Which parameters train is fixed by shard(): a parameter unfrozen later was
// never reduced nor stepped, and one frozen later was still stepped, with no
// word (gradual unfreezing, say). The next optimizer step names it.
TEST_P(RequiresGradChanged, ChangingRequiresGradAfterShardIsAnErrorAtTheNextStep) {
  const shardtorch::Strategy s = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    for (bool unfreeze : {false, true}) {
      if (unfreeze && s == shardtorch::Strategy::NoShard) continue;  // NoShard keeps no list of frozen ones
      torch::manual_seed(0);
      MLP m;
      shardtorch::shard(m, w, strategy_options(s, 2));
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
      auto step = [&] {
        opt->zero_grad();
        m(torch::ones({2, 7})).square().sum().backward();
        opt->step();
      };
      step();
      if (unfreeze) {
        m->l2->lin->bias.set_requires_grad(true);
      } else {
        m->l1->lin->weight.set_requires_grad(false);
      }
      std::string e = "no error";
      try {
        step();
      } catch (const std::exception& err) {
        e = err.what();
      }
      const std::string want = unfreeze ? "parameter 'l2.lin.bias' was frozen at shard() and is trainable now"
                                        : "parameter 'l1.lin.weight' was trainable at shard() and is frozen now";
      require(e.find("rank " + std::to_string(w.rank()) + ": " + want) != std::string::npos,
              std::string(shardtorch::strategy_name(s)) + ": " + e);
    }
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Frozen, RequiresGradChanged, ::testing::Values(Strategy::FullShard, Strategy::NoShard),
                         StrategyName());
