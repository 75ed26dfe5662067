#pragma once
// Progress and logs (docs/api.md, "Progress and logs"): one level for every
// message the library prints, and progress reports of long operations
// (shard() of a model, checkpoint loads and saves, a fault-tolerance heal).
#include <cstdint>
#include <functional>
#include <string>

#include "shardtorch/export.h"

namespace shardtorch {

/// What the library prints to stderr. Each level includes the ones before it.
/// Warnings go through TORCH_WARN (a program's c10::WarningHandler sees
/// them); errors, info lines (progress, the fault-tolerance timeline) and
/// debug lines are written to stderr, prefixed "[rank N] ".
enum class LogLevel { Quiet, Error, Warning, Info, Debug };

/// The programmatic setting; it wins over SHARDTORCH_LOG_LEVEL.
SHARDTORCH_API void set_log_level(LogLevel level);
/// The level in force: set_log_level's, else the environment variable
/// SHARDTORCH_LOG_LEVEL (quiet, error, warning, info or debug, any case;
/// read once, at the first use), else Info.
SHARDTORCH_API LogLevel log_level();
/// "quiet", "error", "warning" (or "warn"), "info", "debug", any case;
/// throws shardtorch::Error on others.
SHARDTORCH_API LogLevel parse_log_level(const std::string& name);
SHARDTORCH_API const char* log_level_name(LogLevel level);

/// Where a long operation stands, on this rank.
struct SHARDTORCH_API ProgressUpdate {
  std::string operation;  // "shard", "load_hf_checkpoint", "save_sharded_checkpoint", "heal", ...
  std::string unit;       // what done and total count: "units", "files", "tensors", "transfers"
  int64_t done = 0;
  int64_t total = 0;
  int64_t bytes_done = 0;
  int64_t bytes_total = 0;  // 0 when not known in advance
  double elapsed_s = 0;     // since the operation started
  double bytes_per_s = 0;   // bytes_done / elapsed_s
  double eta_s = -1;        // time left, from the bytes (else the counts) at the rate so far; -1 unknown
  bool finished = false;    // the last update of an operation that succeeded (done == total)
};

/// Called on every rank, on the thread running the operation, when the
/// operation starts (done 0), after each step, and once finished.
using ProgressCallback = std::function<void(const ProgressUpdate&)>;

/// The callback of every operation whose options set none; nullptr (the
/// default) prints progress on rank 0 at level Info: one line updated in
/// place when stderr is a terminal, else a line every 5 s, nothing for an
/// operation that ends within 2 s, and a last line when anything was printed.
SHARDTORCH_API void set_progress_callback(ProgressCallback callback);
/// The library-wide callback (nullptr: none).
SHARDTORCH_API ProgressCallback progress_callback();

}  // namespace shardtorch
