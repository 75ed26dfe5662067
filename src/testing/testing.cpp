#include "shardtorch/testing.h"
#include "base/check.h"

#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <thread>

#include "base/errors.h"
#include "comm/comm_testing.h"
#include "base/files.h"

namespace shardtorch::testing {

void init() { at::set_num_threads(1); }

std::string RunResult::summary() const {
  std::ostringstream os;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const auto& o = ranks[r];
    os << "rank " << r << ": ";
    if (o.timed_out) {
      os << "did not finish in time (killed)";
    } else if (o.signal) {
      os << "killed by signal " << o.signal << " (" << strsignal(o.signal) << ")";
    } else {
      os << "exit " << o.exit_code;
    }
    if (!o.message.empty()) os << ": " << o.message;
    os << "\n";
  }
  return os.str();
}

namespace {
// Set by testing.h's GoogleTest probe (shardtorch::detail::set_failure_probe).
std::atomic<shardtorch::detail::FailureProbe> failure_probe{nullptr};

// The failures `probe` lists beyond the first `before` (none without a probe).
std::string new_failures(shardtorch::detail::FailureProbe probe, size_t before) {
  if (probe == nullptr) return "";
  const std::vector<std::string> all = probe();
  std::string out;
  for (size_t i = before; i < all.size(); ++i) out += (out.empty() ? "" : "; ") + all[i];
  return out;
}

[[noreturn]] void child_main(int rank, int world_size, const std::string& store_path, int fd, const RankBody& body,
                             const RunOptions& options) {
  int code = 0;
  std::string message;
  c10::intrusive_ptr<c10d::FileStore> store;
  // gdb, started by the parent to show a rank that hangs, may attach to it
  // (Yama's ptrace_scope 1 lets only ancestors otherwise).
  ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  const shardtorch::detail::FailureProbe probe = failure_probe.load();
  const size_t failures_before = probe ? probe().size() : 0;  // the parent's test failed already: not this rank
  try {
    at::set_num_threads(options.threads());
    // No count of workers: c10d's FileStore removes its file once that many
    // of its objects are destroyed, and a rank still in its own destructor's
    // read of the file then spins on a file cut short (a rank stuck at exit,
    // seen under load). The parent removes the directory instead.
    store = c10::make_intrusive<c10d::FileStore>(store_path, -1);
    WorldOptions wo;
    wo.timeout(options.collective_timeout()).gloo_hostname("127.0.0.1").check_collectives(options.check_collectives());
    if (options.device_type() == c10::kCUDA) {
      wo.device(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(rank)));
    } else {
      wo.device(c10::Device(c10::kCPU)).backend("gloo");
    }
    auto world = World::create(store, rank, world_size, wo, rank);
    // Every rank finishes connecting before any runs the body: a rank whose
    // body ends at once (an expected error) would otherwise exit and close its
    // sockets while a peer is still completing Gloo's connection mesh.
    if (world_size > 1) world->barrier();
    body(*world);
  } catch (const std::exception& e) {
    code = 1;
    message = e.what();
  } catch (...) {
    code = 1;
    message = "unknown exception";
  }
  const std::string failures = new_failures(probe, failures_before);
  if (!failures.empty()) {
    code = 1;
    message += (message.empty() ? "" : "; ") + std::string("assertions failed in this rank: ") + failures;
  }
  if (!message.empty()) {
    size_t off = 0;
    while (off < message.size()) {
      ssize_t n = ::write(fd, message.data() + off, message.size() - off);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
  }
  ::close(fd);
  // Never destroyed: ~FileStore reads every record the others appended, and
  // one cut short (a peer process that ended in the middle of an append)
  // makes that read spin for ever: a rank stuck at exit in ~FileStore, seen
  // under the full suite's load. Nothing else needs the destructor here.
  (void)store.release();
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  ::_exit(code);
}

}  // namespace

