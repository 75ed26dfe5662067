#include "base/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "shardtorch/error.h"

namespace shardtorch::files {
namespace {

[[noreturn]] void fail(const std::string& call, const std::string& path, int err) {
  throw Error("shardtorch: " + call + " '" + path + "' failed: " + std::strerror(err));
}

bool stat_of(const std::string& path, struct stat& st, bool follow = true) {
  return (follow ? ::stat(path.c_str(), &st) : ::lstat(path.c_str(), &st)) == 0;
}

// The entry names of `dir` ("." and ".." left out) into `names`, in the
// directory's order; 0, or errno if `dir` cannot be opened.
int read_names(const std::string& dir, std::vector<std::string>& names) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return errno;
  while (struct dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  return 0;
}

// Removes `path` bottom-up; the first failure (other than "already gone")
// is kept in `first_error`.
void remove_tree(const std::string& path, int& first_error, std::string& failed_path) {
  struct stat st;
  if (!stat_of(path, st, /*follow=*/false)) {
    if (errno != ENOENT && !first_error) first_error = errno, failed_path = path;
    return;
  }
  if (S_ISDIR(st.st_mode)) {
    std::vector<std::string> names;
    if (const int err = read_names(path, names)) {
      if (!first_error) first_error = err, failed_path = path;
      return;
    }
    for (const auto& n : names) remove_tree(join(path, n), first_error, failed_path);
    if (::rmdir(path.c_str()) != 0 && errno != ENOENT && !first_error) first_error = errno, failed_path = path;
  } else if (::unlink(path.c_str()) != 0 && errno != ENOENT && !first_error) {
    first_error = errno, failed_path = path;
  }
}

}  // namespace

bool exists(const std::string& path) {
  struct stat st;
  return stat_of(path, st, /*follow=*/false);
}

bool is_directory(const std::string& path) {
  struct stat st;
  return stat_of(path, st) && S_ISDIR(st.st_mode);
}

bool is_regular_file(const std::string& path) {
  struct stat st;
  return stat_of(path, st) && S_ISREG(st.st_mode);
}

bool is_empty_directory(const std::string& path) {
  std::vector<std::string> names;
  return is_directory(path) && read_names(path, names) == 0 && names.empty();
}

int64_t file_size(const std::string& path) {
  struct stat st;
  if (!stat_of(path, st)) fail("stat of", path, errno);
  if (!S_ISREG(st.st_mode)) throw Error("shardtorch: '" + path + "' is not a regular file");
  return static_cast<int64_t>(st.st_size);
}

namespace {
const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}
}  // namespace

std::string irregular_kind(const std::string& path) {
  struct stat st;
  if (!stat_of(path, st) || S_ISREG(st.st_mode)) return "";
  return kind_of(st.st_mode);
}

int open_regular_for_reading(const std::string& path, std::string& why) {
  // O_NONBLOCK: opening a FIFO to read would otherwise wait for a writer,
  // forever. It changes nothing for a regular file, and is cleared below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    why = std::strerror(errno);
    return -1;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    why = std::strerror(errno);
    ::close(fd);
    return -1;
  }
  if (!S_ISREG(st.st_mode)) {
    why = std::string("is ") + kind_of(st.st_mode) + ", not a regular file";
    ::close(fd);
    return -1;
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

std::vector<std::string> list_directory(const std::string& dir) {
  std::vector<std::string> names;
  if (const int err = read_names(dir, names)) fail("listing of", dir, err);
  std::sort(names.begin(), names.end());
  return names;
}

void remove_all(const std::string& path) {
  int err = 0;
  std::string where;
  remove_tree(path, err, where);
  if (err) fail("removal of", where, err);
}

void remove_all_quietly(const std::string& path) noexcept {
  try {
    int err = 0;
    std::string where;
    remove_tree(path, err, where);
  } catch (...) {  // only allocation can throw here
  }
}

bool remove(const std::string& path) {
  if (::remove(path.c_str()) == 0) return true;
  if (errno == ENOENT) return false;
  fail("removal of", path, errno);
}

void rename(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw Error("shardtorch: renaming '" + from + "' to '" + to + "' failed: " + std::strerror(errno));
}

void sync(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_DIRECTORY : 0) | O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("open (to fsync it) of", path, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && directory && (err == EINVAL || err == ENOTSUP || err == EOPNOTSUPP)) return;
  if (rc != 0) fail("fsync of", path, err);
}

void rename_durably(const std::string& from, const std::string& to, const std::function<void()>& renamed) {
  rename(from, to);
  if (renamed) renamed();
  sync(directory_of(to), /*directory=*/true);
}

