#include "tool_files.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace shardtorch::tools {

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

void create_directories(const std::string& dir) {
  if (dir.empty()) return;
  for (size_t pos = dir.find('/', 1);; pos = dir.find('/', pos + 1)) {
    const std::string prefix = dir.substr(0, pos);
    struct stat st {};
    if (::stat(prefix.c_str(), &st) != 0) {
      if (::mkdir(prefix.c_str(), 0777) != 0 && errno != EEXIST)
        throw std::runtime_error("create_directories('" + dir + "'): mkdir('" + prefix + "'): " + std::strerror(errno));
    } else if (!S_ISDIR(st.st_mode)) {
      throw std::runtime_error("create_directories('" + dir + "'): '" + prefix + "' is not a directory");
    }
    if (pos == std::string::npos) return;
  }
}

std::string join(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

}  // namespace shardtorch::tools
