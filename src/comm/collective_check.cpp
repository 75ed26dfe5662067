#include "comm/collective_check.h"
#include "base/check.h"
#include "base/env.h"

#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "shardtorch/collectives.h"
#include "shardtorch/world.h"

namespace shardtorch::detail {

TensorShape TensorShape::of(const at::Tensor& t) {
  if (!t.defined()) return {};
  return {true, t.scalar_type(), t.sizes().vec(), t.device()};
}

std::string TensorShape::text() const {
  if (!defined) return "undefined";
  std::ostringstream os;
  os << c10::toString(dtype) << c10::IntArrayRef(sizes);
  if (!device.is_cpu()) os << " on " << device;
  return os.str();
}

using Kind = WaitBoard::Kind;

int64_t text_hash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h);
}

void CollectiveContext::backward_begins(bool sync) {
  std::lock_guard<std::mutex> lock(mu_);
  in_backward_ = 1;
  sync_ = sync;
}

void CollectiveContext::backward_ends() {
  std::lock_guard<std::mutex> lock(mu_);
  if (in_backward_ == 0) return;
  in_backward_ = 0;
  ++backwards_;
}

void step_began(CheckerShared& s, int64_t step, bool setup);  // below

void CollectiveContext::setup_done() { mark(/*setup=*/true); }

void CollectiveContext::step_done() { mark(/*setup=*/false); }

void CollectiveContext::mark(bool setup) {
  std::vector<std::weak_ptr<CheckerShared>> checkers;
  int64_t step;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!setup) {
      ++step_;
      backwards_ = 0;
      inputs_seen_ = false;
      inputs_hash_ = 0;
      inputs_.reset();
      forwards_without_grad_ = 0;
      last_without_grad_.reset();
    }
    step = step_;
    checkers = checkers_;
  }
  for (auto& weak : checkers)
    if (auto s = weak.lock()) step_began(*s, step, setup);
}

void CollectiveContext::follow(std::weak_ptr<CheckerShared> checker) {
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(checkers_, [](const auto& w) { return w.expired(); });
  checkers_.push_back(std::move(checker));
}

void CollectiveContext::root_forward_without_grad(const std::vector<at::Tensor>& inputs) {
  auto shapes = std::make_shared<Shapes>();
  for (const auto& t : inputs) shapes->push_back(TensorShape::of(t));
  std::lock_guard<std::mutex> lock(mu_);
  ++forwards_without_grad_;
  last_without_grad_ = std::move(shapes);
}

void CollectiveContext::root_inputs(const std::vector<at::Tensor>& inputs) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (inputs_seen_) return;
  }
  std::ostringstream os;
  for (size_t i = 0; i < inputs.size(); ++i) os << (i ? ", " : "") << describe(inputs[i]);
  auto text = std::make_shared<const std::string>(inputs.empty() ? std::string("no tensor") : os.str());
  std::lock_guard<std::mutex> lock(mu_);
  inputs_seen_ = true;
  inputs_hash_ = text_hash(*text);
  inputs_ = std::move(text);
}

CollectiveContext::Snapshot CollectiveContext::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  Snapshot s;
  s.step = step_;
  s.backwards = backwards_;
  s.phase = in_backward_ ? (sync_ ? 2 : 1) : 0;
  s.inputs_hash = inputs_hash_;
  s.inputs = inputs_;
  s.forwards_without_grad = forwards_without_grad_;
  s.last_without_grad = last_without_grad_;
  return s;
}

std::string CollectiveContext::Snapshot::words() const {
  std::ostringstream os;
  os << "step " << step << ", ";
  if (phase != 0)
    os << "in backward " << backwards + 1 << " since the last optimizer step (gradient sync "
       << (phase == 2 ? "on" : "off") << ")";
  else
    os << "after " << backwards << " backward" << (backwards == 1 ? "" : "s") << " since the last optimizer step";
  if (inputs) os << "; the step's first forward took " << *inputs;
  if (forwards_without_grad > 0) {
    os << "; " << forwards_without_grad << " forward" << (forwards_without_grad == 1 ? "" : "s")
       << " without gradients (an evaluation) since the last optimizer step, the last taking ";
    for (size_t i = 0; i < last_without_grad->size(); ++i) os << (i ? ", " : "") << (*last_without_grad)[i].text();
    if (last_without_grad->empty()) os << "no tensor";
  }
  return os.str();
}

