// In-memory snapshots (shardtorch/snapshot.h; the protocol is in
// docs/fault_tolerance.md, "In-memory snapshots"). A snapshot is a directory
// DIR/shardtorch-JOB-rR-own-sSTEP (or -rR-held-by-rH-sSTEP, the copy rank H
// keeps of rank R's) holding rank-R.safetensors, whose metadata is the
// snapshot's header; it is written as a hidden temporary directory and
// renamed into place, so a crash leaves the previous snapshots whole.
#include "shardtorch/snapshot.h"

#include <boost/json.hpp>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>

#include "base/check.h"
#include "base/env.h"
#include "base/errors.h"
#include "base/files.h"
#include "base/log.h"
#include "checkpoint/checksum.h"
#include "checkpoint/index_format.h"
#include "checkpoint/rank_state.h"
#include "checkpoint/safetensors_format.h"
#include "comm/world_access.h"
#include "runtime/backward_tracker.h"
#include "runtime/placement.h"
#include "runtime/shard_state.h"
#include "shardtorch/checkpoint.h"
#include "shardtorch/checkpoint/safetensors.h"

namespace shardtorch {

namespace json = boost::json;
using checkpoint::index_format::Entry;
using checkpoint::index_format::Index;

namespace {

constexpr int kVersion = 1;
constexpr const char* kFormat = "shardtorch snapshot";
constexpr int kKeep = 2;  // generations kept of each snapshot: the ranks may be one apart when one dies

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

std::string prefix(const SnapshotOptions& o) { return "shardtorch-" + detail::snapshot_job(o) + "-r"; }
std::string own_name(const SnapshotOptions& o, int rank) { return prefix(o) + std::to_string(rank) + "-own-s"; }
std::string held_name(const SnapshotOptions& o, int rank, int holder) {
  return prefix(o) + std::to_string(rank) + "-held-by-r" + std::to_string(holder) + "-s";
}
std::string file_of(int rank) { return "rank-" + std::to_string(rank) + ".safetensors"; }
// Every member's string of `comm`, in order, through its backend directly:
// the persisting thread runs beside the program's, whose collectives the
// check orders (Comm's would be checked against them).
std::vector<std::string> gather_unchecked(Comm& comm, const std::string& mine) {
  const auto& backend = comm.backend();
  const int n = comm.size();
  auto all_gather = [&](const at::Tensor& t) {
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < n; ++r) out[0].push_back(at::empty_like(t));
    std::vector<at::Tensor> in{t};
    backend->allgather(out, in)->wait(comm.timeout());
    return out[0];
  };
  const auto lengths = all_gather(torch::tensor({static_cast<int64_t>(mine.size())}, torch::kInt64));
  int64_t longest = 1;
  for (const auto& l : lengths) longest = std::max(longest, l.item<int64_t>());
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  const auto all = all_gather(bytes);
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r)
    out.emplace_back(static_cast<const char*>(all[static_cast<size_t>(r)].data_ptr()),
                     static_cast<size_t>(lengths[static_cast<size_t>(r)].item<int64_t>()));
  return out;
}

// A barrier over `comm`, through its backend directly (see gather_unchecked).
void barrier_unchecked(Comm& comm) {
  c10d::BarrierOptions o;
  o.timeout = comm.timeout();
  comm.backend()->barrier(o)->wait(comm.timeout());
}

// Rank `rank`'s registered state `name` in a persisted checkpoint's user_state.
std::string persisted_key(int rank, const std::string& name) {
  return "snapshot.rank" + std::to_string(rank) + "." + name;
}

// The steps of the snapshots named `name`STEP in `dir`, newest first.
std::vector<int64_t> steps_named(const std::string& dir, const std::string& name) {
  std::vector<int64_t> out;
  if (!files::is_directory(dir)) return out;
  for (const auto& e : files::list_directory(dir)) {
    if (e.compare(0, name.size(), name) != 0) continue;
    const std::string rest = e.substr(name.size());
    if (rest.empty() || rest.find_first_not_of("0123456789") != std::string::npos || rest.size() > 18) continue;
    out.push_back(std::stoll(rest));
  }
  std::sort(out.rbegin(), out.rend());
  return out;
}

// Hidden while it is written: steps_named never sees it.
std::string temporary_of(const std::string& dir, const std::string& name) {
  return files::join(dir, "." + name + ".tmp");
}

// The hidden temporary directory for the snapshot `name`STEP, made from the
// oldest generation older than STEP that goes once it is in place (its
// file's pages are written over instead of freed and allocated again), or
// new. The kKeep - 1 newest older ones stay whole meanwhile.
std::string temporary_for(const std::string& dir, const std::string& name, int64_t step) {
  const std::string tmp = temporary_of(dir, name + std::to_string(step));
  files::remove_all_quietly(tmp);
  std::vector<int64_t> older;
  for (int64_t s : steps_named(dir, name))
    if (s < step) older.push_back(s);
  if (older.size() >= static_cast<size_t>(kKeep))
    files::rename(files::join(dir, name + std::to_string(older.back())), tmp);
  else
    files::create_directories(tmp);
  return tmp;
}

// Once `name``step` is in place: the generations after it (of a
// timeline the job left, or another run's) and all but the kKeep newest up
// to it go.
void prune(const std::string& dir, const std::string& name, int64_t step) {
  int kept = 0;
  for (int64_t s : steps_named(dir, name))
    if (s > step || ++kept > kKeep) files::remove_all_quietly(files::join(dir, name + std::to_string(s)));
}

// Moves the finished temporary directory `tmp` in as `final_dir`.
void put_in_place(const std::string& tmp, const std::string& final_dir) {
  files::remove_all_quietly(final_dir);  // a step done again after a restore: the older generation stays whole
  files::rename(tmp, final_dir);
}

std::string read_whole(const std::string& path) {
  std::string why;
  const int fd = files::open_regular_for_reading(path, why);
  if (fd < 0) throw std::runtime_error("cannot open '" + path + "': " + why);
  std::string out;
  out.resize(static_cast<size_t>(std::max<int64_t>(0, files::file_size(path))));
  size_t at = 0;
  while (at < out.size()) {
    const ssize_t n = ::read(fd, out.data() + at, out.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      throw std::runtime_error("cannot read '" + path + "'");
    }
    at += static_cast<size_t>(n);
  }
  ::close(fd);
  return out;
}

// Writes `n` bytes at offset `at` of the open file `fd` (`path`, in errors).
void write_at(int fd, const char* data, size_t n, off_t at, const std::string& path) {
  size_t done = 0;
  while (done < n) {
    const ssize_t w = ::pwrite(fd, data + done, n - done, at + static_cast<off_t>(done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw std::runtime_error("cannot write '" + path + "': " + std::strerror(errno));
    done += static_cast<size_t>(w);
  }
}

void write_whole(const std::string& path, const char* data, size_t n) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot create '" + path + "': " + std::strerror(errno));
  try {
    write_at(fd, data, n, 0, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0) throw std::runtime_error("cannot close '" + path + "'");
}

// The file `path` opened for writing at `size` bytes: an existing file
// keeps its pages (no allocation on tmpfs), a longer one is cut.
int open_sized(const std::string& path, int64_t size) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot create '" + path + "': " + std::strerror(errno));
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error("cannot size '" + path + "': " + std::strerror(err));
  }
  return fd;
}

