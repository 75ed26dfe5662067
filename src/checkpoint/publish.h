#pragma once
// Internal: how a checkpoint directory is replaced atomically (sharded
// checkpoints, DCP checkpoints). A save writes DIR.shardtorch-tmp and
// publishes it as DIR; `marker` is the file whose presence makes a directory
// a complete checkpoint of the kind ("index.json", ".metadata").
#include <cstdint>
#include <string>
#include <vector>

namespace shardtorch::checkpoint {

/// Next to DIR while a save runs, and the previous checkpoint set aside where
/// RENAME_EXCHANGE is missing. Names no one else uses: a save deletes them.
inline constexpr const char* kTmpSuffix = ".shardtorch-tmp";
inline constexpr const char* kAsideSuffix = ".shardtorch-old";

/// files::sync, its failure a SafetensorsError.
void fsync_path(const std::string& p, bool dir);
/// Writes `text` to `path` and fsyncs it; any failure (a full disk, a quota)
/// throws, so a truncated file is never published.
void write_text_durably(const std::string& path, const std::string& text);
/// "ck/" and "ck" are the same checkpoint (a trailing slash would put the
/// temporary directory "ck/.shardtorch-tmp" inside the one it is to replace).
std::string normalized(const std::string& dir);
/// Where a checkpoint saved to `dir` is: `dir` itself, or the previous one
/// set aside when a save without RENAME_EXCHANGE was interrupted between its
/// two renames (`dir` then has no marker); said on stderr if `announce`.
std::string published_dir(const std::string& dir, const std::string& marker, bool announce = true);
/// Before a save writes anything: `dir` may be replaced only if it is a
/// checkpoint (it has `marker`) or an empty directory, never a directory of
/// other files; the refusal calls it `kind` ("shardtorch checkpoint").
void check_replaceable(const std::string& dir, const std::string& marker, const std::string& kind);
/// Whether `name` is a file of a checkpoint whose marker is `marker`: the
/// marker and the data files of that kind (index.json and rank-R.safetensors;
/// .metadata and *.distcp).
bool own_file(const std::string& name, const std::string& marker);
/// Swaps the finished checkpoint `tmp` in as `dir`, so that at every instant
/// a complete checkpoint is loadable (`dir`, or the one set aside). First,
/// the previous checkpoint's other files (a config.json, notes: anything not
/// own_file and not in `tmp`) are hard-linked (else copied) into `tmp`, so
/// that they stay in `dir`:
/// - no checkpoint at `dir` (absent, or an empty directory): `tmp` is renamed
///   to `dir`; only then is a previous one set aside by an interrupted save
///   removed;
/// - else renameat2's RENAME_EXCHANGE swaps the two in one step;
/// - file systems without it (some network file systems answer EINVAL), or
///   SHARDTORCH_CHECKPOINT_NO_EXCHANGE set: `dir` is renamed aside
///   (DIR.shardtorch-old), `tmp` to `dir`, and the one aside is removed; a
///   writer killed between the two renames leaves the previous checkpoint
///   aside, where loading looks for it (published_dir).
/// Crash points (crash_point): "exchanged", or "previous moved aside" and
/// "new moved in".
void publish(const std::string& tmp, const std::string& dir, const std::string& marker);

/// Which of `writers` writes each of `sizes` (ranges held alike by several
/// ranks, written once): largest first, each to the writer with the fewest
/// elements so far, so that no one writer writes the whole model while the
/// others wait in the next collective.
std::vector<int> spread_over_writers(const std::vector<int64_t>& sizes, int writers);

}  // namespace shardtorch::checkpoint