CheckChoice check_collectives_choice(std::optional<bool> option, const char* env, bool cuda, int world_size) {
  if (env != nullptr && *env != '\0') option = parse_switch("SHARDTORCH_CHECK_COLLECTIVES", env);
  CheckChoice c;
  if (cuda) {
    c.refused_on_cuda = option.value_or(false);
    return c;
  }
  c.on = option.value_or(world_size <= WorldOptions::kCheckedByDefaultUpTo);
  return c;
}

// ---- CheckedLaunch, CollectiveChecker

const std::string& CheckedLaunch::description() const {
  std::call_once(described_, [&] { description_ = describe ? describe() : std::string("a collective"); });
  return description_;
}

bool work_done_within(c10d::Work& work, std::chrono::milliseconds slice) {
  const auto start = std::chrono::steady_clock::now();
  try {
    work.wait(slice);  // throws when the slice passes (the work goes on), or with the work's failure
    return true;
  } catch (const std::exception&) {
    // A failure, not the slice passing: completed, or thrown well before the slice's end.
    return work.isCompleted() || std::chrono::steady_clock::now() - start < slice / 2;
  }
}

void CheckedLaunch::settle(c10::intrusive_ptr<c10d::Work> w, std::exception_ptr e) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (done) return;
    work = std::move(w);
    error = std::move(e);
    done = true;
    start = nullptr;  // drops the tensors it held
  }
  cv.notify_all();
}

void CheckedLaunch::abandon(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (done) return;
    done = true;
    error = std::make_exception_ptr(std::runtime_error(why));
    // `start` stays: the launch still comes if its exchange succeeds, so the
    // peers that launched it are not left waiting.
  }
  cv.notify_all();
}

struct CheckerShared : std::enable_shared_from_this<CheckerShared> {
  c10::intrusive_ptr<c10d::Backend> check;  // the check group: the exchanges alone
  int rank = 0, size = 1;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<CheckedLaunch>> queue;  // not launched yet, in order
  bool stop = false;
  std::mutex launch_mu;              // held by each launch; after mu where both are held
  std::exception_ptr cancelled;      // under launch_mu: CollectiveChecker::cancel_launches, nothing launches
  bool busy = false;                 // an entry taken off the queue runs, on the checker's thread or on a waiting one
  std::exception_ptr broken;         // after a failed check: the ranks are out of step, every later launch fails alike
  std::shared_ptr<WaitBoard> board;  // may be null
  int comm = -1;                     // this communicator's number on `board`
  // The patterns of the previous step's collectives and of this step's so far.
  std::vector<std::vector<int64_t>> previous, current;
  size_t position = 0;  // this step's collectives so far (`current` holds the first kMaxPatternsPerStep)
  int64_t step = -1;
  bool marked = false;                                         // this step began with a marker exchange (step_began)
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // a marker's: the last collective's
  int64_t issued = 0;                                          // collectives submitted
  int64_t entered = 0;                                         // exchanges entered
  int64_t finished = 0;                   // exchanges finished (in order: the next to finish is finished + 1)
  std::shared_ptr<CheckedLaunch> newest;  // the last one queued (launched in order: when it is, all are)
};

