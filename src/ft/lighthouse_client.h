#pragma once
// A client of torchft's lighthouse (proto/lighthouse.proto): the only file
// pair that sees gRPC and protobuf, so that the rest of the library does not
// depend on their headers.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace shardtorch::ft::detail {

struct Member {
  std::string replica_id;
  std::string address;
  std::string store_address;
  int64_t step = 0;
  uint64_t world_size = 0;
  std::string data;
};

struct QuorumReply {
  int64_t quorum_id = 0;
  std::vector<Member> participants;  // as the lighthouse sorted them (by replica_id)
};

class LighthouseClient {
 public:
  /// `address`: host:port, or http://host:port as torchft writes it.
  explicit LighthouseClient(const std::string& address);
  ~LighthouseClient();
  const std::string& address() const { return address_; }
  /// Joins the next quorum and waits for it, at most `timeout`. Throws
  /// shardtorch::Error naming the lighthouse on a failure or a timeout, and
  /// after cancel_quorum().
  QuorumReply quorum(const Member& me, std::chrono::milliseconds timeout);
  /// Ends the quorum() call in flight on another thread, if any, and makes
  /// every later one throw at once until allow_quorum(). Thread-safe.
  void cancel_quorum();
  void allow_quorum();
  /// Tells the lighthouse this replica is alive; throws like quorum().
  void heartbeat(const std::string& replica_id, std::chrono::milliseconds timeout);
  /// Where quorum() says, before its timeout, that the lighthouse refuses
  /// connections (a quarter of the wait, 5 s at most, without one made);
  /// none: not said. Set before quorum() is called.
  void set_warn(std::function<void(const std::string&)> warn) { warn_ = std::move(warn); }

 private:
  struct Impl;
  std::string address_;
  std::function<void(const std::string&)> warn_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardtorch::ft::detail
