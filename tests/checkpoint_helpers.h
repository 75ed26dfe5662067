#pragma once
// Helpers shared by the checkpoint tests.
#include <csignal>
#include <cstdint>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include "shardtorch/checkpoint.h"
#include "shardtorch/testing.h"

namespace testmodels {

/// A safetensors file at `p` of this header text and these data bytes, as
/// given (malformed ones too).
inline void write_raw(const std::string& p, const std::string& json, const std::string& data) {
  std::string bytes(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes << json << data;
}

/// What `f` threw; "" if it returned.
inline std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

/// The whole of a text file.
inline std::string read_text(const std::string& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Crash tests: this process dies (SIGKILL) when a checkpoint write reaches
// `point`. The run's limits notice a rank left waiting for a dead one.
inline void die_at(const std::string& point) {
  shardtorch::checkpoint::set_crash_hook([point](const std::string& p) {
    if (p == point) ::raise(SIGKILL);
  });
}
inline shardtorch::testing::RunOptions crash_run() {
  return shardtorch::testing::RunOptions()
      .timeout(std::chrono::seconds(60))
      .collective_timeout(std::chrono::seconds(5));
}

}  // namespace testmodels
