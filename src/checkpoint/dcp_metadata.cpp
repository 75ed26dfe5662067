#include "checkpoint/dcp_metadata.h"

#include <algorithm>
#include <set>

#include "checkpoint/hf_index.h"
#include "checkpoint/pickle_reader.h"
#include "shardtorch/checkpoint/safetensors_error.h"

namespace shardtorch::checkpoint::dcp {
namespace {

using pickle::Kind;
using pickle::Node;

constexpr const char* kMeta = "torch.distributed.checkpoint.metadata";
constexpr const char* kFs = "torch.distributed.checkpoint.filesystem";
constexpr int64_t kMaxDim = int64_t{1} << 62;  // any dimension, offset or element count

// torch's dtype names this code reads, and their element sizes.
const std::map<std::string, size_t>& dtypes() {
  static const std::map<std::string, size_t> d = {
      {"float64", 8}, {"float32", 4}, {"float16", 2}, {"bfloat16", 2}, {"int64", 8},  {"int32", 4}, {"int16", 2},
      {"int8", 1},    {"uint8", 1},   {"bool", 1},    {"uint16", 2},   {"uint32", 4}, {"uint64", 8}};
  return d;
}

// Every dtype torch pickles as a bare global: the allow-list names them all,
// so that an unsupported one is refused by its name, not as a foreign global.
const std::vector<std::string>& torch_dtype_names() {
  static const std::vector<std::string> n = {"float64",         "float32",
                                             "float16",         "bfloat16",
                                             "int64",           "int32",
                                             "int16",           "int8",
                                             "uint8",           "bool",
                                             "uint16",          "uint32",
                                             "uint64",          "complex32",
                                             "complex64",       "complex128",
                                             "float8_e4m3fn",   "float8_e5m2",
                                             "float8_e4m3fnuz", "float8_e5m2fnuz",
                                             "float8_e8m0fnu",  "float4_e2m1fn_x2",
                                             "qint8",           "quint8",
                                             "qint32",          "quint4x2",
                                             "quint2x4",        "bits1x8",
                                             "bits2x4",         "bits4x2",
                                             "bits8",           "bits16"};
  return n;
}

const pickle::Policy& policy() {
  static const pickle::Policy p = [] {
    pickle::Policy p;
    p.opcodes = pickle::data_opcodes();
    // GLOBAL, STACK_GLOBAL, REDUCE, NEWOBJ, BUILD
    for (uint8_t op : std::initializer_list<uint8_t>{'c', 0x93, 'R', 0x81, 'b'}) p.opcodes.insert(op);
    for (const char* c : {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                          "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"})
      p.globals.insert({kMeta, c});
    p.globals.insert({kFs, "_StorageInfo"});
    p.globals.insert({"torch", "Size"});
    p.globals.insert({"torch.serialization", "_get_layout"});
    p.globals.insert({"torch", "strided"});
    for (const char* m : {"pathlib", "pathlib._local"})
      for (const char* c : {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}) p.globals.insert({m, c});
    for (const auto& d : torch_dtype_names()) p.globals.insert({"torch", d});
    return p;
  }();
  return p;
}

std::string dims_text(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// The pickle's objects read as the classes DCP writes. Every visit of a node
// counts against a budget proportional to the file: objects shared through
// the memo are visited once per reference, which a crafted file could
// multiply without bound.
class Schema {
 public:
  Schema(const pickle::Tree& t, const std::string& file) : t_(t), file_(file), budget_(16 * t.size() + 4096) {}

  const Node& get(uint32_t id) {
    if (budget_-- == 0)
      throw SafetensorsError(file_ +
                             ": its objects refer to each other so often that reading them would take "
                             "too long (not a file DCP writes)");
    return t_.at(id);
  }
  [[noreturn]] void bad(const Node& n, const std::string& what) const {
    throw SafetensorsError(file_ + ": byte " + std::to_string(n.at) + ": " + what);
  }
  const Node& kind(uint32_t id, Kind k, const std::string& what) {
    const Node& n = get(id);
    if (n.kind != k)
      bad(n, what + " is a " + pickle::kind_name(n.kind) + " where a " + pickle::kind_name(k) + " was expected");
    return n;
  }
  bool is_global(const Node& n, const char* module, const char* name) const {
    return n.kind == Kind::Global && n.text == module && n.name == name;
  }
  int64_t integer(uint32_t id, const std::string& what, int64_t lo = 0) {
    const Node& n = kind(id, Kind::Int, what);
    if (n.i < lo || n.i > kMaxDim) bad(n, what + " is " + std::to_string(n.i) + ", out of range");
    return n.i;
  }
  std::string str(uint32_t id, const std::string& what) { return kind(id, Kind::String, what).text; }
  bool none(uint32_t id) { return get(id).kind == Kind::None; }

  // An object of class (module, cls) made by NEWOBJ with no arguments: its
  // BUILD state's fields, each one of `known`; unknown ones are refused.
  std::map<std::string, uint32_t> fields(uint32_t id, const char* module, const char* cls,
                                         const std::set<std::string>& known, const std::string& what) {
    const Node& n = get(id);
    if (n.kind != Kind::Object || !is_global(get(n.items[0]), module, cls))
      bad(n, what + " is not a " + cls + " (" + describe(n) + ")");
    if (!get(n.items[1]).items.empty()) bad(n, what + ": " + cls + " made with arguments");
    std::map<std::string, uint32_t> out;
    if (!n.built || none(n.items[2])) return out;
    const Node& d = kind(n.items[2], Kind::Dict, std::string(cls) + "'s state");
    for (size_t k = 0; k + 1 < d.items.size(); k += 2) {
      const std::string key = str(d.items[k], std::string(cls) + "'s field name");
      if (!known.count(key))
        bad(d, std::string(cls) + " has a field '" + key + "' that DCP 1.0.0 does not write (a newer format?)");
      if (!out.emplace(key, d.items[k + 1]).second) bad(d, std::string(cls) + " has the field '" + key + "' twice");
    }
    return out;
  }
  std::string describe(const Node& n) {
    if (n.kind == Kind::Object || n.kind == Kind::Reduce) {
      const Node& g = get(n.items[0]);
      return std::string(n.kind == Kind::Object ? "an object of " : "a call of ") + g.text + "." + g.name;
    }
    return std::string("a ") + pickle::kind_name(n.kind);
  }

  // torch.Size((d, ...)) or a plain tuple or list of ints.
  std::vector<int64_t> shape(uint32_t id, const std::string& what) {
    const Node* n = &get(id);
    if (n->kind == Kind::Reduce) {
      if (!is_global(get(n->items[0]), "torch", "Size")) bad(*n, what + " is " + describe(*n) + ", not a torch.Size");
      const Node& args = get(n->items[1]);
      if (args.items.size() != 1) bad(args, what + ": torch.Size takes one tuple");
      n = &get(args.items[0]);
    }
    if (n->kind != Kind::Tuple && n->kind != Kind::List) bad(*n, what + " is " + describe(*n) + ", not a shape");
    std::vector<int64_t> out;
    for (uint32_t d : n->items) out.push_back(integer(d, what + "'s dimension"));
    return out;
  }

  std::string dtype(uint32_t id, const std::string& what) {
    const Node& n = get(id);
    if (n.kind != Kind::Global || n.text != "torch") bad(n, what + " is " + describe(n) + ", not a torch dtype");
    if (!dtypes().count(n.name))
      bad(n, what + " is torch." + n.name + ", which shardtorch does not read (float64, float32, float16, " +
                 "bfloat16, int64, int32, int16, int8, uint8, uint16, uint32, uint64 and bool are read)");
    return n.name;
  }

  // TensorProperties: the 5-tuple its __getstate__ gives: dtype, layout,
  // requires_grad, memory format, pin_memory. Only strided tensors.
  std::string properties(uint32_t id, const std::string& what) {
    const Node& n = get(id);
    if (n.kind != Kind::Object || !is_global(get(n.items[0]), kMeta, "TensorProperties"))
      bad(n, what + " is not a TensorProperties (" + describe(n) + ")");
    if (!n.built) bad(n, what + ": TensorProperties without a state");
    const Node& st = get(n.items[2]);
    if (st.kind != Kind::Tuple || st.items.size() != 5)
      bad(st, what +
                  ": TensorProperties' state is not the 5-tuple DCP writes (dtype, layout, requires_grad, "
                  "memory_format, pin_memory)");
    const std::string dt = dtype(st.items[0], what + "'s dtype");
    const Node& layout = get(st.items[1]);
    std::string lname;
    if (is_global(layout, "torch", "strided")) {
      lname = "torch.strided";
    } else if (layout.kind == Kind::Reduce && is_global(get(layout.items[0]), "torch.serialization", "_get_layout")) {
      const Node& args = get(layout.items[1]);
      if (args.items.size() != 1) bad(args, what + ": _get_layout takes one name");
      lname = str(args.items[0], what + "'s layout");
    } else {
      bad(layout, what + "'s layout is " + describe(layout) + ", not a torch layout");
    }
    if (lname != "torch.strided")
      bad(layout, what + " has layout " + lname + ": only dense (torch.strided) tensors are read");
    kind(st.items[2], Kind::Bool, what + "'s requires_grad");
    const Node& fmt = get(st.items[3]);
    if (fmt.kind != Kind::Reduce || !is_global(get(fmt.items[0]), kMeta, "_MEM_FORMAT_ENCODING"))
      bad(fmt, what + "'s memory format is " + describe(fmt) + ", not a _MEM_FORMAT_ENCODING");
    kind(st.items[4], Kind::Bool, what + "'s pin_memory");
    return dt;
  }

  Storage storage(uint32_t id, const std::string& what) {
    auto f = fields(id, kFs, "_StorageInfo", {"relative_path", "offset", "length", "transform_descriptors"}, what);
    for (const char* k : {"relative_path", "offset", "length"})
      if (!f.count(k)) bad(get(id), what + ": _StorageInfo without '" + k + "'");
    Storage s;
    s.relative_path = str(f["relative_path"], what + "'s relative_path");
    s.offset = static_cast<uint64_t>(integer(f["offset"], what + "'s offset"));
    s.length = static_cast<uint64_t>(integer(f["length"], what + "'s length"));
    if (!hf_index::inside_directory(s.relative_path))
      bad(get(f["relative_path"]),
          what + " is in '" + s.relative_path + "', which is not a file name inside the checkpoint's directory");
    if (f.count("transform_descriptors") && !none(f["transform_descriptors"])) {
      const Node& l = get(f["transform_descriptors"]);
      if (l.kind != Kind::List && l.kind != Kind::Tuple)
        bad(l, what + "'s transform_descriptors is " + describe(l) + ", not a list");
      if (!l.items.empty())
        bad(l, what + " is stored through transform '" + str(l.items[0], what + "'s transform") +
                   "' (FileSystemWriter's _extensions, e.g. ZStandard), which shardtorch does not read: save "
                   "without _extensions");
    }
    return s;
  }

 private:
  const pickle::Tree& t_;
  const std::string& file_;
  size_t budget_;
};

// Chunks lie inside the tensor, do not overlap and cover it exactly.
void check_chunks(const Entry& e, const std::string& file) {
  auto fail = [&](const std::string& what) { throw SafetensorsError(file + ": '" + e.name + "' " + what); };
  __int128 numel = 1;
  for (int64_t d : e.size) {
    numel *= d;
    if (numel > kMaxDim) fail("has " + dims_text(e.size) + " elements: too many");
  }
  __int128 covered = 0;
  std::vector<const Chunk*> full;
  for (const auto& c : e.chunks) {
    if (c.offsets.size() != e.size.size() || c.sizes.size() != e.size.size())
      fail("has shape " + dims_text(e.size) + " but a chunk at " + dims_text(c.offsets) + " of size " +
           dims_text(c.sizes) + " (another number of dimensions)");
    __int128 v = 1;
    for (size_t d = 0; d < e.size.size(); ++d) {
      if (c.offsets[d] > e.size[d] || c.sizes[d] > e.size[d] - c.offsets[d])  // each <= kMaxDim: no overflow
        fail("has shape " + dims_text(e.size) + " but a chunk at " + dims_text(c.offsets) + " of size " +
             dims_text(c.sizes) + ", which reaches past it");
      v *= c.sizes[d];
    }
    covered += v;
    if (v > 0) full.push_back(&c);
  }
  // Overlaps: swept along the first dimension whose offsets differ (DCP's
  // chunks are slabs of one dimension: each meets few others there).
  size_t dim = 0;
  while (dim < e.size.size() && std::all_of(full.begin(), full.end(), [&](const Chunk* c) {
           return c->offsets[dim] == full.front()->offsets[dim];
         }))
    ++dim;
  if (dim == e.size.size()) dim = 0;
  if (!e.size.empty())
    std::sort(full.begin(), full.end(),
              [&](const Chunk* a, const Chunk* b) { return a->offsets[dim] < b->offsets[dim]; });
  std::vector<const Chunk*> open;
  for (const Chunk* c : full) {
    if (!e.size.empty())
      open.erase(std::remove_if(open.begin(), open.end(),
                                [&](const Chunk* o) { return o->offsets[dim] + o->sizes[dim] <= c->offsets[dim]; }),
                 open.end());
    for (const Chunk* o : open) {
      bool meet = true;
      for (size_t d = 0; d < e.size.size() && meet; ++d)
        meet = o->offsets[d] < c->offsets[d] + c->sizes[d] && c->offsets[d] < o->offsets[d] + o->sizes[d];
      if (meet)
        fail("has chunks at " + dims_text(o->offsets) + " of size " + dims_text(o->sizes) + " and at " +
             dims_text(c->offsets) + " of size " + dims_text(c->sizes) + ", which overlap");
    }
    open.push_back(c);
  }
  if (covered != numel)
    fail("of shape " + dims_text(e.size) + " has " + std::to_string(static_cast<int64_t>(numel)) +
         " elements but its chunks cover " + std::to_string(static_cast<int64_t>(covered)) +
         " (a rank's data is missing: saved with use_collectives=False, or a file of another save?)");
}

}  // namespace

size_t dtype_size(const std::string& torch_name) {
  auto it = dtypes().find(torch_name);
  return it == dtypes().end() ? 0 : it->second;
}

std::vector<std::variant<std::string, int64_t>> path_of(const std::string& key, const std::string& model_prefix,
                                                        const std::string& optimizer_prefix) {
  std::vector<std::variant<std::string, int64_t>> path;
  auto top = [](const std::string& prefix) { return prefix.substr(0, prefix.size() - 1); };
  auto under = [&](const std::string& prefix) {
    return prefix.size() > 1 && prefix.back() == '.' && key.size() > prefix.size() && key.rfind(prefix, 0) == 0;
  };
  if (under(optimizer_prefix)) {
    const std::string rest = key.substr(optimizer_prefix.size());
    const auto dot = rest.rfind('.');
    if (rest.rfind("state.", 0) == 0 && dot != std::string::npos && dot > 6 && dot + 1 < rest.size())
      return {top(optimizer_prefix), std::string("state"), rest.substr(6, dot - 6), rest.substr(dot + 1)};
    const auto dot2 = rest.find('.', 13);
    if (rest.rfind("param_groups.", 0) == 0 && dot2 != std::string::npos && dot2 > 13 && dot2 + 1 < rest.size() &&
        dot2 - 13 <= 9 && rest.find_first_not_of("0123456789", 13) == dot2)
      return {top(optimizer_prefix), std::string("param_groups"), static_cast<int64_t>(std::stoll(rest.substr(13))),
              rest.substr(dot2 + 1)};
    return path;
  }
  if (under(model_prefix)) return {top(model_prefix), key.substr(model_prefix.size())};
  return path;
}

const Entry* Metadata::find(const std::string& name) const {
  auto it = index.find(name);
  return it == index.end() ? nullptr : &entries[it->second];
}

// state_dict_metadata: every key, a tensor (dtype, size, chunks) or bytes.
void read_entries(Schema& s, uint32_t node, Metadata& m, const std::string& where) {
  const Node& sdm = s.kind(node, Kind::Dict, "state_dict_metadata");
  for (size_t k = 0; k + 1 < sdm.items.size(); k += 2) {
    Entry e;
    e.name = s.str(sdm.items[k], "a state_dict_metadata key");
    const std::string what = "'" + e.name + "'";
    const Node& v = s.get(sdm.items[k + 1]);
    if (v.kind == Kind::Object && s.is_global(s.get(v.items[0]), kMeta, "BytesStorageMetadata")) {
      if (!s.fields(sdm.items[k + 1], kMeta, "BytesStorageMetadata", {}, what).empty())
        s.bad(v, what + ": BytesStorageMetadata with fields");
      e.tensor = false;
    } else {
      auto f = s.fields(sdm.items[k + 1], kMeta, "TensorStorageMetadata", {"properties", "size", "chunks"}, what);
      for (const char* key : {"properties", "size", "chunks"})
        if (!f.count(key)) s.bad(v, what + ": TensorStorageMetadata without '" + key + "'");
      e.dtype = s.properties(f["properties"], what);
      e.size = s.shape(f["size"], what + "'s size");
      const Node& chunks = s.kind(f["chunks"], Kind::List, what + "'s chunks");
      for (uint32_t c : chunks.items) {
        auto cf = s.fields(c, kMeta, "ChunkStorageMetadata", {"offsets", "sizes"}, what + "'s chunk");
        if (!cf.count("offsets") || !cf.count("sizes")) s.bad(s.get(c), what + ": a chunk without offsets or sizes");
        Chunk ch;
        ch.offsets = s.shape(cf["offsets"], what + "'s chunk offsets");
        ch.sizes = s.shape(cf["sizes"], what + "'s chunk sizes");
        e.chunks.push_back(std::move(ch));
      }
    }
    if (!m.index.emplace(e.name, m.entries.size()).second) s.bad(sdm, "state_dict_metadata has " + what + " twice");
    m.entries.push_back(std::move(e));
  }
  for (const auto& e : m.entries)
    if (e.tensor) check_chunks(e, where);
}

// storage_data: MetadataIndex(fqn, offset) -> _StorageInfo, one per item;
// every chunk with elements and every bytes entry must have one.
void read_storage(Schema& s, uint32_t node, Metadata& m, const std::string& where) {
  std::vector<std::map<std::vector<int64_t>, std::vector<Chunk*>>> by_offsets(m.entries.size());
  for (size_t i = 0; i < m.entries.size(); ++i)
    for (auto& c : m.entries[i].chunks) by_offsets[i][c.offsets].push_back(&c);
  std::vector<std::set<std::vector<int64_t>>> stored(m.entries.size());
  std::vector<bool> bytes_stored(m.entries.size(), false);
  const Node& sd = s.kind(node, Kind::Dict, "storage_data");
  for (size_t k = 0; k + 1 < sd.items.size(); k += 2) {
    auto key = s.fields(sd.items[k], kMeta, "MetadataIndex", {"fqn", "offset", "index"}, "a storage_data key");
    if (!key.count("fqn")) s.bad(s.get(sd.items[k]), "a storage_data key without fqn");
    const std::string fqn = s.str(key["fqn"], "a storage_data key's fqn");
    const std::string what = "the item of '" + fqn + "'";
    auto it = m.index.find(fqn);
    if (it == m.index.end())
      s.bad(s.get(sd.items[k]), "storage_data has an item of '" + fqn + "', which state_dict_metadata does not list");
    if (key.count("index") && !s.none(key["index"])) s.integer(key["index"], what + "'s index");
    Entry& e = m.entries[it->second];
    Storage st = s.storage(sd.items[k + 1], what);
    const bool has_offset = key.count("offset") && !s.none(key["offset"]);
    if (!e.tensor) {
      if (has_offset) s.bad(s.get(sd.items[k]), what + " has offsets, but it is not a tensor");
      if (bytes_stored[it->second]) s.bad(s.get(sd.items[k]), "storage_data has " + what + " twice");
      bytes_stored[it->second] = true;
      e.bytes = st;
      continue;
    }
    if (!has_offset) s.bad(s.get(sd.items[k]), what + " has no offsets, but it is a tensor");
    const auto offsets = s.shape(key["offset"], what + "'s offsets");
    auto c = by_offsets[it->second].find(offsets);
    if (c == by_offsets[it->second].end())
      s.bad(s.get(sd.items[k]),
            "storage_data has an item of '" + fqn + "' at " + dims_text(offsets) + ", where it has no chunk");
    if (!stored[it->second].insert(offsets).second)
      s.bad(s.get(sd.items[k]), "storage_data has " + what + " at " + dims_text(offsets) + " twice");
    for (Chunk* ch : c->second) ch->storage = st;
  }
  for (size_t i = 0; i < m.entries.size(); ++i) {
    const Entry& e = m.entries[i];
    if (!e.tensor && !bytes_stored[i])
      throw SafetensorsError(where + ": '" + e.name + "' has no item in storage_data (an incomplete file)");
    for (const auto& c : e.chunks) {
      int64_t v = 1;
      for (int64_t d : c.sizes) v *= d;
      if (v > 0 && !stored[i].count(c.offsets))
        throw SafetensorsError(where + ": the chunk of '" + e.name + "' at " + dims_text(c.offsets) +
                               " has no item in storage_data (an incomplete file)");
    }
  }
}

// planner_data: each key's path in the nested state dict, when it is the
// default planner's (a dict of tuples of strings and ints); anything else
// is another planner's business and left out.
void read_planner_data(Schema& s, const Node& pd, Metadata& m) {
  for (size_t k = 0; k + 1 < pd.items.size(); k += 2) {
    const Node& key = s.get(pd.items[k]);
    const Node& val = s.get(pd.items[k + 1]);
    if (key.kind != Kind::String || val.kind != Kind::Tuple) continue;
    auto it = m.index.find(key.text);
    if (it == m.index.end()) continue;
    std::vector<std::variant<std::string, int64_t>> path;
    for (uint32_t p : val.items) {
      const Node& x = s.get(p);
      if (x.kind == Kind::String)
        path.emplace_back(x.text);
      else if (x.kind == Kind::Int)
        path.emplace_back(x.i);
      else {
        path.clear();
        break;
      }
    }
    m.entries[it->second].path = std::move(path);
  }
}

Metadata parse(const std::string& bytes, const std::string& file) {
  const pickle::Tree tree = pickle::parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), policy(),
                                          "DCP metadata '" + file + "'");
  const std::string where = "DCP metadata '" + file + "'";
  Schema s(tree, where);
  Metadata m;
  auto top = s.fields(tree.root(), kMeta, "Metadata",
                      {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"}, "the file");
  if (!top.count("state_dict_metadata") || !top.count("storage_data") || s.none(top["storage_data"]))
    throw SafetensorsError(where + ": Metadata without state_dict_metadata or storage_data");
  if (top.count("version") && !s.none(top["version"])) {
    m.version = s.str(top["version"], "version");
    if (*m.version != kVersion)
      throw SafetensorsError(where + ": DCP version '" + *m.version + "', which shardtorch does not read (it reads " +
                             kVersion + " and unversioned files of earlier torch releases)");
  }
  if (top.count("storage_meta") && !s.none(top["storage_meta"])) {  // informative only: its fields are not read
    const Node& sm = s.get(top["storage_meta"]);
    if (sm.kind != Kind::Object || !s.is_global(s.get(sm.items[0]), kMeta, "StorageMeta"))
      s.bad(sm, "storage_meta is " + s.describe(sm) + ", not a StorageMeta");
  }

  read_entries(s, top["state_dict_metadata"], m, where);
  read_storage(s, top["storage_data"], m, where);
  if (top.count("planner_data") && s.get(top["planner_data"]).kind == Kind::Dict)
    read_planner_data(s, s.get(top["planner_data"]), m);
  return m;
}

namespace {

// Writes a Metadata as torch's pickler does, field by field.
class MetadataPickler {
 public:
  explicit MetadataPickler(const Metadata& m) : m_(m) {}

  std::string run() {
    object(kMeta, "Metadata");
    w_.empty_dict().mark();
    state_dict_metadata();
    planner_data();
    storage_data();
    w_.string("storage_meta").none().string("version").string(kVersion).setitems().build();
    return w_.finish();
  }

 private:
  void size(const std::vector<int64_t>& v) {
    w_.global("torch", "Size").mark().mark();
    for (int64_t d : v) w_.integer(d);
    w_.tuple().tuple().reduce();
  }
  void object(const char* module, const char* cls) { w_.global(module, cls).empty_tuple().newobj(); }

  void tensor_entry(const Entry& e) {
    object(kMeta, "TensorStorageMetadata");
    w_.empty_dict().mark().string("properties");
    object(kMeta, "TensorProperties");
    w_.mark().global("torch", e.dtype);
    w_.global("torch.serialization", "_get_layout").mark().string("torch.strided").tuple().reduce();
    w_.boolean(false).global(kMeta, "_MEM_FORMAT_ENCODING").mark().integer(0).tuple().reduce().boolean(false);
    w_.tuple().build();
    w_.string("size");
    size(e.size);
    w_.string("chunks").empty_list();
    if (!e.chunks.empty()) w_.mark();
    for (const auto& c : e.chunks) {
      object(kMeta, "ChunkStorageMetadata");
      w_.empty_dict().mark().string("offsets");
      size(c.offsets);
      w_.string("sizes");
      size(c.sizes);
      w_.setitems().build();
    }
    if (!e.chunks.empty()) w_.appends();
    w_.setitems().build();
  }

  void state_dict_metadata() {
    w_.string("state_dict_metadata").empty_dict();
    if (!m_.entries.empty()) w_.mark();
    for (const auto& e : m_.entries) {
      w_.string(e.name);
      if (e.tensor)
        tensor_entry(e);
      else
        object(kMeta, "BytesStorageMetadata");
    }
    if (!m_.entries.empty()) w_.setitems();
  }

  void planner_data() {
    w_.string("planner_data").empty_dict();
    bool any_path = false;
    for (const auto& e : m_.entries) {
      if (e.path.empty()) continue;
      if (!any_path) w_.mark();
      any_path = true;
      w_.string(e.name).mark();
      for (const auto& p : e.path) {
        if (std::holds_alternative<std::string>(p))
          w_.string(std::get<std::string>(p));
        else
          w_.integer(std::get<int64_t>(p));
      }
      w_.tuple();
    }
    if (any_path) w_.setitems();
  }

  void storage(const Storage& st) {
    object(kFs, "_StorageInfo");
    w_.empty_dict().mark().string("relative_path").string(st.relative_path);
    w_.string("offset").integer(static_cast<int64_t>(st.offset));
    w_.string("length").integer(static_cast<int64_t>(st.length)).setitems().build();
  }

  void storage_data() {
    w_.string("storage_data").empty_dict();
    bool any_item = false;
    auto begin_item = [&] {
      if (!any_item) w_.mark();
      any_item = true;
      object(kMeta, "MetadataIndex");
    };
    for (const auto& e : m_.entries) {
      if (!e.tensor) {
        begin_item();
        w_.empty_dict().mark().string("fqn").string(e.name).string("index").none().setitems().build();
        storage(e.bytes);
        continue;
      }
      std::set<std::vector<int64_t>> written;  // empty chunks may share offsets (and need no item)
      for (size_t i = 0; i < e.chunks.size(); ++i) {
        if (e.chunks[i].storage.relative_path.empty() || !written.insert(e.chunks[i].offsets).second) continue;
        begin_item();
        w_.empty_dict().mark().string("fqn").string(e.name).string("index").integer(static_cast<int64_t>(i));
        w_.string("offset");
        size(e.chunks[i].offsets);
        w_.setitems().build();
        storage(e.chunks[i].storage);
      }
    }
    if (any_item) w_.setitems();
  }

  const Metadata& m_;
  pickle::Writer w_;
};

}  // namespace

std::string serialize(const Metadata& m) { return MetadataPickler(m).run(); }

}  // namespace shardtorch::checkpoint::dcp