namespace {
void make_directories(const std::string& dir, const std::string& target) {
  if (dir.empty() || is_directory(dir)) return;
  const std::string parent = parent_path(dir);
  if (!parent.empty() && parent != dir) make_directories(parent, target);
  if (::mkdir(dir.c_str(), 0777) == 0 || (errno == EEXIST && is_directory(dir))) return;
  const int err = errno;
  std::string why = std::strerror(err);
  if (err == EEXIST)
    why = "'" + dir + "' exists and is not a directory";
  else if (dir != target)
    why = "mkdir of '" + dir + "': " + why;
  throw Error("shardtorch: making directory '" + target + "' failed: " + why);
}
}  // namespace

void create_directories(const std::string& dir) { make_directories(dir, dir); }

void copy_file(const std::string& from, const std::string& to) {
  const int in = ::open(from.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) fail("open of", from, errno);
  const int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out < 0) {
    const int err = errno;
    ::close(in);
    fail("creation of", to, err);
  }
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(in, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : 0;
      ::close(in);
      if (::close(out) != 0 && !err) fail("close of", to, errno);
      if (err) fail("read of", from, err);
      return;
    }
    for (ssize_t done = 0; done < n;) {
      const ssize_t w = ::write(out, buf + done, static_cast<size_t>(n - done));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) {
        const int err = errno;
        ::close(in);
        ::close(out);
        fail("write of", to, err);
      }
      done += w;
    }
  }
}

void copy_tree(const std::string& from, const std::string& to) {
  if (!is_directory(from)) {
    copy_file(from, to);
    return;
  }
  create_directories(to);
  for (const auto& n : list_directory(from)) copy_tree(join(from, n), join(to, n));
}

std::vector<std::string> link_tree(const std::string& from, const std::string& to) {
  std::vector<std::string> left_out;
  struct stat st;
  if (!stat_of(from, st, /*follow=*/false)) {
    if (errno == ENOENT) return left_out;  // removed since it was listed
    fail("stat of", from, errno);
  }
  if (S_ISDIR(st.st_mode)) {
    create_directories(to);
    for (const auto& n : list_directory(from))
      for (auto& p : link_tree(join(from, n), join(to, n))) left_out.push_back(std::move(p));
    sync(to, /*directory=*/true);
  } else if (S_ISLNK(st.st_mode)) {
    std::vector<char> target(static_cast<size_t>(st.st_size) + 1);
    const ssize_t n = ::readlink(from.c_str(), target.data(), target.size());
    if (n < 0) {
      if (errno == ENOENT) return left_out;
      fail("readlink of", from, errno);
    }
    if (::symlink(std::string(target.data(), static_cast<size_t>(n)).c_str(), to.c_str()) != 0)
      fail("symlink to", to, errno);
  } else if (!S_ISREG(st.st_mode)) {
    left_out.push_back(from);
  } else if (::link(from.c_str(), to.c_str()) != 0) {
    if (errno == ENOENT && !exists(from)) return left_out;
    copy_file(from, to);
    if (::chmod(to.c_str(), st.st_mode & 07777) != 0) fail("chmod of", to, errno);
    sync(to);
  }
  return left_out;
}

void resize_file(const std::string& path, int64_t bytes) {
  if (::truncate(path.c_str(), static_cast<off_t>(bytes)) != 0) fail("truncate of", path, errno);
}

std::string make_temp_dir(const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string t = join(tmp && *tmp ? tmp : "/tmp", prefix + "-XXXXXX");
  std::vector<char> buf(t.begin(), t.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) fail("mkdtemp in", t, errno);
  return std::string(buf.data());
}

std::string parent_path(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return "";
  size_t end = slash;
  while (end > 0 && path[end - 1] == '/') --end;  // "a//b" -> "a"
  return end == 0 ? "/" : path.substr(0, end);
}

std::string directory_of(const std::string& path) {
  const std::string parent = parent_path(path);
  return parent.empty() ? "." : parent;
}

std::string filename(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string lexically_normal(const std::string& path) {
  if (path.empty()) return "";
  const bool absolute = path[0] == '/';
  std::vector<std::string> parts;
  bool trailing = false;  // the last component was a directory (".", "..", or a slash)
  size_t i = 0;
  while (i <= path.size()) {
    size_t j = path.find('/', i);
    if (j == std::string::npos) j = path.size();
    const std::string c = path.substr(i, j - i);
    const bool last = j == path.size();
    if (c.empty()) {
      trailing = last && !parts.empty();
    } else if (c == ".") {
      trailing = !parts.empty();
    } else if (c == "..") {
      if (!parts.empty() && parts.back() != "..") {
        parts.pop_back();
        trailing = !parts.empty();
      } else if (!absolute) {
        parts.push_back(c);
        trailing = false;
      }
    } else {
      parts.push_back(c);
      trailing = false;
    }
    i = j + 1;
  }
  std::string out = absolute ? "/" : "";
  for (size_t k = 0; k < parts.size(); ++k) out += (k ? "/" : "") + parts[k];
  if (trailing && !parts.empty()) out += "/";
  if (out.empty()) out = ".";
  return out;
}

std::string join(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

}  // namespace shardtorch::files
