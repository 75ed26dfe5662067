#include "checkpoint/publish.h"

#include <fcntl.h>
#include <stdio.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>

#include "base/check.h"
#include "base/env.h"
#include "base/files.h"
#include "base/log.h"
#include "base/text.h"
#include "shardtorch/checkpoint/safetensors.h"

namespace shardtorch::checkpoint {
namespace {

// After publishing: a failure here does not undo a published checkpoint, so
// it is reported, not thrown.
void best_effort(const std::string& what, const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    SHARDTORCH_WARN("shardtorch: ", what,
                    " after publishing a checkpoint failed (the checkpoint is saved): ", e.what());
  }
}

// The files of the checkpoint at `from` that are not the checkpoint's,
// into `tmp`, the new one.
void carry_other_files(const std::string& from, const std::string& tmp, const std::string& marker) {
  std::vector<std::string> carried, left_out;
  for (const auto& n : files::list_directory(from)) {
    if (own_file(n, marker) || files::exists(files::join(tmp, n))) continue;
    try {
      for (auto& p : files::link_tree(files::join(from, n), files::join(tmp, n))) left_out.push_back(std::move(p));
    } catch (const std::exception& e) {
      throw SafetensorsError("checkpoint '" + from + "': keeping '" + n +
                             "' (not a file of the checkpoint) in the new checkpoint failed, and the previous one "
                             "stays as it was: " +
                             e.what() + ". Move it out of the directory, or save elsewhere");
    }
    carried.push_back(n);
  }
  if (!left_out.empty())
    SHARDTORCH_WARN("shardtorch: checkpoint '", from, "': ", detail::quoted_names(left_out),
                    " (neither a file, a directory nor a link) cannot be kept in the new checkpoint and goes with "
                    "the previous one");
  if (carried.empty()) return;
  fsync_path(tmp, true);
  SHARDTORCH_DEBUG("shardtorch: kept ", detail::quoted_names(carried), " of '", from,
                   "' (not the checkpoint's files) in the new checkpoint");
}

}  // namespace

bool own_file(const std::string& name, const std::string& marker) {
  auto ends_with = [&](const std::string& tail) {
    return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  if (name == marker) return true;
  if (marker == ".metadata") return ends_with(".distcp");
  return name.rfind("rank-", 0) == 0 && ends_with(".safetensors");
}

// files::sync, its failure a SafetensorsError.
void fsync_path(const std::string& p, bool dir) {
  try {
    files::sync(p, dir);
  } catch (const std::runtime_error& e) {
    throw SafetensorsError(std::string("checkpoint: ") + e.what());
  }
}

// Writes `text` to `path` and fsyncs it; any failure (a full disk, a quota)
// throws, so a truncated index is never published.
void write_text_durably(const std::string& path, const std::string& text) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (out) SHARDTORCH_DEBUG("opened '", path, "' for writing");
    out << text;
    out.flush();
    if (!out) throw SafetensorsError("checkpoint: writing '" + path + "' failed: " + std::strerror(errno));
  }
  if (static_cast<size_t>(files::file_size(path)) != text.size())
    throw SafetensorsError("checkpoint: '" + path + "' was not written completely");
  fsync_path(path, false);
}

// "ck/" and "ck" are the same checkpoint (a trailing slash would put the
// temporary directory "ck/.shardtorch-tmp" inside the one it is to replace).
std::string normalized(const std::string& dir) {
  std::string d = files::lexically_normal(dir);
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  SHARDTORCH_CHECK(!d.empty() && d != "." && d != "/", "shardtorch: '", dir, "' cannot be a checkpoint directory");
  return d;
}