namespace {

// `wait`: the waiting thread's, when it runs the exchange itself (probed as it lasts).
at::Tensor gather(c10d::Backend& backend, const at::Tensor& mine, int size, std::chrono::milliseconds timeout,
                  WaitBoard::Wait* wait = nullptr) {
  at::Tensor all = at::empty({mine.numel() * size}, mine.options());
  at::Tensor in = mine;
  c10d::AllgatherOptions o;
  o.timeout = timeout;
  auto work = backend._allgather_base(all, in, o);
  if (!wait) {
    work->wait(timeout);
    return all;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!work_done_within(*work, wait->interval())) {
    std::string crossed = wait->probe(deadline);
    if (!crossed.empty()) throw CollectivesDiverged(crossed);  // run_taken marks the checker broken
  }
  work->wait(timeout);  // its own outcome: the exchange's failure, if any
  return all;
}

// Every rank's text, in rank order: every rank calls it, after every rank saw the same mismatch.
std::vector<std::string> gather_texts(c10d::Backend& backend, const std::string& mine, int size,
                                      std::chrono::milliseconds timeout) {
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lens = gather(backend, len, size, timeout);
  const int64_t* l = lens.data_ptr<int64_t>();
  const int64_t max_len = std::max<int64_t>(1, *std::max_element(l, l + size));
  at::Tensor bytes = at::zeros({max_len}, at::kByte);
  if (!mine.empty()) std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  at::Tensor all = gather(backend, bytes, size, timeout);
  std::vector<std::string> out;
  const char* base = static_cast<const char*>(all.data_ptr());
  for (int r = 0; r < size; ++r) out.emplace_back(base + r * max_len, l[r]);
  return out;
}

std::atomic<size_t> max_patterns{kMaxPatternsPerStep};

// Under s.mu: step `step` (or the end of shard()) begins here, and what was
// issued since the last one becomes the reference; `keep_when_empty`: the
// reference stays when nothing was.
void new_reference(CheckerShared& s, int64_t step, bool keep_when_empty) {
  if (!keep_when_empty || !s.current.empty()) s.previous = std::move(s.current);
  s.current.clear();
  s.position = 0;
  s.step = step;
}

void mark_broken(CheckerShared& s, const std::exception_ptr& e) {
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.broken) s.broken = e;
}

// Starts the collective and counts it; throws what the launch threw. A
// step's marker (no `start`) launches nothing.
void launch(CheckerShared& s, CheckedLaunch& c) {
  if (c.marker) {
    c.settle(nullptr, nullptr);
    return;
  }
  std::function<c10::intrusive_ptr<c10d::Work>()> start;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    start = std::move(c.start);
  }
  if (!start) return;  // settled meanwhile by a failure: nothing to launch
  c10::intrusive_ptr<c10d::Work> work;
  std::exception_ptr cancelled;
  {
    // Under launch_mu (submit may hold mu here): cancel_launches() returns
    // only once no launch runs.
    std::lock_guard<std::mutex> lock(s.launch_mu);
    cancelled = s.cancelled;
    if (!cancelled) work = start();
  }
  if (cancelled) {
    c.settle(nullptr, cancelled);
    return;
  }
  if (s.board) s.board->launched(s.comm);
  c.settle(std::move(work), nullptr);
}

// Exchanges the fingerprint of `c` and launches it where every rank's is the
// same; throws CollectivesDiverged where one differs. Runs on one thread at
// a time (`busy`), in the order of the queue.
void exchange_and_launch(CheckerShared& s, CheckedLaunch& c, WaitBoard::Wait* wait) {
  // The fingerprints are real host tensors even under a live DeferredInit on this thread.
  c10::impl::ExcludeDispatchKeyGuard no_deferred(c10::DispatchKey::DeferredInit);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    ++s.entered;
    if (wait) wait->set(Kind::Exchange, s.entered);
  }
  if (s.board) s.board->entered(s.comm);
  struct Finished {  // counted however the exchange ends
    CheckerShared& s;
    ~Finished() {
      std::lock_guard<std::mutex> lock(s.mu);
      ++s.finished;
    }
  } finished{s};
  const int64_t k = static_cast<int64_t>(c.fingerprint.size());
  at::Tensor mine = at::empty({k}, at::kLong);
  std::memcpy(mine.data_ptr(), c.fingerprint.data(), k * sizeof(int64_t));
  at::Tensor all = gather(*s.check, mine, s.size, c.timeout, wait);
  const int64_t* a = all.data_ptr<int64_t>();
  std::vector<int> differ;
  for (int r = 1; r < s.size; ++r)
    if (!std::equal(a + r * k, a + (r + 1) * k, a)) differ.push_back(r);
  if (differ.empty()) {
    launch(s, c);
    return;
  }
  // Every rank saw the same fingerprints, so every rank is here: the texts.
  const auto texts = gather_texts(*s.check, c.description(), s.size, c.timeout);
  std::ostringstream os;
  os << detail::rank_prefix(s.rank) << "/" << s.size << ": collectives diverged: rank 0 is at " << texts[0]
     << " but rank " << differ[0] << " is at " << texts[differ[0]];
  if (differ.size() > 1) {
    os << "; ranks that differ from rank 0:";
    for (int r : differ) os << " " << r;
  }
  os << ". " << kSameOrder << "; neither collective ran";
  if (s.board && s.board->issued_from_several_threads())
    os << ". This rank issued checked collectives from two or more threads in this optimizer step or the last: "
          "the check follows one thread's steps and cannot order another's. If that is why, turn the check off "
          "(WorldOptions::check_collectives(false), or SHARDTORCH_CHECK_COLLECTIVES=0)";
  throw CollectivesDiverged(os.str());
}

