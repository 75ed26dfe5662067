#include "shardtorch/checkpoint/safetensors.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "base/log.h"
#include "base/files.h"
#include "checkpoint/reader_access.h"

namespace shardtorch::checkpoint {
namespace {

[[noreturn]] void sys_fail(const std::string& file, const std::string& what) {
  throw SafetensorsError("safetensors file '" + file + "': " + what + ": " + std::strerror(errno));
}

void write_all(int fd, const void* data, size_t n, uint64_t at, const std::string& file) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(at));
    if (w < 0) {
      if (errno == EINTR) continue;
      sys_fail(file, "write failed");
    }
    shardtorch::detail::count_io(w);
    p += w;
    n -= static_cast<size_t>(w);
    at += static_cast<uint64_t>(w);
  }
}

}  // namespace

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return "F64";
    case at::kFloat:
      return "F32";
    case at::kHalf:
      return "F16";
    case at::kBFloat16:
      return "BF16";
    case at::kLong:
      return "I64";
    case at::kInt:
      return "I32";
    case at::kShort:
      return "I16";
    case at::kChar:
      return "I8";
    case at::kByte:
      return "U8";
    case at::kUInt16:
      return "U16";
    case at::kUInt32:
      return "U32";
    case at::kUInt64:
      return "U64";
    case at::kBool:
      return "BOOL";
    default:
      throw SafetensorsError(std::string("safetensors cannot hold dtype ") + c10::toString(t));
  }
}

at::ScalarType scalar_type(const std::string& d) {
  if (d == "F64") return at::kDouble;
  if (d == "F32") return at::kFloat;
  if (d == "F16") return at::kHalf;
  if (d == "BF16") return at::kBFloat16;
  if (d == "I64") return at::kLong;
  if (d == "I32") return at::kInt;
  if (d == "I16") return at::kShort;
  if (d == "I8") return at::kChar;
  if (d == "U8") return at::kByte;
  if (d == "U16") return at::kUInt16;
  if (d == "U32") return at::kUInt32;
  if (d == "U64") return at::kUInt64;
  if (d == "BOOL") return at::kBool;
  throw SafetensorsError("safetensors dtype '" + d + "' has no ATen equivalent here");
}

namespace {
// Bits of magnitude an integer dtype holds (bool: 1), or the significand
// bits of a floating-point one; 0 for dtypes outside the rule.
int value_bits(at::ScalarType t) {
  switch (t) {
    case at::kBool:
      return 1;
    case at::kByte:
      return 8;
    case at::kChar:
      return 7;
    case at::kUInt16:
      return 16;
    case at::kShort:
      return 15;
    case at::kUInt32:
      return 32;
    case at::kInt:
      return 31;
    case at::kUInt64:
      return 64;
    case at::kLong:
      return 63;
    case at::kBFloat16:
      return 8;
    case at::kHalf:
      return 11;
    case at::kFloat:
      return 24;
    case at::kDouble:
      return 53;
    default:
      return 0;
  }
}
bool is_float(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble; }
bool is_signed_integer(at::ScalarType t) {
  return t == at::kChar || t == at::kShort || t == at::kInt || t == at::kLong;
}
}  // namespace

bool is_safe_cast(at::ScalarType from, at::ScalarType to) {
  if (from == to) return true;
  if (value_bits(from) == 0 || value_bits(to) == 0) return false;
  if (is_float(from)) return is_float(to);
  if (to == at::kBool) return false;
  if (is_signed_integer(from) && !is_float(to) && !is_signed_integer(to)) return false;
  return value_bits(from) <= value_bits(to);
}

std::string dtype_text(at::ScalarType t) {
  try {
    return dtype_name(t);
  } catch (const SafetensorsError&) {
    return c10::toString(t);
  }
}

