#include "comm/bounded_store.h"
#include "base/check.h"
#include "base/errors.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <condition_variable>
#include <deque>
#include <exception>
#include <iomanip>
#include <mutex>
#include <sstream>
#include <thread>

namespace shardtorch::detail {

namespace {
std::string seconds(std::chrono::milliseconds t) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << t.count() / 1000.0 << " s";
  return os.str();
}
}  // namespace

struct BoundedStore::Shared {
  struct Call {
    std::function<void(c10d::Store&)> fn;
    std::chrono::milliseconds bound{0};
    bool abandoned = false, done = false;
    std::exception_ptr error;
  };
  c10::intrusive_ptr<c10d::Store> inner;
  std::mutex mu;
  std::condition_variable cv;  // the thread waits for calls, callers for their outcome
  std::deque<std::shared_ptr<Call>> queue;
  std::shared_ptr<Call> running;
  Clock::time_point running_since, running_deadline;
  std::string broken;
  bool stop = false, exited = false;

  bool overdue(Clock::time_point now) const { return running && now > running_deadline; }
};

BoundedStore::BoundedStore(c10::intrusive_ptr<c10d::Store> inner, std::chrono::milliseconds bound, std::string name,
                           std::optional<Host> host)
    : c10d::Store(inner->getTimeout()),
      s_(std::make_shared<Shared>()),
      bound_(bound),
      name_(std::move(name)),
      host_(std::move(host)) {
  s_->inner = std::move(inner);
  std::thread([s = s_] {
    std::unique_lock<std::mutex> lock(s->mu);
    for (;;) {
      s->cv.wait(lock, [&] { return s->stop || !s->queue.empty(); });
      if (s->queue.empty()) break;  // stopping, nothing left
      auto call = std::move(s->queue.front());
      s->queue.pop_front();
      if (call->abandoned) continue;  // its caller gave up before it started
      s->running = call;
      s->running_since = Clock::now();
      s->running_deadline = s->running_since + call->bound;
      s->cv.notify_all();
      lock.unlock();
      std::exception_ptr error;
      std::string closed;
      try {
        call->fn(*s->inner);
      } catch (const c10::DistNetworkError& e) {  // the connection is gone: nothing more is sent
        error = std::current_exception();
        closed = e.what_without_backtrace();
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (!closed.empty() && s->broken.empty()) s->broken = closed;
      call->error = error;
      call->done = true;
      s->running.reset();
      s->cv.notify_all();
    }
    s->exited = true;
    s->cv.notify_all();
  }).detach();  // joined in effect by the destructor's wait for `exited`, unless a call holds it
}

BoundedStore::~BoundedStore() {
  std::unique_lock<std::mutex> lock(s_->mu);
  s_->stop = true;
  for (auto& call : s_->queue) call->abandoned = true;
  s_->cv.notify_all();
  // A call in progress keeps the thread (and what it uses, through s_): it
  // ends when the call does (a store that does not answer: with the process).
  if (!s_->running) s_->cv.wait(lock, [&] { return s_->exited; });
}

c10::intrusive_ptr<BoundedStore> BoundedStore::fresh_connection() const {
  // A TCPStore client serves one call at a time: a clone is a connection of
  // its own. Other stores (a FileStore, a HashStore) are shared: a FileStore
  // counts its instances to delete its file, and a clone would have it
  // deleted while other ranks still use it.
  c10::intrusive_ptr<c10d::Store> copy = s_->inner;
  c10::intrusive_ptr<c10d::Store> base = s_->inner;
  while (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(base.get())) base = prefixed->getUnderlyingStore();
  if (dynamic_cast<c10d::TCPStore*>(base.get()) != nullptr) {
    try {
      copy = s_->inner->clone();
    } catch (const std::exception&) {  // no second connection: shared
    }
  }
  return c10::make_intrusive<BoundedStore>(copy, bound_, name_, host_);
}

std::chrono::milliseconds BoundedStore::unanswered_for() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  if (!s_->running) return std::chrono::milliseconds(0);
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - s_->running_since);
}

std::string BoundedStore::broken() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->broken;
}

