#pragma once
// Internal: the environment variables the library reads (docs/api.md,
// "Environment variables").
#include <chrono>
#include <optional>
#include <string>

namespace shardtorch::detail {

/// The variable `name`; nullopt when unset or empty.
std::optional<std::string> env(const char* name);

/// A switch's value: "0" is false, "1" true, anything else an Error that
/// names the variable and its value.
bool parse_switch(const std::string& name, const std::string& value);

/// The switch `name` (parse_switch); nullopt when unset or empty.
std::optional<bool> env_switch(const char* name);

/// The process's rank as its launcher gives it (torchrun's RANK, Open MPI's,
/// MPICH's and Slurm's), before a World exists; nullopt when none is set or
/// the value is not a rank.
std::optional<int> launcher_rank();

/// SHARDTORCH_CHECK_PROBE_MS: how often a long wait of the collective check
/// is compared with the peers' (500 ms when unset or empty); a value that is
/// not a whole number of milliseconds in 10..60000 is an Error naming it.
std::chrono::milliseconds check_probe_interval();

/// Reads every switch the library has (parse_switch), and the other values
/// it reads only later (check_probe_interval), so that a bad value is an
/// error when a World is made rather than at its first use.
void check_switches();

}  // namespace shardtorch::detail
