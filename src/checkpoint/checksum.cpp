#include "checkpoint/checksum.h"

#include <cstdio>
#include <stdexcept>

// Inlined: no run-time dependency on libxxhash (only its headers at build time).
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace shardtorch::checkpoint::checksum {

std::string_view algorithm_of(std::string_view text) {
  for (std::string_view alg : {kXxh3, kFnv1a}) {
    if (text.size() <= alg.size() + 1 || text.size() > alg.size() + 17 || text.substr(0, alg.size()) != alg ||
        text[alg.size()] != ':')
      continue;
    if (text.find_first_not_of("0123456789abcdef", alg.size() + 1) != std::string_view::npos) return {};
    return alg;
  }
  return {};
}

// The FNV basis earlier versions used (one digit short of the published
// 14695981039346656037): their checkpoints' checksums were computed with it.
Hasher::Hasher(std::string_view algorithm) : xxh3_(algorithm == kXxh3), fnv_(1469598103934665603ull) {
  if (!xxh3_ && algorithm != kFnv1a)
    throw std::invalid_argument("unknown checksum algorithm '" + std::string(algorithm) + "'");
  if (xxh3_) {
    state_ = XXH3_createState();
    if (state_ == nullptr) throw std::bad_alloc();
    XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
  }
}

Hasher::~Hasher() {
  if (state_) XXH3_freeState(static_cast<XXH3_state_t*>(state_));
}

void Hasher::update(const char* data, size_t n) {
  if (xxh3_) {
    XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, n);
    return;
  }
  uint64_t h = fnv_;
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(data[i]);
    h *= 1099511628211ull;
  }
  fnv_ = h;
}

uint64_t Hasher::value() const { return xxh3_ ? XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_)) : fnv_; }

std::string Hasher::text() const {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%llx", static_cast<unsigned long long>(value()));
  return std::string(xxh3_ ? kXxh3 : kFnv1a) + ":" + hex;
}

std::string of(const char* data, size_t n, std::string_view algorithm) {
  Hasher h(algorithm);
  h.update(data, n);
  return h.text();
}

}  // namespace shardtorch::checkpoint::checksum