// Runs `c`, taken off the queue with `busy` set, on this thread (`wait`:
// when it is the waiting thread). Nothing leaves: the launch's waiter hears
// of a failure, and every later launch fails alike (the ranks are out of step).
void run_taken(CheckerShared& s, CheckedLaunch& c, const std::exception_ptr& broken, WaitBoard::Wait* wait) {
  if (broken) {
    c.settle(nullptr, broken);
  } else {
    try {
      if (c.exchange)
        exchange_and_launch(s, c, wait);
      else
        launch(s, c);
    } catch (...) {
      std::exception_ptr e = std::current_exception();
      // Another rank that found a cycle of waits through this one may have
      // left before this rank saw it: its exchange then fails here. Say why.
      if (s.board)
        if (std::string crossed = s.board->cycle_reported(); !crossed.empty())
          e = std::make_exception_ptr(CollectivesDiverged(crossed));
      mark_broken(s, e);
      c.settle(nullptr, e);
    }
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.busy = false;
  }
  s.cv.notify_all();  // the checker's thread, for what was queued meanwhile
}

// Runs `c` on this thread when it is first and nothing runs; fails it at
// once when the checker is broken.
void take_if_next(CheckerShared& s, CheckedLaunch& c, WaitBoard::Wait* wait) {
  std::exception_ptr broken;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.broken) {
      // The exchange that broke it may still hold the thread: do not queue behind it.
      auto it = std::find_if(s.queue.begin(), s.queue.end(), [&](const auto& q) { return q.get() == &c; });
      if (it == s.queue.end()) return;
      s.queue.erase(it);
      broken = s.broken;
    } else {
      if (s.busy || s.queue.empty() || s.queue.front().get() != &c) return;
      s.queue.pop_front();  // the caller holds `c`
      s.busy = true;
    }
  }
  if (broken) {
    c.settle(nullptr, broken);
    return;
  }
  run_taken(s, c, nullptr, wait);
}

// Probes `wait`; for a cycle of waits through this rank, marks the checker
// broken and returns the CollectivesDiverged to throw (null otherwise).
std::exception_ptr diverged_on_probe(CheckerShared& s, WaitBoard::Wait& wait,
                                     std::optional<std::chrono::steady_clock::time_point> until = std::nullopt) {
  std::string crossed = wait.probe(until);
  if (crossed.empty()) return nullptr;
  auto e = std::make_exception_ptr(CollectivesDiverged(crossed));
  mark_broken(s, e);
  return e;
}

// What a thread whose launch is not done waits for: the next exchange to finish.
int64_t next_exchange(CheckerShared& s) {
  std::lock_guard<std::mutex> lock(s.mu);
  return s.finished + 1;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> CheckedLaunch::launched(bool probe) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (done) {
      if (error) std::rethrow_exception(error);
      return work;
    }
  }
  auto s = checker.lock();
  std::optional<WaitBoard::Wait> wait;
  if (probe && s && s->board)
    wait.emplace(s->board, s->comm, Kind::Exchange, next_exchange(*s), [this] { return description(); });
  if (probe && s) take_if_next(*s, *this, wait ? &*wait : nullptr);
  std::unique_lock<std::mutex> lock(mu);
  if (!wait) {
    cv.wait(lock, [&] { return done; });
  } else {
    // It runs on the checker's thread: probe while it lasts.
    while (!cv.wait_for(lock, s->board->probe(), [&] { return done; })) {
      lock.unlock();
      wait->set(Kind::Exchange, next_exchange(*s));
      if (auto e = diverged_on_probe(*s, *wait)) settle(nullptr, e);
      lock.lock();
    }
  }
  if (error) std::rethrow_exception(error);
  return work;
}

