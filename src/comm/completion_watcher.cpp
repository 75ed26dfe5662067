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
  {
    std::lock_guard<std::mutex> lock(mu);
    done = true;
    failure = std::move(error);
  }
  cv.notify_all();
}

namespace {
constexpr const char* kAbandoned = "shardtorch: the sharded model was destroyed before this collective was launched";
}  // namespace

CompletionWatcher::~CompletionWatcher() {
  std::shared_ptr<CheckedLaunch> waiting;  // the queued ones are abandoned by run() as it takes them
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    waiting = waiting_;
  }
  if (waiting) waiting->abandon(kAbandoned);
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
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
    std::lock_guard<std::mutex> lock(mu_);
    broken = broken_;
    if (!broken) {
      queue_.push_back(Item{work, checked, timeout, state});
      if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
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
  cv_.notify_one();
  return state;
}

void CompletionWatcher::loop() noexcept {
  try {
    run();
  } catch (...) {
    // The thread's own machinery failed (not a collective): every collective
    // still queued, and every later one, reports it to its waiter.
    std::deque<Item> left;
    {
      std::lock_guard<std::mutex> lock(mu_);
      broken_ = std::current_exception();
      left.swap(queue_);
    }
    for (auto& item : left) {
      std::exception_ptr error = broken_;
      try {
        wait(item);
      } catch (...) {
        error = std::current_exception();
      }
      item.state->settle(error);
    }
  }
}

void CompletionWatcher::run() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to wait for
      item = std::move(queue_.front());
      queue_.pop_front();
      // Abandoned by the destructor from here on, should it come meanwhile.
      waiting_ = item.work ? nullptr : item.checked;
      if (stop_ && waiting_) waiting_->abandon(kAbandoned);
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
      std::lock_guard<std::mutex> lock(mu_);
      waiting_.reset();
    }
    item.state->settle(error);
  }
}

}  // namespace shardtorch::detail