// A whole file mapped into memory (shared: writes go to the file), as a
// byte tensor over the mapping; unmapped when the last tensor goes.
at::Tensor map_file(int fd, int64_t size, bool writable, const std::string& path) {
  void* p = ::mmap(nullptr, static_cast<size_t>(size), writable ? PROT_READ | PROT_WRITE : PROT_READ,
                   MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) throw std::runtime_error("cannot map '" + path + "': " + std::strerror(errno));
  const auto n = static_cast<size_t>(size);
  return at::from_blob(
      p, {size}, [n](void* q) { ::munmap(q, n); }, at::TensorOptions().dtype(at::kByte));
}

// A whole file mapped read-only (map_file), its descriptor closed.
at::Tensor map_for_reading(const std::string& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open '" + file + "': " + std::strerror(errno));
  at::Tensor data;
  try {
    data = map_file(fd, files::file_size(file), /*writable=*/false, file);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);  // the mapping stays
  return data;
}

// The checksum of a safetensors file's data (what follows its header).
std::string data_checksum_of(const std::string& bytes) {
  if (bytes.size() < 8) throw std::runtime_error("shorter than a safetensors header");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  if (n > bytes.size() - 8) throw std::runtime_error("its header runs past its end");
  return checkpoint::checksum::of(bytes.data() + 8 + n, bytes.size() - 8 - n);
}

// A snapshot found on this node, checked.
struct Found {
  Index index;
  std::map<std::string, std::string> user_state;
};

std::string who_of(const World& world) { return detail::rank_prefix(world.global_rank()) + ": snapshots"; }

// A copy of the state running in the background, which the model's updates
// wait for (open while it runs).
class CopyGate {
 public:
  void open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
  }
  void close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = false;
    }
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return !open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// This rank's snapshot directory: its own snapshots and the copies it keeps
// of its buddies' (which ranks those are), checked, written, listed, dropped.
struct SnapshotDir {
  SnapshotDir(const World& w, const SnapshotOptions& o) : world(w), options(o) {}
  const World& world;
  const SnapshotOptions& options;
  std::string fingerprint, strategy;  // of this rank's model, as the headers name them
  // Every rank's fingerprint (a pipeline's stages differ): a copy held for
  // rank r is checked against r's.
  std::vector<std::string> fingerprints;

  int rank() const { return world.rank(); }
  // The ranks whose copies this rank keeps.
  std::vector<int> held_for() const {
    std::vector<int> out;
    for (int r = 0; r < world.size(); ++r)
      if (r != rank() && options.buddy[static_cast<size_t>(r)] == rank()) out.push_back(r);
    return out;
  }

  // Checks the snapshot directory `path` of rank `rank`'s state: the
  // header's format, job, model and layout, and (`data`) the data's
  // checksum. Without `data` only the header is read, and a valid one gives
  // an empty Found.
  std::optional<Found> check(const std::string& path, int for_rank, int64_t step, std::string& why,
                             bool data = true) const {
    try {
      const std::string file = files::join(path, file_of(for_rank));
      checkpoint::Reader reader(file);
      const auto& meta = reader.metadata();
      auto it = meta.find("shardtorch_snapshot");
      if (it == meta.end()) throw std::runtime_error("no snapshot header");
      const json::object h = json::parse(it->second).as_object();
      auto text = [&](const char* k) { return json::value_to<std::string>(h.at(k)); };
      if (text("format") != kFormat || h.at("version").as_int64() != kVersion)
        throw std::runtime_error("format '" + text("format") + "' version " +
                                 std::to_string(h.at("version").as_int64()) + ", not '" + kFormat + "' version " +
                                 std::to_string(kVersion));
      if (text("job") != detail::snapshot_job(options))
        throw std::runtime_error("of job '" + text("job") + "', not '" + detail::snapshot_job(options) + "'");
      if (h.at("world_size").as_int64() != world.size() || h.at("rank").as_int64() != for_rank)
        throw std::runtime_error("of rank " + std::to_string(h.at("rank").as_int64()) + " of " +
                                 std::to_string(h.at("world_size").as_int64()) + ", not rank " +
                                 std::to_string(for_rank) + " of " + std::to_string(world.size()));
      const std::string& want = fingerprints.empty() ? fingerprint : fingerprints.at(static_cast<size_t>(for_rank));
      if (text("fingerprint") != want)
        throw std::runtime_error("of another model or strategy (fingerprint " + text("fingerprint") + ", rank " +
                                 std::to_string(for_rank) + "'s model in this job has " + want + ")");
      if (h.at("step").as_int64() != step)
        throw std::runtime_error("its header says step " + std::to_string(h.at("step").as_int64()));
      if (!data) return Found{};
      const std::string bytes = read_whole(file);
      if (data_checksum_of(bytes) != text("data_checksum"))
        throw std::runtime_error("its data does not match its checksum (damaged)");
      json::object index{
          {"format_version", 1},
          {"world_size", world.size()},
          {"strategy", strategy},
          {"step", step},
          {"files", json::array{json::object{{"name", file_of(for_rank)},
                                             {"size", static_cast<int64_t>(bytes.size())},
                                             {"checksum", checkpoint::checksum::of(bytes.data(), bytes.size())}}}},
          {"entries", h.at("entries")},
          {"shapes", h.at("shapes")}};
      Found f;
      f.index = checkpoint::index_format::parse_index(json::serialize(index), file);
      for (const auto& [k, v] : h.at("user_state").as_object())
        f.user_state[std::string(k)] = json::value_to<std::string>(v);
      return f;
    } catch (const std::exception& e) {
      why = "snapshot '" + path + "' is not used: " + e.what();
      return std::nullopt;
    }
  }

  // The steps of the snapshots named `name`STEP of `for_rank` whose header
  // is valid, newest first (their data is checked once chosen). The others
  // (another model's, world size's or format's, or unreadable) can never be
  // used: they are removed, so that no later write keeps them in its stead.
  std::vector<int64_t> valid_steps(const std::string& name, int for_rank) const {
    std::vector<int64_t> out;
    for (int64_t s : steps_named(options.dir, name)) {
      std::string why;
      const std::string path = files::join(options.dir, name + std::to_string(s));
      if (check(path, for_rank, s, why, /*data=*/false)) {
        out.push_back(s);
        continue;
      }
      files::remove_all_quietly(path);
      SHARDTORCH_WARN(who_of(world), ": ", why, "; removed");
    }
    return out;
  }

  // Writes `bytes`, rank `owner`'s file of `step`, as the snapshot directory `name`STEP.
  void write_received(const std::string& name, int owner, int64_t step, const at::Tensor& bytes) {
    const std::string full = name + std::to_string(step);
    const std::string tmp = temporary_of(options.dir, full);
    files::remove_all_quietly(tmp);
    files::create_directories(tmp);
    write_whole(files::join(tmp, file_of(owner)), static_cast<const char*>(bytes.data_ptr()),
                static_cast<size_t>(bytes.numel()));
    put_in_place(tmp, files::join(options.dir, full));
    prune(options.dir, name, step);
  }

