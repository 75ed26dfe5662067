// libFuzzer target for the safetensors header parser (built with ASan and
// UBSan). Any input must either parse or throw SafetensorsError: never crash,
// never read out of bounds, never throw anything else. What parses must
// serialize again (so its names and metadata are UTF-8, which the writer
// requires).
#include <cstddef>
#include <cstdint>

#include "../../src/checkpoint/safetensors_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto h = shardtorch::checkpoint::parse_header(data, size, size, "fuzz-input");
    // What parses must describe data inside the input.
    for (const auto& t : h.tensors) {
      if (h.data_start + t.end > size) __builtin_trap();
    }
    // And serialize again, which refuses strings that are not UTF-8.
    try {
      std::string again = shardtorch::checkpoint::serialize_header(h.tensors, h.metadata);
      (void)again;
    } catch (...) {
      __builtin_trap();
    }
  } catch (const shardtorch::checkpoint::SafetensorsError&) {
  }
  return 0;
}
