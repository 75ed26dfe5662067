#pragma once
// Internal: a DCP checkpoint directory open for reading: its metadata read
// and checked, every data file it names checked to be there (a stat, not an
// open) and long enough for its items, files and items opened on demand, and
// the reads that fill a range of a tensor from the chunks overlapping it.
#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/dcp_items.h"
#include "checkpoint/dcp_metadata.h"

namespace shardtorch::checkpoint::dcp {

class Source {
 public:
  /// Reads `dir`/.metadata (or, after an interrupted save, the checkpoint
  /// set aside); refuses by name what is not a DCP checkpoint shardtorch
  /// reads (per-rank metadata of use_collectives=False, Hugging Face's
  /// layout, an unfinished save).
  explicit Source(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const Metadata& metadata() const { return md_; }
  /// The metadata's checksum: the same on every rank reading one checkpoint.
  const std::string& fingerprint() const { return fingerprint_; }
  /// What was opened, in order (files as the metadata names them).
  const std::vector<std::string>& files_opened() const { return opened_; }
  int64_t items_opened() const { return static_cast<int64_t>(items_.size()); }

  const DataFile& file(const std::string& relative_path);
  const TensorItem& item(const Entry& e, const Chunk& c);

  /// Elements [begin, begin + count) of `e` (flattened, row-major) as copies
  /// from the items of the chunks that overlap them; opens and checks those
  /// items (and no other), reads no tensor data.
  struct Fill {
    struct Copy {
      const TensorItem* item;
      int64_t from, to, length;  // item-local element, destination element, elements
    };
    std::vector<Copy> copies;
  };
  Fill plan(const Entry& e, int64_t begin, int64_t count);
  /// Runs a plan into `dst` (1-D, contiguous, the plan's count); returns the
  /// bytes read.
  static int64_t run(const Fill& fill, at::Tensor dst);

 private:
  std::string dir_;
  Metadata md_;
  std::string fingerprint_;
  std::map<std::string, uint64_t> sizes_;  // every file the metadata names
  std::map<std::string, std::unique_ptr<DataFile>> files_;
  std::map<std::pair<std::string, uint64_t>, TensorItem> items_;
  std::vector<std::string> opened_;
};

/// A flat range [begin, end) of a tensor of `shape` as the boxes it is made
/// of (at most 2 per dimension less one), in order; each is a contiguous
/// range of elements starting at `begin` (flat).
struct Box {
  std::vector<int64_t> offsets, sizes;
  int64_t begin = 0, numel = 0;
};
std::vector<Box> boxes_of_range(const std::vector<int64_t>& shape, int64_t begin, int64_t end);

}  // namespace shardtorch::checkpoint::dcp
