#pragma once
// safetensors files of ATen tensors: a validating reader with random access
// (whole tensors or element ranges, so a rank reads only its shard) and an
// atomic writer. Never pickle.
#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardtorch/checkpoint/safetensors_error.h"
#include "shardtorch/export.h"

namespace shardtorch::checkpoint {

struct SafetensorsHeader;
struct TensorRecord;
struct ReaderAccess;

/// "F32" <-> at::kFloat, ... (throws for dtypes safetensors cannot hold).
SHARDTORCH_API std::string dtype_name(at::ScalarType t);
SHARDTORCH_API at::ScalarType scalar_type(const std::string& dtype);

/// Whether loading may cast a saved `from` tensor into a `to` one without
/// being asked to (LoadOptions::allow_lossy_casts): the same dtype; any
/// floating-point dtype to another (rounded as a mixed-precision cast
/// rounds); bool to any; an integer to a wider one that holds all its values
/// (signed to unsigned never); an integer to a floating-point dtype that
/// holds all its values exactly (U8/I8 to F16 or BF16, I16/U16 to F32,
/// I32/U32 to F64). Everything else (floating point to an integer or bool,
/// an integer to a narrower one, I64 to F64, ...) can change values.
SHARDTORCH_API bool is_safe_cast(at::ScalarType from, at::ScalarType to);
/// The safetensors name of a dtype ("F32"), or ATen's where it has none.
SHARDTORCH_API std::string dtype_text(at::ScalarType t);

/// What a file's header says of one tensor (read without its data).
struct SHARDTORCH_API TensorInfo {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t nbytes = 0;  // its bytes in the file
};

class SHARDTORCH_API Reader {
 public:
  /// Opens and validates the file; throws SafetensorsError naming it.
  explicit Reader(const std::string& path);
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  const std::string& path() const { return path_; }
  bool contains(const std::string& name) const;
  /// The tensors' names, in the order of their data in the file.
  std::vector<std::string> names() const;
  /// Every tensor's name, dtype, shape and size, in the order of their data.
  std::vector<TensorInfo> tensors() const;
  /// One tensor's; throws SafetensorsError naming the file if there is none.
  TensorInfo info(const std::string& name) const;
  /// The header's "__metadata__" (empty if it has none).
  const std::map<std::string, std::string>& metadata() const;
  /// The whole tensor, on the CPU.
  at::Tensor read(const std::string& name) const;
  /// `count` elements of the flattened tensor from element `offset`.
  at::Tensor read_range(const std::string& name, int64_t offset, int64_t count) const;

 private:
  friend struct ReaderAccess;  // the library's own access to the parsed header
  const TensorRecord& record(const std::string& name) const;
  void read_bytes(uint64_t file_offset, void* dst, size_t n) const;
  std::string path_;
  int fd_ = -1;
  std::unique_ptr<SafetensorsHeader> header_;
};

/// A tensor to write: its name, dtype and shape, and a function that yields
/// its contiguous CPU bytes when the writer reaches it (so tensors can be
/// produced one at a time, e.g. gathered unit by unit).
struct SHARDTORCH_API PendingTensor {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  std::function<at::Tensor()> produce;
};

/// Writes atomically: to a temporary file beside `path` (".NAME.tmp-HOST-PID"),
/// fsync, rename over `path`, fsync the directory. If the process dies at any
/// point, `path` is either the previous file or the complete new one.
/// `remove_stale_temporaries`: then removes the temporary files of earlier
/// writes of `path` on this host whose process is gone (it scans the
/// directory; a fresh directory has none to remove).
SHARDTORCH_API void write_file(const std::string& path, const std::vector<PendingTensor>& tensors,
                               const std::map<std::string, std::string>& metadata = {},
                               bool remove_stale_temporaries = true);
SHARDTORCH_API void save_file(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata = {},
                              bool remove_stale_temporaries = true);
SHARDTORCH_API std::map<std::string, at::Tensor> load_file(const std::string& path);

/// Fault injection for crash tests. Checkpoint writes call crash_point() with
/// the name of each point at which a crash must leave the previous checkpoint
/// or the complete new one (docs/checkpoints.md lists them); a test's hook
/// kills the process at one. An empty function (the default) removes it.
SHARDTORCH_API void set_crash_hook(std::function<void(const std::string& point)> hook);
SHARDTORCH_API void crash_point(const char* point);

}  // namespace shardtorch::checkpoint
