#pragma once
// Internal: small helpers of the fault-tolerance manager's files.
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace shardtorch::ft::detail {

/// `n` random hex digits, different in every call and process.
std::string random_hex(int n);
/// "{a, b, c}".
std::string join(const std::vector<std::string>& v);
/// FNV-1a: the same on every machine and build (names a rendezvous that
/// every member computes).
uint64_t fnv1a(const std::string& s);

/// The manager's log lines: on group rank 0 only, with ManagerOptions::log,
/// at LogLevel::Info, stamped with the time of day and the group's name.
class FtLog {
 public:
  FtLog() = default;
  FtLog(bool on, std::string group) : on_(on), group_(std::move(group)) {}
  void operator()(const std::string& line) const;

 private:
  bool on_ = false;
  std::string group_;
};

/// The first failure of a step's cross-replica work; thread-safe (the
/// reductions fail on Gloo's threads).
class StepErrors {
 public:
  /// Records `why` unless a failure is recorded already.
  void fail(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (first_.empty()) first_ = why;
  }
  std::string first() {
    std::lock_guard<std::mutex> lock(mu_);
    return first_;
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    first_.clear();
  }

 private:
  std::mutex mu_;
  std::string first_;
};

}  // namespace shardtorch::ft::detail
