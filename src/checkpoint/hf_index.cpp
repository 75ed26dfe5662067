#include "checkpoint/hf_index.h"

#include <boost/json.hpp>

#include <stdexcept>

#include "checkpoint/safetensors_format.h"

namespace shardtorch::checkpoint::hf_index {
namespace json = boost::json;

bool inside_directory(const std::string& name) {
  if (name.empty() || name[0] == '/') return false;
  size_t start = 0;
  while (true) {
    const size_t slash = name.find('/', start);
    const std::string part = name.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
    if (part.empty() || part == "." || part == ".." || part.find('\0') != std::string::npos) return false;
    if (slash == std::string::npos) return true;
    start = slash + 1;
  }
}

Index parse(const std::string& text, const std::string& file) {
  auto fail = [&](const std::string& what) -> SafetensorsError {
    return SafetensorsError("Hugging Face index '" + file + "': " + what);
  };
  json::value root;
  {
    boost::system::error_code ec;
    json::parse_options opts;
    opts.max_depth = 32;
    root = json::parse(text, ec, {}, opts);
    if (ec) throw fail("not valid JSON (" + ec.message() + ")");
  }
  if (!root.is_object()) throw fail("not a JSON object");
  const auto& o = root.as_object();
  Index idx;
  if (const auto* m = o.if_contains("metadata")) {
    if (!m->is_object() && !m->is_null()) throw fail("\"metadata\" is not an object");
    if (m->is_object())
      for (const auto& kv : m->as_object())
        idx.metadata[std::string(kv.key())] =
            kv.value().is_string() ? std::string(kv.value().as_string()) : json::serialize(kv.value());
  }
  const auto* wm = o.if_contains("weight_map");
  if (wm == nullptr) throw fail("no \"weight_map\" (is this a model.safetensors.index.json?)");
  if (!wm->is_object()) throw fail("\"weight_map\" is not an object of tensor names to file names");
  for (const auto& kv : wm->as_object()) {
    const std::string name(kv.key());
    if (name.empty()) throw fail("\"weight_map\" has an empty tensor name");
    if (!kv.value().is_string())
      throw fail("\"weight_map\" maps '" + name + "' to " + json::serialize(kv.value()) + ", not a file name");
    const std::string f(kv.value().as_string());
    if (!inside_directory(f))
      throw fail("\"weight_map\" maps '" + name + "' to '" + f +
                 "', which is not a file name inside the checkpoint's directory");
    idx.weight_map.emplace_back(name, f);
  }
  return idx;
}

}  // namespace shardtorch::checkpoint::hf_index