namespace {

// The forked ranks, and the read ends of the pipes their errors come through
// (-1 once closed).
struct Children {
  std::vector<pid_t> pids;
  std::vector<int> fds;
  std::vector<bool> done;
  std::vector<std::string> stacks;  // of the ranks killed at the time limit
  int alive = 0;
};

// A gdb printing the stacks of every thread of a process: its output, or
// why it could not start (popen's errno, kept before later calls change it).
struct StacksReader {
  FILE* out = nullptr;
  int error = 0;
};

// gdb printing the stacks of every thread of `pid` (at most 60 s), started
// at once so that several ranks' stacks are read together.
StacksReader start_thread_stacks(pid_t pid) {
  const std::string cmd =
      "command -v gdb > /dev/null 2>&1 || { echo 'no stacks: gdb is not installed'; exit 0; }; "
      "timeout 60 gdb -p " +
      std::to_string(pid) + " -batch -ex 'thread apply all bt' < /dev/null 2>&1";
  StacksReader r;
  r.out = ::popen(cmd.c_str(), "r");
  if (r.out == nullptr) r.error = errno;
  return r;
}

// What the gdb of start_thread_stacks printed: the frames and thread
// headers only; a line saying why when there are none.
std::string read_thread_stacks(const StacksReader& gdb) {
  FILE* p = gdb.out;
  if (!p) return "no stacks: popen failed: " + std::string(std::strerror(gdb.error));
  std::string out;
  char line[4096];
  while (std::fgets(line, sizeof(line), p)) {
    const std::string l(line);
    if (out.size() < (256 << 10) && (l.rfind("Thread ", 0) == 0 || l.rfind('#', 0) == 0 ||
                                     l.find("ptrace") != std::string::npos || l.rfind("no stacks", 0) == 0))
      out += l;
  }
  ::pclose(p);
  return out.empty() ? "no stacks: gdb printed none\n" : out;
}

Children fork_ranks(int world_size, const std::string& store_path, const RankBody& body, const RunOptions& options) {
  Children c;
  c.pids.assign(world_size, -1);
  c.fds.assign(world_size, -1);
  c.done.assign(world_size, false);
  c.stacks.assign(world_size, "");
  for (int r = 0; r < world_size; ++r) {
    int p[2];
    SHARDTORCH_CHECK(::pipe(p) == 0, "run_ranks: pipe failed: ", std::strerror(errno));
    pid_t pid = ::fork();
    SHARDTORCH_CHECK(pid >= 0, "run_ranks: fork failed: ", std::strerror(errno));
    if (pid == 0) {
      ::close(p[0]);
      for (int q = 0; q < r; ++q) ::close(c.fds[q]);
      child_main(r, world_size, store_path, p[1], body, options);
    }
    ::close(p[1]);
    c.pids[r] = pid;
    c.fds[r] = p[0];
  }
  c.alive = world_size;
  return c;
}

// Appends what the pipes hold (waiting up to 20 ms), so that a chatty rank
// never blocks on a full pipe; closes a pipe at its end.
void drain(Children& c, RunResult& result) {
  std::vector<pollfd> pfds;
  for (int fd : c.fds)
    if (fd >= 0) pfds.push_back({fd, POLLIN, 0});
  if (pfds.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return;
  }
  ::poll(pfds.data(), pfds.size(), 20);
  for (auto& pf : pfds) {
    if (!(pf.revents & (POLLIN | POLLHUP))) continue;
    const auto r = static_cast<size_t>(std::find(c.fds.begin(), c.fds.end(), pf.fd) - c.fds.begin());
    char chunk[4096];
    ssize_t n = ::read(pf.fd, chunk, sizeof(chunk));
    if (n > 0) {
      result.ranks[r].message.append(chunk, static_cast<size_t>(n));
    } else {
      ::close(c.fds[r]);
      c.fds[r] = -1;
    }
  }
}

// Records the exit of every rank that ended; past `deadline`, kills the rest
// (with `stacks`, after reading their threads' stacks).
void reap(Children& c, RunResult& result, std::chrono::steady_clock::time_point deadline, bool stacks) {
  for (size_t r = 0; r < c.pids.size(); ++r) {
    if (c.done[r]) continue;
    int status = 0;
    if (::waitpid(c.pids[r], &status, WNOHANG) == c.pids[r]) {
      c.done[r] = true;
      --c.alive;
      if (WIFEXITED(status)) result.ranks[r].exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) result.ranks[r].signal = WTERMSIG(status);
    }
  }
  if (c.alive == 0 || std::chrono::steady_clock::now() <= deadline) return;
  // Every stuck rank's gdb at once: one after another, they took about 12 s
  // each (a LibTorch program's symbols) past the time limit.
  std::vector<StacksReader> gdbs(c.pids.size());
  if (stacks)
    for (size_t r = 0; r < c.pids.size(); ++r)
      if (!c.done[r]) gdbs[r] = start_thread_stacks(c.pids[r]);
  for (size_t r = 0; r < c.pids.size(); ++r) {
    if (c.done[r]) continue;
    if (stacks) c.stacks[r] = read_thread_stacks(gdbs[r]);
    ::kill(c.pids[r], SIGKILL);
    ::waitpid(c.pids[r], nullptr, 0);
    c.done[r] = true;
    result.ranks[r].timed_out = true;
    --c.alive;
  }
}

}  // namespace

RunResult run_ranks(int world_size, const RankBody& body, RunOptions options) {
  SHARDTORCH_CHECK(world_size >= 1, "run_ranks: world size ", world_size);
  const std::string dir = files::make_temp_dir("shardtorch");  // POSIX calls: files.h says why
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  Children c = fork_ranks(world_size, dir + "/store", body, options);
  RunResult result;
  result.ranks.resize(world_size);
  const auto deadline = std::chrono::steady_clock::now() + options.timeout();
  while (c.alive > 0) {
    drain(c, result);
    reap(c, result, deadline, options.stacks_on_timeout());
  }
  for (int r = 0; r < world_size; ++r) {
    if (c.fds[r] < 0) continue;
    char chunk[4096];
    ssize_t n;
    while ((n = ::read(c.fds[r], chunk, sizeof(chunk))) > 0)
      result.ranks[r].message.append(chunk, static_cast<size_t>(n));
    ::close(c.fds[r]);
  }
  for (int r = 0; r < world_size; ++r)
    if (!c.stacks[r].empty())
      result.ranks[r].message += "\nthe stacks of its threads when it was killed:\n" + c.stacks[r];
  files::remove_all_quietly(dir);  // a leftover temporary folder is no failure
  result.ok = true;
  for (const auto& o : result.ranks)
    if (o.exit_code != 0) result.ok = false;
  return result;
}

void inject_failure(const std::string& site, int count) { detail::arm_failure_point(site, count); }

void fail_collectives(const std::string& what, int count) { detail::arm_collective_failure(what, count); }

}  // namespace shardtorch::testing

namespace shardtorch::detail {
void set_failure_probe(FailureProbe probe) { testing::failure_probe.store(probe); }
}  // namespace shardtorch::detail
