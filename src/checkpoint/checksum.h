#pragma once
// The checksums a sharded checkpoint's index records for its files, as text
// "ALGORITHM:HEX": "xxh3_64" (XXH3, 64 bits) is written; "fnv1a64" (FNV-1a,
// 64 bits), written by earlier versions, is still verified. A recorded
// checksum is verified with the algorithm it names. No LibTorch here (the
// index fuzz target builds it alone).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace shardtorch::checkpoint::checksum {

inline constexpr std::string_view kXxh3 = "xxh3_64";
inline constexpr std::string_view kFnv1a = "fnv1a64";
/// The algorithm new checkpoints record.
inline constexpr std::string_view kDefault = kXxh3;

/// The algorithm `text` names if it is "ALGORITHM:HEX" with a known
/// algorithm and 1 to 16 lowercase hex digits; empty otherwise.
std::string_view algorithm_of(std::string_view text);

/// A running checksum over bytes given in pieces (any split gives the same).
class Hasher {
 public:
  /// `algorithm`: kXxh3 or kFnv1a; anything else throws std::invalid_argument.
  explicit Hasher(std::string_view algorithm = kDefault);
  ~Hasher();
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  void update(const char* data, size_t n);
  uint64_t value() const;
  /// "ALGORITHM:HEX".
  std::string text() const;

 private:
  bool xxh3_;
  uint64_t fnv_;
  void* state_ = nullptr;  // XXH3_state_t
};

/// The checksum text of `n` bytes at `data`.
std::string of(const char* data, size_t n, std::string_view algorithm = kDefault);

}  // namespace shardtorch::checkpoint::checksum
