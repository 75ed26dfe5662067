#include "checkpoint/dcp_items.h"

#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <map>
#include <memory>

#include "base/log.h"
#include "base/errors.h"
#include "base/files.h"
#include "checkpoint/pickle_reader.h"
#include "shardtorch/checkpoint/safetensors_error.h"

namespace shardtorch::checkpoint::dcp {
namespace {

using pickle::Kind;
using pickle::Node;

const std::map<std::string, at::ScalarType>& by_name() {
  static const std::map<std::string, at::ScalarType> m = {
      {"float64", at::kDouble}, {"float32", at::kFloat}, {"float16", at::kHalf},  {"bfloat16", at::kBFloat16},
      {"int64", at::kLong},     {"int32", at::kInt},     {"int16", at::kShort},   {"int8", at::kChar},
      {"uint8", at::kByte},     {"bool", at::kBool},     {"uint16", at::kUInt16}, {"uint32", at::kUInt32},
      {"uint64", at::kUInt64}};
  return m;
}

// torch.save's typed storages (data.pkl's persistent ids) and their dtypes.
const std::map<std::string, at::ScalarType>& storages() {
  static const std::map<std::string, at::ScalarType> m = {
      {"DoubleStorage", at::kDouble},     {"FloatStorage", at::kFloat}, {"HalfStorage", at::kHalf},
      {"BFloat16Storage", at::kBFloat16}, {"LongStorage", at::kLong},   {"IntStorage", at::kInt},
      {"ShortStorage", at::kShort},       {"CharStorage", at::kChar},   {"ByteStorage", at::kByte},
      {"BoolStorage", at::kBool}};
  return m;
}

const pickle::Policy& tensor_policy() {
  static const pickle::Policy p = [] {
    pickle::Policy p;
    p.opcodes = pickle::data_opcodes();
    for (uint8_t op : std::initializer_list<uint8_t>{'c', 0x93, 'R', 'Q'})
      p.opcodes.insert(op);  // GLOBAL, REDUCE, BINPERSID
    p.globals = {{"torch._utils", "_rebuild_tensor_v2"},
                 {"torch._utils", "_rebuild_tensor_v3"},
                 {"collections", "OrderedDict"},
                 {"torch.storage", "UntypedStorage"}};
    for (const auto& [name, t] : storages()) p.globals.insert({"torch", name});
    for (const auto& [name, t] : by_name()) p.globals.insert({"torch", name});
    return p;
  }();
  return p;
}

// A bounds-checked slice [offset, offset + length) of a data file, the
// "file" PyTorchStreamReader reads.
class Slice : public caffe2::serialize::ReadAdapterInterface {
 public:
  Slice(const DataFile& f, uint64_t offset, uint64_t length) : f_(f), offset_(offset), length_(length) {}
  size_t size() const override { return length_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char*) const override {
    if (pos >= length_) return 0;
    n = static_cast<size_t>(std::min<uint64_t>(n, length_ - pos));
    f_.read(offset_ + pos, buf, n);
    return n;
  }

