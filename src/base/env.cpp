#include "base/env.h"

#include <cerrno>
#include <cstdlib>

#include "base/check.h"

namespace shardtorch::detail {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::optional<int> launcher_rank() {
  for (const char* var : {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    const auto v = env(var);
    if (!v) continue;
    char* end = nullptr;
    const long r = std::strtol(v->c_str(), &end, 10);
    if (r < 0 || *end != '\0') return std::nullopt;
    return static_cast<int>(r);
  }
  return std::nullopt;
}

bool parse_switch(const std::string& name, const std::string& value) {
  if (value != "0" && value != "1")
    throw Error("shardtorch: environment variable " + name + "='" + value + "' must be 0 or 1");
  return value == "1";
}

std::optional<bool> env_switch(const char* name) {
  auto v = env(name);
  if (!v) return std::nullopt;
  return parse_switch(name, *v);
}

std::chrono::milliseconds check_probe_interval() {
  const char* name = "SHARDTORCH_CHECK_PROBE_MS";
  const auto v = env(name);
  if (!v) return std::chrono::milliseconds(500);
  char* end = nullptr;
  errno = 0;
  const long ms = std::strtol(v->c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || ms < 10 || ms > 60000)
    throw Error("shardtorch: environment variable " + std::string(name) + "='" + *v +
                "' must be a whole number of milliseconds from 10 to 60000");
  return std::chrono::milliseconds(ms);
}

void check_switches() {
  for (const char* name : {"SHARDTORCH_BLOCKING_WAIT", "SHARDTORCH_CHECK_COLLECTIVES",
                           "SHARDTORCH_CHECKPOINT_NO_EXCHANGE", "SHARDTORCH_REJOIN", "SHARDTORCH_SHOW_CPP_STACKTRACES"})
    env_switch(name);
  check_probe_interval();
}

}  // namespace shardtorch::detail
