#pragma once
// Internal: the items of a DCP data file (__R_K.distcp). Each is a complete
// torch.save zip at (offset, length): archive/data.pkl (a pickle calling
// torch._utils._rebuild_tensor_v2, read with the allow-list reader) and the
// tensor's raw little-endian storage in archive/data/<key>; a BYTE_IO item
// holds a pickled plain value instead. The zip is read with LibTorch's
// PyTorchStreamReader through a bounds-checked slice of the file and written
// with its PyTorchStreamWriter, as torch.save writes it.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "checkpoint/dcp_metadata.h"

namespace shardtorch::checkpoint::dcp {

/// at::ScalarType of a dtype name of dcp_metadata.h ("float32").
at::ScalarType scalar_type_of(const std::string& torch_name);
/// torch's name of a dtype ("bfloat16"); throws for one DCP cannot hold here.
std::string torch_name_of(at::ScalarType t);

/// A data file, open for reading (never a blocking open).
class DataFile {
 public:
  DataFile(const std::string& path, const std::string& name);
  ~DataFile();
  DataFile(const DataFile&) = delete;
  DataFile& operator=(const DataFile&) = delete;
  const std::string& path() const { return path_; }
  const std::string& name() const { return name_; }  // as storage_data names it
  uint64_t size() const { return size_; }
  /// n bytes at `offset`, or an error naming the file (a short read is one).
  void read(uint64_t offset, void* dst, size_t n) const;

 private:
  std::string path_, name_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

/// What an item's data.pkl says of its tensor, and where its bytes are.
struct TensorItem {
  const DataFile* file = nullptr;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> size, stride;
  int64_t storage_offset = 0;
  uint64_t data_offset = 0;  // in the file, of the storage's first byte
  uint64_t data_bytes = 0;
  /// Row-major with no gaps: any range of elements is one range of bytes.
  bool contiguous() const;
};

/// Opens the tensor item of `entry`'s chunk `chunk` in `file` and checks it:
/// a torch.save zip (not a safetensors file: SerializationFormat.SAFETENSORS
/// is refused by name) whose data.pkl passes the allow-list, whose storage
/// is stored (not compressed) inside the item, whose dtype is the metadata's
/// and whose size is the chunk's, and whose view stays inside its storage.
TensorItem open_tensor_item(const DataFile& file, const Entry& entry, const Chunk& chunk);

/// Elements [from, from + count) of the item's tensor in row-major order,
/// into `dst` (1-D, contiguous, `count` elements, any dtype: cast as copy_
/// casts). A contiguous item is read straight into `dst` when the dtypes
/// agree; otherwise through a buffer of those elements (of the whole
/// storage for a strided one). Returns the bytes read from the file.
int64_t read_elements(const TensorItem& item, int64_t from, int64_t count, at::Tensor dst);

/// A BYTE_IO item's value, as Python's repr writes it ("0.01", "(0.9,
/// 0.999)", "['a', 'b']", "None"). Only plain values are read: None, bool,
/// int, float, str, tuple, list and dict, no globals.
std::string read_value_item(const DataFile& file, const Entry& entry);

/// Writes a data file: items one after the other, as FileSystemWriter
/// writes them (no padding between them).
class ItemWriter {
 public:
  /// Creates (or truncates) `path`; `relative_path` is its name in the metadata.
  ItemWriter(const std::string& path, const std::string& relative_path);
  ~ItemWriter();
  ItemWriter(const ItemWriter&) = delete;
  ItemWriter& operator=(const ItemWriter&) = delete;
  /// A tensor item of `t` (contiguous, on the CPU); where it went.
  Storage tensor(const at::Tensor& t);
  /// A BYTE_IO item of the pickled value `pickled`.
  Storage value(const std::string& pickled);
  /// fsync, then close; a failure throws naming the file.
  void finish();
  uint64_t size() const { return size_; }

 private:
  void write(const void* p, size_t n);
  std::string path_, relative_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

/// Appends torch.save's zip of `t` (a contiguous CPU tensor) through `out`
/// and returns its length: data.pkl, the format records and data/0 (64-byte
/// aligned), as torch.save writes to a stream.
uint64_t write_tensor_item(const std::function<void(const void*, size_t)>& out, const at::Tensor& t);
/// The same for a BYTE_IO item: `pickled` is the value's pickle.
uint64_t write_value_item(const std::function<void(const void*, size_t)>& out, const std::string& pickled);

}  // namespace shardtorch::checkpoint::dcp
