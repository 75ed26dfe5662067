#pragma once
// The few file-system calls the tools make, with POSIX calls: nothing built
// here may import a std::filesystem symbol (the library's src/base/files.h says why).
// Errors throw std::runtime_error naming the call, the path and errno's text.
#include <string>

namespace shardtorch::tools {

bool is_regular_file(const std::string& path);
/// `dir` and its missing parents.
void create_directories(const std::string& dir);
/// "a" + "/" + "b", without doubling a trailing slash of `a`.
std::string join(const std::string& a, const std::string& b);

}  // namespace shardtorch::tools
