#pragma once
// Internal: the cross-replica group of one rank: rank k of every group in
// the quorum, in a Gloo group of their own, rebuilt when the quorum changes.
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "ft/quorum.h"

namespace shardtorch::ft::detail {

class CrossReplicaGroup {
 public:
  /// `host`: the address Gloo binds to; `timeout`: how long a build waits
  /// for every member to connect.
  CrossReplicaGroup(std::string host, std::chrono::milliseconds timeout) : host_(std::move(host)), timeout_(timeout) {}

  /// Null when none is held.
  c10d::Backend* backend() const { return pg_.get(); }
  /// The name of the group held, unique to the rendezvous that built it; ""
  /// when none is held. Every rank of a replica group holds the same name
  /// between steps (a failure drops it on every rank at the vote), so group
  /// rank 0 reports the group's in its quorum requests.
  const std::string& name() const { return name_; }
  void drop();
  /// Builds the group that serves `q` as this group's rank `rank`, unless the
  /// one held does (q.rebuilt says which); holds none when `q` has a single
  /// participant. Throws when the build fails: the step cannot commit, and
  /// the next quorum builds it again.
  void configure(Quorum& q, int rank);

 private:
  // Whether the group held serves `q`: every participant holds it (its name
  // is unique to the rendezvous that built it) and its members are the
  // participants.
  bool serves(const Quorum& q) const;

  std::string host_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Backend> pg_;
  std::string name_;
  std::vector<std::string> members_;  // their replica ids
};

}  // namespace shardtorch::ft::detail
