#include "ft/group_primary.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "base/check.h"
#include "base/errors.h"
#include "base/log.h"
#include "comm/store_listener.h"

namespace shardtorch::ft::detail {

namespace {

// The port the kernel gave a socket bound to port 0.
int bound_port(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  SHARDTORCH_CHECK(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0,
                   "shardtorch::ft: getsockname: ", std::strerror(errno));
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

}  // namespace

GroupPrimary::GroupPrimary(const std::string& lighthouse, const std::string& host, std::chrono::milliseconds timeout,
                           std::string replica_id, std::chrono::milliseconds heartbeat_interval)
    : replica_id_(std::move(replica_id)), interval_(heartbeat_interval) {
  const int fd = shardtorch::detail::listen_socket(host, 0);
  const int port = bound_port(fd);
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.isServer = true;
  so.waitWorkers = false;
  so.numWorkers = std::nullopt;
  so.timeout = timeout;
  so.masterListenFd = fd;  // c10d owns it from here
  store_ = c10::make_intrusive<c10d::TCPStore>(host, so);
  store_address_ = host + ":" + std::to_string(port);
  lighthouse_ = std::make_unique<LighthouseClient>(lighthouse);
  lighthouse_->set_warn([](const std::string& w) { SHARDTORCH_WARN(w); });
  heartbeats_ = std::thread([this] { beat(); });
}

GroupPrimary::~GroupPrimary() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (heartbeats_.joinable()) heartbeats_.join();
}

void GroupPrimary::beat() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    lock.unlock();
    try {
      lighthouse_->heartbeat(replica_id_, std::chrono::seconds(1));
    } catch (const std::exception&) {
      // The quorum reports an unreachable lighthouse; a missed beat is only late.
    }
    lock.lock();
    cv_.wait_for(lock, interval_, [this] { return stopping_; });
  }
}

void GroupPrimary::drop_old_rendezvous(const std::string& current, const FtLog& log) {
  const std::string keep = "shardtorch-ft/" + current + "/";
  try {
    for (const auto& key : store_->listKeys())
      if (key.rfind("shardtorch-ft/", 0) == 0 && key.rfind(keep, 0) != 0) store_->deleteKey(key);
  } catch (const std::exception& e) {
    log("could not drop earlier cross-replica groups' keys from this group's store: " +
        shardtorch::detail::message_of(e));
  }
}

}  // namespace shardtorch::ft::detail
