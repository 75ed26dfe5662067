// DCP checkpoints in one process: read whole tensors and values (tools,
// tests), and written from a list of tensors.
#include "base/check.h"
#include "base/files.h"
#include "checkpoint/dcp_items.h"
#include "checkpoint/dcp_source.h"
#include "checkpoint/pickle_reader.h"
#include "checkpoint/publish.h"
#include "shardtorch/dcp_checkpoint.h"

namespace shardtorch::checkpoint {

namespace {

const dcp::Entry& entry_of(const dcp::Source& src, const std::string& name) {
  const dcp::Entry* e = src.metadata().find(name);
  if (e == nullptr) throw SafetensorsError("DCP checkpoint '" + src.dir() + "' has no key '" + name + "'");
  return *e;
}

void pickle_value(pickle::Writer& w, const DcpValue& v) {
  switch (v.kind) {
    case DcpValue::Kind::None:
      w.none();
      return;
    case DcpValue::Kind::Bool:
      w.boolean(v.b);
      return;
    case DcpValue::Kind::Int:
      w.integer(v.i);
      return;
    case DcpValue::Kind::Float:
      w.real(v.f);
      return;
    case DcpValue::Kind::String:
      w.string(v.s);
      return;
    case DcpValue::Kind::Tuple:
      w.mark();
      for (const auto& x : v.items) pickle_value(w, x);
      w.tuple();
      return;
    case DcpValue::Kind::List:
      w.empty_list().mark();
      for (const auto& x : v.items) pickle_value(w, x);
      w.appends();
      return;
  }
}

}  // namespace

struct DcpReader::Impl {
  explicit Impl(const std::string& dir) : src(dir) {}
  mutable dcp::Source src;
};

DcpReader::DcpReader(const std::string& dir) : impl_(std::make_unique<Impl>(dir)) {}
DcpReader::~DcpReader() = default;

std::vector<DcpEntryInfo> DcpReader::entries() const {
  std::vector<DcpEntryInfo> out;
  for (const auto& e : impl_->src.metadata().entries) {
    DcpEntryInfo i;
    i.name = e.name;
    i.tensor = e.tensor;
    if (e.tensor) i.dtype = dcp::scalar_type_of(e.dtype);
    i.shape = e.size;
    i.chunks = static_cast<int64_t>(e.chunks.size());
    out.push_back(std::move(i));
  }
  return out;
}

bool DcpReader::contains(const std::string& name) const { return impl_->src.metadata().find(name) != nullptr; }

at::Tensor DcpReader::read(const std::string& name) const {
  const dcp::Entry& e = entry_of(impl_->src, name);
  if (!e.tensor)
    throw SafetensorsError("DCP checkpoint '" + impl_->src.dir() + "': '" + name + "' is a value, not a tensor");
  int64_t n = 1;
  for (int64_t d : e.size) n *= d;
  at::Tensor t = at::empty({n}, at::TensorOptions().dtype(dcp::scalar_type_of(e.dtype)));
  dcp::Source::run(impl_->src.plan(e, 0, n), t);
  return t.view(e.size);
}

std::string DcpReader::read_value(const std::string& name) const {
  const dcp::Entry& e = entry_of(impl_->src, name);
  if (e.tensor)
    throw SafetensorsError("DCP checkpoint '" + impl_->src.dir() + "': '" + name + "' is a tensor, not a value");
  return dcp::read_value_item(impl_->src.file(e.bytes.relative_path), e);
}

void write_dcp(const std::string& dir_arg, const std::vector<PendingTensor>& tensors,
               const std::vector<std::pair<std::string, DcpValue>>& values, const DcpSaveOptions& options) {
  const std::string dir = normalized(dir_arg);
  const std::string tmp = dir + kTmpSuffix;
  constexpr const char* kMarker = ".metadata";
  check_replaceable(dir, kMarker, "DCP checkpoint");
  files::remove_all(tmp);
  files::create_directories(tmp);
  try {
    dcp::Metadata md;
    const std::string file = "__0_0.distcp";
    dcp::ItemWriter w(tmp + "/" + file, file);
    auto add = [&](dcp::Entry e) {
      SHARDTORCH_CHECK(md.index.emplace(e.name, md.entries.size()).second, "shardtorch::write_dcp: '", e.name,
                       "' is written twice");
      e.path = dcp::path_of(e.name, options.model_prefix(), options.optimizer_prefix());
      md.entries.push_back(std::move(e));
    };
    for (const auto& [name, v] : values) {
      pickle::Writer p;
      pickle_value(p, v);
      dcp::Entry e;
      e.name = name;
      e.tensor = false;
      e.bytes = w.value(p.finish());
      add(std::move(e));
    }
    for (const auto& t : tensors) {
      at::Tensor v = t.produce().contiguous();
      if (v.scalar_type() != t.dtype) v = v.to(t.dtype);
      SHARDTORCH_CHECK(v.sizes() == c10::IntArrayRef(t.shape), "shardtorch::write_dcp: '", t.name, "' was produced ",
                       "with shape ", v.sizes(), " but is declared ", c10::IntArrayRef(t.shape));
      dcp::Entry e;
      e.name = t.name;
      e.dtype = dcp::torch_name_of(t.dtype);
      e.size = t.shape;
      int64_t n = 1;
      for (int64_t d : t.shape) n *= d;
      if (n > 0) e.chunks.push_back({std::vector<int64_t>(t.shape.size(), 0), t.shape, w.tensor(v.cpu())});
      add(std::move(e));
    }
    w.finish();
    const std::string bytes = dcp::serialize(md);
    dcp::parse(bytes, tmp + "/" + kMarker);
    write_text_durably(tmp + "/" + kMarker, bytes);
    fsync_path(tmp, true);
    publish(tmp, dir, kMarker);
  } catch (...) {
    files::remove_all_quietly(tmp);
    throw;
  }
}

}  // namespace shardtorch::checkpoint
