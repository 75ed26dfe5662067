#include "errors.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <exception>
#include <mutex>
#include <stdexcept>

#include "shardtorch/testing.h"

namespace shardtorch::detail {

namespace {
bool names_rank(const std::string& message, int rank) {
  return message.rfind("shardtorch", 0) == 0 && message.find("rank " + std::to_string(rank)) != std::string::npos;
}
}  // namespace

void rethrow_naming(int rank, const std::function<std::string()>& operation) {
  const std::string where = "shardtorch: rank " + std::to_string(rank) + ": " + operation() + " failed";
  try {
    throw;
  } catch (c10::Error& e) {
    if (!names_rank(e.what_without_backtrace(), rank)) e.add_context(where);
    throw;
  } catch (const std::exception& e) {
    if (names_rank(e.what(), rank)) throw;
    throw std::runtime_error(where + ": " + e.what());
  } catch (...) {
    throw std::runtime_error(where + " (an exception of unknown type)");
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

namespace shardtorch::testing {
void inject_failure(const std::string& site, int count) {
  auto& a = detail::armed();
  std::lock_guard<std::mutex> lock(a.mu);
  a.site = site;
  a.count = count;
}
}  // namespace shardtorch::testing