bool CheckedLaunch::await(const std::function<bool(std::chrono::milliseconds)>& done_within,
                          std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto s = checker.lock();
  if (!s || !s->board) return done_within(timeout);
  WaitBoard::Wait wait(s->board, s->comm, Kind::Collective, seq, [this] { return description(); });
  std::chrono::milliseconds slice = s->board->quiet();  // a shorter wait is never compared: one call
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    if (done_within(std::min(slice, left))) return true;
    slice = s->board->probe();
    bool is_launched;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (done && error) return true;  // the waiter's own path reports it
      is_launched = done;
    }
    std::exception_ptr broken;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      broken = s->broken;
    }
    // A later check failed: the ranks are out of step, and a launched
    // collective would wait for a peer that will never launch it.
    if (broken) std::rethrow_exception(broken);
    if (is_launched)
      wait.set(Kind::Collective, seq);
    else
      wait.set(Kind::Exchange, next_exchange(*s));
    if (auto e = diverged_on_probe(*s, wait, deadline)) std::rethrow_exception(e);
  }
}

std::exception_ptr CheckedLaunch::explain(std::exception_ptr e) const {
  auto s = checker.lock();
  if (!s || !s->board) return e;
  std::string crossed = s->board->cycle_reported();
  return crossed.empty() ? e : std::make_exception_ptr(CollectivesDiverged(crossed));
}

CollectiveChecker::CollectiveChecker(c10::intrusive_ptr<c10d::Backend> check, int rank, int size,
                                     std::shared_ptr<WaitBoard> board, int comm)
    : s_(std::make_shared<CheckerShared>()) {
  s_->check = std::move(check);
  s_->rank = rank;
  s_->size = size;
  s_->board = std::move(board);
  s_->comm = comm;
  thread_ = std::thread([s = s_] {
    for (;;) {
      std::shared_ptr<CheckedLaunch> c;
      std::exception_ptr broken;
      {
        std::unique_lock<std::mutex> lock(s->mu);
        s->cv.wait(lock, [&] { return !s->busy && (s->stop || !s->queue.empty()); });
        // Stopping: a step's marker no one waits for is not exchanged (a
        // peer that left would keep this thread until the timeout).
        if (s->stop) std::erase_if(s->queue, [](const auto& q) { return q->marker; });
        if (s->queue.empty()) return;  // stopping, nothing left
        c = std::move(s->queue.front());
        s->queue.pop_front();
        broken = s->broken;
        s->busy = true;
      }
      run_taken(*s, *c, broken, nullptr);
    }
  });
}

CollectiveChecker::~CollectiveChecker() {
  bool busy;
  {
    std::unique_lock<std::mutex> lock(s_->mu);
    // The last step's markers: the peers queued the same ones, so they pair
    // at once, unless a peer is gone (or out of step: then it is broken).
    s_->cv.wait_for(lock, kMarkerDrain, [&] {
      return s_->broken ||
             (!s_->busy && std::none_of(s_->queue.begin(), s_->queue.end(), [](const auto& q) { return q->marker; }));
    });
    s_->stop = true;
    busy = s_->busy;
  }
  s_->cv.notify_all();
  // A thread inside an exchange whose peers never come would keep this
  // destructor for the whole timeout: it holds what it uses, so let it go.
  if (busy)
    thread_.detach();
  else
    thread_.join();
}

