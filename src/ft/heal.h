#pragma once
// Internal: a heal, which sends a replica's whole state (step, model,
// optimizer, the program's own) from a live group to one that is behind, over
// the cross-replica group. The tensors go in one order on every group:
// a header (the step, the program state's length, each piece's count of
// optimizer tensors and its step), the model's state tensors, each piece's
// optimizer tensors, the program state's bytes.
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "ft/quorum.h"
#include "ft/util.h"
#include "optim/replica_optimizer.h"
#include "shard/replica_model.h"

namespace shardtorch::ft::detail {

/// The program's own state that a heal carries (Manager::set_user_state).
struct UserState {
  std::function<std::string()> save;
  std::function<void(const std::string&)> load;
};

class StateTransfer {
 public:
  StateTransfer(shardtorch::detail::ReplicaModel& model, shardtorch::detail::ReplicaOptimizer optimizer,
                std::chrono::milliseconds timeout)
      : model_(model), optimizer_(optimizer), timeout_(timeout) {}

  void set_user_state(UserState user) { user_ = std::move(user); }

  /// Every heal of `q` this rank takes part in over `pg`: a source sends its
  /// state and `step`, a healed rank receives them into its own and `step`.
  void heal(const Quorum& q, c10d::Backend& pg, int64_t& step, const FtLog& log);

 private:
  /// Sends this rank's state at `step`; returns the bytes sent.
  int64_t send(c10d::Backend& pg, int dst, int tag, int64_t step);
  /// Receives everything first, then replaces the state: a transfer that
  /// fails half-way changes nothing. Returns the step received.
  int64_t receive(c10d::Backend& pg, int src, int tag);

  shardtorch::detail::ReplicaModel& model_;
  shardtorch::detail::ReplicaOptimizer optimizer_;
  UserState user_;
  std::chrono::milliseconds timeout_;
};

}  // namespace shardtorch::ft::detail
