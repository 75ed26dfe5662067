#include "shardtorch/world.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace shardtorch {
namespace {

std::optional<std::string> process_env(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

[[noreturn]] void bad_var(const std::string& name, const std::string& value, const std::string& why) {
  throw std::invalid_argument("shardtorch: environment variable " + name + "='" + value + "' " + why);
}

int parse_int(const std::string& name, const std::string& value) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    bad_var(name, value, "is not an integer");
  }
  if (used != value.size()) bad_var(name, value, "is not an integer");
  if (v < 0 || v > (1LL << 30)) bad_var(name, value, "is out of range");
  return static_cast<int>(v);
}

bool is_local_address(const std::string& addr) {
  return addr.empty() || addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

}  // namespace

LaunchEnv parse_launch_env(const EnvLookup& lookup_in) {
  EnvLookup lookup = lookup_in ? lookup_in : EnvLookup(process_env);
  struct Scheme {
    const char* launcher;
    const char* rank;
    const char* size;
    const char* local;
  };
  const Scheme schemes[] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
      {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
      // MPICH and Intel MPI (Hydra's PMI): without it each process would be
      // rank 0 of a world of its own, and all train alone.
      {"mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
  };
  LaunchEnv env;
  env.launcher = "none";
  for (const auto& s : schemes) {
    auto rank = lookup(s.rank);
    auto size = lookup(s.size);
    if (!rank && !size) continue;
    if (!rank) throw std::invalid_argument(std::string("shardtorch: ") + s.size + " is set but " + s.rank + " is not");
    if (!size) throw std::invalid_argument(std::string("shardtorch: ") + s.rank + " is set but " + s.size + " is not");
    env.launcher = s.launcher;
    env.rank = parse_int(s.rank, *rank);
    env.world_size = parse_int(s.size, *size);
    if (env.world_size < 1) bad_var(s.size, *size, "must be at least 1");
    if (env.rank >= env.world_size)
      bad_var(s.rank, *rank, "is not below " + std::string(s.size) + "=" + *size);
    auto local = lookup(s.local);
    env.local_rank = local ? parse_int(s.local, *local) : 0;
    break;
  }
  if (auto addr = lookup("MASTER_ADDR")) {
    if (addr->empty()) bad_var("MASTER_ADDR", *addr, "is empty");
    env.master_addr = *addr;
  }
  if (auto port = lookup("MASTER_PORT")) {
    int p = parse_int("MASTER_PORT", *port);
    if (p < 1 || p > 65535) bad_var("MASTER_PORT", *port, "is outside 1..65535");
    env.master_port = p;
  }
  auto agent = lookup("TORCHELASTIC_USE_AGENT_STORE");
  env.use_agent_store = agent && (*agent == "True" || *agent == "true" || *agent == "1");
  if (env.world_size > 1) {
    if (env.master_addr.empty())
      throw std::invalid_argument("shardtorch: MASTER_ADDR is not set (world size " +
                                  std::to_string(env.world_size) + " from " + env.launcher +
                                  "); set it to the address of rank 0");
    if (env.master_port == 0)
      throw std::invalid_argument("shardtorch: MASTER_PORT is not set (world size " +
                                  std::to_string(env.world_size) + " from " + env.launcher + ")");
  }
  return env;
}

std::shared_ptr<World> World::from_env(WorldOptions options) {
  LaunchEnv env = parse_launch_env();
  c10::intrusive_ptr<c10d::Store> store;
  if (env.world_size == 1) {  // nothing to rendezvous with (a MASTER_PORT left set used to wait for a server)
    store = c10::make_intrusive<c10d::HashStore>();
  } else {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(env.master_port);
    so.isServer = env.rank == 0 && !env.use_agent_store;
    so.numWorkers = env.world_size;
    so.waitWorkers = false;
    so.timeout = options.timeout();
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    store = c10::make_intrusive<c10d::PrefixStore>("shardtorch", tcp);
  }
  if (options.gloo_hostname().empty() && is_local_address(env.master_addr)) options.gloo_hostname("127.0.0.1");
  return create(store, env.rank, env.world_size, options, env.local_rank);
}

std::shared_ptr<World> World::create(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                                     WorldOptions options, int local_rank) {
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "shardtorch: rank ", rank,
              " is not in [0, ", world_size, ")");
  std::shared_ptr<World> w(new World());
  w->rank_ = rank;
  w->size_ = world_size;
  w->local_rank_ = local_rank;
  w->options_ = options;
  w->store_ = store;
  store->setTimeout(options.timeout());
  if (options.device()) {
    w->device_ = *options.device();
  } else if (at::hasCUDA()) {
    w->device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
  }
  std::string backend = options.backend();
  if (backend == "auto") backend = (w->device_.is_cuda() && detail::nccl_available()) ? "nccl" : "gloo";
  c10::intrusive_ptr<c10d::Backend> b;
  if (backend == "gloo") {
    b = detail::make_gloo_backend(store, rank, world_size, options.timeout(), options.gloo_hostname());
  } else if (backend == "nccl") {
    TORCH_CHECK(detail::nccl_available(), "shardtorch: backend 'nccl' asked for, but this build has no NCCL");
    TORCH_CHECK(w->device_.is_cuda(), "shardtorch: backend 'nccl' needs a CUDA device, got ", w->device_);
    b = detail::make_nccl_backend(store, rank, world_size, options.timeout());
  } else {
    TORCH_CHECK(false, "shardtorch: unknown backend '", backend, "' (expected auto, gloo or nccl)");
  }
  w->backend_name_ = backend;
  // Gloo moves CPU tensors; NCCL moves tensors on the rank's device.
  c10::Device comm_device = backend == "nccl" ? w->device_ : c10::Device(c10::kCPU);
  w->comm_ = std::make_unique<Comm>(b, rank, world_size, options.timeout(), comm_device);
  return w;
}

