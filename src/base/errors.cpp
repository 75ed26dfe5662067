#include "base/errors.h"

#include <c10/util/Backtrace.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <atomic>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>

#include "base/check.h"
#include "base/env.h"
#include "base/log.h"
#include "shardtorch/checkpoint/safetensors_error.h"

namespace shardtorch::detail {

namespace {
bool names_rank(const std::string& message, int rank) {
  return message.rfind("shardtorch", 0) == 0 && message.find("rank " + std::to_string(rank)) != std::string::npos;
}

// Read at each error (errors are rare); a value other than 0 or 1 is said
// once and leaves them off (this runs while an error is being raised).
bool show_backtraces() {
  try {
    return env_switch("SHARDTORCH_SHOW_CPP_STACKTRACES").value_or(false);
  } catch (const std::exception& e) {
    SHARDTORCH_WARN_ONCE(e.what(), "; C++ backtraces stay off");
    return false;
  }
}
}  // namespace

std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

void quiet_cpp_stacktraces() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (!show_backtraces())
      c10::SetStackTraceFetcher([]() -> std::string { return "(frames left out: SHARDTORCH_SHOW_CPP_STACKTRACES=1)"; });
  });
}

void throw_error(const char* condition, const std::string& message) {
  std::string m = message.empty() ? std::string("shardtorch: expected ") + condition : message;
  if (show_backtraces()) m += "\n" + c10::get_backtrace(/*frames_to_skip=*/1);
  throw Error(m);
}

void rethrow_naming(int rank, const std::function<std::string()>& operation) {
  const std::string where = detail::rank_prefix(rank) + ": " + operation() + " failed";
  try {
    throw;
  } catch (c10::OutOfMemoryError& e) {  // keeps its type: callers may free memory and retry
    if (!names_rank(e.what_without_backtrace(), rank)) e.add_context(where);
    throw;
  } catch (const checkpoint::SafetensorsError& e) {
    if (names_rank(e.what(), rank)) throw;
    throw checkpoint::SafetensorsError(where + ": " + e.what());
  } catch (const Error& e) {
    if (names_rank(e.what(), rank)) throw;
    throw_error("", where + ": " + e.what());
  } catch (const c10::Error& e) {  // from LibTorch or c10d: its message, without c10's backtrace
    const std::string m = e.what_without_backtrace();
    throw_error("", names_rank(m, rank) ? m : where + ": " + m);
  } catch (const std::exception& e) {  // one error type: a shardtorch::Error, its message kept
    throw_error("", names_rank(e.what(), rank) ? std::string(e.what()) : where + ": " + e.what());
  } catch (...) {
    throw_error("", where + " (an exception of unknown type)");
  }
}

namespace {
struct Armed {
  std::mutex mu;
  std::string site;
  std::atomic<int> count{0};
};
Armed& armed() {
  static Armed a;
  return a;
}
}  // namespace

void arm_failure_point(const std::string& site, int count) {
  auto& a = armed();
  std::lock_guard<std::mutex> lock(a.mu);
  a.site = site;
  a.count = count;
}

namespace {
struct TestPoints {
  std::atomic<bool> set{false};
  std::function<void(const char*)> action;
};
TestPoints& test_points() {
  static TestPoints t;
  return t;
}
}  // namespace

void set_test_point_action(std::function<void(const char* site)> action) {
  auto& t = test_points();
  t.set = false;
  t.action = std::move(action);
  t.set = static_cast<bool>(t.action);
}

void test_point(const char* site) {
  auto& t = test_points();
  if (t.set.load(std::memory_order_relaxed)) t.action(site);
}

void failure_point(const char* site) {
  auto& a = armed();
  if (a.count.load(std::memory_order_relaxed) == 0) return;
  {
    std::lock_guard<std::mutex> lock(a.mu);
    if (a.count == 0 || a.site != site) return;
    --a.count;
  }
  throw std::runtime_error(std::string("failure injected at '") + site + "' by shardtorch::testing::inject_failure");
}

}  // namespace shardtorch::detail