  // After a restore to `step`: the snapshots of later steps are of a
  // timeline the job left; they go, so that none is ever restored.
  void drop_newer(int64_t step) {
    auto drop = [&](const std::string& name) {
      for (int64_t s : steps_named(options.dir, name))
        if (s > step) files::remove_all_quietly(files::join(options.dir, name + std::to_string(s)));
    };
    drop(own_name(options, rank()));
    for (int from : held_for()) drop(held_name(options, from, rank()));
  }

  // Leftovers of writes a crash interrupted.
  void remove_leftovers() {
    for (const auto& e : files::list_directory(options.dir))
      if (e.size() > 5 && e.compare(e.size() - 4, 4, ".tmp") == 0 &&
          (e.rfind("." + own_name(options, rank()), 0) == 0 ||
           (e.rfind("." + prefix(options), 0) == 0 &&
            e.find("-held-by-r" + std::to_string(rank()) + "-s") != std::string::npos)))
        files::remove_all_quietly(files::join(options.dir, e));
  }

  // Snapshots of this job that name a rank the world does not have (left by
  // a run at a larger world size) can never be used: they go, with a
  // warning from the rank that removed each, and so do those ranks' lock
  // files that no live process holds.
  void remove_other_worlds() {
    const std::string p = prefix(options), lock_p = "." + p;
    const int64_t n = world.size();
    auto rank_at = [](const std::string& text, size_t at, size_t* end) -> int64_t {
      const size_t stop = text.find_first_not_of("0123456789", at);
      *end = stop == std::string::npos ? text.size() : stop;
      if (*end == at || *end - at > 9) return -1;
      return std::stoll(text.substr(at, *end - at));
    };
    for (const auto& e : files::list_directory(options.dir)) {
      size_t end = 0;
      if (e.rfind(p, 0) == 0) {
        const int64_t owner = rank_at(e, p.size(), &end);
        int64_t holder = -1;
        if (owner < 0) continue;
        const std::string rest = e.substr(end);
        if (rest.rfind("-held-by-r", 0) == 0) {
          size_t hend = 0;
          holder = rank_at(rest, 10, &hend);
          if (holder < 0 || rest.compare(hend, 2, "-s") != 0) continue;
        } else if (rest.rfind("-own-s", 0) != 0) {
          continue;
        }
        if (owner < n && holder < n) continue;
        const std::string path = files::join(options.dir, e);
        const std::string taken = files::join(options.dir, "." + e + ".gone-r" + std::to_string(rank()) + ".tmp");
        if (::rename(path.c_str(), taken.c_str()) != 0) continue;  // another rank of this node took it
        files::remove_all_quietly(taken);
        SHARDTORCH_WARN(who_of(world), ": snapshot '", path, "' is not used: of rank ", owner,
                        holder >= 0 ? " held by rank " + std::to_string(holder) : std::string(),
                        ", and this job has ranks 0 to ", n - 1, "; removed");
      } else if (e.rfind(lock_p, 0) == 0) {
        const int64_t owner = rank_at(e, lock_p.size(), &end);
        if (owner < n || e.substr(end) != ".lock") continue;
        const std::string path = files::join(options.dir, e);
        const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
        if (fd < 0) continue;
        if (::flock(fd, LOCK_EX | LOCK_NB) == 0) ::unlink(path.c_str());  // held: a live process of that name
        ::close(fd);
      }
    }
  }

  // The bytes of `owner`'s snapshot `name`STEP in `dir` (0: none).
  int64_t bytes_of(const std::string& name, int owner, int64_t s) const {
    const std::string f = files::join(files::join(options.dir, name + std::to_string(s)), file_of(owner));
    return files::exists(f) ? files::file_size(f) : 0;
  }
  // The bytes this rank keeps in `dir`, as they are now.
  int64_t kept_now() const {
    int64_t total = 0;
    for (int64_t s : steps_named(options.dir, own_name(options, rank())))
      total += bytes_of(own_name(options, rank()), rank(), s);
    for (int from : held_for())
      for (int64_t s : steps_named(options.dir, held_name(options, from, rank())))
        total += bytes_of(held_name(options, from, rank()), from, s);
    return total;
  }
  // kept_now() once this rank's snapshot of `step`, `size` bytes, is in
  // place: the older generations it keeps and the copies as they are.
  int64_t kept_after(int64_t step, int64_t size) const {
    const std::string name = own_name(options, rank());
    int64_t total = kept_now() + size;
    std::vector<int64_t> older;
    for (int64_t s : steps_named(options.dir, name)) {
      if (s < step) older.push_back(s);
      if (s >= step) total -= bytes_of(name, rank(), s);
    }
    for (size_t i = kKeep - 1; i < older.size(); ++i) total -= bytes_of(name, rank(), older[i]);
    return total;
  }

  // What this rank has: its own snapshots and the copies it keeps (JSON).
  std::string held_steps() const {
    json::object report;
    json::array own;
    for (int64_t s : valid_steps(own_name(options, rank()), rank())) own.push_back(s);
    report["own"] = own;
    json::object held;
    for (int from : held_for()) {
      json::array steps;
      for (int64_t s : valid_steps(held_name(options, from, rank()), from)) steps.push_back(s);
      held[std::to_string(from)] = steps;
    }
    report["held"] = held;
    return json::serialize(report);
  }
};

// The point-to-point transfers the background thread waits on, which a
// rejoin aborts: a receive from a rank that died is not woken by its
// connection closing. Once aborted, a transfer posted later is aborted too,
// and check() throws, until reset() (the next snapshot).
class Transfers {
 public:
  void reset() {
    std::lock_guard<std::mutex> lock(mu_);
    works_.clear();
    aborted_ = false;
  }
  void add(const PendingWork& p) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!p.work) return;
    works_.push_back(p.work);
    if (aborted_) abort_all();
  }
  void abort() {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    abort_all();
  }
  void check() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) throw std::runtime_error("aborted for a rejoin");
  }

 private:
  void abort_all() {
    for (auto& w : works_) try {
        w->abort();
      } catch (const std::exception&) {  // done already
      }
    works_.clear();
  }
  mutable std::mutex mu_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  bool aborted_ = false;
};

}  // namespace

namespace detail {

std::string snapshot_job(const SnapshotOptions& options) {
  return options.job.empty() ? env_or("TORCHELASTIC_RUN_ID", "shardtorch") : options.job;
}
std::string own_snapshot_path(const SnapshotOptions& options, int rank, int64_t step) {
  return files::join(options.dir, own_name(options, rank) + std::to_string(step));
}
std::string held_snapshot_path(const SnapshotOptions& options, int rank, int holder, int64_t step) {
  return files::join(options.dir, held_name(options, rank, holder) + std::to_string(step));
}

}  // namespace detail

