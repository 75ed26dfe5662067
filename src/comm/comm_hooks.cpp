#include "shardtorch/comm_hooks.h"
#include "base/check.h"

#include <ATen/core/jit_type.h>
#include <c10/util/Type.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <chrono>
#include <sstream>
#include <typeinfo>

#include "base/errors.h"
#include "comm/hook_call.h"
#include "comm/world_access.h"
#include "shardtorch/collectives.h"
#include "shardtorch/world.h"

namespace shardtorch {

c10::intrusive_ptr<c10::ivalue::Future> completed_future(const at::Tensor& value) {
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  fut->markCompleted(c10::IValue(value));
  return fut;
}

c10::intrusive_ptr<c10::ivalue::Future> AllReduceHook::runHook(c10d::GradBucket& bucket) {
  at::Tensor& buffer = bucket.getBufferRef();
  if (!state_) return completed_future(buffer);
  buffer.div_(state_->getSize());  // first, as c10d's and PyTorch's allreduce_hook: a sum of means cannot overflow
  std::vector<at::Tensor> tensors{buffer};
  return state_->allreduce(tensors)->getFuture();
}

c10::intrusive_ptr<c10::ivalue::Future> CompressHook::runHook(c10d::GradBucket& bucket) {
  at::Tensor buffer = bucket.getBuffer();
  if (!state_) return completed_future(buffer);
  // As PyTorch's _compress_hook: cast, divide in the compressed dtype, sum,
  // and copy (cast) back into the bucket.
  at::Tensor compressed = buffer.to(dtype_).div_(state_->getSize());
  std::vector<at::Tensor> tensors{compressed};
  auto fut = state_->allreduce(tensors)->getFuture();
  return fut->then(
      [buffer](c10::ivalue::Future& f) {
        buffer.copy_(f.value().toTensorVector().at(0));
        return c10::IValue(buffer);
      },
      c10::TensorType::get());
}

std::unique_ptr<CommHook> allreduce_hook(HookGroup group) { return std::make_unique<AllReduceHook>(std::move(group)); }
std::unique_ptr<CommHook> fp16_compress_hook(HookGroup group) {
  return std::make_unique<CompressHook>(std::move(group), at::kHalf);
}
std::unique_ptr<CommHook> bf16_compress_hook(HookGroup group) {
  return std::make_unique<CompressHook>(std::move(group), at::kBFloat16);
}

namespace detail {

namespace {
std::string seconds(std::chrono::steady_clock::duration d) {
  std::ostringstream s;
  s.precision(3);
  s << std::chrono::duration<double>(d).count() << " s";
  return s.str();
}
}  // namespace

HookCall call_hook(CommHook& hook, c10d::GradBucket& bucket, int rank, std::string what, HookCounter* counter) {
  HookCall call;
  call.what = std::move(what);
  call.shape = describe(bucket.getBuffer());
  call.sizes = bucket.getBuffer().sizes().vec();
  call.counter = counter;
  if (counter) {  // handed over, whatever the hook then does with it
    ++counter->calls;
    counter->bucket_bytes += static_cast<int64_t>(bucket.getBuffer().nbytes());
  }
  call.start = std::chrono::steady_clock::now();
  try {
    call.future = hook.runHook(bucket);
  } catch (...) {
    rethrow_naming(rank, [&] { return "the communication hook for " + call.what + " (" + call.shape + ")"; });
  }
  SHARDTORCH_CHECK(call.future, detail::rank_prefix(rank), ": the communication hook for ", call.what, " (", call.shape,
                   ") returned no future");
  call.signal = std::make_shared<HookCall::Signal>();
  // Runs on whichever thread completes the future (a Gloo worker) or here:
  // it only wakes the waiter, and cannot throw.
  call.future->addCallback(
      [signal = call.signal](c10::ivalue::Future&) noexcept {
        {
          std::lock_guard<std::mutex> lock(signal->mu);
          signal->done = true;
        }
        signal->cv.notify_all();
      },
      /*uses_future=*/false);
  return call;
}

bool hook_done_within(const HookCall& call, std::chrono::milliseconds bound) {
  std::unique_lock<std::mutex> lock(call.signal->mu);
  return call.signal->cv.wait_for(lock, bound, [&] { return call.signal->done; });
}

at::Tensor finish_hook(CommHook& hook, HookCall& call, int rank, std::chrono::milliseconds timeout) {
  HookCall c = std::move(call);
  call = HookCall{};
  const std::string head = detail::rank_prefix(rank) + ": the communication hook for " + c.what + " (" + c.shape + ")";
  const auto deadline = c.start + timeout;
  {
    std::unique_lock<std::mutex> lock(c.signal->mu);
    if (!c.signal->cv.wait_until(lock, deadline, [&] { return c.signal->done; }))
      SHARDTORCH_CHECK(false, head, ": its future did not complete after ",
                       seconds(std::chrono::steady_clock::now() - c.start), " (timeout ", seconds(timeout), ")");
  }
  if (c.counter)
    c.counter->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - c.start).count();
  c.future->wait();  // completed: returns at once (on CUDA, the current streams wait for its value)
  if (c.future->hasError()) {
    std::string cause;
    try {
      c.future->value();  // rethrows the future's error
    } catch (const c10::Error& e) {
      cause = e.what_without_backtrace();
    } catch (const std::exception& e) {
      cause = e.what();
    } catch (...) {
      cause = "an exception of unknown type";
    }
    SHARDTORCH_CHECK(false, head, ": its future failed: ", cause);
  }
  at::Tensor result;
  try {
    result = hook.parseHookResult(c.future->value());
  } catch (const std::exception& e) {
    SHARDTORCH_CHECK(false, head, ": its future holds ", c.future->value().tagKind(),
                     ", not the reduced bucket (a tensor or a list of one): ", e.what());
  }
  SHARDTORCH_CHECK(result.defined() && result.sizes().vec() == c.sizes, head, ": its future holds ",
                   result.defined() ? describe(result) : std::string("an undefined tensor"),
                   ", expected a tensor of the bucket's shape ", c10::IntArrayRef(c.sizes));
  return result;
}

void abandon_hook(HookCall& call, std::chrono::milliseconds timeout) noexcept {
  if (!call.active()) return;
  try {
    std::unique_lock<std::mutex> lock(call.signal->mu);
    call.signal->cv.wait_for(lock, timeout, [&] { return call.signal->done; });
  } catch (...) {
  }
  call = HookCall{};
}

std::string describe_hook(const CommHook* hook) {
  if (!hook) return "no hook";
  std::string d = c10::demangle(typeid(*hook).name());
  if (const auto* c = dynamic_cast<const CompressHook*>(hook)) d += "(" + std::string(c10::toString(c->dtype())) + ")";
  return d;
}

void check_same_hook(World& world, const CommHook* hook) {
  const int n = world.size(), rank = world.rank();
  if (n <= 1) return;
  const std::string mine = describe_hook(hook);
  auto store = c10::make_intrusive<c10d::PrefixStore>("shardtorch-comm-hooks", world.store());
  // This rank's n-th check meets every other rank's n-th: a key per round.
  const int64_t round = store->add("checks-of-rank-" + std::to_string(rank), 1);
  auto key = [&](int r) { return std::to_string(round) + "/" + std::to_string(r); };
  store->set(key(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::vector<std::string> keys;
  for (int r = 0; r < n; ++r) keys.push_back(key(r));
  // Waited for in slices: a rank that ended (its program caught an error
  // before this backward, or died) is said at once, with its record, not
  // after the whole timeout as a rank without a hook.
  const auto started = std::chrono::steady_clock::now();
  const auto deadline = started + world.timeout();
  auto missing = [&] {
    std::vector<int> out;
    for (int r = 0; r < n; ++r)
      if (!store->check({keys[r]})) out.push_back(world.global_rank_of(r));
    return out;
  };
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    try {
      store->wait(keys, std::max(std::chrono::milliseconds(1), std::min(left, std::chrono::milliseconds(1000))));
      break;
    } catch (const std::exception&) {
    }
    const std::vector<int> late = missing();
    std::string ranks;
    for (int r : late) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    auto* progress = WorldAccess::progress(world);
    if (progress && !late.empty() && progress->any_ended(late))
      SHARDTORCH_CHECK(false, detail::rank_prefix(world.global_rank()),
                       ": the check that every rank has the same communication hook, at the first backward that "
                       "reduces gradients: rank(s) ",
                       ranks, " will not report theirs. ", progress->report(late, started));
    SHARDTORCH_CHECK(std::chrono::steady_clock::now() < deadline, detail::rank_prefix(world.global_rank()),
                     ": the check that every rank has the same communication hook "
                     "(this rank: ",
                     mine, "): rank(s) ", ranks, " did not report theirs within ", seconds(world.timeout()),
                     ". The ranks compare their hooks at the first backward that reduces "
                     "gradients after shard() and after register_comm_hook: register the hook on every rank, before "
                     "the same backward",
                     progress && !late.empty() ? ". " + progress->report(late, started) : std::string());
  }
  std::vector<std::string> hooks;
  for (int r = 0; r < n; ++r) {
    const std::vector<uint8_t> v = store->get(keys[r]);
    hooks.emplace_back(v.begin(), v.end());
  }
  for (int r = 1; r < n; ++r)
    SHARDTORCH_CHECK(hooks[r] == hooks[0], detail::rank_prefix(rank),
                     ": the ranks have different communication "
                     "hooks: rank 0 has ",
                     hooks[0], ", rank ", r, " has ", hooks[r], " (this rank: ", mine,
                     "). Different hooks issue different collectives; register the same kind of hook on every rank "
                     "(register_comm_hook), or none on any");
}

}  // namespace detail
}  // namespace shardtorch
