// Network exposure: with a loopback MASTER_ADDR nothing the ranks open
// listens beyond loopback, the rendezvous store included (c10d's own socket
// listens on every interface).
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "../src/comm/store_listener.h"
#include "models.h"

using namespace testmodels;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

struct Listener {
  std::string address;  // as inet_ntop writes it
  int port = 0;
  bool loopback = false;
  uint64_t inode = 0;
};

// Every TCP socket in state LISTEN on this host (this network namespace),
// from /proc/net/tcp and /proc/net/tcp6.
std::vector<Listener> listening_sockets() {
  std::vector<Listener> out;
  for (const bool v6 : {false, true}) {
    std::ifstream in(v6 ? "/proc/net/tcp6" : "/proc/net/tcp");
    std::string line;
    std::getline(in, line);  // the column names
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string sl, local, remote, state, skip;
      fields >> sl >> local >> remote >> state;
      if (state != "0A") continue;                 // TCP_LISTEN
      for (int i = 0; i < 5; ++i) fields >> skip;  // tx:rx queues, timer, retransmits, uid, timeout
      Listener l;
      fields >> l.inode;
      const size_t colon = local.find(':');
      const std::string hex = local.substr(0, colon);
      l.port = static_cast<int>(std::stoul(local.substr(colon + 1), nullptr, 16));
      char text[INET6_ADDRSTRLEN] = {};
      if (!v6) {
        in_addr a{};
        a.s_addr = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));  // the kernel prints the word as held
        ::inet_ntop(AF_INET, &a, text, sizeof(text));
        l.loopback = (ntohl(a.s_addr) >> 24) == 127;
      } else {
        in6_addr a{};
        for (int w = 0; w < 4; ++w) {
          const uint32_t word = static_cast<uint32_t>(std::stoul(hex.substr(8 * w, 8), nullptr, 16));
          std::memcpy(a.s6_addr + 4 * w, &word, 4);
        }
        ::inet_ntop(AF_INET6, &a, text, sizeof(text));
        l.loopback = IN6_IS_ADDR_LOOPBACK(&a) || (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127);
      }
      l.address = text;
      out.push_back(l);
    }
  }
  return out;
}

// The inodes of this process's sockets.
std::set<uint64_t> own_socket_inodes() {
  std::set<uint64_t> out;
  for (const auto& fd : files::list_directory("/proc/self/fd")) {
    char target[256] = {};
    const ssize_t n = ::readlink(("/proc/self/fd/" + fd).c_str(), target, sizeof(target) - 1);
    const std::string t(target, n > 0 ? static_cast<size_t>(n) : 0);
    if (t.rfind("socket:[", 0) == 0) out.insert(std::stoull(t.substr(8)));
  }
  return out;
}

std::string describe(const std::vector<Listener>& ls) {
  std::string s;
  for (const auto& l : ls) s += (s.empty() ? "" : ", ") + l.address + ":" + std::to_string(l.port);
  return s.empty() ? "none" : s;
}

// A port no socket uses now (bound on every interface, then closed).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    throw std::runtime_error("no free port");
  ::close(fd);
  return ntohs(a.sin_port);
}

bool ipv6_loopback_available() {
  const int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

std::vector<std::string> loopback_addresses() {
  std::vector<std::string> out = {"127.0.0.1", "localhost"};
  if (ipv6_loopback_available()) out.push_back("::1");
  return out;
}

}  // namespace

