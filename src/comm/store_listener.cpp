#include "comm/store_listener.h"
#include "base/check.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>

namespace shardtorch::detail {

std::optional<std::string> loopback_listen_address(const std::string& master_addr) {
  if (master_addr == "localhost") return std::string("127.0.0.1");
  in_addr v4{};
  if (::inet_pton(AF_INET, master_addr.c_str(), &v4) == 1) {
    if ((ntohl(v4.s_addr) >> 24) == 127) return master_addr;
    return std::nullopt;
  }
  in6_addr v6{};
  if (::inet_pton(AF_INET6, master_addr.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6)) return master_addr;
  return std::nullopt;
}

int listen_socket(const std::string& address, uint16_t port) {
  sockaddr_storage storage{};
  socklen_t length = 0;
  int family = AF_INET;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&storage);
  if (::inet_pton(AF_INET, address.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(port);
    length = sizeof(sockaddr_in);
  } else if (::inet_pton(AF_INET6, address.c_str(), &v6->sin6_addr) == 1) {
    family = AF_INET6;
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(port);
    length = sizeof(sockaddr_in6);
  } else {
    SHARDTORCH_CHECK(false, "shardtorch: '", address, "' is not an IP address to listen on");
  }
  const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  SHARDTORCH_CHECK(fd >= 0, "shardtorch: cannot create a socket to listen on ", address, ":", port, ": ",
                   std::strerror(errno));
  auto fail = [&](const char* what) {
    const int err = errno;
    ::close(fd);
    SHARDTORCH_CHECK(false, "shardtorch: cannot ", what, " ", address, ":", port, ": ", std::strerror(err));
  };
  // As c10d's own listening socket: a port a previous run left in TIME_WAIT
  // can be bound again at once. A socket listening on the port (any
  // address) still makes bind fail.
  const int on = 1;
  if (::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)) != 0) fail("set SO_REUSEADDR to listen on");
  if (family == AF_INET6 && ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &on, sizeof(on)) != 0)
    fail("set IPV6_V6ONLY to listen on");
  if (::bind(fd, reinterpret_cast<sockaddr*>(&storage), length) != 0) fail("bind to");
  if (::listen(fd, SOMAXCONN) != 0) fail("listen on");
  return fd;
}

}  // namespace shardtorch::detail
