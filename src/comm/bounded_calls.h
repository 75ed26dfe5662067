#pragma once
// Internal: BoundedStore's line of calls (comm/bounded_store.h). Calls run
// one at a time, in order, on a thread of its own. A call other than a wait
// may take `bound` once it reaches the store; a wait, its own timeout plus
// `bound`. A caller whose call is late, or queued behind a late one, gets a
// shardtorch::Error saying so; the late call goes on in the background (the
// connection stays in order) and the store answers again when it completes.
// After a closed connection (c10::DistNetworkError: the host died) every
// later call fails at once with that error, without touching the store
// again.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace shardtorch::detail {

class BoundedCalls {
 public:
  using Clock = std::chrono::steady_clock;

  /// The rank whose process serves the store, where one does (rank 0 under
  /// mpirun, srun or a hand launch; none under torchrun, whose agent does).
  struct Host {
    int rank = 0;
    int64_t pid = 0;   // 0: unknown
    std::string name;  // its host name
  };

  /// `inner`: where the calls go. `name`: the store in words, for errors
  /// ("the store at 127.0.0.1:29500").
  BoundedCalls(c10::intrusive_ptr<c10d::Store> inner, std::chrono::milliseconds bound, std::string name,
               std::optional<Host> host);
  /// Stops the thread; one stuck in a call is left to finish on its own.
  ~BoundedCalls();
  BoundedCalls(const BoundedCalls&) = delete;
  BoundedCalls& operator=(const BoundedCalls&) = delete;

  /// How long the call in progress has waited for the store (zero when idle).
  std::chrono::milliseconds unanswered_for() const;
  /// Open, and no call has waited for an answer `within` or longer.
  bool answering(std::chrono::milliseconds within) const { return broken().empty() && unanswered_for() < within; }
  /// The error that closed the connection, "" while it is open.
  std::string broken() const;
  const std::string& name() const { return name_; }
  const std::optional<Host>& host() const { return host_; }
  std::chrono::milliseconds bound() const { return bound_; }

  /// Runs `fn` (calls on the inner store) as a call of this store, within
  /// `bound` plus `wait` once it starts; the caller gives up at `give_up`,
  /// if given, whatever the bound. `fn` may outlive the caller (a call
  /// given up on runs to its end): it owns what it uses.
  void run(std::function<void(c10d::Store&)> fn, std::optional<Clock::time_point> give_up = std::nullopt,
           std::chrono::milliseconds wait = std::chrono::milliseconds(0));
  /// The same, for a call that returns a value.
  template <class T, class Fn>
  T value_of(Fn fn, std::optional<Clock::time_point> give_up = std::nullopt,
             std::chrono::milliseconds wait = std::chrono::milliseconds(0)) {
    auto out = std::make_shared<T>();
    run([fn = std::move(fn), out](c10d::Store& s) { *out = fn(s); }, give_up, wait);
    return std::move(*out);
  }

  /// The value of `key`, or nullopt when it is not set (check, then get).
  std::optional<std::string> get_if_set(const std::string& key, std::optional<Clock::time_point> give_up);
  /// set, then a round trip (check): returns when the store has answered.
  void set_and_confirm(const std::string& key, const std::string& value, std::optional<Clock::time_point> give_up);

 protected:
  /// The store the calls go to (read only what needs no call: its timeout).
  const c10::intrusive_ptr<c10d::Store>& inner() const;

 private:
  struct Shared;
  std::shared_ptr<Shared> s_;
  std::chrono::milliseconds bound_;
  std::string name_;
  std::optional<Host> host_;
};

}  // namespace shardtorch::detail