TEST(Network, OnlyLoopbackAddressesAreListenedOnAlone) {
  using shardtorch::detail::loopback_listen_address;
  EXPECT_EQ(loopback_listen_address("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(loopback_listen_address("127.3.2.1"), "127.3.2.1");
  EXPECT_EQ(loopback_listen_address("localhost"), "127.0.0.1");
  EXPECT_EQ(loopback_listen_address("::1"), "::1");
  for (const char* other : {"10.0.0.1", "0.0.0.0", "::", "128.0.0.1", "127.example.com", "node-7", "::ffff:10.0.0.1"})
    EXPECT_FALSE(loopback_listen_address(other).has_value()) << other;
}

// World::from_env at 2 ranks with MASTER_ADDR loopback (as torchrun
// --standalone, mpirun on one host): every socket either rank listens on,
// and every socket on the store's port, is bound to loopback. c10d's
// TCPStore listened on :: (every interface) before.
TEST(Network, WithALoopbackMasterAddrNothingListensBeyondLoopback) {
  for (const std::string& addr : loopback_addresses()) {
    // Another process (a parallel test's torchrun) may take the free port
    // before rank 0 binds it: then the run is repeated on another one.
    for (int attempt = 1;; ++attempt) {
      const int port = free_port();
      auto r = run_ranks(2, [&](World& w) {
        ::setenv("RANK", std::to_string(w.rank()).c_str(), 1);
        ::setenv("WORLD_SIZE", "2", 1);
        ::setenv("MASTER_ADDR", addr.c_str(), 1);
        ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
        auto world = World::from_env(shardtorch::WorldOptions().timeout(std::chrono::seconds(20)));
        world->barrier();  // both ranks are connected: every socket is open
        const auto all = listening_sockets();
        const auto mine = own_socket_inodes();
        std::vector<Listener> on_port, exposed, own;
        for (const auto& l : all) {
          if (l.port == port) on_port.push_back(l);
          if (mine.count(l.inode)) own.push_back(l);
          if ((l.port == port || mine.count(l.inode)) && !l.loopback) exposed.push_back(l);
        }
        require(exposed.empty(), "MASTER_ADDR=" + addr + ": rank " + std::to_string(w.rank()) +
                                     " finds sockets listening beyond loopback: " + describe(exposed));
        if (w.rank() == 0) {
          require(!on_port.empty(), "no socket listens on the store's port " + std::to_string(port));
          require(!own.empty(), "rank 0 (the store's host) owns no listening socket");
        }
        world->barrier();  // rank 1 stays connected while rank 0 looks
      });
      if (!r.ok && attempt < 3 && r.ranks[0].message.find("Address already in use") != std::string::npos) continue;
      ASSERT_TRUE(r.ok) << "MASTER_ADDR=" << addr << "\n" << r.summary();
      break;
    }
  }
}

// The listening socket handed over through TCPStoreOptions::masterListenFd
// serves under both of c10d's store servers (libuv, the default, and the
// older one), over IPv4 and IPv6 loopback.
TEST(Network, BothTcpStoreServersServeOnTheSocketHandedToThem) {
  for (const bool libuv : {true, false}) {
    for (const std::string& addr : loopback_addresses()) {
      if (addr == "localhost") continue;  // the same socket as 127.0.0.1
      auto r = run_ranks(1, [&](World&) {
        const auto port = static_cast<uint16_t>(free_port());
        c10d::TCPStoreOptions so;
        so.port = port;
        so.isServer = true;
        so.waitWorkers = false;
        so.useLibUV = libuv;
        so.timeout = std::chrono::seconds(10);
        so.masterListenFd = shardtorch::detail::listen_socket(addr, port);
        auto server = c10::make_intrusive<c10d::TCPStore>(addr, so);
        c10d::TCPStoreOptions co = so;
        co.isServer = false;
        co.masterListenFd = std::nullopt;
        auto client = c10::make_intrusive<c10d::TCPStore>(addr, co);
        client->set("key", std::vector<uint8_t>{4, 2});
        require(server->get("key") == std::vector<uint8_t>{4, 2}, "the value did not go through the store");
        require(server->getPort() == port, "the store reports port " + std::to_string(server->getPort()));
        std::vector<Listener> on_port;
        for (const auto& l : listening_sockets())
          if (l.port == port) on_port.push_back(l);
        require(on_port.size() == 1 && on_port[0].loopback,
                std::string(libuv ? "libuv" : "legacy") + " server: listening on " + describe(on_port));
      });
      ASSERT_TRUE(r.ok) << (libuv ? "libuv " : "legacy ") << addr << "\n" << r.summary();
    }
  }
}
