#include "shardtorch/testing.h"
#include "base/check.h"

#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

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

[[noreturn]] void child_main(int rank, int world_size, const std::string& store_path, int fd, const RankBody& body,
                             const RunOptions& options) {
  int code = 0;
  std::string message;
  try {
    at::set_num_threads(options.threads());
    auto store = c10::make_intrusive<c10d::FileStore>(store_path, world_size);
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
  if (!message.empty()) {
    size_t off = 0;
    while (off < message.size()) {
      ssize_t n = ::write(fd, message.data() + off, message.size() - off);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
  }
  ::close(fd);
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  ::_exit(code);
}

}  // namespace

RunResult run_ranks(int world_size, const RankBody& body, RunOptions options) {
  SHARDTORCH_CHECK(world_size >= 1, "run_ranks: world size ", world_size);
  const std::string dir = files::make_temp_dir("shardtorch");  // POSIX calls: files.h says why
  std::string store_path = dir + "/store";

  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  std::vector<pid_t> pids(world_size, -1);
  std::vector<int> fds(world_size, -1);
  for (int r = 0; r < world_size; ++r) {
    int p[2];
    SHARDTORCH_CHECK(::pipe(p) == 0, "run_ranks: pipe failed: ", std::strerror(errno));
    pid_t pid = ::fork();
    SHARDTORCH_CHECK(pid >= 0, "run_ranks: fork failed: ", std::strerror(errno));
    if (pid == 0) {
      ::close(p[0]);
      for (int q = 0; q < r; ++q) ::close(fds[q]);
      child_main(r, world_size, store_path, p[1], body, options);
    }
    ::close(p[1]);
    pids[r] = pid;
    fds[r] = p[0];
  }

  RunResult result;
  result.ranks.resize(world_size);
  auto deadline = std::chrono::steady_clock::now() + options.timeout();
  int alive = world_size;
  std::vector<bool> done(world_size, false);
  while (alive > 0) {
    // Drain messages so a chatty rank never blocks on a full pipe.
    std::vector<pollfd> pfds;
    for (int r = 0; r < world_size; ++r)
      if (fds[r] >= 0) pfds.push_back({fds[r], POLLIN, 0});
    if (!pfds.empty())
      ::poll(pfds.data(), pfds.size(), 20);
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (auto& pf : pfds) {
      if (!(pf.revents & (POLLIN | POLLHUP))) continue;
      int r = static_cast<int>(std::find(fds.begin(), fds.end(), pf.fd) - fds.begin());
      char chunk[4096];
      ssize_t n = ::read(pf.fd, chunk, sizeof(chunk));
      if (n > 0) {
        result.ranks[r].message.append(chunk, static_cast<size_t>(n));
      } else {
        ::close(fds[r]);
        fds[r] = -1;
      }
    }
    for (int r = 0; r < world_size; ++r) {
      if (done[r]) continue;
      int status = 0;
      if (::waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        done[r] = true;
        --alive;
        if (WIFEXITED(status)) result.ranks[r].exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) result.ranks[r].signal = WTERMSIG(status);
      }
    }
    if (alive > 0 && std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < world_size; ++r) {
        if (done[r]) continue;
        ::kill(pids[r], SIGKILL);
        ::waitpid(pids[r], nullptr, 0);
        done[r] = true;
        result.ranks[r].timed_out = true;
        --alive;
      }
    }
  }
  for (int r = 0; r < world_size; ++r) {
    if (fds[r] < 0) continue;
    char chunk[4096];
    ssize_t n;
    while ((n = ::read(fds[r], chunk, sizeof(chunk))) > 0)
      result.ranks[r].message.append(chunk, static_cast<size_t>(n));
    ::close(fds[r]);
  }
  files::remove_all_quietly(dir);  // a leftover temporary folder is no failure
  result.ok = true;
  for (const auto& o : result.ranks)
    if (o.exit_code != 0) result.ok = false;
  return result;
}

void inject_failure(const std::string& site, int count) { detail::arm_failure_point(site, count); }

void fail_collectives(const std::string& what, int count) { detail::arm_collective_failure(what, count); }

}  // namespace shardtorch::testing