// Where a checkpoint saved to `dir` is: `dir` itself, or the previous one set
// aside when a save without RENAME_EXCHANGE was interrupted between its two
// renames (`dir` then has no index).
std::string published_dir(const std::string& dir, const std::string& marker, bool announce) {
  const std::string aside = dir + kAsideSuffix;
  if (!files::exists(dir + "/" + marker) && files::exists(aside + "/" + marker)) {
    if (announce)
      SHARDTORCH_WARN("shardtorch: checkpoint '", dir, "' is missing; using the previous one, left at '", aside,
                      "' by an interrupted save");
    return aside;
  }
  return dir;
}

// Rank 0, before a save writes anything: `dir` may be replaced only if it is
// a checkpoint (or an empty directory), never a directory of other files.
void check_replaceable(const std::string& dir, const std::string& marker, const std::string& kind) {
  if (!files::exists(dir)) return;
  if (!files::is_directory(dir)) throw SafetensorsError("checkpoint '" + dir + "': exists and is not a directory");
  if (!files::exists(dir + "/" + marker) && !files::is_empty_directory(dir))
    throw SafetensorsError("checkpoint '" + dir + "': the directory exists and is not a " + kind + " (no " + marker +
                           "); refusing to replace it and the files in it");
}

// Swaps the finished checkpoint `tmp` in as `dir`, so that at every instant
// a complete checkpoint is loadable (`dir`, or the one set aside), with the
// previous one's other files:
// - no checkpoint at `dir` (absent, or an empty directory): `tmp` is renamed
//   to `dir`; only then is a previous one set aside by an interrupted save
//   removed;
// - else renameat2's RENAME_EXCHANGE swaps the two in one step;
// - file systems without it (some network file systems answer EINVAL), or
//   SHARDTORCH_CHECKPOINT_NO_EXCHANGE=1: `dir` is renamed aside
//   (DIR.shardtorch-old), `tmp` to `dir`, and the one aside is removed; a
//   writer killed between the two renames leaves the previous checkpoint
//   aside, where loading looks for it (published_dir).
void publish(const std::string& tmp, const std::string& dir, const std::string& marker) {
  const std::string aside = dir + kAsideSuffix;
  const bool exchange = !detail::env_switch("SHARDTORCH_CHECKPOINT_NO_EXCHANGE").value_or(false);
  // The renames are durable once the parent directory is synced: before any
  // previous checkpoint is deleted (a crash must not find neither).
  auto sync_parent = [&] {
    best_effort("syncing the parent directory", [&] { fsync_path(files::directory_of(dir), true); });
  };
  const std::string previous = published_dir(dir, marker, /*announce=*/false);
  if (files::exists(previous + "/" + marker)) carry_other_files(previous, tmp, marker);
  if (!files::exists(dir + "/" + marker)) {
    if (files::exists(dir)) files::remove(dir);  // an empty directory (check_replaceable)
    files::rename(tmp, dir);
    crash_point("new moved in");
    sync_parent();
  } else if (exchange && ::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    crash_point("exchanged");
    sync_parent();
    best_effort("removing the previous checkpoint", [&] { files::remove_all(tmp); });
  } else {
    if (exchange && errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)
      throw SafetensorsError("checkpoint '" + dir + "': could not swap in the new checkpoint: " + std::strerror(errno));
    files::remove_all(aside);  // older than `dir`, which is complete
    files::rename(dir, aside);
    crash_point("previous moved aside");
    files::rename(tmp, dir);
    crash_point("new moved in");
    sync_parent();
  }
  // `dir` is complete now: a checkpoint set aside, by this save or by an
  // earlier one killed between its renames, is older.
  best_effort("removing '" + aside + "'", [&] { files::remove_all(aside); });
}

std::vector<int> spread_over_writers(const std::vector<int64_t>& sizes, int writers) {
  std::vector<size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return sizes[a] > sizes[b]; });
  std::vector<int64_t> load(static_cast<size_t>(writers), 0);
  std::vector<int> owner(sizes.size(), 0);
  for (size_t k : order) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    owner[k] = static_cast<int>(least);
    load[static_cast<size_t>(least)] += sizes[k];
  }
  return owner;
}

}  // namespace shardtorch::checkpoint
