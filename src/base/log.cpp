// The library's one writer to stderr (base/log.h).
#include "base/log.h"
#include "base/env.h"
#include "shardtorch/error.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <utility>

namespace shardtorch {
namespace {

constexpr int kUnset = -1;
std::atomic<int> g_set_level{kUnset};  // set_log_level's
std::atomic<int> g_env_level{kUnset};  // SHARDTORCH_LOG_LEVEL's, once read
std::atomic<int> g_rank{-1};

std::mutex g_write_mu;     // one line at a time on stderr
bool g_line_open = false;  // a progress line updated in place ends without a newline

std::mutex g_callback_mu;
ProgressCallback g_callback;

std::atomic<int64_t> g_io_bytes{0};
thread_local detail::ProgressReporter* t_io_reporter = nullptr;

std::atomic<double> g_quiet_s{2.0};
std::atomic<double> g_interval_s{5.0};

// Writes `text` to stderr, ending a progress line left open first unless
// `text` continues it.
void write_stderr(const std::string& text, bool continues_line, bool leaves_open) {
  std::lock_guard<std::mutex> lock(g_write_mu);
  std::string out;
  if (g_line_open && !continues_line) out += "\n";
  out += text;
  std::fwrite(out.data(), 1, out.size(), stderr);
  std::fflush(stderr);
  g_line_open = leaves_open;
}

// What SHARDTORCH_LOG_LEVEL and parse_log_level accept (any case).
constexpr const char* kLevelNames = "quiet (or off, none), error, warning (or warn), info, debug";

// "[rank R] " before `message`; a message that names this rank itself
// ("shardtorch: rank R: ...", as errors do) names it once, in the prefix.
std::string prefixed(const std::string& message) {
  int rank = g_rank.load(std::memory_order_relaxed);
  if (rank < 0) {  // before the World: the launcher's rank, when it gives one
    const auto launched = detail::launcher_rank();
    if (!launched) return message;
    rank = *launched;
  }
  const std::string prefix = "[rank " + std::to_string(rank) + "] ";
  const std::string named = "shardtorch: rank " + std::to_string(rank) + ": ";
  if (message.compare(0, named.size(), named) == 0) return prefix + "shardtorch: " + message.substr(named.size());
  return prefix + message;
}

void read_env() {
  const char* e = std::getenv("SHARDTORCH_LOG_LEVEL");
  int level = static_cast<int>(LogLevel::Info);
  if (e != nullptr && *e != '\0') {
    try {
      level = static_cast<int>(parse_log_level(e));
    } catch (const std::exception&) {
      write_stderr(prefixed(std::string("shardtorch: SHARDTORCH_LOG_LEVEL='") + e + "' is not one of " + kLevelNames +
                            "; using info\n"),
                   false, false);
    }
  }
  g_env_level.store(level);
}

std::string lower(const std::string& s) {
  std::string out;
  for (char c : s) out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string bytes_text(double b) {
  const char* units[] = {"B", "kB", "MB", "GB", "TB"};
  int u = 0;
  while (b >= 1000 && u < 4) {
    b /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
  return buf;
}

std::string seconds_text(double s) {
  char buf[32];
  if (s < 60) {
    std::snprintf(buf, sizeof buf, "%.1f s", s);
  } else {
    const long t = std::lround(s);
    std::snprintf(buf, sizeof buf, "%ldm %02lds", t / 60, t % 60);
  }
  return buf;
}

}  // namespace

LogLevel parse_log_level(const std::string& name) {
  const std::string n = lower(name);
  if (n == "quiet" || n == "off" || n == "none") return LogLevel::Quiet;
  if (n == "error") return LogLevel::Error;
  if (n == "warning" || n == "warn") return LogLevel::Warning;
  if (n == "info") return LogLevel::Info;
  if (n == "debug") return LogLevel::Debug;
  throw Error("shardtorch: unknown log level '" + name + "'; expected one of " + kLevelNames);
}

const char* log_level_name(LogLevel level) {
  switch (level) {
    case LogLevel::Quiet:
      return "quiet";
    case LogLevel::Error:
      return "error";
    case LogLevel::Warning:
      return "warning";
    case LogLevel::Info:
      return "info";
    case LogLevel::Debug:
      return "debug";
  }
  return "?";
}

void set_log_level(LogLevel level) { g_set_level.store(static_cast<int>(level)); }

LogLevel log_level() {
  const int set = g_set_level.load(std::memory_order_relaxed);
  if (set != kUnset) return static_cast<LogLevel>(set);
  if (g_env_level.load(std::memory_order_relaxed) == kUnset) read_env();  // once (two threads: the same value)
  return static_cast<LogLevel>(g_env_level.load(std::memory_order_relaxed));
}

void set_progress_callback(ProgressCallback callback) {
  std::lock_guard<std::mutex> lock(g_callback_mu);
  g_callback = std::move(callback);
}

ProgressCallback progress_callback() {
  std::lock_guard<std::mutex> lock(g_callback_mu);
  return g_callback;
}

namespace detail {

void set_log_rank(int rank) { g_rank.store(rank); }
int log_rank() { return g_rank.load(); }

bool log_enabled(LogLevel level) {
  return level != LogLevel::Quiet && static_cast<int>(level) <= static_cast<int>(log_level());
}

void log(LogLevel level, const std::string& message) {
  if (level == LogLevel::Warning) return warn(message);
  if (!log_enabled(level)) return;
  write_stderr(prefixed(message) + "\n", false, false);
}

void warn(const std::string& message) {
  if (!log_enabled(LogLevel::Warning)) return;
  {
    // A progress line in place ends before the warning's.
    std::lock_guard<std::mutex> lock(g_write_mu);
    if (g_line_open) {
      std::fputs("\n", stderr);
      g_line_open = false;
    }
  }
  TORCH_WARN(prefixed(message));
}

void count_io(int64_t bytes) {
  g_io_bytes.fetch_add(bytes, std::memory_order_relaxed);
  if (t_io_reporter != nullptr) t_io_reporter->on_io();
}
int64_t io_bytes() { return g_io_bytes.load(std::memory_order_relaxed); }

void reset_log_level() {
  g_set_level.store(kUnset);
  g_env_level.store(kUnset);
}

void set_progress_timing(double quiet_s, double interval_s) {
  g_quiet_s.store(quiet_s);
  g_interval_s.store(interval_s);
}

ProgressReporter::ProgressReporter(std::string operation, std::string unit, int64_t total, int64_t bytes_total,
                                   const ProgressCallback& callback)
    : callback_(callback ? callback : progress_callback()), start_(std::chrono::steady_clock::now()) {
  u_.operation = std::move(operation);
  u_.unit = std::move(unit);
  u_.total = total;
  u_.bytes_total = bytes_total;
  print_ = !callback_ && log_rank() <= 0 && log_enabled(LogLevel::Info);
  in_place_ = print_ && ::isatty(STDERR_FILENO) == 1;
  last_print_ = start_;
  report(false);
}

ProgressReporter::~ProgressReporter() {
  if (io_ && t_io_reporter == this) t_io_reporter = outer_;
  // An operation that failed: a line left open ends, no last update.
  if (printed_ && in_place_ && !done_) {
    std::lock_guard<std::mutex> lock(g_write_mu);
    if (g_line_open) std::fputs("\n", stderr);
    g_line_open = false;
  }
}

void ProgressReporter::count_io() {
  if (io_) return;
  io_ = true;
  io_base_ = io_bytes();
  last_io_report_ = std::chrono::steady_clock::now();
  outer_ = t_io_reporter;
  t_io_reporter = this;
}

void ProgressReporter::on_io() {
  const auto now = std::chrono::steady_clock::now();
  if (done_ || now - last_io_report_ < std::chrono::milliseconds(100)) return;
  last_io_report_ = now;
  report(false);
}

void ProgressReporter::set_totals(int64_t total, int64_t bytes_total) {
  u_.total = total;
  u_.bytes_total = bytes_total;
}

void ProgressReporter::advance(int64_t steps, int64_t bytes) {
  u_.done += steps;
  u_.bytes_done += bytes;
  report(false);
}

void ProgressReporter::finish() {
  if (done_) return;
  u_.done = std::max(u_.done, u_.total);
  if (io_) u_.bytes_done = std::max(u_.bytes_done, io_bytes() - io_base_);
  if (u_.bytes_total > 0) u_.bytes_done = u_.bytes_total;
  report(true);
  done_ = true;
}

void ProgressReporter::report(bool finished) {
  if (!callback_ && !print_) return;
  if (io_ && !finished) {
    u_.bytes_done = io_bytes() - io_base_;
    if (u_.bytes_total > 0) u_.bytes_done = std::min(u_.bytes_done, u_.bytes_total);
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  u_.elapsed_s = elapsed;
  u_.finished = finished;
  u_.bytes_per_s = elapsed > 0 ? static_cast<double>(u_.bytes_done) / elapsed : 0;
  u_.eta_s = -1;
  if (finished) {
    u_.eta_s = 0;
  } else if (u_.bytes_total > 0 && u_.bytes_done > 0) {
    u_.eta_s = elapsed * static_cast<double>(u_.bytes_total - u_.bytes_done) / static_cast<double>(u_.bytes_done);
  } else if (u_.total > 0 && u_.done > 0) {
    u_.eta_s = elapsed * static_cast<double>(u_.total - u_.done) / static_cast<double>(u_.done);
  }
  if (!callback_) return print(u_);
  try {
    callback_(u_);
  } catch (const std::exception& e) {
    callback_ = nullptr;
    warn("shardtorch: the progress callback of " + u_.operation + " threw (no more progress reported): " + e.what());
  } catch (...) {
    callback_ = nullptr;
    warn("shardtorch: the progress callback of " + u_.operation +
         " threw something not derived from std::exception (no more progress reported)");
  }
}

void ProgressReporter::print(const ProgressUpdate& u) {
  const auto now = std::chrono::steady_clock::now();
  if (u.elapsed_s < g_quiet_s.load()) return;  // short operations print nothing
  if (!u.finished) {
    const double since = std::chrono::duration<double>(now - last_print_).count();
    if (printed_ && since < (in_place_ ? 0.2 : g_interval_s.load())) return;
  }
  std::string line =
      "shardtorch: " + u.operation + ": " + std::to_string(u.done) + "/" + std::to_string(u.total) + " " + u.unit;
  if (u.bytes_total > 0 || u.bytes_done > 0) {
    line += ", " + bytes_text(static_cast<double>(u.bytes_done));
    if (u.bytes_total > 0 && !u.finished) line += "/" + bytes_text(static_cast<double>(u.bytes_total));
    if (!bytes_words_.empty()) line += " " + bytes_words_;
    line += ", " + bytes_text(u.bytes_per_s) + "/s";
  }
  if (u.finished) {
    line += " in " + seconds_text(u.elapsed_s);
  } else if (u.eta_s >= 0) {
    line += ", " + seconds_text(u.eta_s) + " left";
  }
  if (in_place_) {
    // \r and the line again; padded so that it covers the longest line before it.
    std::string text = "\r" + prefixed(line);
    const size_t cover = std::max<size_t>(100, widest_);
    widest_ = std::max(widest_, text.size());
    if (text.size() < cover) text.append(cover - text.size(), ' ');
    write_stderr(u.finished ? text + "\n" : text, printed_, !u.finished);
  } else {
    write_stderr(prefixed(line) + "\n", false, false);
  }
  printed_ = true;
  last_print_ = now;
}

}  // namespace detail
}  // namespace shardtorch