void BoundedStore::run(std::function<void(c10d::Store&)> fn, std::optional<Clock::time_point> give_up,
                       std::chrono::milliseconds wait) {
  auto call = std::make_shared<Shared::Call>();
  call->fn = std::move(fn);
  call->bound = bound_ + wait;
  const auto asked = Clock::now();
  std::unique_lock<std::mutex> lock(s_->mu);
  auto unanswered = [&](Clock::time_point now) {
    call->abandoned = true;
    auto waited = now - asked;
    if (s_->running) waited = std::max(waited, now - s_->running_since);
    throw_error("", "shardtorch: " + name_ + " has not answered for " +
                        seconds(std::chrono::duration_cast<std::chrono::milliseconds>(waited)) +
                        " (its host process is stopped or hung, or gone without closing its connections)");
  };
  if (!s_->broken.empty())
    throw_error("", "shardtorch: " + name_ + " closed its connection (its host is gone): " + s_->broken);
  if (s_->overdue(asked)) unanswered(asked);
  s_->queue.push_back(call);
  s_->cv.notify_all();
  while (!call->done) {
    const auto now = Clock::now();
    if (s_->overdue(now) || (give_up && now >= *give_up)) unanswered(now);
    auto until = s_->running ? s_->running_deadline : Clock::time_point::max();
    if (give_up) until = std::min(until, *give_up);
    if (until == Clock::time_point::max())
      s_->cv.wait(lock);
    else
      s_->cv.wait_until(lock, until + std::chrono::milliseconds(1));
  }
  if (call->error) std::rethrow_exception(call->error);
}

std::optional<std::string> BoundedStore::get_if_set(const std::string& key, std::optional<Clock::time_point> give_up) {
  return value_of<std::optional<std::string>>(
      [key](c10d::Store& s) -> std::optional<std::string> {
        if (!s.check({key})) return std::nullopt;
        auto v = s.get(key);
        return std::string(v.begin(), v.end());
      },
      give_up);
}

void BoundedStore::set_and_confirm(const std::string& key, const std::string& value,
                                   std::optional<Clock::time_point> give_up) {
  run(
      [key, value](c10d::Store& s) {
        s.set(key, std::vector<uint8_t>(value.begin(), value.end()));
        s.check({key});  // a round trip: a set alone is sent without an answer
      },
      give_up);
}

c10::intrusive_ptr<c10d::Store> BoundedStore::clone() { return fresh_connection(); }

void BoundedStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  run([key, value](c10d::Store& s) { s.set(key, value); });
}

std::vector<uint8_t> BoundedStore::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                              const std::vector<uint8_t>& desired) {
  return value_of<std::vector<uint8_t>>(
      [key, expected, desired](c10d::Store& s) { return s.compareSet(key, expected, desired); });
}

std::vector<uint8_t> BoundedStore::get(const std::string& key) {  // waits for the key first
  return value_of<std::vector<uint8_t>>([key](c10d::Store& s) { return s.get(key); }, std::nullopt,
                                        s_->inner->getTimeout());
}

int64_t BoundedStore::add(const std::string& key, int64_t value) {
  return value_of<int64_t>([key, value](c10d::Store& s) { return s.add(key, value); });
}

bool BoundedStore::deleteKey(const std::string& key) {
  return value_of<bool>([key](c10d::Store& s) { return s.deleteKey(key); });
}

bool BoundedStore::check(const std::vector<std::string>& keys) {
  return value_of<bool>([keys](c10d::Store& s) { return s.check(keys); });
}

int64_t BoundedStore::getNumKeys() {
  return value_of<int64_t>([](c10d::Store& s) { return s.getNumKeys(); });
}

void BoundedStore::wait(const std::vector<std::string>& keys) { wait(keys, s_->inner->getTimeout()); }

void BoundedStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  run([keys, timeout](c10d::Store& s) { s.wait(keys, timeout); }, std::nullopt, timeout);
}

const std::chrono::milliseconds& BoundedStore::getTimeout() const noexcept { return s_->inner->getTimeout(); }

void BoundedStore::setTimeout(const std::chrono::milliseconds& timeout) {
  run([timeout](c10d::Store& s) { s.setTimeout(timeout); });
}

void BoundedStore::append(const std::string& key, const std::vector<uint8_t>& value) {
  run([key, value](c10d::Store& s) { s.append(key, value); });
}

std::vector<std::vector<uint8_t>> BoundedStore::multiGet(const std::vector<std::string>& keys) {
  return value_of<std::vector<std::vector<uint8_t>>>([keys](c10d::Store& s) { return s.multiGet(keys); }, std::nullopt,
                                                     s_->inner->getTimeout());
}

void BoundedStore::multiSet(const std::vector<std::string>& keys, const std::vector<std::vector<uint8_t>>& values) {
  run([keys, values](c10d::Store& s) { s.multiSet(keys, values); });
}

bool BoundedStore::hasExtendedApi() const { return s_->inner->hasExtendedApi(); }

std::vector<std::string> BoundedStore::listKeys() {
  return value_of<std::vector<std::string>>([](c10d::Store& s) { return s.listKeys(); });
}

}  // namespace shardtorch::detail
