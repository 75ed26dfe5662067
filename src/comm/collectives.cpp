#include "shardtorch/collectives.h"
#include "comm/comm_testing.h"
#include "base/log.h"
#include "base/check.h"
#include "base/env.h"
#include "base/errors.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string_view>

#include "comm/collective_check.h"

namespace shardtorch {

std::string describe(const at::Tensor& t) { return detail::TensorShape::of(t).text(); }

namespace {
struct InjectedFailures {
  std::mutex mu;
  std::string what;
  std::atomic<int> count{0};  // read without the lock on every collective: nothing armed, nothing more

  // True (once per armed count) when the collective described by `what` is to fail.
  bool take(const std::string& description) {
    if (count.load(std::memory_order_relaxed) == 0) return false;
    std::lock_guard<std::mutex> lock(mu);
    if (count == 0 || description.find(what) == std::string::npos) return false;
    --count;
    return true;
  }
};
InjectedFailures& injected() {
  static InjectedFailures f;
  return f;
}
}  // namespace

void detail::arm_collective_failure(const std::string& what, int count) {
  auto& f = injected();
  std::lock_guard<std::mutex> lock(f.mu);
  f.what = what;
  f.count = count;
}

namespace {
bool is_gloo(const c10::intrusive_ptr<c10d::Backend>& backend) {
  if (!backend) return false;
  try {
    return backend->getBackendName() == "gloo";
  } catch (const std::exception&) {  // a backend without a name (c10d's default throws): not Gloo
    return false;
  }
}
}  // namespace

namespace detail {
// Collectives a CUDA stream waits for and the host has not seen complete: an
// event recorded on the stream right after its wait, so that nothing holds
// the collective's tensors.
class StreamOrderedWaits {
 public:
  struct Entry {
    c10::Event passed;
    const char* op;
    std::string what, shapes;
    std::chrono::steady_clock::time_point start;
    int64_t seq;
  };
  explicit StreamOrderedWaits(c10::Device device) : device_(device) {}

  void add(const char* op, std::string what, std::string shapes, std::chrono::steady_clock::time_point start,
           int64_t seq) {
    c10::impl::VirtualGuardImpl impl(device_.type());
    Entry e{spare_event(), op, std::move(what), std::move(shapes), start, seq};
    e.passed.record(impl.getStream(device_));
    entries_.push_back(std::move(e));
  }
  /// Drops the entries the device has passed, oldest first; returns the
  /// oldest one left (null if none).
  const Entry* reap() {
    while (!entries_.empty() && entries_.front().passed.query()) {
      spare_.push_back(std::move(entries_.front().passed));
      entries_.pop_front();
    }
    return entries_.empty() ? nullptr : &entries_.front();
  }
  size_t size() const { return entries_.size(); }
  void block_on_oldest() { entries_.front().passed.synchronize(); }
  void clear() { entries_.clear(); }

