#include "comm/completion_watcher.h"

#include <stdexcept>

#include "comm/collective_check.h"
#include "base/errors.h"

namespace shardtorch::detail {

bool CompletionState::wait_for(std::chrono::milliseconds bound) {
  std::unique_lock<std::mutex> lock(mu);
  return cv.wait_for(lock, bound, [&] { return done; });
}

void CompletionState::wait() {
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
}

std::exception_ptr CompletionState::error() {
  std::lock_guard<std::mutex> lock(mu);
  return failure;
}

void CompletionState::settle(std::exception_ptr error) {
  std::shared_ptr<void> let_go;  // destroyed outside the lock: it may hold the last reference to a backend
  {
    std::lock_guard<std::mutex> lock(mu);
    done = true;
    failure = std::move(error);
    let_go = std::move(kept);
  }
  cv.notify_all();
}

bool CompletionState::keep(std::shared_ptr<void> what) {
  std::lock_guard<std::mutex> lock(mu);
  if (done) return false;
  kept = std::move(what);
  return true;
}

struct CompletionWatcher::Shared {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Item> queue;
  std::shared_ptr<CheckedLaunch> waiting;  // the launch the thread waits for, if any
  bool busy = false;                       // the thread is inside an item's wait
  bool stop = false;
  std::exception_ptr broken;  // set when the thread failed; later watches wait on the caller's thread
};

namespace {
constexpr const char* kAbandoned = "shardtorch: the sharded model was destroyed before this collective was launched";
}  // namespace

CompletionWatcher::CompletionWatcher() : s_(std::make_shared<Shared>()) {}

CompletionWatcher::~CompletionWatcher() {
  std::shared_ptr<CheckedLaunch> waiting;  // the queued ones are abandoned by run() as it takes them
  bool busy;
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->stop = true;
    waiting = s_->waiting;
    busy = s_->busy || !s_->queue.empty();
  }
  if (waiting) waiting->abandon(kAbandoned);
  s_->cv.notify_all();
  if (!thread_.joinable()) return;
  // Inside a wait that a stopped peer may hold for the whole timeout: the
  // thread keeps what it uses (s_, each item's work and state) and ends
  // after the last one.
  if (busy)
    thread_.detach();
  else
    thread_.join();
}

void CompletionWatcher::wait(Item& item) {
  if (!item.work) item.work = item.checked->launched(/*probe=*/false);  // a background wait
  item.checked.reset();
  item.work->wait(item.timeout);
}

std::shared_ptr<CompletionState> CompletionWatcher::watch(c10::intrusive_ptr<c10d::Work> work,
                                                          std::chrono::milliseconds timeout,
                                                          std::shared_ptr<CheckedLaunch> checked) {
  auto state = std::make_shared<CompletionState>();
  std::exception_ptr broken;
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    broken = s_->broken;
    if (!broken) {
      s_->queue.push_back(Item{work, checked, timeout, state});
      if (!thread_.joinable()) thread_ = std::thread([s = s_] { loop(*s); });
    }
  }
  if (broken) {  // the thread is gone: wait here (the buffers must outlive the collective), report its failure
    std::exception_ptr error = broken;
    try {
      Item item{work, checked, timeout, state};
      wait(item);
    } catch (...) {
      error = std::current_exception();
    }
    state->settle(error);
    return state;
  }
  s_->cv.notify_one();
  return state;
}

void CompletionWatcher::loop(Shared& s) noexcept {
  try {
    run(s);
  } catch (...) {
    // The thread's own machinery failed (not a collective): every collective
    // still queued, and every later one, reports it to its waiter.
    std::deque<Item> left;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.broken = std::current_exception();
      s.busy = true;
      left.swap(s.queue);
    }
    for (auto& item : left) {
      std::exception_ptr error = s.broken;
      try {
        wait(item);
      } catch (...) {
        error = std::current_exception();
      }
      item.state->settle(error);
    }
    std::lock_guard<std::mutex> lock(s.mu);
    s.busy = false;
  }
}

void CompletionWatcher::run(Shared& s) {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(s.mu);
      s.busy = false;
      s.cv.wait(lock, [&] { return s.stop || !s.queue.empty(); });
      if (s.queue.empty()) return;  // stopping, and nothing left to wait for
      item = std::move(s.queue.front());
      s.queue.pop_front();
      s.busy = true;
      // Abandoned by the destructor from here on, should it come meanwhile.
      s.waiting = item.work ? nullptr : item.checked;
      if (s.stop && s.waiting) s.waiting->abandon(kAbandoned);
    }
    // Whatever fails here, the collective's waiter hears of it (Comm::finish
    // names the rank and the collective); nothing escapes the thread.
    std::exception_ptr error;
    try {
      wait(item);
      failure_point("completion watcher");
      item.work.reset();
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.waiting.reset();
    }
    item.state->settle(error);
  }
}

}  // namespace shardtorch::detail