Reader::Reader(const std::string& path) : path_(path) {
  // Never a plain open(): on a FIFO it would wait for a writer, forever.
  std::string why;
  fd_ = files::open_regular_for_reading(path, why);
  if (fd_ < 0) throw SafetensorsError("safetensors file '" + path + "': cannot open: " + why);
  SHARDTORCH_DEBUG("opened '", path, "' for reading");
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    ::close(fd_);
    sys_fail(path, "cannot stat");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  try {
    uint8_t len[8] = {0};
    size_t have = size < 8 ? static_cast<size_t>(size) : 8;
    read_bytes(0, len, have);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
    std::vector<uint8_t> prefix(8);
    std::memcpy(prefix.data(), len, 8);
    if (size >= 8 && n <= kMaxHeaderBytes && n <= size - 8) {
      prefix.resize(8 + n);
      read_bytes(8, prefix.data() + 8, n);
    }
    header_ = std::make_unique<SafetensorsHeader>(parse_header(prefix.data(), prefix.size(), size, path));
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

Reader::~Reader() {
  if (fd_ >= 0) ::close(fd_);
}

void Reader::read_bytes(uint64_t off, void* dst, size_t n) const {
  char* p = static_cast<char*>(dst);
  while (n > 0) {
    ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      sys_fail(path_, "read failed");
    }
    if (r == 0) throw SafetensorsError("safetensors file '" + path_ + "': unexpected end of file (was it truncated?)");
    shardtorch::detail::count_io(r);
    p += r;
    off += static_cast<uint64_t>(r);
    n -= static_cast<size_t>(r);
  }
}

bool Reader::contains(const std::string& name) const { return header_->find(name) != nullptr; }

std::vector<std::string> Reader::names() const {
  std::vector<std::string> out;
  out.reserve(header_->tensors.size());
  for (const auto& r : header_->tensors) out.push_back(r.name);
  return out;
}

const std::map<std::string, std::string>& Reader::metadata() const { return header_->metadata; }

namespace {
TensorInfo info_of(const TensorRecord& r) {
  return TensorInfo{r.name, scalar_type(r.dtype), r.shape, static_cast<int64_t>(r.end - r.begin)};
}
}  // namespace

std::vector<TensorInfo> Reader::tensors() const {
  std::vector<TensorInfo> out;
  out.reserve(header_->tensors.size());
  for (const auto& r : header_->tensors) out.push_back(info_of(r));
  return out;
}

TensorInfo Reader::info(const std::string& name) const { return info_of(record(name)); }

const TensorRecord& Reader::record(const std::string& name) const {
  const auto* r = header_->find(name);
  if (r == nullptr) throw SafetensorsError("safetensors file '" + path_ + "': no tensor named '" + name + "'");
  return *r;
}

at::Tensor Reader::read(const std::string& name) const {
  const auto& r = record(name);
  at::Tensor t = at::empty(r.shape, at::TensorOptions().dtype(scalar_type(r.dtype)));
  read_bytes(header_->data_start + r.begin, t.data_ptr(), static_cast<size_t>(r.end - r.begin));
  return t;
}

at::Tensor Reader::read_range(const std::string& name, int64_t offset, int64_t count) const {
  const auto& r = record(name);
  const uint64_t es = dtype_size(r.dtype);
  const uint64_t numel = (r.end - r.begin) / es;
  if (offset < 0 || count < 0 || static_cast<uint64_t>(offset) + static_cast<uint64_t>(count) > numel)
    throw SafetensorsError("safetensors file '" + path_ + "': elements [" + std::to_string(offset) + ", " +
                           std::to_string(offset + count) + ") of '" + name + "' are outside its " +
                           std::to_string(numel) + " elements");
  at::Tensor t = at::empty({count}, at::TensorOptions().dtype(scalar_type(r.dtype)));
  read_bytes(header_->data_start + r.begin + static_cast<uint64_t>(offset) * es, t.data_ptr(),
             static_cast<size_t>(count) * es);
  return t;
}

namespace {

// The records of `tensors`, laid out by element size, largest first (as
// Python's safetensors does), the given order kept within a size: every
// tensor then starts at a multiple of its element size (sizes are powers of
// two, the data at a multiple of 8), which readers that map the file and
// cast in place need.
std::vector<TensorRecord> laid_out(const std::vector<PendingTensor>& tensors) {
  std::vector<TensorRecord> records;
  for (const auto& t : tensors) {
    TensorRecord r;
    r.name = t.name;
    r.dtype = dtype_name(t.dtype);
    r.shape = t.shape;
    records.push_back(std::move(r));
  }
  std::vector<size_t> layout(tensors.size());
  for (size_t i = 0; i < layout.size(); ++i) layout[i] = i;
  std::stable_sort(layout.begin(), layout.end(),
                   [&](size_t a, size_t b) { return dtype_size(records[a].dtype) > dtype_size(records[b].dtype); });
  uint64_t at = 0;
  for (size_t i : layout) {
    TensorRecord& r = records[i];
    uint64_t bytes = dtype_size(r.dtype);
    for (int64_t d : r.shape) bytes *= static_cast<uint64_t>(d);
    r.begin = at;
    r.end = at + bytes;
    at = r.end;
  }
  return records;
}

// `tmp` written and synced: the header, then each tensor at its place,
// produced in the given order (a producer may run a collective:
// save_full_state_dict gathers as it goes). On failure `tmp` is removed.
void write_temporary(const std::string& tmp, const std::string& path, const std::string& header,
                     const std::vector<PendingTensor>& tensors, const std::vector<TensorRecord>& records) {
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) sys_fail(tmp, "cannot create");
  SHARDTORCH_DEBUG("opened '", tmp, "' for writing (", path, ")");
  try {
    write_all(fd, header.data(), header.size(), 0, tmp);
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (i == 1) crash_point("file partly written");
      at::Tensor t = tensors[i].produce().contiguous().cpu();
      const uint64_t want = records[i].end - records[i].begin;
      if (t.scalar_type() != tensors[i].dtype || static_cast<uint64_t>(t.nbytes()) != want)
        throw SafetensorsError("safetensors file '" + path + "': tensor '" + tensors[i].name + "' produced " +
                               std::string(c10::toString(t.scalar_type())) + " of " + std::to_string(t.nbytes()) +
                               " bytes, announced " + records[i].dtype + " of " + std::to_string(want));
      write_all(fd, t.data_ptr(), static_cast<size_t>(want), header.size() + records[i].begin, tmp);
    }
    crash_point("file written");
    if (::fsync(fd) != 0) sys_fail(tmp, "fsync failed");
    crash_point("file synced");
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) sys_fail(tmp, "close failed");
}

