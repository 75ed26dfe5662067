#include "checkpoint/dcp_source.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/files.h"
#include "checkpoint/checksum.h"
#include "checkpoint/publish.h"
#include "checkpoint/text_file.h"
#include "shardtorch/checkpoint/safetensors_error.h"

namespace shardtorch::checkpoint::dcp {
namespace {

constexpr const char* kMetadata = ".metadata";
constexpr uint64_t kMaxMetadataBytes = uint64_t{2} << 30;

std::string read_whole(const std::string& path) {
  return read_text_file(path, "DCP metadata", kMaxMetadataBytes, "larger than 2 GiB; not DCP metadata");
}

// Why `dir` holds no checkpoint this code reads, by what it holds instead.
std::string not_a_checkpoint(const std::string& dir) {
  if (!files::exists(dir)) return "DCP checkpoint '" + dir + "': does not exist";
  if (!files::is_directory(dir)) return "DCP checkpoint '" + dir + "': not a directory";
  bool per_rank = false, safetensors = false, tmp = false, distcp = false, sharded = false;
  for (const auto& n : files::list_directory(dir)) {
    if (n == "index.json") sharded = true;
    if (n.size() > 11 && n.rfind("__", 0) == 0 && n.compare(n.size() - 9, 9, ".metadata") == 0) per_rank = true;
    if (n == "model.safetensors.index.json" || (n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0))
      safetensors = true;
    if (n == ".metadata.tmp") tmp = true;
    if (n.size() > 7 && n.compare(n.size() - 7, 7, ".distcp") == 0) distcp = true;
  }
  const std::string where = "DCP checkpoint '" + dir + "': no .metadata";
  if (per_rank)
    return where +
           ", but per-rank __<rank>.metadata files: it was saved with dcp.save(..., use_collectives=False), "
           "whose files each describe one rank's chunks; shardtorch reads checkpoints saved with collectives";
  if (sharded && safetensors)
    return where +
           ", but index.json and per-rank safetensors files: a shardtorch sharded checkpoint; load it with "
           "load_sharded_checkpoint, or convert it with `shardtorch-convert sharded-to-dcp`";
  if (safetensors)
    return where +
           ", but safetensors files: a Hugging Face layout (HuggingFaceStorageWriter); load it with "
           "load_hf_checkpoint";
  if (tmp) return where + ", only .metadata.tmp: the save did not finish";
  if (distcp) return where + " beside its data files: the save did not finish, or the file was lost";
  return where + ": not a DCP checkpoint";
}

}  // namespace

Source::Source(const std::string& dir_arg) {
  dir_ = published_dir(normalized(dir_arg), kMetadata);
  const std::string path = files::join(dir_, kMetadata);
  if (!files::exists(path)) throw SafetensorsError(not_a_checkpoint(dir_));
  const std::string bytes = read_whole(path);
  md_ = parse(bytes, path);
  fingerprint_ = "DCP metadata " + checksum::of(bytes.data(), bytes.size());
  // Every file the metadata names is there and holds its items (a stat:
  // every rank, whichever reads it, fails alike on a missing one).
  auto check = [&](const Storage& st, const std::string& name) {
    auto it = sizes_.find(st.relative_path);
    if (it == sizes_.end()) {
      const std::string full = files::join(dir_, st.relative_path);
      if (!files::exists(full))
        throw SafetensorsError("DCP checkpoint '" + dir_ + "': its metadata names '" + st.relative_path +
                               "', which is not there (copy every file of the checkpoint)");
      if (const std::string kind = files::irregular_kind(full); !kind.empty())
        throw SafetensorsError("DCP checkpoint '" + dir_ + "': '" + st.relative_path + "' is " + kind +
                               ", not a regular file");
      it = sizes_.emplace(st.relative_path, static_cast<uint64_t>(files::file_size(full))).first;
    }
    if (st.offset > it->second || st.length > it->second - st.offset)
      throw SafetensorsError("DCP checkpoint '" + dir_ + "': the item of '" + name + "' is at bytes [" +
                             std::to_string(st.offset) + ", " + std::to_string(st.offset + st.length) + ") of '" +
                             st.relative_path + "', which has " + std::to_string(it->second) +
                             " bytes (truncated, or a file of another save)");
  };
  for (const auto& e : md_.entries) {
    if (!e.tensor) check(e.bytes, e.name);
    for (const auto& c : e.chunks) {
      int64_t v = 1;
      for (int64_t d : c.sizes) v *= d;
      if (v > 0) check(c.storage, e.name);
    }
  }
}

const DataFile& Source::file(const std::string& relative_path) {
  auto& f = files_[relative_path];
  if (!f) {
    f = std::make_unique<DataFile>(files::join(dir_, relative_path), relative_path);
    opened_.push_back(relative_path);
  }
  return *f;
}

const TensorItem& Source::item(const Entry& e, const Chunk& c) {
  auto key = std::make_pair(c.storage.relative_path, c.storage.offset);
  auto it = items_.find(key);
  if (it != items_.end()) return it->second;
  return items_.emplace(key, open_tensor_item(file(c.storage.relative_path), e, c)).first->second;
}

Source::Fill Source::plan(const Entry& e, int64_t begin, int64_t count) {
  Fill fill;
  const int64_t end = begin + count;
  const size_t nd = e.size.size();
  std::vector<int64_t> gstride(nd, 1);
  for (size_t d = nd; d-- > 1;) gstride[d - 1] = gstride[d] * e.size[d];
  int64_t total = 0;
  for (const auto& c : e.chunks) {
    int64_t volume = 1;
    for (int64_t s : c.sizes) volume *= s;
    if (volume == 0) continue;
    if (nd == 0) {  // a 0-d tensor: one element
      if (begin <= 0 && 0 < end) {
        fill.copies.push_back({&item(e, c), 0, -begin, 1});
        total += 1;
      }
      continue;
    }
    // The chunk is runs of L contiguous elements: dimensions after k are
    // whole, so each index of dimensions 0..k-1 gives one run.
    size_t k = nd - 1;
    while (k > 0 && c.offsets[k] == 0 && c.sizes[k] == e.size[k]) --k;
    const int64_t run = c.sizes[k] * gstride[k];
    // The first run to look at: at `begin`'s index in dimensions 0..k-1,
    // clamped into the chunk (a run before `begin` is skipped below), so
    // that reading a few rows of a chunk costs those rows, not the chunk's.
    std::vector<int64_t> idx(k, 0);
    bool past = false;  // an earlier dimension was clamped to the chunk's end: the rest at their ends
    for (size_t d = 0; d < k; ++d) {
      const int64_t at = begin / gstride[d] % e.size[d] - c.offsets[d];
      if (past || at >= c.sizes[d]) {
        idx[d] = c.sizes[d] - 1;
        past = true;
      } else if (at < 0) {
        break;  // this and the later dimensions from 0
      } else {
        idx[d] = at;
      }
    }
    int64_t r = 0;  // the run's index in the chunk
    for (size_t d = 0; d < k; ++d) r = r * c.sizes[d] + idx[d];
    for (;; ++r) {
      int64_t gstart = c.offsets[k] * gstride[k];
      for (size_t d = 0; d < k; ++d) gstart += (c.offsets[d] + idx[d]) * gstride[d];
      if (gstart >= end) break;  // runs go up in flat order
      const int64_t lo = std::max(begin, gstart), hi = std::min(end, gstart + run);
      if (lo < hi) {
        fill.copies.push_back({&item(e, c), r * run + (lo - gstart), lo - begin, hi - lo});
        total += hi - lo;
      }
      size_t d = k;  // the next index of dimensions 0..k-1
      while (d > 0 && ++idx[d - 1] == c.sizes[d - 1]) idx[--d] = 0;
      if (d == 0) break;
    }
  }
  if (total != count)  // the metadata's chunks tile the tensor: cannot happen
    throw SafetensorsError("DCP checkpoint '" + dir_ + "': the chunks of '" + e.name + "' cover " +
                           std::to_string(total) + " of the " + std::to_string(count) + " elements read");
  return fill;
}

int64_t Source::run(const Fill& fill, at::Tensor dst) {
  int64_t bytes = 0;
  for (const auto& c : fill.copies) bytes += read_elements(*c.item, c.from, c.length, dst.narrow(0, c.to, c.length));
  return bytes;
}

std::vector<Box> boxes_of_range(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  std::vector<Box> out;
  if (begin >= end) return out;
  if (shape.empty()) {
    out.push_back({{}, {}, begin, 1});
    return out;
  }
  const std::vector<int64_t> inner_shape(shape.begin() + 1, shape.end());
  int64_t inner = 1;
  for (int64_t d : inner_shape) inner *= d;
  auto sub = [&](int64_t row, int64_t lo, int64_t hi) {  // elements [lo, hi) of one row
    for (Box b : boxes_of_range(inner_shape, lo, hi)) {
      b.offsets.insert(b.offsets.begin(), row);
      b.sizes.insert(b.sizes.begin(), 1);
      b.begin += row * inner;
      out.push_back(std::move(b));
    }
  };
  int64_t r0 = begin / inner;
  const int64_t r1 = end / inner;
  if (r0 == r1) {
    sub(r0, begin % inner, end % inner);
    return out;
  }
  if (begin % inner != 0) sub(r0++, begin % inner, inner);
  if (r1 > r0) {
    Box b;
    b.offsets.assign(shape.size(), 0);
    b.offsets[0] = r0;
    b.sizes = shape;
    b.sizes[0] = r1 - r0;
    b.begin = r0 * inner;
    b.numel = (r1 - r0) * inner;
    out.push_back(std::move(b));
  }
  if (end % inner != 0) sub(r1, 0, end % inner);
  return out;
}

}  // namespace shardtorch::checkpoint::dcp
