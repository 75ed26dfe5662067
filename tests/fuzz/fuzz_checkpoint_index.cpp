// libFuzzer target for the sharded checkpoint's index.json parser (built with
// ASan and UBSan, Boost.JSON from the system). Any text must either parse or
// throw SafetensorsError naming the file: never crash, never throw anything
// else, and what parses must hold what loading relies on (a world of at least
// one rank, a known strategy and kinds, files named for its ranks).
#include <cstddef>
#include <cstdint>
#include <string>

#include "../../src/checkpoint/index_format.h"
#include "../../src/checkpoint/safetensors_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace f = shardtorch::checkpoint::index_format;
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    f::Index idx = f::parse_index(text, "fuzz/index.json");
    if (idx.version > f::kFormatVersion || idx.version < 1) __builtin_trap();
    if (idx.world_size < 1 || !f::known_strategy(idx.strategy)) __builtin_trap();
    for (const auto& [name, size_and_sum] : idx.files) {
      if (name.rfind("rank-", 0) != 0 || size_and_sum.first < 0) __builtin_trap();
      if (std::stoll(name.substr(5)) >= idx.world_size) __builtin_trap();
    }
    for (const auto& e : idx.entries) {
      if (e.begin < 0 || e.end < e.begin || e.step < 0) __builtin_trap();
      if (e.rows < 1 || (e.rows > 1 && (e.stride < e.end - e.begin || e.end == e.begin || idx.version < 2)))
        __builtin_trap();
      if (e.rows > 1 && (e.rows - 1 > (INT64_MAX - e.end) / e.stride)) __builtin_trap();  // reach() fits
      if (e.file.find('/') != std::string::npos || e.file.find("..") != std::string::npos) __builtin_trap();
      if (!idx.files.count(e.file)) __builtin_trap();
      if (e.kind != "param" && e.kind != "buffer" && e.kind != "exp_avg" && e.kind != "exp_avg_sq" &&
          e.kind != "max_exp_avg_sq" && e.kind != "momentum_buffer")
        __builtin_trap();
    }
    if (idx.shapes)
      for (const auto& [name, shape] : *idx.shapes)
        for (int64_t d : shape)
          if (d < 0) __builtin_trap();
    // An accepted entry serializes (the save path's serializer).
    for (const auto& e : idx.entries) (void)boost::json::serialize(f::entry_json(e));
  } catch (const shardtorch::checkpoint::SafetensorsError& e) {
    if (std::string(e.what()).find("fuzz/index.json") == std::string::npos) __builtin_trap();
  }
  return 0;
}