struct Snapshots::Impl {
  std::shared_ptr<World> world;
  torch::nn::Module& root;
  ShardedOptimizer* opt;
  SnapshotOptions options;
  std::shared_ptr<Comm> comm;  // the buddy copies' (and persisting's) own group
  std::shared_ptr<detail::ShardState> sharded;
  SnapshotDir dir;  // of this rank
  // Of the last snapshot written, for persisting it in the background.
  struct Written {
    std::map<std::string, std::string> user_state;
    std::string entries;  // JSON
    std::map<std::string, std::vector<int64_t>> shapes;
  } written;
  std::map<std::string, std::pair<std::function<std::string()>, std::function<void(const std::string&)>>> state;
  std::thread transfer;
  std::string transfer_error, persist_error;
  CopyGate copy;          // the copy of the state in the background, which updates wait for
  Transfers sent;         // the background thread's transfers
  int guard = -1;         // the model's update guard
  int lock_fd = -1;       // this rank's lock on the job's files in `dir`, held while this object lives
  bool restored = false;  // restore() or rejoin() was called
  bool finished = false;  // finish() was called: the job's files and lock are gone
  std::string lock_path;  // the file of lock_fd
  // This rank's state as training left it, for a rejoin (Snapshots::rejoin):
  // it is the state of `step` while no update began since after_step(step);
  // the buffers (a forward changes them) and the registered state are those
  // of the snapshot collected at `collected`.
  struct Live {
    int64_t step = -1, collected = -1;
    std::atomic<bool> updated{true};
    std::atomic<bool> trained{false};  // an update since the Snapshots were made
    std::vector<std::pair<std::string, at::Tensor>> buffers;
    std::map<std::string, std::string> user_state;
    bool usable() const { return !updated.load() && step >= 0 && step == collected; }
  } live;

  Impl(std::shared_ptr<World> w, torch::nn::Module& r, ShardedOptimizer* o, SnapshotOptions opts)
      : world(std::move(w)), root(r), opt(o), options(std::move(opts)), dir(*world, options) {}
  ~Impl() {
    if (lock_fd >= 0) ::close(lock_fd);  // the lock goes with it, also when the constructor throws
  }

  int rank() const { return world->rank(); }
  std::string who() const { return who_of(*world); }

  // Refuses `call` after finish(), which removed what it would use.
  void check_not_finished(const char* call) const {
    SHARDTORCH_CHECK(!finished, who(), ": ", call,
                     " after finish(): finish() removed this job's snapshots and released its lock in '", options.dir,
                     "'. Make a new Snapshots object for another run");
  }

  void wait_transfer(bool rethrow) {
    if (transfer.joinable()) transfer.join();
    if (!persist_error.empty() && rank() == 0) SHARDTORCH_WARN("shardtorch: snapshots: ", persist_error);
    persist_error.clear();
    std::string e;
    std::swap(e, transfer_error);
    if (rethrow && !e.empty()) throw Error(who() + ": the copy to the buddy failed: " + e);
  }

  // A snapshot of this rank collected on the program's thread: the state's
  // tensors (the buffers copied, which a forward changes; the rest read where
  // they are until the next update, which before_update holds back), their
  // layout in the file, and the program's registered state.
  struct Own {
    int64_t step = 0;
    std::vector<at::Tensor> data;
    std::vector<checkpoint::TensorRecord> records;
    uint64_t bytes = 0;      // of data
    json::object header;     // without its data_checksum
    int64_t file_bytes = 0;  // the file's size, its header's checksum the longest one

    // The file's header, with the data's checksum.
    std::string head(const std::string& checksum) const {
      json::object h = header;
      h["data_checksum"] = checksum;
      return checkpoint::serialize_header(
          records, {{"step", std::to_string(step)}, {"shardtorch_snapshot", json::serialize(h)}});
    }
  };

  Own collect_own(int64_t step) {
    Own o;
    o.step = step;
    auto items = checkpoint::rank_state(root, opt, file_of(rank()));
    // Laid out by element size, largest first, as safetensors writers lay
    // them out, so the data's checksum is of the file's data in order.
    std::stable_sort(items.begin(), items.end(),
                     [](const auto& a, const auto& b) { return a.second.element_size() > b.second.element_size(); });
    json::array entries;
    live.buffers.clear();
    for (auto& [e, t] : items) {
      at::Tensor c = t.contiguous().cpu();
      if (e.kind == "buffer" && c.is_same(t)) c = c.clone();
      if (e.kind == "buffer") live.buffers.emplace_back(e.name, c);  // the file's copy, kept for a rejoin
      entries.push_back(checkpoint::index_format::entry_json(e));
      checkpoint::TensorRecord r;
      r.name = e.tensor;
      r.dtype = checkpoint::dtype_name(c.scalar_type());
      r.shape = c.sizes().vec();
      r.begin = o.bytes;
      r.end = o.bytes = r.begin + static_cast<uint64_t>(c.nbytes());
      o.records.push_back(std::move(r));
      o.data.push_back(std::move(c));
    }
    json::object shapes, user;
    written.shapes = checkpoint::model_shapes_of(root);
    for (const auto& [n, shape] : written.shapes) {
      json::array dims;
      for (int64_t d : shape) dims.push_back(d);
      shapes[n] = dims;
    }
    written.user_state.clear();
    for (const auto& [k, fns] : state) {
      written.user_state[k] = fns.first();
      user[k] = written.user_state[k];
    }
    live.collected = step;
    live.user_state = written.user_state;
    written.entries = json::serialize(entries);
    o.header = json::object{{"format", kFormat},
                            {"version", kVersion},
                            {"job", detail::snapshot_job(options)},
                            {"fingerprint", dir.fingerprint},
                            {"world_size", world->size()},
                            {"rank", rank()},
                            {"step", step},
                            {"entries", std::move(entries)},
                            {"shapes", std::move(shapes)},
                            {"user_state", std::move(user)}};
    o.file_bytes = static_cast<int64_t>(
        o.head(std::string(checkpoint::checksum::kXxh3) + ":" + std::string(16, 'f')).size() + o.bytes);
    return o;
  }

  // Writes the collected snapshot as this rank's file: the data's checksum,
  // then the bytes copied once from the tensors into the file (a recycled
  // generation's, in place), then the directory renamed into place.
  void write_own(const Own& o) {
    detail::test_point("snapshot copy");
    checkpoint::checksum::Hasher hash;
    for (const auto& c : o.data) hash.update(static_cast<const char*>(c.data_ptr()), c.nbytes());
    const std::string head = o.head(hash.text());
    const std::string name = own_name(options, rank());
    const std::string tmp = temporary_for(options.dir, name, o.step);
    checkpoint::crash_point("snapshot started");
    const std::string file = files::join(tmp, file_of(rank()));
    const int fd = open_sized(file, static_cast<int64_t>(head.size() + o.bytes));
    try {
      write_at(fd, head.data(), head.size(), 0, file);
      for (size_t i = 0; i < o.data.size(); ++i)
        write_at(fd, static_cast<const char*>(o.data[i].data_ptr()), static_cast<size_t>(o.data[i].nbytes()),
                 static_cast<off_t>(head.size() + o.records[i].begin), file);
      if (::fsync(fd) != 0) throw std::runtime_error("cannot sync '" + file + "': " + std::strerror(errno));
    } catch (...) {
      ::close(fd);
      throw;
    }
    if (::close(fd) != 0) throw std::runtime_error("cannot close '" + file + "'");
    checkpoint::crash_point("snapshot written");
    put_in_place(tmp, files::join(options.dir, name + std::to_string(o.step)));
    checkpoint::crash_point("snapshot in place");
    prune(options.dir, name, o.step);
  }

