// ReduceScatterBucketer on its own, over real Gloo groups of 1 and 2 ranks,
// each test both ways a launch can go: an all-reduce of the input in place
// (Gloo's default) and c10d's reduce-scatter into an output (NCCL's).
#include <gtest/gtest.h>

#include <thread>

#include "../src/buckets/reduce_scatter_bucketer.h"
#include "shardtorch/testing.h"

using shardtorch::ReduceScatterBucketer;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {
// Rank r contributes (r + 1) * (base + arange(n)); the sum over ranks of chunk
// c is that times sum(r + 1) = W(W+1)/2.
at::Tensor input_for(int rank, int64_t n, double base, at::ScalarType dtype = at::kFloat) {
  return (at::arange(n, at::TensorOptions().dtype(dtype)) + base) * (rank + 1);
}
at::Tensor expected_shard(World& w, int64_t n, double base, at::ScalarType dtype = at::kFloat) {
  int64_t s = n / w.size();
  double factor = w.size() * (w.size() + 1) / 2.0;
  return ((at::arange(n, at::TensorOptions().dtype(dtype)) + base) * factor).narrow(0, w.rank() * s, s);
}
void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}
}  // namespace

class BucketerTest : public ::testing::TestWithParam<std::tuple<int, bool>> {
 protected:
  int world() const { return std::get<0>(GetParam()); }
  bool in_place() const { return std::get<1>(GetParam()); }
};

