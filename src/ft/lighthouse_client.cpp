#include "ft/lighthouse_client.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <sstream>

#include "shardtorch/error.h"
#include "lighthouse.grpc.pb.h"

namespace shardtorch::ft::detail {

struct LighthouseClient::Impl {
  std::mutex mu;                                           // guards the members below
  std::condition_variable cv;                              // cancel_quorum() wakes a quorum() waiting to retry
  std::shared_ptr<torchft::LighthouseService::Stub> stub;  // replaced by fresh_channel()
  grpc::ClientContext* active = nullptr;                   // the quorum call in flight
  bool cancelled = false;
};

namespace {

// This file sees no LibTorch header (CMakeLists.txt: the torch wheel ships
// protobuf headers of another version), hence no SHARDTORCH_CHECK.
template <class... Parts>
void check(bool ok, const Parts&... parts) {
  if (ok) return;
  std::ostringstream s;
  (s << ... << parts);
  throw shardtorch::Error(s.str());
}

std::string strip_scheme(const std::string& a) {
  for (const char* scheme : {"http://", "https://"})
    if (a.rfind(scheme, 0) == 0) return a.substr(std::string(scheme).size());
  return a;
}

std::string describe(const grpc::Status& s) {
  std::string code;
  switch (s.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
      code = "unavailable";
      break;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      code = "no answer before the timeout";
      break;
    case grpc::StatusCode::CANCELLED:
      code = "cancelled";
      break;
    case grpc::StatusCode::INVALID_ARGUMENT:
      code = "invalid argument";
      break;
    default:
      code = "gRPC status " + std::to_string(static_cast<int>(s.error_code()));
  }
  return code + (s.error_message().empty() ? "" : ": " + s.error_message());
}

void set_deadline(grpc::ClientContext& ctx, std::chrono::milliseconds timeout) {
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
}

// A channel of its own: no subchannel (nor its reconnect backoff) shared
// with an earlier one.
std::shared_ptr<torchft::LighthouseService::Stub> new_stub(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return torchft::LighthouseService::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

// What became of a quorum request's sends before it failed.
struct Attempts {
  int closed = 0, refused = 0;  // connections the lighthouse closed; connections that could not be made
  int64_t first_closed_ms = 0;  // after the first send
};

// Throws the error of a quorum request that failed with `s` after `took` ms.
[[noreturn]] void quorum_failed(const grpc::Status& s, const std::string& replica_id, const std::string& address,
                                std::chrono::milliseconds timeout, int64_t took, const Attempts& a) {
  std::string history;
  if (a.closed > 0)
    history += "The lighthouse closed the connection " + std::to_string(a.closed) +
               (a.closed == 1 ? " time" : " times") + " (first after " + std::to_string(a.first_closed_ms) + " ms)";
  if (a.refused > 0)
    history += (a.closed > 0 ? "; " : "") + std::to_string(a.refused) +
               (a.refused == 1 ? " attempt to connect to it failed" : " attempts to connect to it failed");
  if (a.closed > 0) history += "; it may have died or been restarted";
  if (!history.empty()) history += ". ";
  // Ran out of time (waiting for the quorum, or sending again), or ended
  // early (cancelled, or the lighthouse refused the request).
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED || s.error_code() == grpc::StatusCode::UNAVAILABLE)
    check(false, "shardtorch::ft: replica '", replica_id, "' got no quorum from the lighthouse at ", address,
          " within ", timeout.count(), " ms (last: ", describe(s), "). ", history,
          "Check that torchft_lighthouse runs there and that --min_replicas replica groups are up; "
          "ManagerOptions::quorum_timeout sets this wait");
  std::ostringstream m;
  m << "shardtorch::ft: replica '" << replica_id << "': its quorum request to the lighthouse at " << address
    << " failed after " << took << " ms of the " << timeout.count() << " ms it may take (" << describe(s) << ")"
    << (history.empty() ? std::string() : ". " + history.substr(0, history.size() - 1));
  throw shardtorch::Error(m.str());
}

// The process that made the first client. A forked child inherits the
// value: gRPC's threads and timers are not copied by fork(), so its calls in
// the child would wait forever, deadlines included.
std::atomic<pid_t> grpc_process{0};

void check_not_forked_after_grpc() {
  const pid_t me = ::getpid();
  pid_t first = 0;
  if (grpc_process.compare_exchange_strong(first, me) || first == me) return;
  check(false, "shardtorch::ft: this process (pid ", me, ") was forked from pid ", first,
        " after that one had used gRPC (a lighthouse client, which ft::Manager makes), and gRPC does not "
        "survive a fork: every call here would hang. Make lighthouse clients and managers only in processes "
        "that did not inherit gRPC: with shardtorch::testing::run_ranks, in the ranks and never in the parent "
        "(docs/fault_tolerance.md)");
}

}  // namespace

LighthouseClient::LighthouseClient(const std::string& address)
    : address_(strip_scheme(address)), impl_(std::make_unique<Impl>()) {
  check(!address_.empty(),
        "shardtorch::ft: no lighthouse address: pass ManagerOptions::lighthouse "
        "or set SHARDTORCH_FT_LIGHTHOUSE (host:port of torchft_lighthouse)");
  check_not_forked_after_grpc();
  impl_->stub = new_stub(address_);
}

LighthouseClient::~LighthouseClient() = default;

QuorumReply LighthouseClient::quorum(const Member& me, std::chrono::milliseconds timeout) {
  check_not_forked_after_grpc();
  torchft::LighthouseQuorumRequest req;
  auto* m = req.mutable_requester();
  m->set_replica_id(me.replica_id);
  m->set_address(me.address);
  m->set_store_address(me.store_address);
  m->set_step(me.step);
  m->set_world_size(me.world_size);
  m->set_data(me.data);
  torchft::LighthouseQuorumResponse resp;
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const auto deadline = t0 + timeout;
  const auto ms_since = [](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
  };
  // A request that fails with UNAVAILABLE (the lighthouse closed the
  // connection: it died or was restarted, or the request went out on a
  // connection already dead; or no connection could be made) is sent again
  // on a fresh channel after a short pause, until `timeout` from the first
  // send has passed. Each connection attempt is made by a request, not left
  // to gRPC's reconnect timers: in a process forked after gRPC started
  // (the tests' ranks) those timers do not run.
  int closed = 0, refused = 0;
  int64_t first_closed_ms = 0;
  // Refused connections are said once a quarter of the wait (5 s at most)
  // has gone without one made: the error itself comes only at the timeout.
  const int64_t say_refused_after_ms = std::min<int64_t>(5000, timeout.count() / 4);
  bool said_refused = false;
  auto pause = std::chrono::milliseconds(20);
  grpc::Status s;
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline - Clock::now()));
    std::shared_ptr<torchft::LighthouseService::Stub> stub;
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      check(!impl_->cancelled, "shardtorch::ft: replica '", me.replica_id, "': the quorum request was cancelled");
      impl_->active = &ctx;
      stub = impl_->stub;
    }
    s = stub->Quorum(&ctx, req, &resp);
    std::unique_lock<std::mutex> lock(impl_->mu);
    impl_->active = nullptr;
    if (s.ok() || s.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    if (s.error_message().find("failed to connect") != std::string::npos) {
      ++refused;
      if (!said_refused && closed == 0 && ms_since(t0) >= say_refused_after_ms) {
        said_refused = true;
        std::ostringstream w;
        w << "shardtorch::ft: replica '" << me.replica_id << "': the lighthouse at " << address_ << " refused "
          << refused << " connection" << (refused == 1 ? "" : "s") << " in " << ms_since(t0)
          << " ms; trying again until the quorum timeout (" << timeout.count()
          << " ms) ends. Is torchft_lighthouse running there, on that port?";
        if (warn_) warn_(w.str());
      }
    } else if (closed++ == 0) {
      first_closed_ms = ms_since(t0);
    }
    if (impl_->stub == stub) impl_->stub = new_stub(address_);
    if (Clock::now() + pause >= deadline) break;
    impl_->cv.wait_for(lock, pause, [this] { return impl_->cancelled; });
    pause = std::min(2 * pause, std::chrono::milliseconds(500));
  }
  if (!s.ok()) quorum_failed(s, me.replica_id, address_, timeout, ms_since(t0), {closed, refused, first_closed_ms});
  QuorumReply out;
  out.quorum_id = resp.quorum().quorum_id();
  for (const auto& p : resp.quorum().participants())
    out.participants.push_back({p.replica_id(), p.address(), p.store_address(), p.step(), p.world_size(), p.data()});
  return out;
}

void LighthouseClient::cancel_quorum() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->cancelled = true;
  if (impl_->active) impl_->active->TryCancel();
  impl_->cv.notify_all();
}

void LighthouseClient::allow_quorum() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->cancelled = false;
}

void LighthouseClient::heartbeat(const std::string& replica_id, std::chrono::milliseconds timeout) {
  check_not_forked_after_grpc();
  torchft::LighthouseHeartbeatRequest req;
  req.set_replica_id(replica_id);
  torchft::LighthouseHeartbeatResponse resp;
  grpc::ClientContext ctx;
  set_deadline(ctx, timeout);
  std::shared_ptr<torchft::LighthouseService::Stub> stub;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    stub = impl_->stub;
  }
  const grpc::Status s = stub->Heartbeat(&ctx, req, &resp);
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->stub == stub) impl_->stub = new_stub(address_);  // the next beat connects anew
  }
  check(s.ok(), "shardtorch::ft: replica '", replica_id, "' could not reach the lighthouse at ", address_, " (",
        describe(s), ")");
}

}  // namespace shardtorch::ft::detail