 private:
  const DataFile& f_;
  uint64_t offset_, length_;
};

std::string item_where(const DataFile& f, const Storage& st, const std::string& name) {
  return "DCP data file '" + f.path() + "': the item of '" + name + "' at bytes [" + std::to_string(st.offset) + ", " +
         std::to_string(st.offset + st.length) + ")";
}

// The zip of an item: opened, its data.pkl read and parsed.
struct OpenItem {
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> zip;
  pickle::Tree tree;
  uint64_t pkl_at = 0;  // data.pkl's offset in the file, for the pickle's byte numbers
};

OpenItem open_item(const DataFile& f, const Storage& st, const std::string& where, const pickle::Policy& policy) {
  if (st.offset > f.size() || st.length > f.size() - st.offset)
    throw SafetensorsError(where + " runs past the end of the file (" + std::to_string(f.size()) +
                           " bytes): truncated, or a file of another save");
  unsigned char magic[8] = {};
  if (st.length >= 4) f.read(st.offset, magic, std::min<uint64_t>(8, st.length));
  if (std::memcmp(magic, "PK\x03\x04", 4) != 0) {
    // SerializationFormat.SAFETENSORS puts a safetensors file in each
    // .distcp (an 8-byte header length, then '{'), which dcp.load cannot read.
    if (st.length >= 9) {
      unsigned char brace = 0;
      f.read(st.offset + 8, &brace, 1);
      if (brace == '{')
        throw SafetensorsError(where +
                               " is part of a safetensors file: the checkpoint was saved with "
                               "serialization_format=SerializationFormat.SAFETENSORS, which shardtorch does not "
                               "read (nor does torch's dcp.load): save with the default format");
    }
    throw SafetensorsError(where +
                           " is not a torch.save zip (it does not start with PK\\3\\4): a corrupt file, or "
                           "offsets of another save");
  }
  OpenItem item;
  try {
    item.zip =
        std::make_unique<caffe2::serialize::PyTorchStreamReader>(std::make_shared<Slice>(f, st.offset, st.length));
    if (!item.zip->hasRecord("data.pkl")) throw SafetensorsError(where + ": the zip has no data.pkl");
    const size_t n = item.zip->getRecordSize("data.pkl");
    if (n > st.length) throw SafetensorsError(where + ": data.pkl is larger than the item");
    item.pkl_at = st.offset + item.zip->getRecordOffset("data.pkl");
    std::string pkl(n, '\0');
    item.zip->getRecord("data.pkl", pkl.data(), n);
    item.tree =
        pickle::parse(reinterpret_cast<const uint8_t*>(pkl.data()), n, policy, where + ", data.pkl", item.pkl_at);
  } catch (const SafetensorsError&) {
    throw;
  } catch (const std::exception& e) {
    throw SafetensorsError(where + ": not a readable torch.save zip: " + detail::message_of(e));
  }
  return item;
}

std::string dims(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// Python's repr of a plain value (depth-limited: the pickle may share or
// nest objects without bound).
std::string repr(const pickle::Tree& t, uint32_t id, int depth, size_t& budget, const std::string& where) {
  const Node& n = t.at(id);
  if (depth > 32 || budget-- == 0) throw SafetensorsError(where + ": the value nests too deeply");
  auto seq = [&](const char* open, const char* close, bool one_comma) {
    std::string s = open;
    for (size_t i = 0; i < n.items.size(); ++i) s += (i ? ", " : "") + repr(t, n.items[i], depth + 1, budget, where);
    if (one_comma && n.items.size() == 1) s += ",";
    return s + close;
  };
  switch (n.kind) {
    case Kind::None:
      return "None";
    case Kind::Bool:
      return n.b ? "True" : "False";
    case Kind::Int:
      return std::to_string(n.i);
    case Kind::Float: {
      char buf[64];
      auto r = std::to_chars(buf, buf + sizeof(buf), n.f);
      std::string s(buf, r.ptr);
      if (s.find_first_of(".eni") == std::string::npos) s += ".0";  // 1.0, not 1
      return s;
    }
    case Kind::String: {
      std::string s = "'";
      for (char c : n.text) s += (c == '\'' || c == '\\') ? std::string("\\") + c : std::string(1, c);
      return s + "'";
    }
    case Kind::Tuple:
      return seq("(", ")", true);
    case Kind::List:
      return seq("[", "]", false);
    case Kind::Dict: {
      std::string s = "{";
      for (size_t i = 0; i + 1 < n.items.size(); i += 2)
        s += (i ? ", " : "") + repr(t, n.items[i], depth + 1, budget, where) + ": " +
             repr(t, n.items[i + 1], depth + 1, budget, where);
      return s + "}";
    }
    default:
      throw SafetensorsError(where + ": holds a " + std::string(pickle::kind_name(n.kind)) + ", not a plain value");
  }
}

}  // namespace

at::ScalarType scalar_type_of(const std::string& torch_name) {
  auto it = by_name().find(torch_name);
  if (it == by_name().end()) throw SafetensorsError("DCP: dtype torch." + torch_name + " is not read");
  return it->second;
}

std::string torch_name_of(at::ScalarType t) {
  for (const auto& [name, s] : by_name())
    if (s == t) return name;
  throw SafetensorsError(std::string("DCP: a tensor of dtype ") + c10::toString(t) + " cannot be written");
}

DataFile::DataFile(const std::string& path, const std::string& name) : path_(path), name_(name) {
  std::string why;
  fd_ = files::open_regular_for_reading(path, why);
  if (fd_ < 0) throw SafetensorsError("DCP data file '" + path + "': cannot open: " + why);
  SHARDTORCH_DEBUG("opened '", path, "' for reading");
  struct stat st;
  if (::fstat(fd_, &st) != 0) {
    const std::string err = std::strerror(errno);
    ::close(fd_);
    throw SafetensorsError("DCP data file '" + path + "': cannot stat: " + err);
  }
  size_ = static_cast<uint64_t>(st.st_size);
}

DataFile::~DataFile() {
  if (fd_ >= 0) ::close(fd_);
}

void DataFile::read(uint64_t offset, void* dst, size_t n) const {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw SafetensorsError("DCP data file '" + path_ + "': read failed: " + std::strerror(errno));
    if (r == 0)
      throw SafetensorsError("DCP data file '" + path_ + "': ends at byte " + std::to_string(offset) +
                             ", before the data it should hold (truncated?)");
    shardtorch::detail::count_io(r);
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

bool TensorItem::contiguous() const {
  int64_t expect = 1;
  for (size_t d = size.size(); d-- > 0;) {
    if (size[d] != 1 && stride[d] != expect) return false;
    expect *= size[d];
  }
  return true;
}

namespace {

// What an item's data.pkl says (torch.save of one tensor): dtype, storage
// offset, size and stride; the storage's record name and its bytes. Only the
// rebuild calls torch.save writes are accepted.
TensorItem read_tensor_pickle(const pickle::Tree& t, const std::string& where, std::string& record,
                              int64_t& storage_bytes) {
  auto bad = [&](const Node& n, const std::string& what) -> SafetensorsError {
    return SafetensorsError(where + ", data.pkl: byte " + std::to_string(n.at) + ": " + what);
  };
  auto ints = [&](uint32_t id, const char* what) {
    const Node& n = t.at(id);
    if (n.kind != Kind::Tuple) throw bad(n, std::string(what) + " is not a tuple");
    std::vector<int64_t> v;
    for (uint32_t x : n.items) {
      const Node& d = t.at(x);
      if (d.kind != Kind::Int || d.i < 0) throw bad(d, std::string(what) + " holds something other than a size");
      v.push_back(d.i);
    }
    return v;
  };
  const Node& root = t.at(t.root());
  const bool v3 = root.kind == Kind::Reduce && t.at(root.items[0]).name == "_rebuild_tensor_v3";
  if (root.kind != Kind::Reduce || (t.at(root.items[0]).name != "_rebuild_tensor_v2" && !v3))
    throw bad(root, "not a tensor (torch._utils._rebuild_tensor_v2 or _v3)");
  const Node& args = t.at(root.items[1]);
  if (args.items.size() != (v3 ? 7u : 6u)) throw bad(args, "the tensor's arguments are not the ones torch.save writes");
  const Node& pid = t.at(args.items[0]);
  if (pid.kind != Kind::PersId || t.at(pid.items[0]).kind != Kind::Tuple || t.at(pid.items[0]).items.size() != 5)
    throw bad(pid, "the tensor's storage is not a persistent id ('storage', type, key, location, numel)");
  const auto& p = t.at(pid.items[0]).items;
  const Node& type = t.at(p[1]);
  const Node& key = t.at(p[2]);
  const Node& numel = t.at(p[4]);
  if (t.at(p[0]).kind != Kind::String || t.at(p[0]).text != "storage" || type.kind != Kind::Global ||
      key.kind != Kind::String || numel.kind != Kind::Int || numel.i < 0)
    throw bad(pid, "the tensor's storage is not a persistent id ('storage', type, key, location, numel)");
  TensorItem out;
  if (v3) {
    const Node& dt = t.at(args.items[6]);
    if (type.name != "UntypedStorage" || dt.kind != Kind::Global || !by_name().count(dt.name))
      throw bad(dt, "a _rebuild_tensor_v3 tensor of an unread dtype");
    out.dtype = by_name().at(dt.name);
    storage_bytes = numel.i;
  } else {
    auto s = storages().find(type.name);
    if (type.text != "torch" || s == storages().end()) throw bad(type, "storage type " + type.name + " is not read");
    out.dtype = s->second;
    if (numel.i > (int64_t{1} << 62) / 8) throw bad(numel, "a storage too large");
    storage_bytes = numel.i * static_cast<int64_t>(c10::elementSize(out.dtype));
  }
  const Node& off = t.at(args.items[1]);
  if (off.kind != Kind::Int || off.i < 0) throw bad(off, "the storage offset is not a size");
  out.storage_offset = off.i;
  out.size = ints(args.items[2], "the size");
  out.stride = ints(args.items[3], "the stride");
  if (out.stride.size() != out.size.size()) throw bad(args, "size and stride differ in length");
  record = "data/" + key.text;
  return out;
}

// The tensor agrees with the metadata's entry and chunk, and its view stays
// inside its storage of `storage_bytes`.
void check_tensor_item(const TensorItem& out, const Entry& entry, const Chunk& chunk, int64_t storage_bytes,
                       const std::string& where) {
  const at::ScalarType want = scalar_type_of(entry.dtype);
  if (out.dtype != want)
    throw SafetensorsError(where + " holds a " + c10::toString(out.dtype) + " tensor, but the metadata says " +
                           entry.dtype + " (a file of another save?)");
  if (out.size != chunk.sizes)
    throw SafetensorsError(where + " holds a tensor of size " + dims(out.size) + ", but the metadata's chunk at " +
                           dims(chunk.offsets) + " has size " + dims(chunk.sizes));
  // The view must stay inside the storage: its last element's offset.
  const int64_t esize = static_cast<int64_t>(c10::elementSize(out.dtype));
  __int128 last = out.storage_offset;
  bool empty = false;
  for (size_t d = 0; d < out.size.size(); ++d) {
    if (out.size[d] == 0)
      empty = true;
    else
      last += static_cast<__int128>(out.size[d] - 1) * out.stride[d];
  }
  if (!empty && (last + 1) * esize > storage_bytes)
    throw SafetensorsError(where + ": its view (offset " + std::to_string(out.storage_offset) + ", stride " +
                           dims(out.stride) + ") reaches past its storage of " + std::to_string(storage_bytes) +
                           " bytes");
}

// Where the storage record's bytes lie in the data file: inside the item,
// stored uncompressed, little-endian.
void locate_record(const DataFile& f, OpenItem& item, const Chunk& chunk, const std::string& record,
                   int64_t storage_bytes, const std::string& where, TensorItem& out) {
  try {
    if (!item.zip->hasRecord(record)) throw SafetensorsError(where + ": the zip has no record '" + record + "'");
    const uint64_t rsize = item.zip->getRecordSize(record);
    if (rsize != static_cast<uint64_t>(storage_bytes))
      throw SafetensorsError(where + ": its storage record has " + std::to_string(rsize) +
                             " bytes, its data.pkl says " + std::to_string(storage_bytes));
    // Stored, not compressed: the local header's method (bytes 8-9) is 0.
    const uint64_t header = item.zip->getRecordHeaderOffset(record);
    const uint64_t data = item.zip->getRecordOffset(record);
    unsigned char lh[30];
    if (header + 30 > chunk.storage.length || data < header + 30 || data > chunk.storage.length ||
        rsize > chunk.storage.length - data)
      throw SafetensorsError(where + ": its storage record lies outside the item");
    f.read(chunk.storage.offset + header, lh, 30);
    if (std::memcmp(lh, "PK\x03\x04", 4) != 0 || lh[8] != 0 || lh[9] != 0)
      throw SafetensorsError(where + ": its storage record is compressed (torch.save stores them uncompressed)");
    out.data_offset = chunk.storage.offset + data;
    out.data_bytes = rsize;
    if (item.zip->hasRecord("byteorder")) {
      char order[16] = {};
      const size_t n = item.zip->getRecordSize("byteorder");
      if (n < sizeof(order)) item.zip->getRecord("byteorder", order, n);
      if (std::string(order, std::min(n, sizeof(order))) != "little")
        throw SafetensorsError(where + ": its byte order is not little-endian");
    }
  } catch (const SafetensorsError&) {
    throw;
  } catch (const std::exception& e) {
    throw SafetensorsError(where + ": not a readable torch.save zip: " + detail::message_of(e));
  }
}

}  // namespace

TensorItem open_tensor_item(const DataFile& f, const Entry& entry, const Chunk& chunk) {
  const std::string where = item_where(f, chunk.storage, entry.name);
  OpenItem item = open_item(f, chunk.storage, where, tensor_policy());
  std::string record;
  int64_t storage_bytes = 0;
  TensorItem out = read_tensor_pickle(item.tree, where, record, storage_bytes);
  out.file = &f;
  check_tensor_item(out, entry, chunk, storage_bytes, where);
  locate_record(f, item, chunk, record, storage_bytes, where, out);
  return out;
}

int64_t read_elements(const TensorItem& item, int64_t from, int64_t count, at::Tensor dst) {
  if (count == 0) return 0;
  const int64_t esize = static_cast<int64_t>(c10::elementSize(item.dtype));
  if (item.contiguous()) {
    const uint64_t at = item.data_offset + static_cast<uint64_t>((item.storage_offset + from) * esize);
    const size_t n = static_cast<size_t>(count * esize);
    if (dst.scalar_type() == item.dtype) {
      item.file->read(at, dst.data_ptr(), n);
    } else {
      at::Tensor tmp = at::empty({count}, at::TensorOptions().dtype(item.dtype));
      item.file->read(at, tmp.data_ptr(), n);
      dst.copy_(tmp);
    }
    return static_cast<int64_t>(n);
  }
  // Strided (a transposed tensor saved as it was): its whole storage, viewed.
  at::Tensor storage =
      at::empty({static_cast<int64_t>(item.data_bytes) / esize}, at::TensorOptions().dtype(item.dtype));
  item.file->read(item.data_offset, storage.data_ptr(), static_cast<size_t>(item.data_bytes));
  at::Tensor view = storage.as_strided(item.size, item.stride, item.storage_offset);
  dst.copy_(view.reshape({-1}).narrow(0, from, count));
  return static_cast<int64_t>(item.data_bytes);
}

std::string read_value_item(const DataFile& f, const Entry& entry) {
  const std::string where = item_where(f, entry.bytes, entry.name);
  static const pickle::Policy plain = [] {
    pickle::Policy p;
    p.opcodes = pickle::data_opcodes();
    return p;
  }();
  OpenItem item = open_item(f, entry.bytes, where, plain);
  size_t budget = 16 * item.tree.size() + 1024;
  return repr(item.tree, item.tree.root(), 0, budget, where + ", data.pkl");
}

namespace {

// torch.save's records around the pickle, as it writes them to a stream.
uint64_t write_zip(const std::function<void(const void*, size_t)>& out, const std::string& pkl, const void* data,
                   size_t bytes, bool tensor) {
  uint64_t written = 0;
  caffe2::serialize::PyTorchStreamWriter w([&](const void* p, size_t n) -> size_t {
    out(p, n);
    written += n;
    return n;
  });
  w.writeRecord("data.pkl", pkl.data(), pkl.size());
  w.writeRecord(".format_version", "1", 1);
  w.writeRecord(".storage_alignment", "64", 2);
  w.writeRecord("byteorder", "little", 6);
  if (tensor) w.writeRecord("data/0", data, bytes);
  w.writeEndOfFile();
  return written;
}

}  // namespace

uint64_t write_tensor_item(const std::function<void(const void*, size_t)>& out, const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "write_tensor_item: a contiguous CPU tensor");
  static const std::map<at::ScalarType, std::string> storage_of = [] {
    std::map<at::ScalarType, std::string> m;
    for (const auto& [name, s] : storages()) m[s] = name;
    return m;
  }();
  auto typed = storage_of.find(t.scalar_type());
  pickle::Writer w;
  w.global("torch._utils", typed != storage_of.end() ? "_rebuild_tensor_v2" : "_rebuild_tensor_v3");
  w.mark().mark().string("storage");
  if (typed != storage_of.end())
    w.global("torch", typed->second);
  else
    w.global("torch.storage", "UntypedStorage");
  w.string("0").string("cpu");
  w.integer(typed != storage_of.end() ? t.numel() : t.numel() * static_cast<int64_t>(t.element_size()));
  w.tuple().persid().integer(0).mark();
  for (int64_t d : t.sizes()) w.integer(d);
  w.tuple().mark();
  for (int64_t s : t.strides()) w.integer(s);
  w.tuple().boolean(false).global("collections", "OrderedDict").empty_tuple().reduce();
  if (typed == storage_of.end()) w.global("torch", torch_name_of(t.scalar_type()));
  w.tuple().reduce();
  return write_zip(out, w.finish(), t.data_ptr(), t.numel() * t.element_size(), true);
}

uint64_t write_value_item(const std::function<void(const void*, size_t)>& out, const std::string& pickled) {
  return write_zip(out, pickled, nullptr, 0, false);
}

ItemWriter::ItemWriter(const std::string& path, const std::string& relative_path)
    : path_(path), relative_(relative_path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw SafetensorsError("DCP data file '" + path + "': cannot create: " + std::strerror(errno));
  SHARDTORCH_DEBUG("opened '", path, "' for writing");
}

ItemWriter::~ItemWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void ItemWriter::write(const void* p, size_t n) {
  const auto* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd_, c, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) throw SafetensorsError("DCP data file '" + path_ + "': write failed: " + std::strerror(errno));
    shardtorch::detail::count_io(w);
    c += w;
    n -= static_cast<size_t>(w);
    size_ += static_cast<uint64_t>(w);
  }
}

Storage ItemWriter::tensor(const at::Tensor& t) {
  Storage st{relative_, size_, 0};
  st.length = write_tensor_item([this](const void* p, size_t n) { write(p, n); }, t);
  return st;
}

Storage ItemWriter::value(const std::string& pickled) {
  Storage st{relative_, size_, 0};
  st.length = write_value_item([this](const void* p, size_t n) { write(p, n); }, pickled);
  return st;
}

void ItemWriter::finish() {
  if (::fsync(fd_) != 0 && errno != EINVAL)
    throw SafetensorsError("DCP data file '" + path_ + "': fsync failed: " + std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) throw SafetensorsError("DCP data file '" + path_ + "': close failed: " + std::strerror(errno));
}

}  // namespace shardtorch::checkpoint::dcp
