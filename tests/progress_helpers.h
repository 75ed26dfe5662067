// Checks of what a progress callback (shardtorch/log.h) received.
#pragma once

#include <string>
#include <vector>

#include "models.h"
#include "shardtorch/log.h"

namespace testmodels {

// What a callback received, checked: one operation, counts and bytes that
// never go back, one finished update, the last, at the totals.
inline void require_progress(const std::vector<shardtorch::ProgressUpdate>& got, const std::string& operation,
                             const std::string& at) {
  const std::string where = at + ": " + operation + ": ";
  require(got.size() >= 2, where + std::to_string(got.size()) + " updates, expected the start and the end at least");
  require(got.front().done == 0 && !got.front().finished, where + "the first update is not the start");
  for (size_t i = 0; i < got.size(); ++i) {
    const auto& u = got[i];
    require(u.operation == operation, where + "an update of '" + u.operation + "'");
    require(u.finished == (i + 1 == got.size()), where + "update " + std::to_string(i) + " finished " +
                                                     std::to_string(u.finished) + " of " + std::to_string(got.size()));
    require(u.done <= u.total || u.total == 0,
            where + "done " + std::to_string(u.done) + " past the total " + std::to_string(u.total));
    if (i > 0) {
      require(u.done >= got[i - 1].done, where + "done went back at update " + std::to_string(i));
      require(u.bytes_done >= got[i - 1].bytes_done, where + "bytes_done went back at update " + std::to_string(i));
      require(u.elapsed_s >= got[i - 1].elapsed_s, where + "the time went back at update " + std::to_string(i));
    }
  }
  const auto& last = got.back();
  require(last.total > 0 && last.done == last.total,
          where + "ends at " + std::to_string(last.done) + " of " + std::to_string(last.total));
  require(last.bytes_total == 0 || last.bytes_done == last.bytes_total,
          where + "ends at " + std::to_string(last.bytes_done) + " of " + std::to_string(last.bytes_total) + " bytes");
  require(last.eta_s == 0, where + "a finished operation has time left");
}

// A callback that appends each update to `out`.
inline shardtorch::ProgressCallback collect_into(std::vector<shardtorch::ProgressUpdate>& out) {
  return [&out](const shardtorch::ProgressUpdate& u) { out.push_back(u); };
}

}  // namespace testmodels