 private:
  c10::Event spare_event() {
    if (spare_.empty()) return c10::Event(device_.type());
    c10::Event e = std::move(spare_.back());
    spare_.pop_back();
    return e;
  }
  c10::Device device_;
  std::deque<Entry> entries_;
  std::vector<c10::Event> spare_;
};
}  // namespace detail

namespace {
// At most this many collectives waited for and not yet seen complete; past
// it, wait() blocks on the oldest (the host is then that far ahead anyway).
constexpr size_t kMaxUnsettled = 4096;

bool blocking_wait_requested() { return detail::env_switch("SHARDTORCH_BLOCKING_WAIT").value_or(false); }
}  // namespace

Comm::Comm(c10::intrusive_ptr<c10d::Backend> backend, int rank, int size, std::chrono::milliseconds timeout,
           c10::Device device)
    : backend_(std::move(backend)),
      rank_(rank),
      size_(size),
      timeout_(timeout),
      device_(device),
      reduce_scatter_in_place_(is_gloo(backend_)),
      host_waits_(blocking_wait_requested() || !device.is_cuda()) {
  if (!host_waits_) unsettled_ = std::make_unique<detail::StreamOrderedWaits>(device_);
}

Comm::~Comm() = default;

namespace {
// `text` and, after it, what `report` says of the peers (who is at fault).
std::string with_peers(const std::string& text,
                       const std::function<std::string(std::chrono::steady_clock::time_point, int64_t)>& report,
                       std::chrono::steady_clock::time_point start, int64_t seq) {
  const std::string peers = report ? report(start, seq) : std::string();
  if (peers.empty()) return text;
  // c10d's "Operation timed out!" and Gloo's "... GLHF! ..." end a sentence of their own.
  const bool ended = !text.empty() && (text.back() == '.' || text.back() == '!' || text.back() == '?');
  return text + (ended ? " " : ". ") + peers;
}
}  // namespace

void Comm::run(const char* op, const std::string& what, const std::string& shapes, CollectiveCounter& counter,
               int64_t bytes, const std::function<c10::intrusive_ptr<c10d::Work>()>& launch,
               std::optional<std::chrono::steady_clock::time_point> started, int64_t seq) {
  auto start = started.value_or(std::chrono::steady_clock::now());
  complete(
      op, what, shapes, counter, bytes, start, [&] { launch()->wait(timeout_); }, seq);
}

void Comm::complete(const char* op, const std::string& what, const std::string& shapes, CollectiveCounter& counter,
                    int64_t bytes, std::chrono::steady_clock::time_point start, const std::function<void()>& wait,
                    int64_t seq) {
  try {
    wait();
    if (injected().take(what)) throw std::runtime_error("failure injected by shardtorch::testing::fail_collectives");
  } catch (const CollectivesDiverged&) {
    throw;  // names the ranks and both collectives already; nothing ran
  } catch (const std::exception& e) {
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::ostringstream os;
    os << who() << ": " << op << " for " << what << " (" << shapes << ") did not complete after " << waited
       << " s (timeout " << timeout_.count() / 1000.0 << " s): " << detail::message_of(e);
    throw Error(with_peers(os.str(), peer_report_, start, seq));
  }
  counter.calls += 1;
  counter.bytes_sent += bytes;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  counter.seconds += seconds;
  SHARDTORCH_DEBUG(op, " for ", what, " (", shapes, "): done, ", bytes,
                   std::string_view(op) == "recv" ? " bytes received in " : " bytes sent in ", seconds, " s");
}

void Comm::check_flat(const at::Tensor& out, const at::Tensor& in, const char* op, const std::string& what) const {
  SHARDTORCH_CHECK(out.is_contiguous() && in.is_contiguous() && out.scalar_type() == in.scalar_type(), who(), ": ", op,
                   " for ", what, " needs contiguous tensors of one dtype, got in ", describe(in), ", out ",
                   describe(out));
}

void Comm::check_gather(const at::Tensor& out, const at::Tensor& in, const std::string& what) const {
  SHARDTORCH_CHECK(out.numel() == in.numel() * size_, who(), ": all_gather for ", what, ": output ", describe(out),
                   " is not ", size_, " x input ", describe(in));
  check_flat(out, in, "all_gather", what);
}

namespace {
int64_t op_code(const char* op) { return detail::text_hash(op); }

// A Work that is complete from the start (waits return at once).
class DoneWork : public c10d::Work {
 public:
  DoneWork() { finish(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto f = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
    f->markCompleted(c10::IValue());
    return f;
  }
};

// A collective of a group of one rank, done on this thread (a copy or
// nothing) instead of by the backend: on the CPU the backend would hand it to
// a thread of its own and wake this one, which costs milliseconds on a
// machine whose cores are busy. No fingerprint: there is no peer to differ.
PendingWork done_at_once(const char* op, const std::string& what, std::string shapes, CollectiveCounter& counter) {
  PendingWork p;
  p.op = op;
  p.what = what;
  p.shapes = std::move(shapes);
  p.counter = &counter;
  p.start = std::chrono::steady_clock::now();
  p.work = c10::make_intrusive<DoneWork>();
  return p;
}

bool alone(int size, const c10::Device& device) { return size == 1 && device.is_cpu(); }
}  // namespace

void Comm::all_gather_into(at::Tensor& out, at::Tensor& in, const std::string& what) {
  PendingWork p = all_gather_async(out, in, what);
  wait(p);
}

void Comm::reduce_scatter_into(at::Tensor& out, at::Tensor& in, const std::string& what) {
  PendingWork p = reduce_scatter_async(out, in, what);
  wait(p);
}

void Comm::all_reduce(at::Tensor& t, c10d::ReduceOp op, const std::string& what) {
  if (alone(size_, device_) &&
      op != c10d::ReduceOp::PREMUL_SUM) {  // every other op of one rank's tensor is that tensor
    PendingWork p = done_at_once("all_reduce", what, describe(t), stats_.all_reduce);
    wait_on_host(p);
    return;
  }
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  opts.timeout = timeout_;
  auto b = backend_;
  PendingWork p = launch(
      "all_reduce", what, describe(t), stats_.all_reduce, 2 * t.nbytes() * (size_ - 1) / std::max(size_, 1),
      [b, t, opts]() mutable {
        std::vector<at::Tensor> ts{t};
        return b->allreduce(ts, opts);
      },
      t, static_cast<int64_t>(op) + 1);
  wait_on_host(p);
}

void Comm::enable_checks(std::shared_ptr<detail::CollectiveContext> context, c10::intrusive_ptr<c10d::Backend> check,
                         std::shared_ptr<detail::WaitBoard> board, const std::string& name, std::vector<int> members) {
  SHARDTORCH_CHECK(!device_.is_cuda(), "shardtorch: the collective check runs on CPU (Gloo) groups only");
  context_ = std::move(context);
  if (checker_ || size_ == 1) return;  // one rank: no peer to differ from (its collectives are done_at_once)
  const int comm = board ? board->add(name, std::move(members)) : -1;
  checker_ = std::make_unique<detail::CollectiveChecker>(std::move(check), rank_, size_, std::move(board), comm);
  checker_->follow_steps(*context_, timeout_);
}

void Comm::disable_checks() {
  if (!checker_) return;
  checker_->cancel_launches(who() +
                            ": the collective check was turned off (a rejoin) before this collective was launched");
  checker_.reset();
}

int64_t Comm::check_exchanges() const { return checker_ ? checker_->exchanges() : 0; }

void Comm::flush_launches() {
  if (checker_) checker_->flush();
}

PendingWork Comm::launch(const char* op, const std::string& what, std::string shapes, CollectiveCounter& counter,
                         int64_t bytes, std::function<c10::intrusive_ptr<c10d::Work>()> start, const at::Tensor& data,
                         int64_t extra) {
  PendingWork p;
  p.op = op;
  p.what = what;
  p.shapes = std::move(shapes);
  p.counter = &counter;
  p.bytes = bytes;
  p.start = std::chrono::steady_clock::now();
  p.seq = ++*launched_;
  SHARDTORCH_DEBUG(op, " for ", what, " (", p.shapes, "): start, ", bytes, " bytes to send");
  if (checker_) {
    const auto where = context_->snapshot();
    std::vector<int64_t> pattern{
        op_code(op), detail::text_hash(what), data.numel(), static_cast<int64_t>(data.scalar_type()),
        extra,       where.backwards,         where.phase,  where.inputs_hash};
    auto describe = [op, what = p.what, shapes = p.shapes, where] {
      return std::string(op) + " for " + what + " (" + shapes + "); " + where.words();
    };
    p.checked = checker_->submit(std::move(pattern), where.step, std::move(describe), std::move(start), timeout_);
    return p;
  }
  try {
    p.work = start();
  } catch (const std::exception& e) {
    throw Error(with_peers(
        who() + ": " + op + " for " + what + " (" + p.shapes + ") could not be launched: " + detail::message_of(e),
        peer_report_, p.start, p.seq));
  }
  return p;
}

c10::intrusive_ptr<c10d::Work> Comm::launched(PendingWork& p) {
  if (p.work) return p.work;
  SHARDTORCH_CHECK(p.checked, "shardtorch: Comm::wait on a collective that was not launched");
  auto checked = std::move(p.checked);
  try {
    p.work = checked->launched();
  } catch (const CollectivesDiverged&) {
    throw;
  } catch (const std::exception&) {
    // The fingerprint exchange failed (a peer died, or never came) or the
    // launch did: the same error as a collective that failed.
    std::exception_ptr error = std::current_exception();
    complete(
        p.op, p.what, p.shapes, *p.counter, p.bytes, p.start, [&] { std::rethrow_exception(error); }, p.seq);
    throw;  // not reached: complete() threw
  }
  return p.work;
}

PendingWork Comm::all_gather_async(at::Tensor& out, at::Tensor& in, const std::string& what) {
  check_gather(out, in, what);
  at::Tensor o = out.view({-1}), i = in.view({-1});
  if (alone(size_, device_)) {
    if (!o.is_same(i)) o.copy_(i);
    return done_at_once("all_gather", what, "in " + describe(in) + ", out " + describe(out), stats_.all_gather);
  }
  c10d::AllgatherOptions opts;
  opts.timeout = timeout_;  // else the backend's own, not this Comm's (a checkpoint's longer one, say)
  auto b = backend_;
  return launch(
      "all_gather", what, "in " + describe(in) + ", out " + describe(out), stats_.all_gather, in.nbytes() * (size_ - 1),
      [b, o, i, opts]() mutable { return b->_allgather_base(o, i, opts); }, in);
}

PendingWork Comm::reduce_scatter_async(at::Tensor& out, at::Tensor& in, const std::string& what) {
  SHARDTORCH_CHECK(in.numel() == out.numel() * size_, who(), ": reduce_scatter for ", what, ": input ", describe(in),
                   " is not ", size_, " x output ", describe(out));
  check_flat(out, in, "reduce_scatter", what);
  at::Tensor o = out.view({-1}), i = in.view({-1});
  if (alone(size_, device_)) {
    if (!o.is_same(i)) o.copy_(i);
    return done_at_once("reduce_scatter", what, "in " + describe(in) + ", out " + describe(out), stats_.reduce_scatter);
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.timeout = timeout_;
  auto b = backend_;
  return launch(
      "reduce_scatter", what, "in " + describe(in) + ", out " + describe(out), stats_.reduce_scatter,
      out.nbytes() * (size_ - 1), [b, o, i, opts]() mutable { return b->_reduce_scatter_base(o, i, opts); }, in);
}

PendingWork Comm::reduce_scatter_in_place_async(at::Tensor& in, const std::string& what) {
  SHARDTORCH_CHECK(in.is_contiguous() && in.numel() % size_ == 0, who(), ": reduce_scatter for ", what, ": input ",
                   describe(in), " is not contiguous with a multiple of ", size_, " elements");
  at::Tensor flat = in.view({-1});
  return launch_sum(flat, "reduce_scatter", "in " + describe(in) + ", all-reduced in place", stats_.reduce_scatter,
                    in.nbytes() / size_ * (size_ - 1), what);
}

PendingWork Comm::all_reduce_async(at::Tensor& t, const std::string& what) {
  return launch_sum(t, "all_reduce", describe(t), stats_.all_reduce, 2 * t.nbytes() * (size_ - 1) / std::max(size_, 1),
                    what);
}

PendingWork Comm::launch_sum(at::Tensor& t, const char* op, std::string shapes, CollectiveCounter& counter,
                             int64_t bytes, const std::string& what) {
  if (alone(size_, device_)) return done_at_once(op, what, std::move(shapes), counter);
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.timeout = timeout_;
  auto b = backend_;
  return launch(
      op, what, std::move(shapes), counter, bytes,
      [b, t, opts]() mutable {
        std::vector<at::Tensor> ts{t};
        return b->allreduce(ts, opts);
      },
      t, static_cast<int64_t>(c10d::ReduceOp::SUM) + 1);
}

void Comm::wait(PendingWork& p) {
  SHARDTORCH_CHECK(p.pending(), "shardtorch: Comm::wait on a collective that was not launched");
  if (host_waits_) {
    wait_on_host(p);
    return;
  }
  launched(p);  // a checked launch: its check first (p.checked is spent)
  // Done with it either way: a collective that failed is not waited for again.
  auto work = std::move(p.work);
  settle_earlier();
  // Work::wait with a timeout would block this thread until the device
  // finished the collective (polling every millisecond); without one, the
  // current stream waits for it, and it throws if the collective failed.
  complete(
      p.op, p.what, p.shapes, *p.counter, p.bytes, p.start, [&] { work->wait(); }, p.seq);
  unsettled_->add(p.op, p.what, p.shapes, p.start, p.seq);
}

void Comm::settle_earlier() {
  if (unsettled_->size() >= kMaxUnsettled) unsettled_->block_on_oldest();
  const auto* oldest = unsettled_->reap();
  if (oldest == nullptr || std::chrono::steady_clock::now() - oldest->start < timeout_) return;
  const char* op = oldest->op;
  const std::string what = oldest->what, shapes = oldest->shapes;
  const auto start = oldest->start;
  const int64_t seq = oldest->seq;
  unsettled_->clear();  // reported once; the ranks are out of step from here
  complete(
      op, what, shapes, stats_.all_reduce, 0, start,
      [&] { throw std::runtime_error("the device has not passed it: the collective has not completed"); }, seq);
}

void Comm::finish(PendingWork& p, std::exception_ptr error) {
  SHARDTORCH_CHECK(p.pending(), "shardtorch: Comm::finish on a collective that was not launched");
  auto work = std::move(p.work);
  p.checked.reset();
  complete(
      p.op, p.what, p.shapes, *p.counter, p.bytes, p.start,
      [&] {
        if (error) std::rethrow_exception(error);
      },
      p.seq);
}

namespace {
PendingWork p2p(const char* op, const std::string& what, const at::Tensor& t, CollectiveCounter& counter, int64_t bytes,
                const std::string& who, int rank, int size, int peer, int peer_rank) {
  SHARDTORCH_CHECK(peer >= 0 && peer < size && peer != rank, who, ": ", op, " for ", what, ": peer ", peer,
                   " is not another member of a group of ", size);
  SHARDTORCH_CHECK(t.is_contiguous(), who, ": ", op, " for ", what, " needs a contiguous tensor, got ", describe(t));
  PendingWork p;
  p.op = op;
  p.what = what;
  p.shapes = describe(t) + (std::string(op) == "send" ? " to " : " from ") + "rank " + std::to_string(peer_rank);
  p.counter = &counter;
  p.bytes = bytes;
  p.start = std::chrono::steady_clock::now();
  SHARDTORCH_DEBUG(op, " for ", what, " (", p.shapes, "): start, ", t.nbytes(), " bytes");
  return p;
}
}  // namespace

PendingWork Comm::send_async(const at::Tensor& t, int peer, int tag, const std::string& what) {
  PendingWork p = p2p("send", what, t, stats_.send, t.nbytes(), who(), rank_, size_, peer, global_rank(peer));
  flush_launches();  // every rank's backend sees the checked collectives before this
  try {
    std::vector<at::Tensor> ts{t};
    p.work = backend_->send(ts, peer, tag);
  } catch (const std::exception& e) {
    throw Error(
        with_peers(who() + ": send for " + what + " (" + p.shapes + ") could not be launched: " + detail::message_of(e),
                   peer_report_, p.start, 0));
  }
  return p;
}

PendingWork Comm::recv_async(const at::Tensor& t, int peer, int tag, const std::string& what) {
  PendingWork p = p2p("recv", what, t, stats_.recv, 0, who(), rank_, size_, peer, global_rank(peer));
  flush_launches();
  try {
    std::vector<at::Tensor> ts{t};
    p.work = backend_->recv(ts, peer, tag);
  } catch (const std::exception& e) {
    throw Error(
        with_peers(who() + ": recv for " + what + " (" + p.shapes + ") could not be launched: " + detail::message_of(e),
                   peer_report_, p.start, 0));
  }
  return p;
}

std::string Comm::who() const {
  bool identity = true;  // the group's members are ranks 0..size-1 of the job: a member is its rank
  for (size_t i = 0; i < global_ranks_.size(); ++i) identity = identity && global_ranks_[i] == static_cast<int>(i);
  if (identity) return detail::rank_prefix(rank_) + "/" + std::to_string(size_);
  return detail::rank_prefix(global_rank(rank_)) + " (member " + std::to_string(rank_) + " of " +
         std::to_string(size_) + " of its group)";
}

void Comm::broadcast(at::Tensor& t, int root, const std::string& what) {
  if (alone(size_, device_) && root == 0) {
    PendingWork p = done_at_once("broadcast", what, describe(t), stats_.broadcast);
    wait_on_host(p);
    return;
  }
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = timeout_;
  auto b = backend_;
  PendingWork p = launch(
      "broadcast", what, describe(t), stats_.broadcast, rank_ == root ? t.nbytes() : 0,
      [b, t, opts]() mutable {
        std::vector<at::Tensor> ts{t};
        return b->broadcast(ts, opts);
      },
      t, root);
  wait_on_host(p);
}

void Comm::wait_on_host(PendingWork& p) {
  auto checked = p.checked;  // launched() spends it
  launched(p);
  auto work = std::move(p.work);
  if (!checked) {
    run(
        p.op, p.what, p.shapes, *p.counter, p.bytes, [&] { return work; }, p.start, p.seq);
    return;
  }
  // Checked: waits longer than a second are compared with the peers' (a
  // rank that launched this collective while another differs and waits in
  // its exchange is a cycle of two waits).
  complete(
      p.op, p.what, p.shapes, *p.counter, p.bytes, p.start,
      [&] {
        const bool done = checked->await(
            [&](std::chrono::milliseconds slice) { return detail::work_done_within(*work, slice); }, timeout_);
        try {
          // Its outcome; past the timeout, its timeout error.
          work->wait(done ? timeout_ : std::chrono::milliseconds(1));
        } catch (...) {
          std::rethrow_exception(checked->explain(std::current_exception()));
        }
      },
      p.seq);
}

std::vector<std::string> Comm::all_gather_strings(const std::string& mine, const std::string& what) {
  auto len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong).to(device_);
  auto lens = at::empty({size_}, len.options());
  all_gather_into(lens, len, what + " (lengths)");
  lens = lens.cpu();
  int64_t max_len = std::max<int64_t>(1, lens.max().item<int64_t>());
  auto bytes = at::zeros({max_len}, at::kByte);
  if (!mine.empty()) std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  bytes = bytes.to(device_);
  auto all = at::empty({max_len * size_}, bytes.options());
  all_gather_into(all, bytes, what);
  all = all.cpu();
  std::vector<std::string> out;
  const char* base = static_cast<const char*>(all.data_ptr());
  for (int r = 0; r < size_; ++r) out.emplace_back(base + r * max_len, lens[r].item<int64_t>());
  return out;
}

}  // namespace shardtorch
