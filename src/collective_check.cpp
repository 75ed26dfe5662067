#include "collective_check.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "shardtorch/collectives.h"

namespace shardtorch::detail {

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

void CollectiveContext::step_done() {
  std::lock_guard<std::mutex> lock(mu_);
  ++step_;
  backwards_ = 0;
  inputs_seen_ = false;
  inputs_hash_ = 0;
  inputs_.clear();
}

void CollectiveContext::root_inputs(const std::vector<at::Tensor>& inputs) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (inputs_seen_) return;
  }
  std::ostringstream os;
  for (size_t i = 0; i < inputs.size(); ++i) os << (i ? ", " : "") << describe(inputs[i]);
  std::string text = inputs.empty() ? std::string("no tensor") : os.str();
  std::lock_guard<std::mutex> lock(mu_);
  inputs_seen_ = true;
  inputs_hash_ = text_hash(text);
  inputs_ = std::move(text);
}

CollectiveContext::Snapshot CollectiveContext::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  Snapshot s;
  s.step = step_;
  s.backwards = backwards_;
  s.phase = in_backward_ ? (sync_ ? 2 : 1) : 0;
  s.inputs_hash = inputs_hash_;
  std::ostringstream os;
  os << "step " << step_ << ", ";
  if (in_backward_)
    os << "in backward " << backwards_ + 1 << " since the last optimizer step (gradient sync "
       << (sync_ ? "on" : "off") << ")";
  else
    os << "after " << backwards_ << " backward" << (backwards_ == 1 ? "" : "s") << " since the last optimizer step";
  if (inputs_seen_) os << "; the step's first forward took " << inputs_;
  s.words = os.str();
  return s;
}

void CheckedLaunch::settle(c10::intrusive_ptr<c10d::Work> w, std::exception_ptr e) {
  {
    std::lock_guard<std::mutex> lock(mu);
    work = std::move(w);
    error = std::move(e);
    done = true;
    start = nullptr;  // drops the tensors it held
  }
  cv.notify_all();
}

struct CheckerShared {
  c10::intrusive_ptr<c10d::Backend> backend;
  int rank = 0, size = 1;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<CheckedLaunch>> queue;
  bool stop = false;
  bool busy = false;  // an exchange runs, on the checker's thread or on a waiting one
  std::exception_ptr broken;  // after a failed check: the ranks are out of step, every later launch fails alike
};

namespace {

at::Tensor gather(c10d::Backend& backend, const at::Tensor& mine, int size,
                  std::chrono::milliseconds timeout) {
  at::Tensor all = at::empty({mine.numel() * size}, mine.options());
  at::Tensor in = mine;
  c10d::AllgatherOptions o;
  o.timeout = timeout;
  backend._allgather_base(all, in, o)->wait(timeout);
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

void check(CheckerShared& s, CheckedLaunch& c);

// Runs the check of `c`, taken off the queue with `busy` set, on this thread.
// Nothing leaves: the launch's waiter hears of a failure, and every later
// launch fails alike (the ranks are out of step).
void run_taken(CheckerShared& s, CheckedLaunch& c, const std::exception_ptr& broken) {
  if (broken) {
    c.settle(nullptr, broken);
  } else {
    try {
      check(s, c);
    } catch (...) {
      std::exception_ptr e = std::current_exception();
      {
        std::lock_guard<std::mutex> lock(s.mu);
        s.broken = e;
      }
      c.settle(nullptr, e);
    }
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.busy = false;
  }
  s.cv.notify_all();  // the checker's thread, for what was queued meanwhile
}

// Runs the check of `c` on this thread when it is next and no exchange runs.
void take_if_next(CheckerShared& s, CheckedLaunch& c) {
  std::exception_ptr broken;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.busy || s.queue.empty() || s.queue.front().get() != &c) return;
    s.queue.pop_front();  // the caller holds `c`
    broken = s.broken;
    s.busy = true;
  }
  run_taken(s, c, broken);
}

}  // namespace

c10::intrusive_ptr<c10d::Work> CheckedLaunch::launched() {
  if (auto s = checker.lock()) take_if_next(*s, *this);
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  if (error) std::rethrow_exception(error);
  return work;
}

CollectiveChecker::CollectiveChecker(c10::intrusive_ptr<c10d::Backend> backend, int rank, int size)
    : s_(std::make_shared<CheckerShared>()) {
  s_->backend = std::move(backend);
  s_->rank = rank;
  s_->size = size;
  thread_ = std::thread([s = s_] {
    for (;;) {
      std::shared_ptr<CheckedLaunch> c;
      std::exception_ptr broken;
      {
        std::unique_lock<std::mutex> lock(s->mu);
        s->cv.wait(lock, [&] { return !s->busy && (s->stop || !s->queue.empty()); });
        if (s->queue.empty()) return;  // stopping, nothing left
        c = std::move(s->queue.front());
        s->queue.pop_front();
        broken = s->broken;
        s->busy = true;
      }
      run_taken(*s, *c, broken);
    }
  });
}

CollectiveChecker::~CollectiveChecker() {
  bool busy;
  {
    std::lock_guard<std::mutex> lock(s_->mu);
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

std::shared_ptr<CheckedLaunch> CollectiveChecker::submit(std::vector<int64_t> fingerprint, std::string description,
                                                         std::function<c10::intrusive_ptr<c10d::Work>()> start,
                                                         std::chrono::milliseconds timeout) {
  auto c = std::make_shared<CheckedLaunch>();
  c->fingerprint = std::move(fingerprint);
  c->description = std::move(description);
  c->start = std::move(start);
  c->timeout = timeout;
  c->checker = s_;
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->queue.push_back(c);
  }
  s_->cv.notify_one();
  return c;
}

namespace {

void check(CheckerShared& s, CheckedLaunch& c) {
  const int64_t k = static_cast<int64_t>(c.fingerprint.size());
  at::Tensor mine = at::empty({k}, at::kLong);
  std::memcpy(mine.data_ptr(), c.fingerprint.data(), k * sizeof(int64_t));
  at::Tensor all = gather(*s.backend, mine, s.size, c.timeout);
  const int64_t* a = all.data_ptr<int64_t>();
  std::vector<int> differ;
  for (int r = 1; r < s.size; ++r)
    if (!std::equal(a + r * k, a + (r + 1) * k, a)) differ.push_back(r);
  if (differ.empty()) {
    auto work = c.start();
    c.settle(std::move(work), nullptr);
    return;
  }
  // Every rank saw the same fingerprints, so every rank is here: the texts.
  const auto texts = gather_texts(*s.backend, c.description, s.size, c.timeout);
  std::ostringstream os;
  os << "shardtorch: rank " << s.rank << "/" << s.size << ": collectives diverged: rank 0 is at " << texts[0]
     << " but rank " << differ[0] << " is at " << texts[differ[0]];
  if (differ.size() > 1) {
    os << "; ranks that differ from rank 0:";
    for (int r : differ) os << " " << r;
  }
  os << ". Every rank must issue the same collectives in the same order (the same number of micro-batches and of "
        "optimizer steps, the same units in forward, inputs of the same shapes); neither collective was run";
  throw CollectivesDiverged(os.str());
}

}  // namespace

}  // namespace shardtorch::detail
