#pragma once
// This process's resident memory as Linux reports it in /proc/self/status: the
// one reader of the examples and the benchmarks. The library's own accounting
// (ShardedModel::memory()) counts its tensors, not the process.
#include <cstdint>
#include <fstream>
#include <string>

namespace process_memory {

/// A field of /proc/self/status in bytes ("VmRSS", "VmHWM", "VmSize"); -1
/// where the field is missing (not Linux).
inline int64_t status_bytes(const std::string& field) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  return -1;
}

/// Resident now (VmRSS).
inline int64_t resident_bytes() { return status_bytes("VmRSS"); }

/// The peak resident since the process started or since reset_peak() (VmHWM).
inline int64_t peak_resident_bytes() { return status_bytes("VmHWM"); }

/// Restarts the peak from what is resident now (Linux >= 4.0); false where refused.
inline bool reset_peak() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return f.good();
}

/// Bytes in whole MiB, rounded down; -1 stays -1.
inline int64_t mib(int64_t bytes) { return bytes < 0 ? -1 : bytes / (int64_t{1} << 20); }

}  // namespace process_memory