  // Sends this rank's snapshot of `step` to its buddy and receives the
  // snapshots of the ranks it keeps copies of (the background thread). The
  // bytes go from the file's pages to the socket, and from the socket into
  // the held copy's file (mapped): no other copy.
  void exchange(int64_t step) {
    std::vector<PendingWork> works;
    std::vector<at::Tensor> keep;
    const int buddy = options.buddy[static_cast<size_t>(rank())];
    if (buddy != rank()) {
      at::Tensor data = map_for_reading(files::join(detail::own_snapshot_path(options, rank(), step), file_of(rank())));
      at::Tensor head = torch::tensor({step, data.numel()}, torch::kInt64);
      keep = {head, data};
      works.push_back(comm->send_async(head, buddy, 1, "snapshot header"));
      sent.add(works.back());
      works.push_back(comm->send_async(data, buddy, 2, "snapshot"));
      sent.add(works.back());
    }
    for (int from : dir.held_for()) {
      at::Tensor head = at::empty({2}, at::kLong);
      PendingWork w = comm->recv_async(head, from, 1, "snapshot header");
      sent.add(w);
      comm->wait(w);
      sent.check();
      const int64_t s = head[0].item<int64_t>(), n = head[1].item<int64_t>();
      const std::string name = held_name(options, from, rank());
      const std::string tmp = temporary_for(options.dir, name, s), file = files::join(tmp, file_of(from));
      const int fd = open_sized(file, n);
      at::Tensor data;
      try {
        data = map_file(fd, n, /*writable=*/true, file);
      } catch (...) {
        ::close(fd);
        throw;
      }
      ::close(fd);
      PendingWork d = comm->recv_async(data, from, 2, "snapshot");
      sent.add(d);
      comm->wait(d);
      sent.check();
      data = at::Tensor();  // unmapped: the file holds the bytes
      put_in_place(tmp, files::join(options.dir, name + std::to_string(s)));
      prune(options.dir, name, s);
    }
    for (auto& w : works) comm->wait(w);
    sent.check();
  }

  // Publishes the snapshot of `step` as the sharded checkpoint in
  // fallback_dir (the background thread, after exchange); a failure is
  // persist_error, warned about by wait_transfer (on the program's thread).
  void persist(int64_t step) {
    json::object mine;
    for (const auto& [k, v] : written.user_state) mine[k] = v;
    const checkpoint::GatherStrings gather = [this](const std::string& m, const std::string&) {
      return gather_unchecked(*comm, m);
    };
    const auto all = gather(json::serialize(mine), "the registered state");
    std::map<std::string, std::string> user;
    for (size_t r = 0; r < all.size(); ++r) {
      const json::value theirs = json::parse(all[r]);
      for (const auto& [k, v] : theirs.as_object())
        user[persisted_key(static_cast<int>(r), std::string(k))] = json::value_to<std::string>(v);
    }
    const std::string why = checkpoint::publish_rank_files(
        gather, rank(), files::join(detail::own_snapshot_path(options, rank(), step), file_of(rank())), written.entries,
        sharded->options().strategy(), written.shapes, step, user, options.fallback_dir);
    if (!why.empty())
      persist_error = "step " + std::to_string(step) + " could not be persisted to '" + options.fallback_dir + "' (" +
                      why + "); the checkpoint there stays as it was, and training goes on";
    else if (rank() == 0)
      SHARDTORCH_DEBUG("shardtorch: snapshots: step ", step, " persisted to '", options.fallback_dir, "'");
  }

  // The snapshots' bytes in the model's memory report.
  void count_memory(int64_t bytes) { sharded->mem().set(Mem::Snapshots, bytes); }

  /// `survivor`: this rank's live state may serve (Snapshots::rejoin).
  int64_t restore(bool survivor);
  int64_t fall_back(const std::string& why);
  /// A sharded checkpoint in fallback_dir to fall back to.
  bool has_fallback() const { return !options.fallback_dir.empty() && sharded_checkpoint_exists(options.fallback_dir); }
  // restore's steps.
  struct Choice {
    int64_t step = -1;              // chosen (-1: none)
    std::optional<int64_t> newest;  // the newest step any rank has
    std::vector<int> source;        // per rank: -1 (its own), or the rank keeping its copy
    std::vector<int> kept;          // the ranks whose live state is the step's
    std::vector<int> missing;       // the ranks with no usable copy of `newest`
    /// " (newest seen: S, which ranks R have in no usable copy, ...)", or "".
    std::string newest_text(const std::vector<int>& buddy) const;
  };
  Choice choose(const std::vector<json::object>& reports) const;
  /// The files this rank reads for `c` (its own snapshot, unless kept in
  /// place; the copies it sends back) whose data does not match its
  /// checksum, as [owner, holder] (holder -1: the owner's own), each warned
  /// about; `own`: this rank's own snapshot, checked.
  json::array damaged(const Choice& c, bool keep, std::optional<Found>& own) const;
  std::vector<int> return_copies(int64_t chosen, const std::vector<int>& source);
  void load_step(int64_t chosen, bool keep, std::optional<Found> own);
};

namespace {

std::vector<int> default_buddies(int world_size) {
  std::vector<int> b(static_cast<size_t>(world_size));
  int local = 0;
  if (const char* l = std::getenv("LOCAL_WORLD_SIZE")) local = std::atoi(l);
  const bool nodes = local > 0 && local < world_size && world_size % local == 0;
  for (int r = 0; r < world_size; ++r) b[static_cast<size_t>(r)] = (r + (nodes ? local : 1)) % world_size;
  return b;
}

std::string model_fingerprint(torch::nn::Module& root, ShardedOptimizer* opt, int world_size) {
  std::string text = checkpoint::strategy_of(root) + ";world " + std::to_string(world_size) + ";optimizer " +
                     (opt ? "yes" : "no") + ";";
  for (const auto& [n, shape] : checkpoint::model_shapes_of(root)) {
    text += n + ":";
    for (int64_t d : shape) text += std::to_string(d) + ",";
    text += ";";
  }
  return checkpoint::checksum::of(text.data(), text.size());
}

}  // namespace