TEST_P(BucketerTest, CoalescesSmallInputsIntoOneCollectiveInOrder) {
  const bool ip = in_place();
  auto r = run_ranks(world(), [ip](World& w) {
    w.comm().set_reduce_scatter_in_place(ip);
    ReduceScatterBucketer b(1.0);  // 1 MiB: room for all three
    std::vector<int> order;
    std::vector<at::Tensor> got(3);
    const int64_t sizes[3] = {2L * w.size(), 5L * w.size(), 3L * w.size()};
    for (int i = 0; i < 3; ++i) {
      b.reduce_scatter(
          input_for(w.rank(), sizes[i], 10.0 * i), w.comm(),
          [&, i](const at::Tensor& s) {
            order.push_back(i);
            got[i] = s.clone();
          },
          "t" + std::to_string(i));
    }
    check(b.launches().counts().launched == 0, "nothing should be launched before flush");
    check(order.empty(), "no callback before flush");
    b.flush();
    check(b.launches().counts().launched == 1,
          "three inputs should go out as one collective, got " + std::to_string(b.launches().counts().launched));
    check(order == std::vector<int>({0, 1, 2}), "callbacks out of submission order");
    for (int i = 0; i < 3; ++i)
      check(at::equal(got[i], expected_shard(w, sizes[i], 10.0 * i)), "wrong reduction of input " + std::to_string(i));
    check(w.comm().stats().reduce_scatter.calls == 1, "comm stats disagree");
    // Buffers grow only as far as needed (here 10 columns of a 1 MiB bucket),
    // and the next backward starts at that high-water mark.
    const int64_t W = w.size();
    const int64_t out = ip ? 0 : 10;  // reduced in place, the shard is a row of the input: no output
    check(b.allocated_bytes() <= 2 * (W * 10 + out) * 4,
          "bucket grew past twice what was needed: " + std::to_string(b.allocated_bytes()));
    b.free();
    for (int i = 0; i < 3; ++i)
      b.reduce_scatter(
          input_for(w.rank(), sizes[i], 0.0), w.comm(), [](const at::Tensor&) {}, "again");
    check(b.allocated_bytes() == (W * 10 + out) * 4,
          "second backward should allocate exactly the high-water mark, got " + std::to_string(b.allocated_bytes()));
    b.flush();
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST_P(BucketerTest, LaunchesFullBucketsAsynchronouslyAndBypassesLargeInputs) {
  const bool ip = in_place();
  auto r = run_ranks(world(), [ip](World& w) {
    w.comm().set_reduce_scatter_in_place(ip);
    const int W = w.size();
    shardtorch::MemoryTracker mem;
    // cap = 64 bytes / (4 bytes * W) elements per rank column range.
    ReduceScatterBucketer b(64.0 / (1024 * 1024), &mem, /*max_in_flight=*/2);
    const int64_t cap = 64 / (4 * W);
    auto tracked = [&] { return mem.snapshot().cur(shardtorch::Mem::Buckets); };
    std::vector<int> order;
    std::vector<at::Tensor> got(3);
    auto keep = [&](int i) {
      return [&, i](const at::Tensor& s) {
        order.push_back(i);
        got[i] = s.clone();
      };
    };
    const int64_t sizes[3] = {(cap - 1) * W, 2L * W, (cap + 3) * W};
    // a fills the bucket so far that another input like it would not fit: it
    // is launched at once, and its callback waits for the collective.
    b.reduce_scatter(input_for(w.rank(), sizes[0], 1.0), w.comm(), keep(0), "a");
    check(b.launches().counts().launched == 1 && b.launches().size() == 1,
          "a nearly full bucket should be launched at once");
    check(order.empty(), "a callback ran before anything waited for its collective");
    check(tracked() == b.allocated_bytes() && tracked() > 0, "tracker disagrees with the buffer in flight");
    // b is small: it waits in the bucket.
    b.reduce_scatter(input_for(w.rank(), sizes[1], 2.0), w.comm(), keep(1), "b");
    check(b.launches().counts().launched == 1, "a small input should wait in its bucket");
    // big exceeds the capacity: b's bucket goes first, then big alone; with
    // two in flight already, launching big first completes a.
    b.reduce_scatter(input_for(w.rank(), sizes[2], 3.0), w.comm(), keep(2), "big");
    check(b.launches().counts().launched == 3, "an oversized input launches the queue and goes alone, got " +
                                                   std::to_string(b.launches().counts().launched));
    check(b.launches().size() == 2 && order == std::vector<int>({0}),
          "max_in_flight should have completed a, and only a");
    check(b.launches().counts().while_in_flight == 2, "b's bucket and big were launched with another in flight");
    check(tracked() == b.allocated_bytes(), "tracker disagrees with the buffers in flight");
    b.flush();
    check(b.launches().counts().launched == 3 && b.launches().size() == 0,
          "flush should wait for everything and launch nothing new");
    check(order == std::vector<int>({0, 1, 2}), "callbacks out of submission order");
    for (int i = 0; i < 3; ++i)
      check(at::equal(got[i], expected_shard(w, sizes[i], 1.0 + i)), "wrong reduction of input " + std::to_string(i));
    b.free();
    check(tracked() == 0 && b.allocated_bytes() == 0, "buffers left after flush and free");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

namespace {
// One rank whose reduce-scatter reads its input only when waited for: the
// slowest collective there can be, so whatever the caller writes into a
// launched input before the wait shows up in the result.
class DeferredWork : public c10d::Work {
 public:
  DeferredWork(at::Tensor out, at::Tensor in) : out_(std::move(out)), in_(std::move(in)) {}
  bool wait(std::chrono::milliseconds) override {
    out_.copy_(in_);  // one rank: the sum is its own input
    return true;
  }

 private:
  at::Tensor out_, in_;
};
class DeferredBackend : public c10d::Backend {
 public:
  DeferredBackend() : c10d::Backend(0, 1) {}
  const std::string getBackendName() const override { return "deferred"; }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions&) override {
    return c10::make_intrusive<DeferredWork>(out, in);
  }
  // In place, one rank's sum is the input as it is: the shard is read from
  // the launched input after the wait, so a later write to it shows there too.
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>&, const c10d::AllreduceOptions&) override {
    return c10::make_intrusive<DeferredWork>(at::empty({0}), at::empty({0}));
  }
};
}  // namespace

// A bucket launched partly filled (its buffer sized by the last backward's
// high-water mark) goes out from a copy: the next input is written into the
// same buffer while the first collective may still be reading it. With one
// rank the narrowed columns are contiguous, so contiguous() alone would not copy.
TEST(Bucketer, APartlyFilledLaunchIsNotOverwrittenByTheNextFill) {
  for (bool in_place : {false, true}) {
    SCOPED_TRACE(in_place ? "all-reduced in place" : "reduce-scatter into an output");
    shardtorch::Comm comm(c10::make_intrusive<DeferredBackend>(), 0, 1, std::chrono::seconds(10));
    comm.set_reduce_scatter_in_place(in_place);
    ReduceScatterBucketer b(1.0);
    const int64_t cap = 1024 * 1024 / 4;
    b.reduce_scatter(
        at::ones({cap * 9 / 10}), comm, [](const at::Tensor&) {}, "first pass");
    b.flush();
    b.free();                        // the high-water mark is now 0.9 cap
    const int64_t n = cap * 6 / 10;  // fills 0.6 cap: launched at once, from a buffer of 0.9 cap
    at::Tensor a, c;
    b.reduce_scatter(
        at::full({n}, 1.0), comm, [&](const at::Tensor& s) { a = s.clone(); }, "a");
    ASSERT_EQ(b.launches().size(), 1) << "a should be in flight";
    b.reduce_scatter(
        at::full({n}, 2.0), comm, [&](const at::Tensor& s) { c = s.clone(); }, "c");
    b.flush();
    EXPECT_TRUE(at::equal(a, at::full({n}, 1.0))) << "a's reduction was overwritten by the next fill";
    EXPECT_TRUE(at::equal(c, at::full({n}, 2.0))) << "c's reduction is wrong";
  }
}

// Gloo reduces in place by default (its c10d reduce-scatter would all-reduce
// a clone); another backend does not, unless asked. Either way the launch is
// counted as one reduce-scatter of its ring volume.
TEST(Bucketer, GlooReducesInPlaceByDefaultAndCountsAReduceScatter) {
  shardtorch::Comm other(c10::make_intrusive<DeferredBackend>(), 0, 1, std::chrono::seconds(10));
  EXPECT_FALSE(other.reduce_scatter_in_place());
  auto r = run_ranks(2, [](World& w) {
    check(w.comm().reduce_scatter_in_place(), "a Gloo group should reduce-scatter in place by default");
    w.comm().reset_stats();  // the World's set-up ran collectives of its own
    shardtorch::MemoryTracker mem;
    ReduceScatterBucketer b(1.0, &mem);
    at::Tensor in = input_for(w.rank(), 8, 0.0), got;
    b.reduce_scatter(
        in, w.comm(), [&](const at::Tensor& s) { got = s.clone(); }, "x");
    check(mem.snapshot().cur(shardtorch::Mem::Buckets) == 8 * 4,
          "in place needs the [2, 4] input only, tracked " +
              std::to_string(mem.snapshot().cur(shardtorch::Mem::Buckets)) + " bytes");
    b.flush();
    check(at::equal(got, expected_shard(w, 8, 0.0)), "wrong reduction in place");
    check(at::equal(in, input_for(w.rank(), 8, 0.0)), "the caller's input was written (it was copied into a bucket)");
    const auto& rs = w.comm().stats().reduce_scatter;
    check(rs.calls == 1 && rs.bytes_sent == 4 * 4 && w.comm().stats().all_reduce.calls == 0,
          "counted as " + std::to_string(rs.calls) + " reduce-scatters of " + std::to_string(rs.bytes_sent) +
              " bytes, expected 1 of 16");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST_P(BucketerTest, DiscardWaitsDropsCallbacksAndFreesEverything) {
  const bool ip = in_place();
  auto r = run_ranks(world(), [ip](World& w) {
    w.comm().set_reduce_scatter_in_place(ip);
    shardtorch::MemoryTracker mem;
    ReduceScatterBucketer b(0.0, &mem, /*max_in_flight=*/4);  // every input goes alone
    int calls = 0;
    for (int i = 0; i < 3; ++i)
      b.reduce_scatter(
          input_for(w.rank(), 4 * w.size(), i), w.comm(), [&](const at::Tensor&) { ++calls; }, "x");
    check(b.launches().size() == 3 && calls == 0, "three collectives should be in flight, none completed");
    b.discard();
    check(calls == 0, "discard ran a callback");
    check(b.launches().size() == 0 && b.allocated_bytes() == 0, "discard left work or buffers");
    check(mem.snapshot().cur(shardtorch::Mem::Buckets) == 0, "tracker should show 0 bucket bytes after discard");
    // Usable again, with correct results.
    at::Tensor got;
    b.reduce_scatter(
        input_for(w.rank(), 4 * w.size(), 7.0), w.comm(), [&](const at::Tensor& s) { got = s.clone(); }, "after");
    b.flush();
    check(at::equal(got, expected_shard(w, 4 * w.size(), 7.0)), "reduction after discard wrong");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A collective in flight that a peer holds (stopped, or gone without closing
// its connections) is let go by discard() after kDiscardWait, and by the
// bucketer's destruction, instead of being waited for until the collective
// timeout: a rank whose step failed must be able to exit. It stays alive
// and completes once the peer takes part.
TEST(Bucketer, DiscardLetsGoOfACollectiveAPeerHolds) {
  auto r = run_ranks(
      2,
      [](World& w) {
        auto& store = *w.store();
        using Clock = std::chrono::steady_clock;
        at::Tensor got;
        if (w.rank() == 0) {
          double took = 0;
          {
            shardtorch::MemoryTracker mem;
            ReduceScatterBucketer b(0.0, &mem);
            b.reduce_scatter(
                input_for(0, 8, 1.0), w.comm(), [&](const at::Tensor&) {}, "held by rank 1");
            check(b.launches().size() == 1, "the reduce-scatter should be in flight");
            const auto t0 = Clock::now();
            b.discard();
            check(b.launches().size() == 0 && mem.snapshot().cur(shardtorch::Mem::Buckets) == 0,
                  "discard left work or tracked bytes");
            took = std::chrono::duration<double>(Clock::now() - t0).count();
          }  // the bucketer (and its watcher) destroyed here: no wait either
          check(took < 10, "discard and the bucketer's destruction waited " + std::to_string(took) +
                               " s for a collective rank 1 holds (its timeout is 20 s)");
          store.set("test: rank 0 let go", std::vector<uint8_t>{1});
          store.get("test: rank 1 reduced");  // the collective let go of completes meanwhile
        } else {
          store.get("test: rank 0 let go");
          ReduceScatterBucketer b(0.0);
          b.reduce_scatter(
              input_for(1, 8, 1.0), w.comm(), [&](const at::Tensor& s) { got = s.clone(); }, "late");
          b.flush();
          check(at::equal(got, expected_shard(w, 8, 1.0)), "the late rank's reduction is wrong");
          store.set("test: rank 1 reduced", std::vector<uint8_t>{1});
        }
      },
      shardtorch::testing::RunOptions().check_collectives(false).collective_timeout(std::chrono::seconds(20)));
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST_P(BucketerTest, SeparateBucketsPerDtypeAndFreedAfterFlush) {
  const bool ip = in_place();
  auto r = run_ranks(world(), [ip](World& w) {
    w.comm().set_reduce_scatter_in_place(ip);
    shardtorch::MemoryTracker mem;
    ReduceScatterBucketer b(1.0, &mem);
    at::Tensor f, d;
    b.reduce_scatter(
        input_for(w.rank(), 4 * w.size(), 0.0), w.comm(), [&](const at::Tensor& s) { f = s.clone(); }, "f");
    b.reduce_scatter(
        input_for(w.rank(), 4 * w.size(), 0.0, at::kDouble), w.comm(), [&](const at::Tensor& s) { d = s.clone(); },
        "d");
    check(b.allocated_bytes() > 0, "buffers should exist during backward");
    check(mem.snapshot().cur(shardtorch::Mem::Buckets) == b.allocated_bytes(), "tracker disagrees with buffers");
    b.flush();
    check(b.launches().counts().launched == 2, "float and double need two collectives");
    check(f.scalar_type() == at::kFloat && d.scalar_type() == at::kDouble, "dtypes mixed up");
    check(at::equal(d, expected_shard(w, 4 * w.size(), 0.0, at::kDouble)), "double reduction wrong");
    b.free();
    check(b.allocated_bytes() == 0, "buffers should be freed after free()");
    check(mem.snapshot().cur(shardtorch::Mem::Buckets) == 0, "tracker should show 0 bucket bytes");
    // Reusable after free: buffers come back lazily.
    b.reduce_scatter(
        input_for(w.rank(), 2 * w.size(), 5.0), w.comm(), [&](const at::Tensor& s) { f = s.clone(); }, "again");
    b.flush();
    check(at::equal(f, expected_shard(w, 2 * w.size(), 5.0)), "reduction after free wrong");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST_P(BucketerTest, ZeroBucketSizeDisablesCoalescing) {
  const bool ip = in_place();
  auto r = run_ranks(world(), [ip](World& w) {
    w.comm().set_reduce_scatter_in_place(ip);
    ReduceScatterBucketer b(0.0);
    int calls = 0;
    for (int i = 0; i < 3; ++i)
      b.reduce_scatter(
          input_for(w.rank(), w.size(), i), w.comm(), [&](const at::Tensor&) { ++calls; }, "x");
    check(b.launches().counts().launched == 3, "every input should go out at once");
    check(calls == 1, "with two in flight, the third launch should complete the first");
    b.flush();
    check(calls == 3 && b.allocated_bytes() == 0, "flush should complete all, and nothing stays allocated");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(Bucketer, RejectsInputsNotDivisibleByWorld) {
  auto r = run_ranks(2, [](World& w) {
    ReduceScatterBucketer b(1.0);
    try {
      b.reduce_scatter(
          at::ones({5}), w.comm(), [](const at::Tensor&) {}, "odd");
    } catch (const std::exception& e) {
      check(std::string(e.what()).find("multiple of 2") != std::string::npos, e.what());
      return;
    }
    throw std::runtime_error("no error for 5 elements over 2 ranks");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Worlds, BucketerTest, ::testing::Combine(::testing::Values(1, 2), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& info) {
                           return std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_in_place" : "_reduce_scatter");
                         });

// all_reduce() (OptimizerOnly's gradients) waits for room as long as the
// collective allows, never going out past the limit: with one in flight and
// a peer 2 s late, the second launch waits past the bound on that wait
// (kReduceScatterLimitWait, 1 s, a quarter of the 8 s collective timeout at
// most) for the first. Each callback gets the whole sum, the input reduced
// in place.
TEST(Bucketer, AllReducesWaitForRoomPastTheBoundAndGetTheWholeSum) {
  auto r = run_ranks(
      2,
      [](World& w) {
        ReduceScatterBucketer b(1.0, nullptr, /*max_in_flight=*/1);
        // The stall is the scenario: twice the bound, a quarter of the collective timeout.
        if (w.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2000));
        std::vector<at::Tensor> inputs, got(2);
        for (int i = 0; i < 2; ++i) {
          inputs.push_back(input_for(w.rank(), 6, 10.0 * i));
          b.all_reduce(
              inputs.back(), w.comm(), [&, i](const at::Tensor& s) { got[i] = s; }, "g" + std::to_string(i));
        }
        b.flush();
        check(b.launches().counts().past_limit == 0, "an all-reduce went out past the limit of one in flight");
        for (int i = 0; i < 2; ++i) {
          const at::Tensor want = (at::arange(6, at::kFloat) + 10.0 * i) * 3;  // ranks contribute 1x and 2x
          check(at::equal(got[i], want), "wrong sum for g" + std::to_string(i));
          check(got[i].data_ptr() == inputs[i].data_ptr(), "g" + std::to_string(i) + " was not reduced in place");
        }
      },
      shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(8)));
  ASSERT_TRUE(r.ok) << r.summary();
}
