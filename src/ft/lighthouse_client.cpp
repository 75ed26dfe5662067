#include "ft/lighthouse_client.h"

#include <grpcpp/grpcpp.h>

#include <mutex>
#include <sstream>

#include "shardtorch/error.h"
#include "lighthouse.grpc.pb.h"

namespace shardtorch::ft::detail {

struct LighthouseClient::Impl {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<torchft::LighthouseService::Stub> stub;
  std::mutex mu;                          // guards the two below
  grpc::ClientContext* active = nullptr;  // the quorum call in flight
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

}  // namespace

LighthouseClient::LighthouseClient(const std::string& address)
    : address_(strip_scheme(address)), impl_(std::make_unique<Impl>()) {
  check(!address_.empty(),
        "shardtorch::ft: no lighthouse address: pass ManagerOptions::lighthouse "
        "or set SHARDTORCH_FT_LIGHTHOUSE (host:port of torchft_lighthouse)");
  impl_->channel = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
  impl_->stub = torchft::LighthouseService::NewStub(impl_->channel);
}

LighthouseClient::~LighthouseClient() = default;

QuorumReply LighthouseClient::quorum(const Member& me, std::chrono::milliseconds timeout) {
  torchft::LighthouseQuorumRequest req;
  auto* m = req.mutable_requester();
  m->set_replica_id(me.replica_id);
  m->set_address(me.address);
  m->set_store_address(me.store_address);
  m->set_step(me.step);
  m->set_world_size(me.world_size);
  m->set_data(me.data);
  torchft::LighthouseQuorumResponse resp;
  grpc::ClientContext ctx;
  set_deadline(ctx, timeout);
  // Waits for the channel to connect (within the deadline) instead of failing
  // at once while the lighthouse is still starting.
  ctx.set_wait_for_ready(true);
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    check(!impl_->cancelled, "shardtorch::ft: replica '", me.replica_id, "': the quorum request was cancelled");
    impl_->active = &ctx;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const grpc::Status s = impl_->stub->Quorum(&ctx, req, &resp);
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->active = nullptr;
  }
  if (!s.ok()) {
    const auto took =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    // Ran out of time, or ended early (the connection broke, the lighthouse refused the request).
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
      check(false, "shardtorch::ft: replica '", me.replica_id, "' got no quorum from the lighthouse at ", address_,
            " within ", timeout.count(), " ms (", describe(s),
            "). Check that torchft_lighthouse runs there and that --min_replicas replica groups are up; "
            "ManagerOptions::quorum_timeout sets this wait");
    check(false, "shardtorch::ft: replica '", me.replica_id, "': its quorum request to the lighthouse at ", address_,
          " failed after ", took, " ms of the ", timeout.count(), " ms it may take (", describe(s), ")",
          s.error_code() == grpc::StatusCode::UNAVAILABLE
              ? ": the connection to the lighthouse closed or could not be made; it may have died or been restarted. "
                "Check that torchft_lighthouse runs there"
              : "");
  }
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
}

void LighthouseClient::allow_quorum() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->cancelled = false;
}

void LighthouseClient::heartbeat(const std::string& replica_id, std::chrono::milliseconds timeout) {
  torchft::LighthouseHeartbeatRequest req;
  req.set_replica_id(replica_id);
  torchft::LighthouseHeartbeatResponse resp;
  grpc::ClientContext ctx;
  set_deadline(ctx, timeout);
  const grpc::Status s = impl_->stub->Heartbeat(&ctx, req, &resp);
  check(s.ok(), "shardtorch::ft: replica '", replica_id, "' could not reach the lighthouse at ", address_, " (",
        describe(s), ")");
}

}  // namespace shardtorch::ft::detail
