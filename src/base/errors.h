#pragma once
// Errors raised inside the library's callbacks and threads (autograd hooks,
// the end-of-backward callback, the completion watcher) reach the caller of
// backward() or of the collective's wait naming the rank and the operation;
// and a test-only way to make each of those places fail.
#include <exception>
#include <functional>
#include <string>

#include "shardtorch/export.h"

namespace shardtorch::detail {

/// Rethrows the exception in flight so that its message names this rank and
/// `operation` (built only then), as a shardtorch::Error without a C++
/// backtrace. Errors that name the rank already pass unchanged;
/// checkpoint::SafetensorsError and c10::OutOfMemoryError keep their types;
/// a c10::Error loses c10's backtrace. Call only inside a catch block.
[[noreturn]] void rethrow_naming(int rank, const std::function<std::string()>& operation);

/// An exception's message, without the C++ backtrace a c10::Error's what()
/// carries.
std::string message_of(const std::exception& e);

/// From now on, c10::Errors made in this process carry no C++ backtrace
/// (c10::SetStackTraceFetcher), unless SHARDTORCH_SHOW_CPP_STACKTRACES=1:
/// c10d logs the what() of errors it catches (a store or a peer whose
/// process died) and would print c10's frames. Idempotent; World::create
/// calls it.
void quiet_cpp_stacktraces();

/// Throws if shardtorch::testing::inject_failure armed `site` (one relaxed
/// atomic load when nothing is armed).
void failure_point(const char* site);
/// shardtorch::testing::inject_failure (the testing library): the next
/// `count` failure_point(site) calls throw. Exported for that library only.
SHARDTORCH_API void arm_failure_point(const std::string& site, int count);

/// For test programs linked with the library's internals: `action` runs at
/// every test_point() this process reaches, with the site's name (it may
/// end the process there); an empty one: none. Not for production use.
void set_test_point_action(std::function<void(const char* site)> action);
/// Runs the action set_test_point_action set, if any (one relaxed atomic
/// load when none). Sites: "reduce-scatter posted" (ReduceScatterBucketer:
/// a reduce-scatter issued to the backend, not yet waited for); "snapshot
/// copy" (Snapshots: a copy of the state about to start, in the background).
void test_point(const char* site);

/// Runs `body` at failure point `site`; whatever it throws leaves through
/// rethrow_naming(rank, operation).
template <class Body>
void run_naming(int rank, const char* site, const std::function<std::string()>& operation, Body&& body) {
  try {
    failure_point(site);
    body();
  } catch (...) {
    rethrow_naming(rank, operation);
  }
}

}  // namespace shardtorch::detail
