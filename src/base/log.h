#pragma once
// The one path of the library's messages to stderr (shardtorch/log.h):
// levels, the "[rank N] " prefix, warnings through TORCH_WARN, and the
// progress reports of long operations.
#include <c10/util/StringUtil.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "shardtorch/log.h"

namespace shardtorch::detail {

/// The rank that prefixes messages ("[rank N] "); -1 (before any World):
/// none. World::create sets it.
void set_log_rank(int rank);
int log_rank();

/// Whether messages of `level` are printed (cheap: test it before building
/// a message; the macros below do).
bool log_enabled(LogLevel level);

/// Prints `message` as one line on stderr, prefixed "[rank N] ", if `level`
/// is enabled. A warning goes through warn().
void log(LogLevel level, const std::string& message);

/// A warning: through TORCH_WARN (a c10::WarningHandler sees it), prefixed
/// "[rank N] ", if warnings are enabled.
void warn(const std::string& message);

/// Bytes read from or written to checkpoint files in this process: the
/// readers and writers count them, progress reports of loads and saves
/// (ProgressReporter::count_io) read them.
void count_io(int64_t bytes);
int64_t io_bytes();

/// Test hook: forgets set_log_level's level and the environment's (read
/// again at the next use).
void reset_log_level();

/// Test hook: the default progress printer's quiet period (nothing printed
/// for an operation shorter) and its interval between lines off a terminal.
void set_progress_timing(double quiet_s, double interval_s);

/// One long operation's progress: reports to the operation's callback, else
/// the library-wide one, else prints (rank 0, level Info; see
/// set_progress_callback). The callback's exceptions are caught and warned
/// about, once: progress never fails an operation.
class ProgressReporter {
 public:
  ProgressReporter(std::string operation, std::string unit, int64_t total, int64_t bytes_total = 0,
                   const ProgressCallback& callback = nullptr);
  ~ProgressReporter();
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

  /// From now on bytes_done is the file bytes read or written since
  /// (count_io), at most bytes_total when that is known; file reads and
  /// writes on this thread report (at most every 0.1 s) until this reporter
  /// ends.
  void count_io();
  /// count_io's report of file bytes moved.
  void on_io();
  /// Totals learnt later (a save's tensors once listed).
  void set_totals(int64_t total, int64_t bytes_total);
  /// Words after the bytes in the printed line, where bytes_total is not
  /// the size of what is made ("written and read back": twice a file's).
  void set_bytes_words(std::string words) { bytes_words_ = std::move(words); }
  /// `steps` more done and `bytes` more moved.
  void advance(int64_t steps, int64_t bytes = 0);
  /// Done: done = total, the last update (finished).
  void finish();

 private:
  void report(bool finished);
  void print(const ProgressUpdate& u);

  ProgressUpdate u_;
  ProgressCallback callback_;
  bool print_ = false;  // the default printer, on this rank
  std::chrono::steady_clock::time_point start_, last_print_;
  bool printed_ = false, in_place_ = false, done_ = false;
  size_t widest_ = 0;  // the longest line printed in place so far
  std::string bytes_words_;
  bool io_ = false;
  int64_t io_base_ = 0;
  ProgressReporter* outer_ = nullptr;  // the thread's io reporter before this one
  std::chrono::steady_clock::time_point last_io_report_;
};

}  // namespace shardtorch::detail

/// Debug lines cost one level test when debug is off.
#define SHARDTORCH_DEBUG(...)                                                                            \
  do {                                                                                                   \
    if (::shardtorch::detail::log_enabled(::shardtorch::LogLevel::Debug))                                \
      ::shardtorch::detail::log(::shardtorch::LogLevel::Debug, ::c10::str("shardtorch: ", __VA_ARGS__)); \
  } while (0)

#define SHARDTORCH_INFO(...)                                                            \
  do {                                                                                  \
    if (::shardtorch::detail::log_enabled(::shardtorch::LogLevel::Info))                \
      ::shardtorch::detail::log(::shardtorch::LogLevel::Info, ::c10::str(__VA_ARGS__)); \
  } while (0)

/// A warning (the message names the library itself: "shardtorch: ...").
#define SHARDTORCH_WARN(...)                                                \
  do {                                                                      \
    if (::shardtorch::detail::log_enabled(::shardtorch::LogLevel::Warning)) \
      ::shardtorch::detail::warn(::c10::str(__VA_ARGS__));                  \
  } while (0)

#define SHARDTORCH_WARN_ONCE(...)                                                                                 \
  do {                                                                                                            \
    static std::atomic<bool> shardtorch_warned_{false};                                                           \
    if (::shardtorch::detail::log_enabled(::shardtorch::LogLevel::Warning) && !shardtorch_warned_.exchange(true)) \
      ::shardtorch::detail::warn(::c10::str(__VA_ARGS__));                                                        \
  } while (0)