Snapshots::Snapshots(std::shared_ptr<World> world, torch::nn::Module& root, ShardedOptimizer* opt,
                     SnapshotOptions options)
    : impl_(std::make_unique<Impl>(std::move(world), root, opt, std::move(options))) {
  Impl& m = *impl_;
  const int n = m.world->size();
  if (m.options.buddy.empty()) m.options.buddy = default_buddies(n);
  // The options every rank must share, compared first: a rank that refused
  // its own alone would leave the others waiting in the next collective.
  if (n > 1) {
    std::string mine = "every " + std::to_string(m.options.every) + ", persist_every " +
                       std::to_string(m.options.persist_every) + ", buddy map [";
    for (size_t r = 0; r < m.options.buddy.size(); ++r) mine += (r ? ", " : "") + std::to_string(m.options.buddy[r]);
    mine += "]";
    const auto all = m.world->comm().all_gather_strings(mine, "snapshots: the options");
    for (size_t r = 1; r < all.size(); ++r)
      SHARDTORCH_CHECK(all[r] == all[0], m.who(), ": the ranks were given different SnapshotOptions: rank 0 has ",
                       all[0], " but rank ", r, " has ", all[r], "; give every rank the same");
  }
  SHARDTORCH_CHECK(m.options.every >= 1, m.who(), ": every is ", m.options.every, "; it must be 1 or more");
  SHARDTORCH_CHECK(static_cast<int>(m.options.buddy.size()) == n, m.who(), ": the buddy map has ",
                   m.options.buddy.size(), " entries for ", n, " ranks (give one per rank, or none)");
  for (int r = 0; r < n; ++r) {
    const int b = m.options.buddy[static_cast<size_t>(r)];
    SHARDTORCH_CHECK(b >= 0 && b < n, m.who(), ": buddy[", r, "] is ", b, ", not a rank of ", n);
    SHARDTORCH_CHECK(b != r || n == 1, m.who(), ": buddy[", r, "] is ", r,
                     " itself: its copy must be on another rank (another node)");
  }
  SHARDTORCH_CHECK(m.options.persist_every >= 0 && m.options.persist_every % m.options.every == 0, m.who(),
                   ": persist_every is ", m.options.persist_every, "; it must be 0 (never) or a multiple of every (",
                   m.options.every, ")");
  SHARDTORCH_CHECK(m.options.persist_every == 0 || !m.options.fallback_dir.empty(), m.who(),
                   ": persist_every is set but fallback_dir is not: set the directory to persist to");
  // Before the lock: ranks at different tp coordinates would contend for it.
  m.sharded = detail::require_state(root, "shardtorch::Snapshots");
  for (const auto& item : root.named_parameters())  // a split model: one file per rank of the whole mesh
    if (auto p = detail::placement_of(item.value()); p && p->size > 1) {
      SHARDTORCH_CHECK(n >= m.sharded->world().size() * p->size, m.who(), ": the model is split over ", p->size,
                       " tensor-parallel ranks and sharded over ", m.sharded->world().size(),
                       "; take the snapshots over the mesh's World (every rank of it): over ", n,
                       " ranks, ranks at different tp coordinates would write the same files");
      break;
    }
  files::create_directories(m.options.dir);
  // One live process per job name and rank: a second job under the same
  // name would restore, and write over, the first one's snapshots.
  const std::string lock = m.lock_path =
      files::join(m.options.dir, "." + prefix(m.options) + std::to_string(m.world->rank()) + ".lock");
  std::string refused;
  m.lock_fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (m.lock_fd < 0)
    refused = "cannot open '" + lock + "': " + std::strerror(errno);
  else if (::flock(m.lock_fd, LOCK_EX | LOCK_NB) != 0)
    refused = "another live process holds '" + lock + "'";
  std::vector<std::string> verdicts{refused};
  if (n > 1) verdicts = m.world->comm().all_gather_strings(refused, "snapshots: the job's files");
  for (size_t r = 0; r < verdicts.size(); ++r)
    if (!verdicts[r].empty()) {
      if (refused.empty()) files::remove_all_quietly(lock);  // this rank's, held: it goes as at finish()
      if (m.lock_fd >= 0) ::close(m.lock_fd);
      m.lock_fd = -1;
      throw Error(m.who() + ": the snapshots of job '" + detail::snapshot_job(m.options) + "' in '" + m.options.dir +
                  "' are in use: rank " + std::to_string(n > 1 ? static_cast<int>(r) : m.world->rank()) + ": " +
                  verdicts[r] +
                  ". Two live jobs under one name would take each other's snapshots: give each its own "
                  "SnapshotOptions::job (or torchrun --rdzv-id)");
    }
  m.dir.strategy = checkpoint::strategy_of(root);
  m.dir.fingerprint = model_fingerprint(root, opt, n);
  std::vector<int> all(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) all[static_cast<size_t>(r)] = r;
  if (n > 1 || m.options.persist_every > 0) m.comm = m.world->new_group(all, "snapshots");
  if (n > 1)
    m.dir.fingerprints = m.world->comm().all_gather_strings(m.dir.fingerprint, "snapshots: the models' fingerprints");
  m.guard = m.sharded->optimizer().add_update_guard([&m] {
    m.copy.wait();
    m.live.updated = true;
    m.live.trained = true;
  });
}

Snapshots::~Snapshots() {
  if (!impl_) return;
  impl_->wait_transfer(false);
  impl_->sharded->optimizer().remove_update_guard(impl_->guard);
}

void Snapshots::register_state(const std::string& name, std::function<std::string()> save,
                               std::function<void(const std::string&)> load) {
  impl_->check_not_finished("register_state()");
  SHARDTORCH_CHECK(!impl_->restored, impl_->who(), ": register_state(\"", name,
                   "\") after restore(): a restore gives back only the state registered before it; register every "
                   "state before restore()");
  impl_->state[name] = {std::move(save), std::move(load)};
}

std::map<std::string, std::string> Snapshots::user_state() const {
  std::map<std::string, std::string> out;
  for (const auto& [k, fns] : impl_->state) out[k] = fns.first();
  return out;
}

const std::vector<int>& Snapshots::buddies() const { return impl_->options.buddy; }

int64_t Snapshots::bytes_kept() const {
  impl_->wait_transfer(true);
  return impl_->dir.kept_now();
}

void Snapshots::wait() {
  impl_->wait_transfer(true);
  impl_->count_memory(impl_->dir.kept_now());  // the buddy's copy, now held, counts too
}

void Snapshots::after_step(int64_t step) {
  Impl& m = *impl_;
  m.check_not_finished("after_step()");
  if (!m.restored)
    SHARDTORCH_WARN_ONCE(m.who(),
                         ": after_step() before restore(): call restore() once before the first step, or "
                         "a job that torchrun restarts trains from the beginning again and writes over its "
                         "own snapshots");
  m.live.step = step;
  m.live.updated = false;
  if (step % m.options.every != 0) return;
  m.wait_transfer(true);
  auto own = std::make_shared<Impl::Own>(m.collect_own(step));
  m.count_memory(m.dir.kept_after(step, own->file_bytes));
  // With an optimizer, the copy runs in the background until its next update
  // (which waits for it); without one, nothing tells when the state changes.
  const bool background = m.opt != nullptr;
  if (!background) m.write_own(*own);
  if (!m.comm && !background) return;
  const bool persist = m.options.persist_every > 0 && step % m.options.persist_every == 0;
  if (background) m.copy.open();
  m.sent.reset();
  m.transfer = std::thread([&m, own, step, persist, background] {
    try {
      if (background) {
        try {
          m.write_own(*own);
        } catch (...) {
          m.copy.close();
          throw;
        }
        own->data.clear();
        m.copy.close();
      }
      if (!m.comm) return;
      m.exchange(step);
      // Every rank's snapshot of `step` and its copy are whole before any
      // rank writes the next one over an older generation.
      barrier_unchecked(*m.comm);
    } catch (const std::exception& e) {
      m.transfer_error = e.what();
      return;
    }
    if (!persist) return;
    try {
      m.persist(step);
    } catch (const std::exception& e) {  // a rank gone mid-way: the checkpoint there stays as it was
      m.persist_error = "step " + std::to_string(step) + " could not be persisted to '" + m.options.fallback_dir +
                        "' (" + e.what() + ")";
    }
  });
}

int64_t Snapshots::restore() {
  impl_->check_not_finished("restore()");
  SHARDTORCH_CHECK(!impl_->restored, impl_->who(),
                   ": restore() called again: it loads the newest snapshot once, before the first step (a second "
                   "call would roll back the steps trained since). After a peer's loss, the ranks still running "
                   "call rejoin()");
  const int64_t step = impl_->restore(/*survivor=*/false);
  impl_->count_memory(bytes_kept());
  return step;
}

