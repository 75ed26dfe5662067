#pragma once
// Every rank's error of a run_ranks() result, for tests that expect all of
// them to fail.
#include <string>
#include <vector>

#include "shardtorch/testing.h"

inline std::vector<std::string> errors_of(const shardtorch::testing::RunResult& r) {
  std::vector<std::string> out;
  for (const auto& k : r.ranks) out.push_back(k.message);
  return out;
}
