// libFuzzer target for the DCP metadata reader (the .metadata pickle; built
// with ASan and UBSan). Any bytes must either read as checked metadata or
// throw SafetensorsError naming the file: never crash, never loop, never
// throw anything else. What reads must be what the checks promise (chunks
// inside their tensor, storage for every non-empty chunk, files inside the
// directory) and must write back and read again the same.
#include <cstddef>
#include <cstdint>
#include <string>

#include "../../src/checkpoint/dcp_metadata.h"
#include "../../src/checkpoint/hf_index.h"
#include "shardtorch/checkpoint/safetensors_error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace dcp = shardtorch::checkpoint::dcp;
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  dcp::Metadata md;
  try {
    md = dcp::parse(bytes, "fuzz/.metadata");
  } catch (const shardtorch::checkpoint::SafetensorsError& e) {
    if (std::string(e.what()).find("fuzz/.metadata") == std::string::npos) __builtin_trap();
    return 0;
  }
  for (const auto& e : md.entries) {
    if (!e.tensor && !shardtorch::checkpoint::hf_index::inside_directory(e.bytes.relative_path)) __builtin_trap();
    if (e.tensor && dcp::dtype_size(e.dtype) == 0) __builtin_trap();
    for (const auto& c : e.chunks) {
      if (c.offsets.size() != e.size.size() || c.sizes.size() != e.size.size()) __builtin_trap();
      bool empty = false;
      for (size_t d = 0; d < e.size.size(); ++d) {
        if (c.offsets[d] < 0 || c.sizes[d] < 0 || c.offsets[d] + c.sizes[d] > e.size[d]) __builtin_trap();
        empty = empty || c.sizes[d] == 0;
      }
      if (!empty && !shardtorch::checkpoint::hf_index::inside_directory(c.storage.relative_path)) __builtin_trap();
    }
  }
  // Written back (planner data as read), it reads again the same.
  dcp::Metadata again;
  try {
    again = dcp::parse(dcp::serialize(md), "fuzz/written");
  } catch (const shardtorch::checkpoint::SafetensorsError&) {
    __builtin_trap();
  }
  if (again.entries.size() != md.entries.size()) __builtin_trap();
  for (size_t i = 0; i < md.entries.size(); ++i) {
    const auto &a = md.entries[i], &b = again.entries[i];
    if (a.name != b.name || a.tensor != b.tensor || a.dtype != b.dtype || a.size != b.size ||
        a.chunks.size() != b.chunks.size() || a.path != b.path)
      __builtin_trap();
  }
  return 0;
}
