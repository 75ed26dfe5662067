#include "ft/quorum_requests.h"

#include <exception>

#include "base/check.h"

namespace shardtorch::ft::detail {

namespace {
const char* name(Requested r) {
  switch (r) {
    case Requested::None:
      return "None";
    case Requested::ThisStep:
      return "ThisStep";
    case Requested::NextStep:
      return "NextStep";
  }
  return "?";
}
}  // namespace

QuorumRequests::QuorumRequests(Run run, std::function<void()> cancel, std::function<void()> allow)
    : run_(std::move(run)), cancel_(std::move(cancel)), allow_(std::move(allow)) {
  worker_ = std::thread([this] { loop(); });
}

QuorumRequests::~QuorumRequests() {
  // A request in flight (the next step's, asked for by the last
  // should_commit()) is cancelled, not waited for: it may never be answered.
  abandon();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void QuorumRequests::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || job_.has_value(); });
    if (stop_) return;
    auto [ask, done] = std::move(*job_);
    job_.reset();
    lock.unlock();
    try {
      done.set_value(run_(ask, cancelled_));
    } catch (...) {
      done.set_exception(std::current_exception());  // rethrown where the quorum is waited for
    }
    lock.lock();
  }
}

void QuorumRequests::post(int64_t step, const std::string& held) {
  asked_ = Ask{round_++, step, held};
  std::promise<Quorum> done;
  quorum_ = done.get_future().share();
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_.emplace(asked_, std::move(done));
  }
  cv_.notify_one();
}

void QuorumRequests::ask(int64_t step, const std::string& held) {
  TORCH_INTERNAL_ASSERT(requested_ != Requested::NextStep, "QuorumRequests::ask while ", name(requested_));
  post(step, held);
  requested_ = Requested::ThisStep;
}

void QuorumRequests::prefetch(int64_t step, const std::string& held) {
  TORCH_INTERNAL_ASSERT(requested_ != Requested::NextStep, "QuorumRequests::prefetch while ", name(requested_));
  post(step, held);
  requested_ = Requested::NextStep;
}

void QuorumRequests::take() {
  TORCH_INTERNAL_ASSERT(requested_ == Requested::NextStep, "QuorumRequests::take while ", name(requested_));
  requested_ = Requested::ThisStep;
}

void QuorumRequests::abandon() {
  requested_ = Requested::None;
  if (!quorum_.valid()) return;
  cancelled_ = true;
  if (cancel_) cancel_();
  quorum_.wait();
  quorum_ = {};
  cancelled_ = false;
  if (allow_) allow_();
}

bool QuorumRequests::wait(std::chrono::milliseconds bound) const {
  TORCH_INTERNAL_ASSERT(requested_ != Requested::None && quorum_.valid(), "QuorumRequests::wait while ",
                        name(requested_));
  return quorum_.wait_for(bound) == std::future_status::ready;
}

}  // namespace shardtorch::ft::detail
