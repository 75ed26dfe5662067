// The public headers.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <string>

#include "../src/base/files.h"

namespace files = shardtorch::files;

TEST(Headers, PublicHeadersDoNotIncludeTorchTorchH) {
  // Compile time matters: the public headers include ATen and torch/nn pieces only.
  int seen = 0;
  std::function<void(const std::string&)> walk = [&](const std::string& dir) {
    for (const auto& name : files::list_directory(dir)) {
      const std::string path = files::join(dir, name);
      if (files::is_directory(path)) walk(path);
      if (!files::is_regular_file(path) || name.size() < 2 || name.substr(name.size() - 2) != ".h") continue;
      ++seen;
      std::ifstream in(path);
      std::string line;
      while (std::getline(in, line)) EXPECT_EQ(line.find("torch/torch.h"), std::string::npos) << path << ": " << line;
    }
  };
  walk(std::string(SHARDTORCH_SOURCE_DIR) + "/include");
  EXPECT_GE(seen, 15) << "public headers not found";
}
