#pragma once
// Internal: the .metadata file of a PyTorch distributed checkpoint (DCP), a
// pickle of torch.distributed.checkpoint.metadata.Metadata, read with the
// allow-list reader (pickle_reader.h) and checked whole, and written back as
// a protocol-2 pickle that Python's pickle.load and dcp.load read. Plain C++
// (no ATen), so that the fuzz target (tests/fuzz/fuzz_dcp_metadata.cpp)
// builds it alone. docs/checkpoints.md, "PyTorch distributed checkpoints",
// says what is accepted and refused.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace shardtorch::checkpoint::dcp {

/// DCP's metadata version this code reads and writes ("1.0.0"; files of
/// torch before 2.9 have none).
inline constexpr const char* kVersion = "1.0.0";

/// Where an item is: `length` bytes at `offset` of `relative_path` (a file
/// of the checkpoint's directory).
struct Storage {
  std::string relative_path;
  uint64_t offset = 0, length = 0;
};

/// A box of a tensor saved as one item: offsets[d] <= index < offsets[d] + sizes[d].
struct Chunk {
  std::vector<int64_t> offsets, sizes;
  Storage storage;
};

/// One key of the flattened state dict ("model.l0.weight",
/// "optim.state.l0.weight.exp_avg", "optim.param_groups.0.lr").
struct Entry {
  std::string name;
  bool tensor = true;         // false: a pickled Python value (BYTE_IO)
  std::string dtype;          // torch's name: "float32", "bfloat16", ...
  std::vector<int64_t> size;  // the whole tensor's
  std::vector<Chunk> chunks;  // in the file's order
  Storage bytes;              // a BYTE_IO item's
  /// The key's path in the nested state dict (planner_data): strings and
  /// list indices. Empty: none recorded (the key stays flat).
  std::vector<std::variant<std::string, int64_t>> path;
};

struct Metadata {
  std::vector<Entry> entries;  // in the file's order
  std::optional<std::string> version;
  const Entry* find(const std::string& name) const;
  std::map<std::string, size_t> index;  // name -> entries position
};

/// The nested path of `key` as save_dcp_checkpoint writes it:
/// model_prefix + fqn -> (model, fqn); optimizer_prefix + "state.<fqn>.<kind>"
/// -> (optim, "state", fqn, kind); optimizer_prefix + "param_groups.<i>.<k>"
/// -> (optim, "param_groups", i, k); a prefix is its top-level key and a dot.
/// Empty (the key stays flat) for any other key.
std::vector<std::variant<std::string, int64_t>> path_of(const std::string& key, const std::string& model_prefix,
                                                        const std::string& optimizer_prefix);

/// The dtypes read and written (torch's names), and their element sizes; 0
/// for any other name.
size_t dtype_size(const std::string& torch_name);

/// Parses and checks `bytes`, the .metadata file `file`: the pickle with the
/// metadata allow-list, then the classes' fields; a version other than
/// kVersion or none, transforms (_extensions: "stream.zstd/1") and dtypes or
/// layouts shardtorch has not are refused by name; every tensor's chunks must
/// lie inside it, not overlap and cover it exactly; every chunk and every
/// BYTE_IO value must have its storage entry, and every storage entry a
/// chunk or value; file names must stay inside the directory
/// (hf_index::inside_directory). Throws
/// SafetensorsError naming the file and, for the pickle, the byte.
Metadata parse(const std::string& bytes, const std::string& file);

/// The .metadata pickle of `m` (protocol 2, no memo), with version kVersion
/// and the entries' paths as planner_data.
std::string serialize(const Metadata& m);

}  // namespace shardtorch::checkpoint::dcp
