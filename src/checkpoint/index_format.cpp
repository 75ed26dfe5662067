#include "index_format.h"

#include <sstream>
#include <stdexcept>

#include "shardtorch/checkpoint/safetensors_format.h"

namespace shardtorch::checkpoint::index_format {
namespace json = boost::json;
namespace {

Entry entry_from(const json::value& v, const std::string& index) {
  try {
    const auto& o = v.as_object();
    Entry e;
    e.name = json::value_to<std::string>(o.at("name"));
    e.kind = json::value_to<std::string>(o.at("kind"));
    e.begin = o.at("begin").to_number<int64_t>();
    e.end = o.at("end").to_number<int64_t>();
    e.step = o.at("step").to_number<int64_t>();
    e.file = json::value_to<std::string>(o.at("file"));
    e.tensor = json::value_to<std::string>(o.at("tensor"));
    if (e.begin < 0 || e.end < e.begin) throw std::invalid_argument("bad range");
    if (e.file.find('/') != std::string::npos || e.file.find("..") != std::string::npos)
      throw std::invalid_argument("file name outside the checkpoint directory");
    return e;
  } catch (const std::exception& ex) {
    throw SafetensorsError("checkpoint index '" + index + "': malformed entry: " + ex.what());
  }
}

}  // namespace

std::string tensor_key(const Entry& e) { return e.name + "|" + e.kind + "|" + std::to_string(e.begin); }

uint64_t fnv1a(const char* data, size_t n, uint64_t h) {
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(data[i]);
    h *= 1099511628211ull;
  }
  return h;
}

std::string fnv_text(uint64_t h) {
  std::ostringstream os;
  os << "fnv1a64:" << std::hex << h;
  return os.str();
}

json::object entry_json(const Entry& e) {
  return {{"name", e.name}, {"kind", e.kind}, {"begin", e.begin}, {"end", e.end},
          {"step", e.step}, {"file", e.file}, {"tensor", e.tensor}};
}

Index parse_index(const std::string& text, const std::string& path) {
  boost::system::error_code ec;
  json::value v = json::parse(text, ec);
  if (ec) throw SafetensorsError("checkpoint index '" + path + "': " + ec.message());
  Index idx;
  try {
    const auto& o = v.as_object();
    idx.version = o.at("format_version").to_number<int64_t>();
    if (idx.version > kFormatVersion)
      throw SafetensorsError("checkpoint index '" + path + "': format version " + std::to_string(idx.version) +
                             " is newer than this shardtorch reads (" + std::to_string(kFormatVersion) + ")");
    idx.world_size = o.at("world_size").to_number<int64_t>();
    idx.step = o.at("step").to_number<int64_t>();
    idx.strategy = json::value_to<std::string>(o.at("strategy"));
    for (const auto& f : o.at("files").as_array()) {
      const auto& fo = f.as_object();
      idx.files[json::value_to<std::string>(fo.at("name"))] = {fo.at("size").to_number<int64_t>(),
                                                               json::value_to<std::string>(fo.at("checksum"))};
    }
    for (const auto& e : o.at("entries").as_array()) idx.entries.push_back(entry_from(e, path));
    if (const auto* u = o.if_contains("user_state")) {  // absent in checkpoints saved without it
      for (const auto& [k, v] : u->as_object()) {
        if (!v.is_string())
          throw SafetensorsError("checkpoint index '" + path + "': user_state '" + std::string(k) + "' is not a string");
        idx.user_state[std::string(k)] = json::value_to<std::string>(v);
      }
    }
    if (const auto* sh = o.if_contains("shapes")) {
      idx.shapes.emplace();
      for (const auto& [k, dims] : sh->as_object()) {
        std::vector<int64_t> shape;
        for (const auto& d : dims.as_array()) {
          shape.push_back(d.to_number<int64_t>());
          if (shape.back() < 0) throw std::invalid_argument("negative dimension of '" + std::string(k) + "'");
        }
        (*idx.shapes)[std::string(k)] = std::move(shape);
      }
    }
  } catch (const SafetensorsError&) {
    throw;
  } catch (const std::exception& e) {
    throw SafetensorsError("checkpoint index '" + path + "': malformed: " + e.what());
  }
  for (const auto& e : idx.entries)
    if (!idx.files.count(e.file))
      throw SafetensorsError("checkpoint index '" + path + "': entry '" + e.tensor + "' names unlisted file '" + e.file + "'");
  idx.fingerprint = "step " + std::to_string(idx.step) + ", index " + fnv_text(fnv1a(text.data(), text.size()));
  return idx;
}

}  // namespace shardtorch::checkpoint::index_format
