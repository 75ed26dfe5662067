#include "buckets/reduce_scatter_bucketer.h"
#include "base/check.h"
#include "base/errors.h"
#include "base/log.h"

#include <c10/core/GradMode.h>

#include <cstdio>
#include <thread>

#include "comm/collective_check.h"
#include "comm/completion_watcher.h"

namespace shardtorch {

ReduceScatterBucketer::ReduceScatterBucketer(double bucket_mb, MemoryTracker* mem, int max_in_flight)
    : bucket_bytes_(static_cast<int64_t>(bucket_mb * 1024.0 * 1024.0)), mem_(mem), launches_(mem, max_in_flight) {
  SHARDTORCH_CHECK(bucket_mb >= 0, "ReduceScatterBucketer: bucket_mb ", bucket_mb, " must not be negative");
  SHARDTORCH_CHECK(max_in_flight >= 1, "ReduceScatterBucketer: max_in_flight ", max_in_flight, " must be at least 1");
}

ReduceScatterBucketer::~ReduceScatterBucketer() {
  try {
    discard();
  } catch (...) {  // a destructor must not throw; discard() already ignores collective errors
  }
}

namespace {
void track(MemoryTracker* mem, int64_t bytes) {
  if (mem && bytes > 0) mem->add(Mem::Buckets, bytes);
  if (mem && bytes < 0) mem->sub(Mem::Buckets, -bytes);
}
int64_t nbytes(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }
// The [n] output a reduce-scatter over `group` writes; none where it reduces
// in place (Gloo), the shard then being a row of the input.
at::Tensor output_for(const Comm& group, int64_t n, const at::TensorOptions& opts) {
  return group.reduce_scatter_in_place() ? at::Tensor() : at::empty({n}, opts);
}
}  // namespace

void ReduceScatterBucketer::reserve(Bucket& b, int64_t cols, const at::TensorOptions& opts) {
  int64_t have = b.buffer.defined() ? b.buffer.size(1) : 0;
  if (cols <= have) return;
  int64_t want = std::min(b.cap, std::max({cols, 2 * have, b.high_water}));
  at::Tensor buffer = at::empty({b.group->size(), want}, opts);
  at::Tensor output = output_for(*b.group, want, opts);
  if (b.offset > 0) buffer.narrow(1, 0, b.offset).copy_(b.buffer.narrow(1, 0, b.offset));
  if (b.buffer.defined()) track(mem_, -(nbytes(b.buffer) + nbytes(b.output)));
  b.buffer = std::move(buffer);
  b.output = std::move(output);
  track(mem_, nbytes(b.buffer) + nbytes(b.output));
}

ReduceScatterBucketer::Bucket& ReduceScatterBucketer::bucket_for(const at::Tensor& input, Comm& group) {
  Key key{static_cast<int>(input.scalar_type()), input.device().str(), static_cast<const void*>(&group)};
  auto it = buckets_.find(key);
  if (it != buckets_.end()) return it->second;
  Bucket b;
  b.group = &group;
  b.cap = bucket_bytes_ / (input.element_size() * group.size());
  return buckets_.emplace(key, std::move(b)).first->second;
}

void ReduceScatterBucketer::reduce_scatter(const at::Tensor& input, Comm& group, Callback callback,
                                           const std::string& what, Comm* replicas) {
  const int world = group.size();
  SHARDTORCH_CHECK(input.dim() == 1 && input.numel() % world == 0, detail::rank_prefix(group.rank()),
                   ": reduce_scatter for ", what, ": input ", describe(input), " is not 1-D with a multiple of ", world,
                   " elements");
  c10::NoGradGuard no_grad;
  const int64_t shard = input.numel() / world;
  Bucket& b = bucket_for(input, group);
  if (b.offset == 0) b.replicas = replicas;
  TORCH_INTERNAL_ASSERT(b.replicas == replicas, detail::rank_prefix(group.rank()),
                        ": ReduceScatterBucketer: one bucket for two replica groups (", what, ")");
  if (shard > b.cap) {  // too big to coalesce: launch what is queued (order), then this one alone
    launch_bucket(b);
    launches_.make_room(what);
    at::Tensor in = input.contiguous();
    at::Tensor out = output_for(group, shard, input.options());
    detail::ReductionPieces pieces;
    pieces.push_back({{0, shard}, std::move(callback)});
    track(mem_, nbytes(in) + nbytes(out));
    launches_.launch(group, in, out, nbytes(in) + nbytes(out), std::move(pieces), what,
                     detail::LaunchQueue::Kind::ReduceScatter, replicas);
    return;
  }
  if (b.offset + shard > b.cap) launch_bucket(b);
  reserve(b, b.offset + shard, input.options());
  b.buffer.narrow(1, b.offset, shard).copy_(input.view({world, shard}));
  b.pieces.push_back({{b.offset, shard}, std::move(callback)});
  b.whats.push_back(what);
  b.offset += shard;
  if (b.cap - b.offset < shard) launch_bucket(b);  // another input like this one would not fit
}

void ReduceScatterBucketer::all_reduce(const at::Tensor& input, Comm& group, Callback callback,
                                       const std::string& what) {
  c10::NoGradGuard no_grad;
  launch_bucket(bucket_for(input, group));  // what is queued goes first, as for an input too big for a bucket
  // OptimizerOnly: no bound beyond the collective's timeout (no peer can be
  // waiting in an all-gather of this rank), and the staging gradients in
  // flight stay within the limit.
  launches_.make_room(what, /*bounded=*/false);
  at::Tensor in = input.contiguous().view({-1});
  detail::ReductionPieces pieces;
  pieces.push_back({{0, in.numel()}, std::move(callback)});
  track(mem_, nbytes(in));
  launches_.launch(group, in, at::Tensor(), nbytes(in), std::move(pieces), what, detail::LaunchQueue::Kind::AllReduce);
}

void ReduceScatterBucketer::launch_bucket(Bucket& b) {
  if (b.offset == 0) return;
  b.high_water = std::max(b.high_water, b.offset);
  const std::string what = b.whats.size() == 1 ? b.whats[0]
                                               : "bucket of " + std::to_string(b.whats.size()) + " (" +
                                                     b.whats.front() + " .. " + b.whats.back() + ")";
  launches_.make_room(what);  // before the compact copy below is allocated
  at::Tensor in, out;
  int64_t bytes = 0;
  if (b.offset == b.buffer.size(1)) {  // full: the buffers go with the collective (already tracked)
    in = b.buffer.view({-1});
    out = b.output;
    bytes = nbytes(b.buffer) + nbytes(b.output);
    b.buffer = at::Tensor();
    b.output = at::Tensor();
  } else {  // partly filled: launch a compact copy, keep the buffers for the next fill
    // A copy always: with one rank the narrowed columns are contiguous, and
    // contiguous() would hand the collective the buffer the next fill writes.
    in = at::empty({b.buffer.size(0), b.offset}, b.buffer.options());
    in.copy_(b.buffer.narrow(1, 0, b.offset));
    if (b.output.defined()) out = at::empty({b.offset}, b.buffer.options());  // else reduced in place
    bytes = nbytes(in) + nbytes(out);
    track(mem_, bytes);
  }
  detail::ReductionPieces pieces = std::move(b.pieces);
  b.pieces.clear();
  b.whats.clear();
  b.offset = 0;
  launches_.launch(*b.group, std::move(in), std::move(out), bytes, std::move(pieces), what,
                   detail::LaunchQueue::Kind::ReduceScatter, b.replicas);
}

void ReduceScatterBucketer::flush() {
  c10::NoGradGuard no_grad;
  for (auto& [k, b] : buckets_) launch_bucket(b);
  launches_.complete_all();
}

void ReduceScatterBucketer::free() {
  SHARDTORCH_CHECK(launches_.size() == 0, "ReduceScatterBucketer::free() with ", launches_.size(),
                   " reduce-scatters in flight; call flush() first");
  for (auto& [k, b] : buckets_) {
    SHARDTORCH_CHECK(b.offset == 0, "ReduceScatterBucketer::free() with ", b.pieces.size(),
                     " reductions still queued; call flush() first");
    if (b.buffer.defined()) track(mem_, -(nbytes(b.buffer) + nbytes(b.output)));
    b.buffer = at::Tensor();
    b.output = at::Tensor();
  }
}

void ReduceScatterBucketer::discard() {
  launches_.discard();
  for (auto& [k, b] : buckets_) {
    b.pieces.clear();
    b.whats.clear();
    b.offset = 0;
  }
  free();
}

int64_t ReduceScatterBucketer::allocated_bytes() const {
  int64_t n = 0;
  for (const auto& [k, b] : buckets_) {
    if (b.buffer.defined()) n += nbytes(b.buffer) + nbytes(b.output);
  }
  return n + launches_.bytes();
}

// ---- LaunchQueue

detail::LaunchQueue::LaunchQueue(MemoryTracker* mem, int max_in_flight) : mem_(mem), max_in_flight_(max_in_flight) {}

detail::LaunchQueue::~LaunchQueue() = default;

void detail::LaunchQueue::make_room(const std::string& next, bool bounded) {
  while (static_cast<int>(in_flight_.size()) >= max_in_flight_) {
    // Where the group's waits are stream-ordered (CUDA), completing the
    // oldest blocks nothing, so the bound is not needed.
    if (!bounded || !in_flight_.front().group->host_waits()) {
      complete_oldest();
      continue;
    }
    const Launched& oldest = in_flight_.front();
    const auto bound = std::min(kReduceScatterLimitWait, oldest.group->timeout() / 4);
    if (!oldest_done_within(bound)) {
      if (counts_.past_limit++ == 0)
        SHARDTORCH_WARN("shardtorch: the reduce-scatter for ", next, " goes out past the limit of ", max_in_flight_,
                        " in flight: the oldest (", oldest.work.what, ") did not complete within ",
                        std::chrono::duration<double>(bound).count(),
                        " s. Ranks finished units at different points of the backward (the data routed around "
                        "some); waiting longer could deadlock with an all-gather a peer waits in. Reported once; "
                        "ShardedModel::reduce_scatters_past_the_limit() counts them.");
      return;
    }
    complete_oldest();
  }
}

bool detail::LaunchQueue::oldest_done_within(std::chrono::milliseconds bound) {
  Launched& oldest = in_flight_.front();
  if (oldest.call.active()) return detail::hook_done_within(oldest.call, bound);
  if (oldest.completion) return oldest.completion->wait_for(bound);
  const auto deadline = std::chrono::steady_clock::now() + bound;
  while (!oldest.work.work->isCompleted()) {  // CUDA (NCCL): the Work answers for itself
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

void detail::LaunchQueue::launch(Comm& group, at::Tensor input, at::Tensor output, int64_t bytes,
                                 ReductionPieces pieces, const std::string& what, Kind kind, Comm* replicas) {
  // `bytes` (input and output) are tracked already; from here they belong to
  // the launch. The caller made room under max_in_flight.
  Launched l;
  l.group = &group;
  l.replicas = replicas != nullptr && replicas->size() > 1 ? replicas : nullptr;
  // The hook takes the place of the all-reduce across replicas (of a
  // reduce-scatter's output, or of what an all-reduce summed), never its continuation.
  l.to_hook = hook_.hook() != nullptr && kind != Kind::AcrossReplicas;
  l.input = std::move(input);
  l.output = std::move(output);
  l.bytes = bytes;
  l.pieces = std::move(pieces);
  try {
    if (kind != Kind::ReduceScatter) {  // the callback gets the whole reduced input
      l.work = group.all_reduce_async(l.input, what);
      l.output = l.input;
      l.whole = true;
    } else if (l.output.defined()) {
      l.work = group.reduce_scatter_async(l.output, l.input, what);
    } else {  // all-reduced in place: this rank's shard is its chunk of the input
      l.work = group.reduce_scatter_in_place_async(l.input, what);
      l.output = l.input.view({group.size(), -1}).select(0, group.rank());
    }
  } catch (...) {
    track(mem_, -bytes);
    throw;
  }
  if (!group.device().is_cuda()) {
    if (!watcher_) watcher_ = std::make_unique<detail::CompletionWatcher>();
    l.completion = watcher_->watch(l.work.work, group.timeout(), l.work.checked);
  }
  ++counts_.launched;
  if (!in_flight_.empty()) ++counts_.while_in_flight;
  in_flight_.push_back(std::move(l));
  if (kind == Kind::ReduceScatter) detail::test_point("reduce-scatter posted");
}

void detail::LaunchQueue::wait_for_launch(Launched& l) {
  if (l.call.active()) {
    l.output = detail::finish_hook(*hook_.hook(), l.call, l.group->rank(), l.group->timeout());
  } else if (l.completion) {
    std::exception_ptr error;  // checked: a long wait is compared with the peers' (collective_check.h)
    if (l.work.checked) {
      try {
        l.work.checked->await([&](std::chrono::milliseconds slice) { return l.completion->wait_for(slice); },
                              l.group->timeout());
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (!error) {
      l.completion->wait();
      error = l.completion->error();
      if (error && l.work.checked) error = l.work.checked->explain(error);
    }
    l.group->finish(l.work, error);
  } else {
    l.group->wait(l.work);
  }
}

void detail::LaunchQueue::launch_across_replicas(Launched& l, const std::string& what) {
  // On Gloo the output is a row of the [N, cols] input all-reduced in place:
  // a copy of it lets the input go now. Otherwise the output goes on and
  // the input is freed.
  const bool copied = l.output.is_alias_of(l.input);
  at::Tensor chunk = copied ? l.output.clone() : l.output;
  const int64_t bytes = nbytes(chunk);
  if (!copied) {  // counted once: as the new launch's from here on (the peak counted it twice on NCCL)
    track(mem_, -l.bytes);
    l.bytes = 0;
  }
  track(mem_, bytes);
  // Part of the launch it continues: counts_ counts the
  // reduce-scatter, not this again.
  const int64_t launched = counts_.launched, overlapped = counts_.while_in_flight;
  launch(*l.replicas, chunk, at::Tensor(), bytes, std::move(l.pieces), what + " across replicas", Kind::AcrossReplicas);
  counts_.launched = launched;
  counts_.while_in_flight = overlapped;
  track(mem_, -l.bytes);  // the input and its copied row (Gloo): `chunk` is the new launch's
  l.bytes = 0;
}

void detail::LaunchQueue::launch_hook(Launched& l, const std::string& what) {
  // The hook may write its bucket (the built-in ones reduce in place): on
  // Gloo a reduce-scatter's output is a row of the input, so a copy of it
  // lets the input go. An all-reduce's output is all of its input: no copy.
  const bool copied = !l.whole && l.output.is_alias_of(l.input);
  at::Tensor chunk = copied ? l.output.clone() : l.output;
  Launched h;
  h.group = l.group;
  h.output = chunk;
  h.bytes = nbytes(chunk);
  track(mem_, h.bytes);
  h.pieces = std::move(l.pieces);
  h.work.what = what + " (communication hook)";
  std::vector<size_t> offsets, lengths;
  std::vector<int64_t> numels;
  numels.reserve(h.pieces.size());
  for (const auto& [range, cb] : h.pieces) {
    offsets.push_back(static_cast<size_t>(range.first));
    lengths.push_back(static_cast<size_t>(range.second));
    numels.push_back(range.second);
  }
  std::vector<c10::IntArrayRef> sizes;
  for (const int64_t& n : numels) sizes.emplace_back(&n, 1);
  // The number of buckets in a backward is not known before it ends: 0, so
  // that isLast() is false.
  c10d::GradBucket bucket(hook_calls_++, 0, chunk, std::move(offsets), std::move(lengths), std::move(sizes), {},
                          std::nullopt);
  try {
    if (l.replicas) l.replicas->flush_launches();  // the hook's group: its collectives run on the backend itself
    h.call = detail::call_hook(*hook_.hook(), bucket, l.group->rank(), what, hook_.counter());
  } catch (...) {
    track(mem_, -h.bytes);
    throw;
  }
  track(mem_, -l.bytes);  // the reduce-scatter's buffers: `chunk` is the hook's from here on
  l.bytes = 0;
  in_flight_.push_back(std::move(h));
}

void detail::LaunchQueue::complete_oldest() {
  Launched l = std::move(in_flight_.front());
  in_flight_.pop_front();
  try {
    const std::string what = l.replicas || l.to_hook ? l.work.what : std::string();
    wait_for_launch(l);
    if (l.to_hook) {
      launch_hook(l, what);  // its callbacks run when the hook's future completes
    } else if (l.replicas) {
      launch_across_replicas(l, what);  // its callbacks run when that completes
    } else {
      for (auto& [range, cb] : l.pieces) cb(l.output.narrow(0, range.first, range.second));
    }
  } catch (...) {
    track(mem_, -l.bytes);
    throw;
  }
  track(mem_, -l.bytes);
}

void detail::LaunchQueue::complete_all() {
  while (!in_flight_.empty()) complete_oldest();
  hook_calls_ = 0;
}

void detail::LaunchQueue::discard() {
  const auto give_up = std::chrono::steady_clock::now() + kDiscardWait;
  const auto left = [&] {  // of kDiscardWait, for the next launch
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now()),
                    std::chrono::milliseconds(0));
  };
  while (!in_flight_.empty()) {
    Launched l = std::move(in_flight_.front());
    in_flight_.pop_front();
    const int64_t bytes = l.bytes;
    if (l.call.active()) {
      detail::abandon_hook(l.call, l.group->timeout());
    } else if (l.completion && !l.completion->wait_for(left())) {
      // Still running (a peer stopped, or left it): its buffers, and the
      // backend whose destruction would wait for it, stay alive until the
      // watcher's wait for it ends, without anyone here waiting.
      struct Kept {
        Launched launch;
        c10::intrusive_ptr<c10d::Backend> backend;
      };
      auto state = l.completion;
      auto backend = l.group->backend();
      state->keep(std::make_shared<Kept>(Kept{std::move(l), std::move(backend)}));
    } else {
      try {
        wait_for_launch(l);  // its buffers must outlive the collective
      } catch (...) {
      }
    }
    track(mem_, -bytes);
  }
  hook_calls_ = 0;
}

int64_t detail::LaunchQueue::bytes() const {
  int64_t n = 0;
  for (const auto& l : in_flight_) n += l.bytes;
  return n;
}

}  // namespace shardtorch
