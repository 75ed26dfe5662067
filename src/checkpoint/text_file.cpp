#include "checkpoint/text_file.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/log.h"
#include "base/files.h"
#include "shardtorch/checkpoint/safetensors_error.h"

namespace shardtorch::checkpoint {

std::string read_text_file(const std::string& path, const std::string& what, uint64_t max_bytes,
                           const std::string& too_large) {
  std::string why;
  const int fd = files::open_regular_for_reading(path, why);
  if (fd < 0) throw SafetensorsError(what + " '" + path + "': cannot open: " + why);
  SHARDTORCH_DEBUG("opened '", path, "' for reading");
  std::string text;
  char buf[1 << 16];
  while (true) {
    const ssize_t r = ::read(fd, buf, sizeof(buf));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const std::string err = std::strerror(errno);
      ::close(fd);
      throw SafetensorsError(what + " '" + path + "': read failed: " + err);
    }
    if (r == 0) break;
    text.append(buf, static_cast<size_t>(r));
    if (text.size() > max_bytes) {
      ::close(fd);
      throw SafetensorsError(what + " '" + path + "': " + too_large);
    }
  }
  ::close(fd);
  return text;
}

}  // namespace shardtorch::checkpoint
