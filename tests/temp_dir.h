#pragma once
// Paths and temporary directories for tests.
#include <unistd.h>

#include <string>

#include "../src/base/files.h"

namespace testmodels {

namespace files = shardtorch::files;

/// A path for tests: a string with "/" to join, over shardtorch::files
/// (POSIX calls; std::filesystem is not used anywhere: src/base/files.h says why).
class Path {
 public:
  Path(std::string s) : s_(std::move(s)) {}
  Path(const char* s) : s_(s) {}
  const std::string& string() const { return s_; }
  operator const std::string&() const { return s_; }
  friend Path operator/(const Path& a, const std::string& b) { return Path(files::join(a.s_, b)); }

 private:
  std::string s_;
};

/// A fresh directory under the system's temporary directory, removed with
/// everything in it when this goes out of scope, also when an ASSERT leaves
/// the test early. Multi-rank tests make it before run_ranks: the ranks,
/// forked from the test's process, see the same path; only the process that
/// made it (not a rank) removes it.
class TempDir : public Path {
 public:
  explicit TempDir(const std::string& prefix = "shardtorch-test")
      : Path(files::make_temp_dir(prefix)), owner_(::getpid()) {}
  TempDir(TempDir&& other) noexcept : Path(other), owner_(other.owner_) { other.owner_ = 0; }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  TempDir& operator=(TempDir&&) = delete;
  ~TempDir() {
    if (owner_ == ::getpid()) files::remove_all_quietly(string());
  }

 private:
  pid_t owner_;  // 0 once moved from
};

}  // namespace testmodels
