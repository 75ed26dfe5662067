#pragma once
// Internal: one rank's quorum requests, one at a time, run by a worker
// thread of the manager's own for the manager's life. Requests are rounds,
// numbered alike on every rank of the group.
//
//   Requested:  None --ask--> ThisStep                 (start_step)
//               ThisStep --ask--> ThisStep             (the next start_step)
//               None | ThisStep --prefetch--> NextStep (the end of should_commit)
//               NextStep --take--> ThisStep            (start_step, the step unchanged)
//               any --abandon--> None                  (start_step, the step changed; the destructor)
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "ft/quorum.h"

namespace shardtorch::ft::detail {

enum class Requested { None, ThisStep, NextStep };

class QuorumRequests {
 public:
  using Run = std::function<Quorum(const Ask&, const std::atomic<bool>& cancelled)>;

  /// `run` answers a request on the worker thread; it ends its waits once
  /// its second argument is set (abandon()). `cancel` ends the lighthouse's
  /// call in flight and `allow` lets the next ones through
  /// (LighthouseClient's; null on the ranks that do not ask it).
  QuorumRequests(Run run, std::function<void()> cancel, std::function<void()> allow);
  /// Abandons the request in flight, then ends the worker.
  ~QuorumRequests();
  QuorumRequests(const QuorumRequests&) = delete;
  QuorumRequests& operator=(const QuorumRequests&) = delete;

  Requested requested() const { return requested_; }
  /// What the request was made with (the step, the group held).
  const Ask& asked() const { return asked_; }

  // The transitions above; each checks its source state.
  void ask(int64_t step, const std::string& held);       // None | ThisStep -> ThisStep
  void prefetch(int64_t step, const std::string& held);  // None | ThisStep -> NextStep
  void take();                                           // NextStep -> ThisStep
  /// Ends the request in flight (its lighthouse call, its wait for group
  /// rank 0's answer) and waits for the worker to finish it. Bounded: the
  /// cancelled waits end at once.
  void abandon();  // any -> None

  /// The answer to the last request, waiting at most `bound`; false when it
  /// is not there by then. Rethrows what `run` threw. Not in None.
  bool wait(std::chrono::milliseconds bound) const;
  const Quorum& get() const { return quorum_.get(); }

 private:
  void post(int64_t step, const std::string& held);
  void loop();

  Run run_;
  std::function<void()> cancel_, allow_;
  Requested requested_ = Requested::None;
  int64_t round_ = 0;
  Ask asked_;
  std::shared_future<Quorum> quorum_;
  std::atomic<bool> cancelled_{false};  // the request in flight is abandoned: end its waits
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<std::pair<Ask, std::promise<Quorum>>> job_;  // guarded by mu_
  bool stop_ = false;                                        // guarded by mu_
  std::thread worker_;
};

}  // namespace shardtorch::ft::detail