std::shared_ptr<Comm> World::new_group(const std::vector<int>& ranks, const std::string& tag) {
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  TORCH_CHECK(it != ranks.end(), "shardtorch: rank ", rank_, " is not in the group '", tag, "' it asked to join");
  for (int r : ranks) TORCH_CHECK(r >= 0 && r < size_, "shardtorch: group '", tag, "' names rank ", r, " of ", size_);
  int index = static_cast<int>(it - ranks.begin());
  int n = static_cast<int>(ranks.size());
  // The members of a group are the only ranks that make it, so a count per
  // (tag, ranks) keeps the keys of a second such group apart from the first's
  // and is the same on all of them; a count over all groups would differ
  // between ranks once some made a group the others are not in, and a count
  // per tag once a tag named other ranks (shard()'s groups of two models).
  std::string key = tag + "/ranks";
  for (int r : ranks) key += "-" + std::to_string(r);
  auto store = c10::make_intrusive<c10d::PrefixStore>("group/" + key + "/" + std::to_string(groups_made_[key]++), store_);
  c10::intrusive_ptr<c10d::Backend> b;
  if (backend_name_ == "nccl") {
    b = detail::make_nccl_backend(store, index, n, options_.timeout());
  } else {
    b = detail::make_gloo_backend(store, index, n, options_.timeout(), options_.gloo_hostname());
  }
  auto comm = std::make_shared<Comm>(b, index, n, options_.timeout(), comm_->device());
  // One collective now, while every member is here: a backend that sets up
  // its communicator at the first collective (NCCL) must not do so at some
  // rank-dependent point later (inside a backward, say).
  auto probe = at::zeros({1}, at::TensorOptions().device(comm_->device()));
  comm->all_reduce(probe, c10d::ReduceOp::SUM, "setting up group '" + tag + "'");
  return comm;
}

void World::barrier() {
  auto t = at::zeros({1}, at::TensorOptions().device(comm_->device()));
  comm_->all_reduce(t, c10d::ReduceOp::SUM, "barrier");
}

}  // namespace shardtorch
