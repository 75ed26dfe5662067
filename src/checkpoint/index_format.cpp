#include "checkpoint/index_format.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "checkpoint/checksum.h"
#include "checkpoint/safetensors_format.h"

namespace shardtorch::checkpoint::index_format {
namespace json = boost::json;
namespace {

// A JSON integer, written as one: 2.0, 2.5, "2" and true are not integers.
int64_t integer(const json::value& v, const std::string& what) {
  if (v.is_int64()) return v.get_int64();
  if (v.is_uint64() && v.get_uint64() <= static_cast<uint64_t>(INT64_MAX)) return static_cast<int64_t>(v.get_uint64());
  throw std::invalid_argument(what + " is " + json::serialize(v) + ", not an integer");
}

bool known_kind(const std::string& k) {
  return k == "param" || k == "buffer" || k == "exp_avg" || k == "exp_avg_sq" || k == "max_exp_avg_sq" ||
         k == "momentum_buffer";
}

Entry entry_from(const json::value& v, const std::string& index) {
  try {
    const auto& o = v.as_object();
    Entry e;
    e.name = json::value_to<std::string>(o.at("name"));
    e.kind = json::value_to<std::string>(o.at("kind"));
    e.begin = integer(o.at("begin"), "begin");
    e.end = integer(o.at("end"), "end");
    e.step = integer(o.at("step"), "step");
    e.file = json::value_to<std::string>(o.at("file"));
    e.tensor = json::value_to<std::string>(o.at("tensor"));
    if (e.begin < 0 || e.end < e.begin) throw std::invalid_argument("bad range");
    if (const auto* rows = o.if_contains("rows")) {
      e.rows = integer(*rows, "rows");
      e.stride = integer(o.at("stride"), "stride");
      if (e.rows < 1) throw std::invalid_argument("rows " + std::to_string(e.rows) + " is not 1 or more");
      if (e.rows == 1) e.stride = 0;
      int64_t span = 0;
      if (e.rows > 1 && (e.stride < e.end - e.begin || __builtin_mul_overflow(e.rows - 1, e.stride, &span) ||
                         __builtin_add_overflow(span, e.end, &span) || e.end == e.begin))
        throw std::invalid_argument("rows " + std::to_string(e.rows) + " of stride " + std::to_string(e.stride) +
                                    " from [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                                    ") overlap, are empty or run past 2^63");
    }
    if (e.step < 0) throw std::invalid_argument("negative optimizer step " + std::to_string(e.step));
    if (!known_kind(e.kind)) throw std::invalid_argument("unknown kind '" + e.kind + "'");
    if (e.file.find('/') != std::string::npos || e.file.find("..") != std::string::npos)
      throw std::invalid_argument("file name outside the checkpoint directory");
    return e;
  } catch (const std::exception& ex) {
    throw SafetensorsError("checkpoint index '" + index + "': malformed entry: " + ex.what());
  }
}

// "rank-R.safetensors" with R a rank of the world that saved: the names the
// writer gives, so nothing else is ever opened.
bool shard_file_name(const std::string& name, int64_t world_size) {
  const std::string prefix = "rank-", suffix = ".safetensors";
  if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return false;
  const std::string r = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (r.size() > 10 || r.find_first_not_of("0123456789") != std::string::npos || (r.size() > 1 && r[0] == '0'))
    return false;
  return std::stoll(r) < world_size;
}

}  // namespace

bool known_strategy(const std::string& name) {
  return name == "full_shard" || name == "shard_grad_op" || name == "optimizer_only" || name == "no_shard" ||
         name == "hybrid_shard";
}

std::string tensor_key(const Entry& e) { return e.name + "|" + e.kind + "|" + std::to_string(e.begin); }

json::object entry_json(const Entry& e) {
  json::object o{{"name", e.name}, {"kind", e.kind}, {"begin", e.begin},  {"end", e.end},
                 {"step", e.step}, {"file", e.file}, {"tensor", e.tensor}};
  if (e.rows > 1) {
    o["rows"] = e.rows;
    o["stride"] = e.stride;
  }
  return o;
}

int64_t format_version_of(const std::vector<Entry>& entries) {
  return std::any_of(entries.begin(), entries.end(), [](const Entry& e) { return e.rows > 1; }) ? 2 : 1;
}

int64_t format_version_of(const json::array& entries) {  // entry_json writes "rows" only when above 1
  return std::any_of(entries.begin(), entries.end(),
                     [](const json::value& e) { return e.as_object().contains("rows"); })
             ? 2
             : 1;
}

Index parse_index(const std::string& text, const std::string& path) {
  boost::system::error_code ec;
  json::value v = json::parse(text, ec);
  if (ec) throw SafetensorsError("checkpoint index '" + path + "': " + ec.message());
  Index idx;
  try {
    const auto& o = v.as_object();
    idx.version = integer(o.at("format_version"), "format_version");
    if (idx.version > kFormatVersion)
      throw SafetensorsError("checkpoint index '" + path + "': format version " + std::to_string(idx.version) +
                             " is newer than this shardtorch reads (" + std::to_string(kFormatVersion) + ")");
    if (idx.version < 1)
      throw std::invalid_argument("format_version " + std::to_string(idx.version) + " is not 1 or more");
    if (const auto* f = o.if_contains("format");
        f && (!f->is_string() || f->as_string() != "shardtorch sharded checkpoint"))
      throw std::invalid_argument("format is " + json::serialize(*f) + ", not \"shardtorch sharded checkpoint\"");
    idx.world_size = integer(o.at("world_size"), "world_size");
    if (idx.world_size < 1 || idx.world_size > (int64_t{1} << 30))
      throw std::invalid_argument("world_size " + std::to_string(idx.world_size) + " is not a number of ranks");
    idx.step = integer(o.at("step"), "step");
    idx.strategy = json::value_to<std::string>(o.at("strategy"));
    if (!known_strategy(idx.strategy))
      throw std::invalid_argument("unknown strategy '" + idx.strategy +
                                  "' (full_shard, shard_grad_op, optimizer_only, no_shard or hybrid_shard)");
    for (const auto& f : o.at("files").as_array()) {
      const auto& fo = f.as_object();
      const std::string name = json::value_to<std::string>(fo.at("name"));
      if (!shard_file_name(name, idx.world_size))
        throw std::invalid_argument("file '" + name + "' is not rank-R.safetensors for a rank R of the " +
                                    std::to_string(idx.world_size) + " that saved");
      const int64_t size = integer(fo.at("size"), "the size of '" + name + "'");
      const std::string sum = json::value_to<std::string>(fo.at("checksum"));
      if (size < 0) throw std::invalid_argument("the size of '" + name + "' is negative");
      if (checksum::algorithm_of(sum).empty())
        throw std::invalid_argument("the checksum of '" + name + "' is not xxh3_64:HEX or fnv1a64:HEX");
      if (!idx.files.emplace(name, std::pair{size, sum}).second)
        throw std::invalid_argument("file '" + name + "' is listed twice");
    }
    for (const auto& e : o.at("entries").as_array()) idx.entries.push_back(entry_from(e, path));
    if (idx.version < format_version_of(idx.entries))
      throw std::invalid_argument("an entry holds several rows, which format_version " + std::to_string(idx.version) +
                                  " does not have");
    if (const auto* u = o.if_contains("user_state")) {  // absent in checkpoints saved without it
      for (const auto& [k, v] : u->as_object()) {
        if (!v.is_string())
          throw SafetensorsError("checkpoint index '" + path + "': user_state '" + std::string(k) +
                                 "' is not a string");
        idx.user_state[std::string(k)] = json::value_to<std::string>(v);
      }
    }
    if (const auto* sh = o.if_contains("shapes")) {
      idx.shapes.emplace();
      for (const auto& [k, dims] : sh->as_object()) {
        std::vector<int64_t> shape;
        for (const auto& d : dims.as_array()) {
          shape.push_back(integer(d, "a dimension of '" + std::string(k) + "'"));
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
      throw SafetensorsError("checkpoint index '" + path + "': entry '" + e.tensor + "' names unlisted file '" +
                             e.file + "'");
  for (size_t i = 0; i < idx.entries.size(); ++i)
    idx.ranges[{idx.entries[i].name, idx.entries[i].kind}].order.push_back(i);
  for (auto& [key, r] : idx.ranges) {
    std::stable_sort(r.order.begin(), r.order.end(),
                     [&](size_t a, size_t b) { return idx.entries[a].begin < idx.entries[b].begin; });
    int64_t furthest = std::numeric_limits<int64_t>::min();
    for (size_t i : r.order) r.max_end.push_back(furthest = std::max(furthest, reach(idx.entries[i])));
  }
  idx.fingerprint = "step " + std::to_string(idx.step) + ", index " + checksum::of(text.data(), text.size());
  return idx;
}

}  // namespace shardtorch::checkpoint::index_format
