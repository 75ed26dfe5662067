#pragma once
// The sharded checkpoint's index.json: its entries and its parsing (the
// checksums it records: checksum.h). No LibTorch here, so that the fuzz target
// (tests/fuzz/fuzz_checkpoint_index.cpp) builds it alone with Boost.JSON.
#include <boost/json.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shardtorch::checkpoint::index_format {

/// The newest format this reads. An index is written as 1 unless an entry
/// holds several runs (2): a reader of format 1 would misread those.
constexpr int64_t kFormatVersion = 2;

/// One saved range: elements [begin, end) of a parameter's (or buffer's, or
/// optimizer state's) flattened values, stored as `tensor` in `file`. With
/// rows > 1 (format 2) the entry holds `rows` such runs, run i being
/// elements [begin + i * stride, end + i * stride), stride >= end - begin,
/// one after the other in its tensor: a row-wise split slice's rows.
struct Entry {
  std::string name, kind;  // parameter or buffer name; param, buffer, exp_avg, exp_avg_sq, ...
  int64_t begin = 0, end = 0;
  int64_t step = 0;  // optimizer state: the optimizer's step count for this range
  std::string file, tensor;
  int64_t rows = 1, stride = 0;
};

/// One past the entry's last element.
inline int64_t reach(const Entry& e) { return e.end + (e.rows - 1) * e.stride; }
/// The elements the entry's tensor holds.
inline int64_t saved_numel(const Entry& e) { return e.rows * (e.end - e.begin); }
/// The format an index of `entries` is written in: 2 when an entry holds several runs.
int64_t format_version_of(const std::vector<Entry>& entries);
/// The same, of entries as entry_json() writes them.
int64_t format_version_of(const boost::json::array& entries);

std::string tensor_key(const Entry& e);

struct Index {
  int64_t version = 0, world_size = 0, step = 0;
  std::string strategy;
  std::vector<Entry> entries;
  std::map<std::string, std::pair<int64_t, std::string>> files;  // name -> (size, checksum)
  std::map<std::string, std::string> user_state;
  // Every parameter (under each of its names) and buffer; absent in
  // checkpoints written before shapes were recorded.
  std::optional<std::map<std::string, std::vector<int64_t>>> shapes;
  std::string fingerprint;  // the step and the index's checksum: ranks compare it
  /// The entries of each (name, kind): their positions in `entries` ordered
  /// by begin, and at each position the largest reach() up to it (so that the
  /// entries overlapping a range are found without a pass over all of them).
  struct Ranges {
    std::vector<size_t> order;
    std::vector<int64_t> max_end;
  };
  std::map<std::pair<std::string, std::string>, Ranges> ranges;  // set by parse_index
};

boost::json::object entry_json(const Entry& e);
/// The strategies an index may name: those strategy_name() gives.
bool known_strategy(const std::string& name);
/// Parses and checks index.json's text (`path` names it in errors): any
/// malformed, mistyped or out-of-range content is a SafetensorsError naming
/// the file, never a crash or an unchecked value.
Index parse_index(const std::string& text, const std::string& path);

}  // namespace shardtorch::checkpoint::index_format
