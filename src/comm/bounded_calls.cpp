#include "comm/bounded_calls.h"
#include "base/check.h"
#include "base/errors.h"

#include <c10/util/Exception.h>

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

struct BoundedCalls::Shared {
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

BoundedCalls::BoundedCalls(c10::intrusive_ptr<c10d::Store> inner, std::chrono::milliseconds bound, std::string name,
                           std::optional<Host> host)
    : s_(std::make_shared<Shared>()), bound_(bound), name_(std::move(name)), host_(std::move(host)) {
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

BoundedCalls::~BoundedCalls() {
  std::unique_lock<std::mutex> lock(s_->mu);
  s_->stop = true;
  for (auto& call : s_->queue) call->abandoned = true;
  s_->cv.notify_all();
  // A call in progress keeps the thread (and what it uses, through s_): it
  // ends when the call does (a store that does not answer: with the process).
  if (!s_->running) s_->cv.wait(lock, [&] { return s_->exited; });
}

const c10::intrusive_ptr<c10d::Store>& BoundedCalls::inner() const { return s_->inner; }

std::chrono::milliseconds BoundedCalls::unanswered_for() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  if (!s_->running) return std::chrono::milliseconds(0);
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - s_->running_since);
}

std::string BoundedCalls::broken() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->broken;
}

void BoundedCalls::run(std::function<void(c10d::Store&)> fn, std::optional<Clock::time_point> give_up,
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

std::optional<std::string> BoundedCalls::get_if_set(const std::string& key, std::optional<Clock::time_point> give_up) {
  return value_of<std::optional<std::string>>(
      [key](c10d::Store& s) -> std::optional<std::string> {
        if (!s.check({key})) return std::nullopt;
        auto v = s.get(key);
        return std::string(v.begin(), v.end());
      },
      give_up);
}

void BoundedCalls::set_and_confirm(const std::string& key, const std::string& value,
                                   std::optional<Clock::time_point> give_up) {
  run(
      [key, value](c10d::Store& s) {
        s.set(key, std::vector<uint8_t>(value.begin(), value.end()));
        s.check({key});  // a round trip: a set alone is sent without an answer
      },
      give_up);
}

}  // namespace shardtorch::detail