void step_began(CheckerShared& s, int64_t step, bool setup) {
  auto m = std::make_shared<CheckedLaunch>();
  m->exchange = true;
  m->marker = true;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.broken || s.stop) return;
    // A step with no collective here (two optimizers stepped one after the
    // other; an idle group) keeps the last one that had some as the reference.
    if (setup || step != s.step) new_reference(s, step, /*keep_when_empty=*/true);
    s.marked = true;
    m->fingerprint.assign(kPatternSize, 0);
    m->fingerprint[0] = text_hash(setup ? "the end of shard()" : "the start of a step");
    m->fingerprint.push_back(step);
    m->fingerprint.push_back(s.issued);
    m->describe = [step, setup, issued = s.issued] {
      return (setup ? "the end of shard() in step " : "the start of step ") + std::to_string(step) + " (after " +
             std::to_string(issued) + " collectives on this communicator)";
    };
    m->timeout = s.timeout;
    m->checker = s.weak_from_this();
    s.queue.push_back(std::move(m));
  }
  s.cv.notify_all();
}

void CollectiveChecker::follow_steps(CollectiveContext& context, std::chrono::milliseconds timeout) {
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->timeout = timeout;
  }
  context.follow(s_);
}

std::shared_ptr<CheckedLaunch> CollectiveChecker::submit(std::vector<int64_t> pattern, int64_t step,
                                                         std::function<std::string()> describe,
                                                         std::function<c10::intrusive_ptr<c10d::Work>()> start,
                                                         std::chrono::milliseconds timeout) {
  auto c = std::make_shared<CheckedLaunch>();
  c->describe = std::move(describe);
  c->start = std::move(start);
  c->timeout = timeout;
  c->checker = s_;
  if (pattern.size() != kPatternSize)  // a marker's exchange must pair with any collective's
    throw std::logic_error("CollectiveChecker::submit: a pattern of " + std::to_string(pattern.size()) + " integers");
  if (s_->board) s_->board->issued(step);
  std::unique_lock<std::mutex> lock(s_->mu);
  c->seq = ++s_->issued;
  s_->timeout = timeout;
  if (step != s_->step) {  // a step with no marker: its first collective compares the step counts
    new_reference(*s_, step, /*keep_when_empty=*/false);
    s_->marked = false;
  }
  const size_t k = s_->position++;
  c->exchange = !((k > 0 || s_->marked) && k < s_->previous.size() && s_->previous[k] == pattern);
  c->fingerprint = pattern;
  c->fingerprint.push_back(step);
  c->fingerprint.push_back(c->seq);
  // Bounded: a program that never steps (no note_step_done) exchanges every
  // collective and must not grow this list without end.
  if (s_->current.size() < max_patterns.load(std::memory_order_relaxed)) s_->current.push_back(std::move(pattern));
  if (s_->broken) {
    auto broken = s_->broken;
    lock.unlock();
    c->settle(nullptr, broken);
    return c;
  }
  if (!c->exchange && s_->queue.empty() && !s_->busy) {
    // Nothing before it waits: launched here, under the lock, so that the
    // launches keep the order of the submits.
    try {
      launch(*s_, *c);
    } catch (...) {
      std::exception_ptr e = std::current_exception();
      if (!s_->broken) s_->broken = e;
      c->settle(nullptr, e);
    }
    return c;
  }
  s_->queue.push_back(c);
  s_->newest = c;
  lock.unlock();
  s_->cv.notify_one();
  return c;
}

void CollectiveChecker::cancel_launches(const std::string& why) {
  std::deque<std::shared_ptr<CheckedLaunch>> queued;
  const std::exception_ptr error = std::make_exception_ptr(Error(why));
  {
    std::lock_guard<std::mutex> lock(s_->launch_mu);
    s_->cancelled = error;
  }
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (!s_->broken) s_->broken = error;
    queued.swap(s_->queue);
  }
  for (auto& q : queued) q->settle(nullptr, error);
  s_->cv.notify_all();
}

void CollectiveChecker::flush() {
  std::shared_ptr<CheckedLaunch> newest;
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    newest = s_->newest;
  }
  if (newest) newest->launched();
}

void set_max_patterns_per_step(size_t n) { max_patterns.store(n, std::memory_order_relaxed); }

int64_t CollectiveChecker::exchanges() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->entered;
}

}  // namespace shardtorch::detail
