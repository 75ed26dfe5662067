#include "completion_watcher.h"

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

CompletionWatcher::~CompletionWatcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<CompletionState> CompletionWatcher::watch(c10::intrusive_ptr<c10d::Work> work,
                                                          std::chrono::milliseconds timeout) {
  auto state = std::make_shared<CompletionState>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Item{std::move(work), timeout, state});
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  }
  cv_.notify_one();
  return state;
}

void CompletionWatcher::loop() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to wait for
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr error;
    try {
      item.work->wait(item.timeout);
    } catch (...) {
      error = std::current_exception();
    }
    item.work.reset();
    {
      std::lock_guard<std::mutex> lock(item.state->mu);
      item.state->done = true;
      item.state->failure = error;
    }
    item.state->cv.notify_all();
  }
}

}  // namespace shardtorch::detail