// `tmp` renamed to `path`, durably once the directory is synced
// (files::sync). A failure there is an error: the file is in place, but a
// crash could still lose it.
void rename_into_place(const std::string& tmp, const std::string& path) {
  bool renamed = false, past_crash_point = false;
  try {
    files::rename_durably(tmp, path, [&] {
      renamed = true;
      crash_point("file renamed");
      past_crash_point = true;
    });
  } catch (const std::runtime_error& e) {
    if (!renamed) {
      ::unlink(tmp.c_str());
      throw SafetensorsError("safetensors file '" + path + "': rename of the temporary file failed: " + e.what());
    }
    if (!past_crash_point) throw;  // the crash hook's own
    throw SafetensorsError("safetensors file '" + path +
                           "': the file is written, its rename not yet durable: " + e.what());
  }
}

// Temporary files in `dir` named `tmp_prefix` + PID (writes to one path, on
// this host) whose process is gone (killed before its rename): the new file
// replaces what they would have become. A live writer's file, or another
// host's, is left alone.
void remove_stale(const std::string& dir, const std::string& tmp_prefix) {
  std::vector<std::string> names;
  try {
    names = files::list_directory(dir);
  } catch (const std::exception&) {
    return;  // the file is written; leftovers stay for a later save
  }
  for (const std::string& name : names) {
    if (name.rfind(tmp_prefix, 0) != 0) continue;
    const std::string pid_text = name.substr(tmp_prefix.size());
    if (pid_text.empty() || pid_text.size() > 9 || pid_text.find_first_not_of("0123456789") != std::string::npos)
      continue;
    const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
    if (pid != ::getpid() && ::kill(pid, 0) != 0 && errno == ESRCH) ::unlink(files::join(dir, name).c_str());
  }
}

}  // namespace

void write_file(const std::string& path, const std::vector<PendingTensor>& tensors,
                const std::map<std::string, std::string>& metadata, bool remove_stale_temporaries) {
  const std::vector<TensorRecord> records = laid_out(tensors);
  const std::string header = serialize_header(records, metadata);
  const std::string dir = files::directory_of(path);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  // ".NAME.tmp-HOST-PID": a stale one is known by its host and dead process.
  const std::string tmp_prefix = "." + files::filename(path) + ".tmp-" + host + "-";
  const std::string tmp = files::join(dir, tmp_prefix + std::to_string(::getpid()));
  write_temporary(tmp, path, header, tensors, records);
  rename_into_place(tmp, path);
  if (remove_stale_temporaries) remove_stale(dir, tmp_prefix);
}

void save_file(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
               const std::map<std::string, std::string>& metadata, bool remove_stale_temporaries) {
  std::vector<PendingTensor> pending;
  for (const auto& [name, t] : tensors) {
    at::Tensor keep = t;
    pending.push_back({name, t.scalar_type(), t.sizes().vec(), [keep] { return keep; }});
  }
  write_file(path, pending, metadata, remove_stale_temporaries);
}

namespace {
std::function<void(const std::string&)>& crash_hook() {
  static std::function<void(const std::string&)> hook;
  return hook;
}
}  // namespace

void set_crash_hook(std::function<void(const std::string& point)> hook) { crash_hook() = std::move(hook); }

void crash_point(const char* point) {
  if (crash_hook()) crash_hook()(point);
}

std::map<std::string, at::Tensor> load_file(const std::string& path) {
  Reader r(path);
  std::map<std::string, at::Tensor> out;
  for (const auto& t : ReaderAccess::header(r).tensors) out[t.name] = r.read(t.name);
  return out;
}

}  // namespace shardtorch::checkpoint