int64_t Snapshots::rejoin() {
  Impl& m = *impl_;
  m.check_not_finished("rejoin()");
  m.sent.abort();                                           // a receive from the lost rank waits for nothing
  m.wait_transfer(false);                                   // the copy in flight, most likely failed with the lost rank
  m.sharded->backward().recover_if_failed(/*warn=*/false);  // the failed step's reductions in flight
  if (m.opt) m.opt->zero_grad();                            // its gradients go (a replacement has none)
  m.sharded->forget_learned();
  m.world->rejoin();
  const int64_t step = m.restore(/*survivor=*/true);
  m.count_memory(bytes_kept());
  return step;
}

int64_t Snapshots::Impl::fall_back(const std::string& why) {
  if (!has_fallback()) {
    if (why.empty()) return -1;  // nothing anywhere: a fresh start
    throw Error(who() + ": " + why + ", and there is no sharded checkpoint to fall back to" +
                (options.fallback_dir.empty() ? std::string(" (SnapshotOptions::fallback_dir is not set)")
                                              : " in '" + options.fallback_dir + "'") +
                ": start the job again without its snapshots (remove them) to train from the beginning");
  }
  std::map<std::string, std::string> user;
  const int64_t step = load_sharded_checkpoint(root, opt, options.fallback_dir, &user);
  dir.drop_newer(step);
  for (auto& [k, fns] : state) {  // persisted (this rank's own), else saved by the program
    auto it = user.find(persisted_key(rank(), k));
    if (it == user.end()) it = user.find(k);
    if (it != user.end()) fns.second(it->second);
  }
  if (rank() == 0)
    SHARDTORCH_WARN("shardtorch: snapshots: ", why.empty() ? "no snapshot in memory" : why,
                    "; loaded the sharded checkpoint '", options.fallback_dir, "' at step ", step, " instead");
  return step;
}

int64_t Snapshots::Impl::restore(bool survivor) {
  restored = true;
  wait_transfer(false);
  detail::WorldAccess::end_setup(*world);
  dir.remove_leftovers();
  dir.remove_other_worlds();
  json::object report = json::parse(dir.held_steps()).as_object();
  // torchrun's first attempt (TORCHELASTIC_RESTART_COUNT=0; the same on
  // every rank): nothing of this job can be in memory yet, so snapshots
  // under its name are another job's (torchrun without --rdzv-id names every
  // job "none") or an earlier run's, and are never restored.
  if (!survivor && detail::env("TORCHELASTIC_RESTART_COUNT").value_or("") == "0") {
    bool found = !report["own"].as_array().empty();
    for (const auto& held : report["held"].as_object()) found = found || !held.value().as_array().empty();
    if (found) {
      dir.drop_newer(-1);
      SHARDTORCH_WARN(who(), ": snapshots of a job named '", detail::snapshot_job(options), "' were in '", options.dir,
                      "' at torchrun's first attempt (TORCHELASTIC_RESTART_COUNT=0): another job's or an earlier "
                      "run's, not restored, removed. Give each job its own name (torchrun --rdzv-id, or "
                      "SnapshotOptions::job) so that jobs on one node never meet");
    }
    return fall_back("");
  }
  report["live"] = survivor && opt && live.usable() ? live.step : int64_t{-1};
  report["trained"] = survivor && live.trained.load();
  live.updated = true;  // from here on the state is the restored one's, until the next after_step
  std::string names;    // the same on every rank, or a rank's state would go to no one
  for (const auto& [k, fns] : state) names += (names.empty() ? "'" : ", '") + k + "'";
  report["state"] = names.empty() ? "none" : names;
  std::vector<json::object> reports;
  for (const auto& r : world->comm().all_gather_strings(json::serialize(report), "snapshot restore: the steps held"))
    reports.push_back(json::parse(r).as_object());
  for (size_t r = 1; r < reports.size(); ++r)
    SHARDTORCH_CHECK(reports[r].at("state") == reports[0].at("state"), who(),
                     ": the ranks registered different state: rank 0 registered ",
                     json::value_to<std::string>(reports[0].at("state")), " but rank ", r, " registered ",
                     json::value_to<std::string>(reports[r].at("state")),
                     "; register the same names on every rank, before restore()");
  // The choice from the headers; then the data of the files it reads is
  // checked, and a damaged one leaves the candidates for another round.
  Choice c;
  bool keep = false;
  std::optional<Found> own;
  for (;;) {
    c = choose(reports);
    if (c.step < 0) break;
    keep = std::count(c.kept.begin(), c.kept.end(), rank()) > 0;
    const auto verdicts =
        world->comm().all_gather_strings(json::serialize(damaged(c, keep, own)), "snapshot restore: damaged files");
    bool any = false;
    for (const auto& v : verdicts) {
      const json::value parsed = json::parse(v);
      for (const auto& pair : parsed.as_array()) {
        any = true;
        const int owner = static_cast<int>(pair.as_array()[0].as_int64());
        const int holder = static_cast<int>(pair.as_array()[1].as_int64());
        auto drop = [&](json::array& steps) {
          json::array left;
          for (const auto& s : steps)
            if (s.as_int64() != c.step) left.push_back(s);
          steps = left;
        };
        if (holder < 0)
          drop(reports[static_cast<size_t>(owner)]["own"].as_array());
        else
          drop(reports[static_cast<size_t>(holder)]["held"].as_object()[std::to_string(owner)].as_array());
      }
    }
    if (!any) break;
  }
  bool trained = false;  // a survivor has trained: a fresh start would leave the ranks apart
  for (const auto& r : reports) trained = trained || (r.contains("trained") && r.at("trained").as_bool());
  if (c.step < 0 && trained && !has_fallback())
    throw Error(who() + ": no step is in memory on every rank to rejoin at" + c.newest_text(options.buddy) +
                ", and there is no sharded checkpoint to fall back to, while the ranks still running have " +
                "trained: end every rank and start the job again");
  if (c.step < 0)
    return fall_back(!c.newest ? "" : "no step is in memory on every rank" + c.newest_text(options.buddy));
  const std::vector<int> lost = return_copies(c.step, c.source);
  load_step(c.step, keep, std::move(own));
  if (rank() == 0) {
    std::string from, kept;
    for (int r : lost) from += " " + std::to_string(r);
    for (int r : c.kept) kept += " " + std::to_string(r);
    SHARDTORCH_INFO("shardtorch: snapshots: restored step ", c.step, " from memory",
                    lost.empty() ? "" : "; from their buddies' copies: ranks", from,
                    kept.empty() ? "" : "; kept in place (as training left it) on ranks", kept);
  }
  return c.step;
}

std::string Snapshots::Impl::Choice::newest_text(const std::vector<int>& buddy) const {
  if (!newest) return "";
  std::string ranks, buddies;
  for (int r : missing) {
    ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    buddies += (buddies.empty() ? "" : ", ") + std::to_string(buddy[static_cast<size_t>(r)]);
  }
  return " (newest seen: " + std::to_string(*newest) +
         (missing.empty()
              ? std::string()
              : "; rank(s) " + ranks + " have it neither in their own snapshot nor in their buddy's (rank(s) " +
                    buddies + ") copy: lost, or refused as a warning says)");
}

