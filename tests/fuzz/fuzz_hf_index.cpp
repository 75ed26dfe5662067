// libFuzzer target for the Hugging Face index parser
// (model.safetensors.index.json; built with ASan and UBSan, Boost.JSON from
// the system). Any text must either parse or throw SafetensorsError naming
// the file: never crash, never throw anything else; what parses names only
// non-empty tensors and files inside the checkpoint's directory.
#include <cstddef>
#include <cstdint>
#include <string>

#include "../../src/checkpoint/hf_index.h"
#include "../../src/checkpoint/safetensors_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace h = shardtorch::checkpoint::hf_index;
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    h::Index idx = h::parse(text, "fuzz/model.safetensors.index.json");
    for (const auto& [name, file] : idx.weight_map) {
      if (name.empty() || !h::inside_directory(file)) __builtin_trap();
      if (file[0] == '/' || file == ".." || file.rfind("../", 0) == 0 || file.find("/../") != std::string::npos)
        __builtin_trap();
    }
  } catch (const shardtorch::checkpoint::SafetensorsError& e) {
    if (std::string(e.what()).find("fuzz/model.safetensors.index.json") == std::string::npos) __builtin_trap();
  }
  return 0;
}
