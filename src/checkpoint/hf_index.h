#pragma once
// Hugging Face's model.safetensors.index.json: {"metadata": {...},
// "weight_map": {tensor name: file name}}. No LibTorch here, so that the fuzz
// target (tests/fuzz/fuzz_hf_index.cpp) builds it alone with Boost.JSON.
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace shardtorch::checkpoint::hf_index {

/// The index's file name in a checkpoint directory.
inline constexpr const char* kFileName = "model.safetensors.index.json";

struct Index {
  /// The "metadata" object, each value as its JSON text unless it is a string
  /// (transformers writes "total_size" as a number).
  std::map<std::string, std::string> metadata;
  /// Tensor name -> file name, in the index's order.
  std::vector<std::pair<std::string, std::string>> weight_map;
};

/// Parses `text` (the index file `file`, named in errors). Throws
/// SafetensorsError for anything but a JSON object whose "weight_map" is an
/// object of non-empty names to file names inside the checkpoint directory
/// (relative, no "." or ".." component, no empty component), naming the file
/// and the problem. "metadata", if present, must be an object.
Index parse(const std::string& text, const std::string& file);

/// Whether `name` is a file name that stays inside the directory it is
/// relative to: not empty, not absolute, no empty, "." or ".." component.
bool inside_directory(const std::string& name);

}  // namespace shardtorch::checkpoint::hf_index