// Every rank decides alike, from every rank's held_steps: the newest step
// that each rank has, in its own memory or in a copy another rank keeps.
Snapshots::Impl::Choice Snapshots::Impl::choose(const std::vector<json::object>& reports) const {
  const int n = world->size();
  std::vector<std::set<int64_t>> own_steps(static_cast<size_t>(n));
  std::vector<std::map<int64_t, int>> kept(static_cast<size_t>(n));  // step -> the lowest keeper
  std::set<int64_t> candidates;
  std::vector<int64_t> live_step(static_cast<size_t>(n), -1);  // a survivor's state as training left it
  for (int r = 0; r < n; ++r) {
    const json::object& o = reports[static_cast<size_t>(r)];
    for (const auto& s : o.at("own").as_array()) {
      own_steps[static_cast<size_t>(r)].insert(s.as_int64());
      candidates.insert(s.as_int64());
    }
    for (const auto& [from, steps] : o.at("held").as_object())
      for (const auto& s : steps.as_array()) {
        kept[static_cast<size_t>(std::stoi(std::string(from)))].emplace(s.as_int64(), r);
        candidates.insert(s.as_int64());
      }
    if (const auto* l = o.if_contains("live"); l && l->as_int64() >= 0) {
      live_step[static_cast<size_t>(r)] = l->as_int64();
      own_steps[static_cast<size_t>(r)].insert(l->as_int64());
      candidates.insert(l->as_int64());
    }
  }
  Choice c;
  c.source.assign(static_cast<size_t>(n), -1);
  if (!candidates.empty()) c.newest = *candidates.rbegin();
  for (int r = 0; r < n && c.newest; ++r)
    if (!own_steps[static_cast<size_t>(r)].count(*c.newest) && !kept[static_cast<size_t>(r)].count(*c.newest))
      c.missing.push_back(r);
  for (auto it = candidates.rbegin(); it != candidates.rend() && c.step < 0; ++it) {
    bool all = true;
    for (int r = 0; r < n && all; ++r)
      all = own_steps[static_cast<size_t>(r)].count(*it) || kept[static_cast<size_t>(r)].count(*it);
    if (!all) continue;
    c.step = *it;
    for (int r = 0; r < n; ++r) {
      if (live_step[static_cast<size_t>(r)] == c.step) c.kept.push_back(r);
      if (!own_steps[static_cast<size_t>(r)].count(c.step))
        c.source[static_cast<size_t>(r)] = kept[static_cast<size_t>(r)].at(c.step);
    }
  }
  return c;
}

json::array Snapshots::Impl::damaged(const Choice& c, bool keep, std::optional<Found>& own) const {
  json::array bad;
  auto verify = [&](const std::string& path, int owner, int holder) {
    std::string why;
    std::optional<Found> f = dir.check(path, owner, c.step, why);
    if (!f) {
      SHARDTORCH_WARN(who(), ": ", why);
      bad.push_back(json::array{owner, holder});
    }
    return f;
  };
  own.reset();
  if (!keep && c.source[static_cast<size_t>(rank())] < 0)
    own = verify(detail::own_snapshot_path(options, rank(), c.step), rank(), -1);
  for (int r = 0; r < world->size(); ++r)
    if (c.source[static_cast<size_t>(r)] == rank())
      verify(detail::held_snapshot_path(options, r, rank(), c.step), r, rank());
  return bad;
}

// The copies kept for ranks without their own go back to them (source[r]:
// -1, or the keeper); returns those ranks.
std::vector<int> Snapshots::Impl::return_copies(int64_t chosen, const std::vector<int>& source) {
  std::vector<PendingWork> works;
  std::vector<at::Tensor> keep;
  std::vector<int> lost;
  for (int r = 0; r < world->size(); ++r) {
    const int h = source[static_cast<size_t>(r)];
    if (h < 0) continue;
    lost.push_back(r);
    if (h == rank()) {  // sent from the file's pages, as exchange() sends
      at::Tensor data = map_for_reading(files::join(detail::held_snapshot_path(options, r, h, chosen), file_of(r)));
      at::Tensor head = torch::tensor({data.numel()}, torch::kInt64);
      keep.push_back(head);
      keep.push_back(data);
      works.push_back(comm->send_async(head, r, 3, "snapshot restore header"));
      works.push_back(comm->send_async(data, r, 4, "snapshot restore"));
    } else if (r == rank()) {
      at::Tensor head = at::empty({1}, at::kLong);
      PendingWork w = comm->recv_async(head, h, 3, "snapshot restore header");
      comm->wait(w);
      at::Tensor data = at::empty({head[0].item<int64_t>()}, at::kByte);
      PendingWork d = comm->recv_async(data, h, 4, "snapshot restore");
      comm->wait(d);
      dir.write_received(own_name(options, rank()), rank(), chosen, data);
    }
  }
  for (auto& w : works) comm->wait(w);
  return lost;
}

// Collective: every rank checks what it will load; the load agrees before
// anyone changes. A rank whose file went bad since: every rank fails with
// the reason, before anything changes.
void Snapshots::Impl::load_step(int64_t chosen, bool keep, std::optional<Found> found) {
  const std::string fingerprint = "snapshot step " + std::to_string(chosen);
  const std::map<std::string, std::string>* user = nullptr;  // the registered state to give back
  if (keep) {  // this rank's parameters and optimizer state are the step's: only what a forward changed goes back
    checkpoint::load_rank_state(root, opt, "", Index{}, fingerprint, "", /*keep=*/true);
    c10::NoGradGuard no_grad;
    std::map<std::string, at::Tensor> buffers;
    for (const auto& item : root.named_buffers()) buffers[item.key()] = item.value();
    for (const auto& [name, value] : live.buffers)
      if (auto it = buffers.find(name); it != buffers.end()) it->second.copy_(value);
    user = &live.user_state;
  } else {
    std::string why;
    const std::string path = detail::own_snapshot_path(options, rank(), chosen);
    if (!found) found = dir.check(path, rank(), chosen, why);  // a copy sent back, not checked yet
    checkpoint::load_rank_state(root, opt, path, found ? found->index : Index{}, fingerprint, found ? "" : why);
    user = &found->user_state;
  }
  for (auto& [k, fns] : state)
    if (auto it = user->find(k); it != user->end()) fns.second(it->second);
  dir.drop_newer(chosen);
}

void Snapshots::finish() {
  Impl& m = *impl_;
  m.check_not_finished("finish()");
  m.finished = true;
  m.wait_transfer(true);
  m.world->barrier();  // no rank still needs a copy another keeps
  for (int64_t s : steps_named(m.options.dir, own_name(m.options, m.rank())))
    files::remove_all_quietly(detail::own_snapshot_path(m.options, m.rank(), s));
  for (int from : m.dir.held_for())
    for (int64_t s : steps_named(m.options.dir, held_name(m.options, from, m.rank())))
      files::remove_all_quietly(detail::held_snapshot_path(m.options, from, m.rank(), s));
  files::remove_all_quietly(m.lock_path);  // the job is done: nothing of it stays (its lock goes with the object)
  m.count_memory(0);
}

}  // namespace shardtorch
