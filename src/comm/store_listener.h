// The rendezvous store's listening socket when MASTER_ADDR is loopback: bound
// to that address only, not to every interface as c10d's TCPStore binds its
// own (docs/api.md, "Network exposure").
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace shardtorch::detail {

/// The address a store reached at `master_addr` may listen on alone: the
/// address itself for an IPv4 literal in 127.0.0.0/8 and for "::1",
/// 127.0.0.1 for "localhost"; nullopt for anything else (another host's
/// ranks must reach it: it listens on every interface, as c10d has it).
std::optional<std::string> loopback_listen_address(const std::string& master_addr);

/// A TCP socket bound to `address` (an IPv4 or IPv6 literal) and `port`,
/// listening, close-on-exec: its descriptor, for
/// c10d::TCPStoreOptions::masterListenFd (c10d takes it over and closes
/// it). Throws c10::Error naming the address, the port and the reason.
int listen_socket(const std::string& address, uint16_t port);

}  // namespace shardtorch::detail
