#pragma once
// Internal: the safetensors container, as bytes: an 8-byte little-endian header length
// N, N bytes of JSON ({name: {dtype, shape, data_offsets}} and an optional
// "__metadata__" object of strings), then the tensors' raw bytes.
//
// This file is plain C++ (no ATen), so the header parser can be fuzzed on its
// own. The parser is strict: it validates everything before any data is
// touched and throws SafetensorsError naming the file and the problem:
//   - the header length is at most 100 MB and fits in the file;
//   - the JSON is well formed (objects, arrays, strings, non-negative
//     integers; nothing else), with no duplicate names;
//   - every dtype is known, every shape × element size is computed with
//     overflow checks and equals its offsets' span;
//   - the offsets, sorted, start at 0, leave no gap and do not overlap, and
//     the last one ends exactly at the end of the file.
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "shardtorch/checkpoint/safetensors_error.h"

namespace shardtorch::checkpoint {

/// Largest header accepted (the reference implementation's limit).
constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;

struct TensorRecord {
  std::string name;
  std::string dtype;  // "F32", "BF16", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // offsets in the data section
};

/// A header as parse_header reads it (its names are unique).
struct SafetensorsHeader {
  std::vector<TensorRecord> tensors;  // in data order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;                            // 8 + header length
  std::unordered_map<std::string, size_t> positions;  // name -> index in `tensors`
  /// The record of `name`, null if none.
  const TensorRecord* find(const std::string& name) const;
};

/// Bytes per element of a safetensors dtype name; 0 if unknown.
size_t dtype_size(const std::string& dtype);

/// Parses and validates the header. `prefix` holds the file's first bytes (at
/// least 8 + header length of them, or the call throws), `file_size` the
/// whole file's size; `file` names it in errors.
SafetensorsHeader parse_header(const uint8_t* prefix, size_t prefix_size, uint64_t file_size, const std::string& file);

/// `s` as a JSON string, quotes included; throws SafetensorsError if it is
/// not UTF-8.
std::string quote(const std::string& s);

/// The 8-byte length and the JSON for these records (offsets as given),
/// padded with spaces to a multiple of 8 bytes.
std::string serialize_header(const std::vector<TensorRecord>& tensors,
                             const std::map<std::string, std::string>& metadata);

}  // namespace shardtorch::checkpoint
