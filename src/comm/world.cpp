#include "shardtorch/world.h"
#include "comm/backends.h"
#include "base/check.h"
#include "base/env.h"
#include "base/errors.h"
#include "base/log.h"

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/bounded_store.h"
#include "comm/collective_check.h"
#include "comm/progress.h"
#include "comm/rejoin.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include "comm/store_listener.h"

namespace shardtorch {
namespace {

std::optional<std::string> process_env(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

[[noreturn]] void bad_var(const std::string& name, const std::string& value, const std::string& why) {
  throw Error("shardtorch: environment variable " + name + "='" + value + "' " + why);
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

std::string seconds(std::chrono::milliseconds t) {
  std::ostringstream os;
  os << t.count() / 1000.0;
  return os.str();
}

bool is_local_address(const std::string& addr) {
  return addr.empty() || addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

std::string list(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

// A CUDA device this process cannot use fails here, naming the rank, rather
// than at the first tensor moved to it.
void check_device(const c10::Device& d, int rank, int local_rank) {
  if (!d.is_cuda()) return;
  SHARDTORCH_CHECK(at::hasCUDA(), detail::rank_prefix(rank), " is to compute on ", d,
                   ", but this LibTorch has no CUDA or sees no GPU");
  const auto count = static_cast<int64_t>(at::getNumGPUs());
  SHARDTORCH_CHECK(!d.has_index() || d.index() < count, detail::rank_prefix(rank), " (local rank ", local_rank,
                   ") is to compute on ", d, ", but this host shows it ", count,
                   " GPU(s): start at most that many ranks per host, or set WorldOptions::device");
}

// The backend of the world or of a group. A member that never arrives is an
// error naming this rank, what was being set up and how long it waited.
c10::intrusive_ptr<c10d::Backend> connect(const std::string& backend, const c10::intrusive_ptr<c10d::Store>& store,
                                          int index, int n, const WorldOptions& options, int rank,
                                          const std::string& what) {
  try {
    if (backend == "nccl") return detail::make_nccl_backend(store, index, n, options.timeout());
    return detail::make_gloo_backend(store, index, n, options.timeout(), options.gloo_hostname());
  } catch (const std::exception& e) {
    detail::throw_error("", detail::rank_prefix(rank) + " could not set up " + backend + " for " + what + " within " +
                                seconds(options.timeout()) + " s: " + detail::message_of(e));
  }
}

// Rank 0 hosts the store: it publishes its pid and host name there, and
// every rank learns them, so that a report on a store that stopped answering
// can tell whether rank 0 is stopped or gone. Unknown (pid 0) when that fails.
detail::BoundedStore::Host store_host(c10d::Store& store, int rank) {
  detail::BoundedStore::Host host;
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) != 0) name[0] = '?';
  try {
    if (rank == 0) {
      const std::string mine = std::to_string(::getpid()) + "\t" + name;
      store.set("shardtorch-store-host", std::vector<uint8_t>(mine.begin(), mine.end()));
    }
    const auto v = store.get("shardtorch-store-host");
    const std::string text(v.begin(), v.end());
    const size_t tab = text.find('\t');
    host.pid = std::stoll(text.substr(0, tab));
    host.name = tab == std::string::npos ? "?" : text.substr(tab + 1);
  } catch (const std::exception&) {  // rank 0 never came: the world's set-up says so next
  }
  return host;
}

}  // namespace

namespace {
void read_rest_of_env(const EnvLookup& lookup, LaunchEnv& env);
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
    if (!rank) throw Error(std::string("shardtorch: ") + s.size + " is set but " + s.rank + " is not");
    if (!size) throw Error(std::string("shardtorch: ") + s.rank + " is set but " + s.size + " is not");
    env.launcher = s.launcher;
    env.rank = parse_int(s.rank, *rank);
    env.world_size = parse_int(s.size, *size);
    if (env.world_size < 1) bad_var(s.size, *size, "must be at least 1");
    if (env.rank >= env.world_size) bad_var(s.rank, *rank, "is not below " + std::string(s.size) + "=" + *size);
    auto local = lookup(s.local);
    env.local_rank = local ? parse_int(s.local, *local) : 0;
    break;
  }
  try {
    read_rest_of_env(lookup, env);
  } catch (const Error& e) {  // the rank is known: every rank's line says which it is
    const std::string text = e.what(), plain = "shardtorch: ";
    if (text.rfind(plain, 0) != 0) throw;
    throw Error(detail::rank_prefix(env.rank) + ": " + text.substr(plain.size()));
  }
  return env;
}

namespace {

// parse_launch_env after the rank: the rendezvous, the timeouts, the switches.
void read_rest_of_env(const EnvLookup& lookup, LaunchEnv& env) {
  if (auto addr = lookup("MASTER_ADDR")) {
    if (addr->empty()) bad_var("MASTER_ADDR", *addr, "is empty");
    env.master_addr = *addr;
  }
  if (auto port = lookup("MASTER_PORT")) {
    int p = parse_int("MASTER_PORT", *port);
    if (p < 1 || p > 65535) bad_var("MASTER_PORT", *port, "is outside 1..65535");
    env.master_port = p;
  }
  for (auto [var, field] :
       {std::pair{"SHARDTORCH_TIMEOUT_S", &env.timeout}, std::pair{"SHARDTORCH_FILE_TIMEOUT_S", &env.file_timeout}}) {
    if (auto t = lookup(var)) {
      const int seconds = parse_int(var, *t);
      if (seconds < 1) bad_var(var, *t, "must be at least 1 (seconds)");
      *field = std::chrono::seconds(seconds);
    }
  }
  if (auto r = lookup("SHARDTORCH_REJOIN"); r && !r->empty())
    env.rejoin = detail::parse_switch("SHARDTORCH_REJOIN", *r);
  auto agent = lookup("TORCHELASTIC_USE_AGENT_STORE");
  env.use_agent_store = agent && (*agent == "True" || *agent == "true" || *agent == "1");
  if (env.world_size > 1) {
    if (env.master_addr.empty())
      throw Error("shardtorch: MASTER_ADDR is not set (world size " + std::to_string(env.world_size) + " from " +
                  env.launcher + "); set it to the address of rank 0");
    if (env.master_port == 0)
      throw Error("shardtorch: MASTER_PORT is not set (world size " + std::to_string(env.world_size) + " from " +
                  env.launcher + ")");
  }
}

}  // namespace

std::shared_ptr<World> World::from_env(WorldOptions options) {
  LaunchEnv env = parse_launch_env();
  if (env.timeout) options.timeout(*env.timeout);
  if (env.file_timeout) options.file_timeout(*env.file_timeout);
  if (env.rejoin) options.rejoin(true);
  if (options.rejoin() && env.world_size > 1 && env.rank == 0 && !env.use_agent_store)
    throw Error(detail::rank_prefix(env.rank) + " is to replace a lost rank 0 (SHARDTORCH_REJOIN=1), but in " +
                "this launch rank 0 hosts the rendezvous store, which went with the lost process: a " +
                "replacement can join only where the store outlives the ranks (a store hosted outside them, " +
                "with TORCHELASTIC_USE_AGENT_STORE=1; docs/fault_tolerance.md, \"Survivors that stay alive\")");
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
    c10::intrusive_ptr<c10d::TCPStore> tcp;
    try {
      // A loopback MASTER_ADDR means every rank is on this host: the store
      // listens there alone, not on every interface (c10d's own socket).
      if (so.isServer)
        if (auto address = detail::loopback_listen_address(env.master_addr))
          so.masterListenFd = detail::listen_socket(*address, so.port);
      tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    } catch (const std::exception& e) {
      std::ostringstream os;
      os << detail::rank_prefix(env.rank) << " of " << env.world_size << " (" << env.launcher << ") could not "
         << (so.isServer ? "host" : "reach") << " the rendezvous store at " << env.master_addr << ":" << env.master_port
         << " within " << seconds(options.timeout()) << " s"
         << (so.isServer ? "; is another job using MASTER_PORT?"
                         : "; is rank 0 running, and can this host reach MASTER_ADDR?")
         << " (SHARDTORCH_TIMEOUT_S sets the wait): " << detail::message_of(e);
      detail::throw_error("", os.str());
    }
    // torchrun's agent keeps its store across restarts of the workers: each
    // attempt rendezvouses under its own prefix, or a restarted rank would
    // read the dead attempt's addresses (as PyTorch's env:// rendezvous does).
    std::string prefix = "shardtorch";
    if (env.use_agent_store)
      if (const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT"); attempt && std::string(attempt) != "0")
        prefix += "/attempt_" + std::string(attempt);
    // Every call bounded (a stopped rank 0 would hold its callers forever),
    // and a report that the store does not answer names the rank hosting it.
    const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, tcp);
    std::optional<detail::BoundedStore::Host> host;
    if (!env.use_agent_store)
      host = store_host(*c10::make_intrusive<detail::BoundedStore>(prefixed, options.timeout(), ""), env.rank);
    store = c10::make_intrusive<detail::BoundedStore>(
        prefixed, options.timeout(), (env.use_agent_store ? "torchrun's store at " : "the store at ") + where, host);
  }
  if (options.gloo_hostname().empty() && is_local_address(env.master_addr)) options.gloo_hostname("127.0.0.1");
  return create(store, env.rank, env.world_size, options, env.local_rank);
}

namespace {

// WorldOptions::backend resolved ("auto": nccl on a CUDA device where the
// build has it, else gloo) and checked against the build and the device.
std::string choose_backend(std::string backend, const c10::Device& device) {
  if (backend == "auto") backend = (device.is_cuda() && detail::nccl_available()) ? "nccl" : "gloo";
  SHARDTORCH_CHECK(backend == "gloo" || backend == "nccl", "shardtorch: unknown backend '", backend,
                   "' (expected auto, gloo or nccl)");
  SHARDTORCH_CHECK(backend != "nccl" || detail::nccl_available(),
                   "shardtorch: backend 'nccl' asked for, but this build has no NCCL");
  SHARDTORCH_CHECK(backend != "nccl" || device.is_cuda(), "shardtorch: backend 'nccl' needs a CUDA device, got ",
                   device);
  return backend;
}

// A rank checking beside one that does not would pair its fingerprint with
// the other's collective: every rank must agree, so they compare (on the
// backend itself: nothing counted, nothing checked). Throws on every rank.
void require_same_check(c10d::Backend& b, bool check, int rank, int world_size, std::chrono::milliseconds timeout,
                        const c10::Device& comm_device) {
  auto mine = at::full({1}, check ? 1 : 0, at::kLong).to(comm_device);
  auto all = at::empty({world_size}, mine.options());
  c10d::AllgatherOptions o;
  o.timeout = timeout;
  b._allgather_base(all, mine, o)->wait(timeout);
  all = all.cpu();
  for (int r = 1; r < world_size; ++r)
    SHARDTORCH_CHECK(all[r].item<int64_t>() == all[0].item<int64_t>(), detail::rank_prefix(rank),
                     ": check_collectives differs across ranks: ", all[0].item<int64_t>() ? "on" : "off",
                     " on rank 0 but ", all[r].item<int64_t>() ? "on" : "off", " on rank ", r,
                     "; every rank must pass the same WorldOptions::check_collectives (SHARDTORCH_CHECK_COLLECTIVES)");
}

}  // namespace

std::shared_ptr<World> World::create(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                                     WorldOptions options, int local_rank) {
  SHARDTORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, detail::rank_prefix(rank), " is not in [0, ",
                   world_size, ")");
  try {
    detail::check_switches();  // a typo fails here, not at the first use (a save, hours in)
  } catch (const Error& e) {
    throw Error(detail::rank_prefix(rank) + ": " + std::string(e.what()).substr(std::string("shardtorch: ").size()));
  }
  std::shared_ptr<World> w(new World());
  w->rank_ = rank;
  w->size_ = world_size;
  detail::set_log_rank(rank);  // the "[rank N] " of the library's messages
  w->local_rank_ = local_rank;
  w->options_ = options;
  detail::quiet_cpp_stacktraces();
  c10::initLogging();                                // TORCH_CPP_LOG_LEVEL, read as Python's torch reads it
  c10::intrusive_ptr<detail::BoundedStore> bounded;  // every call of the World's on `store` within a bound
  if (auto* b = dynamic_cast<detail::BoundedStore*>(store.get())) {
    bounded = c10::intrusive_ptr<detail::BoundedStore>::unsafe_reclaim_from_nonowning(b);
  } else if (world_size > 1) {
    bounded = c10::make_intrusive<detail::BoundedStore>(store, options.timeout(), "the World's store");
    store = bounded;
  }
  w->base_store_ = store;
  store->setTimeout(options.timeout());
  w->journal_ = std::make_shared<detail::SetupJournal>();
  if (options.rejoin() && world_size > 1) {
    w->epoch_ = detail::join_as_replacement(*store, rank, world_size, options.timeout());
    store = c10::make_intrusive<c10d::PrefixStore>(detail::epoch_prefix(w->epoch_), store);
  }
  // A rejoin points it at its epoch: what is made over it (groups, subworlds) follows.
  w->store_ = c10::make_intrusive<detail::SwitchableStore>(store);
  if (options.device()) {
    w->device_ = *options.device();
  } else if (at::hasCUDA()) {
    w->device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
  }
  const std::string backend = choose_backend(options.backend(), w->device_);
  check_device(w->device_, rank, local_rank);
  auto b = w->journal_->connect(
      w->journal_,
      [backend, rank, world_size, options](const c10::intrusive_ptr<c10d::Store>& s) {
        return connect(backend, s, rank, world_size, options, rank,
                       "the world (every one of the " + std::to_string(world_size) + " ranks must create it)");
      },
      w->store_, "the world");
  w->backend_name_ = backend;
  // Gloo moves CPU tensors; NCCL moves tensors on the rank's device.
  c10::Device comm_device = backend == "nccl" ? w->device_ : c10::Device(c10::kCPU);
  w->comm_ = std::make_shared<Comm>(b, rank, world_size, options.timeout(), comm_device);
  w->comms_.push_back(w->comm_);
  std::vector<int> all(world_size);  // the world's members, for the peer reports and the check
  for (int r = 0; r < world_size; ++r) all[r] = r;
  // The peer records and the collective check's waits: a connection of their
  // own, so that a call the store does not answer holds up nothing else.
  c10::intrusive_ptr<detail::BoundedStore> peers;
  if (world_size > 1) {
    peers = bounded->fresh_connection();
    const bool file_store = dynamic_cast<c10d::FileStore*>(detail::underlying_store(store).get()) != nullptr;
    w->progress_ = std::make_shared<detail::Progress>(peers, rank, file_store);
    w->progress_->note("world set up");
    std::weak_ptr<detail::Progress> progress = w->progress_;
    if (options.rejoin())
      w->progress_->stop_counting();  // a replacement's counts would not line up with the survivors'
    else
      w->progress_->count("world", w->comm_->launched_count());
    w->comm_->set_peer_report([progress, all](std::chrono::steady_clock::time_point started, int64_t seq) {
      auto p = progress.lock();
      if (!p) return std::string();
      p->failed();  // first: peers that look at this rank, even after it exits, see a survivor
      return p->report(all, started, "world", seq);
    });
  }
  w->context_ = std::make_shared<detail::CollectiveContext>();
  const auto choice = detail::check_collectives_choice(
      options.check_collectives(), std::getenv("SHARDTORCH_CHECK_COLLECTIVES"), w->device_.is_cuda(), world_size);
  if (choice.refused_on_cuda) {
    SHARDTORCH_WARN_ONCE(
        "shardtorch: check_collectives is not available on a CUDA device yet and stays off: it has "
        "not run on a GPU (docs/reliability.md)");
  }
  if (choice.on && options.rejoin())
    SHARDTORCH_INFO(detail::rank_prefix(rank), ": the collective check is off in a World that rejoins");
  const bool check = choice.on && !options.rejoin();
  if (world_size > 1) {
    require_same_check(*b->inner(), check, rank, world_size, options.timeout(), comm_device);
    // A replacement compares its choice (off) with the survivors' replay.
    detail::SetupJournal::Entry e;
    e.kind = detail::SetupJournal::Kind::AllGatherBase;
    e.in = {detail::hold(at::zeros({1}, at::kLong).to(comm_device), true)};
    e.out = {detail::hold(at::zeros({world_size}, at::kLong).to(comm_device), false)};
    w->journal_->record(std::move(e));
  }
  if (check && world_size > 1) {
    w->waits_ = std::make_shared<detail::WaitBoard>(peers, rank, world_size, detail::check_probe_interval());
    auto check = connect("gloo", c10::make_intrusive<c10d::PrefixStore>("shardtorch-check", w->store_), rank,
                         world_size, options, rank, "the collective check of the world");
    w->comm_->enable_checks(w->context_, check, w->waits_, "the world", all);
  }
  return w;
}

World& World::root() {
  World* w = this;
  while (w->parent_) w = w->parent_.get();
  return *w;
}

std::shared_ptr<Comm> World::new_group(const std::vector<int>& ranks, const std::string& tag) {
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  SHARDTORCH_CHECK(it != ranks.end(), detail::rank_prefix(global_rank()), " is not in the group '", tag,
                   "' it asked to join");
  for (int r : ranks)
    SHARDTORCH_CHECK(r >= 0 && r < size_, "shardtorch: group '", tag, "' names rank ", r, " of ", size_);
  std::vector<int> members = ranks;
  std::sort(members.begin(), members.end());
  SHARDTORCH_CHECK(std::adjacent_find(members.begin(), members.end()) == members.end(),
                   detail::rank_prefix(global_rank()), ": group '", tag, "' names a rank twice: ", list(ranks));
  if (parent_) {  // a subworld's group is the whole job's group of the same ranks
    std::vector<int> global;
    for (int r : ranks) global.push_back(global_rank_of(r));
    return root().new_group(global, tag);
  }
  int index = static_cast<int>(it - ranks.begin());
  int n = static_cast<int>(ranks.size());
  // The members of a group are the only ranks that make it, so a count per
  // (tag, members) keys a second such group apart from the first and is the
  // same on all of them; a count over all groups would differ between ranks
  // once some made a group the others are not in, and a count per tag once a
  // tag named other ranks (shard()'s groups of two models). Keyed by the set,
  // not the order, so that members listing it in different orders meet and
  // say so instead of each waiting for a group no one else joins.
  std::string key = tag + "/ranks";
  for (int r : members) key += "-" + std::to_string(r);
  const std::string prefix = "group/" + key + "/" + std::to_string(groups_made_[key]++);
  auto b = journal_->connect(
      journal_,
      [this, prefix, ranks, members, tag, index, n](const c10::intrusive_ptr<c10d::Store>& s) {
        auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, s);
        agree_on_order(*store, ranks, members, tag);
        return connect(backend_name_, store, index, n, options_, rank_, "group '" + tag + "' of ranks " + list(ranks));
      },
      store_, "group '" + tag + "' of ranks " + list(ranks));
  auto comm = std::make_shared<Comm>(b, index, n, options_.timeout(), comm_->device());
  comms_.push_back(comm);
  comm->global_ranks_ = ranks;  // new_group runs on the whole job's World: these are its ranks
  if (progress_) {
    std::weak_ptr<detail::Progress> progress = progress_;
    progress_->count(prefix, comm->launched_count());
    comm->set_peer_report([progress, ranks, prefix](std::chrono::steady_clock::time_point started, int64_t seq) {
      auto p = progress.lock();
      if (!p) return std::string();
      p->failed();  // first: peers that look at this rank, even after it exits, see a survivor
      return p->report(ranks, started, prefix, seq);
    });
  }
  // One collective now, while every member is here: a backend that sets up
  // its communicator at the first collective (NCCL) must not do so at some
  // rank-dependent point later (inside a backward, say).
  auto probe = at::zeros({1}, at::TensorOptions().device(comm_->device()));
  comm->all_reduce(probe, c10d::ReduceOp::SUM, "setting up group '" + tag + "'");
  if (comm_->checks() && n > 1) {  // every member, at the same point
    const std::string name =
        "group '" + tag + "' of ranks " + list(ranks) + " (" + std::to_string(groups_made_[key] - 1) + ")";
    auto check = connect(
        "gloo", c10::make_intrusive<c10d::PrefixStore>("check", c10::make_intrusive<c10d::PrefixStore>(prefix, store_)),
        index, n, options_, rank_, "the collective check of " + name);
    comm->enable_checks(context_, check, waits_, name, ranks);
  }
  return comm;
}

std::shared_ptr<World> World::subworld(const std::vector<int>& ranks, const std::string& tag) {
  auto comm = new_group(ranks, tag);  // checks the ranks, agrees on their order, connects
  std::shared_ptr<World> w(new World());
  w->parent_ = shared_from_this();
  for (int r : ranks) w->global_ranks_.push_back(global_rank_of(r));
  w->rank_ = comm->rank();
  w->size_ = comm->size();
  w->local_rank_ = local_rank_;
  w->device_ = device_;
  w->options_ = options_;
  w->backend_name_ = backend_name_;
  w->comm_ = std::move(comm);
  World& top = root();
  std::string key = tag + "/ranks";
  for (int r : w->global_ranks_) key += "-" + std::to_string(r);
  w->store_ = c10::make_intrusive<c10d::PrefixStore>(
      "subworld/" + key + "/" + std::to_string(top.groups_made_["subworld/" + key]++), top.store_);
  // One process, one place in training: the records peers read and the
  // collectives' fingerprints are the whole job's.
  w->progress_ = progress_;
  w->context_ = context_;
  w->waits_ = waits_;
  return w;
}

// The lowest member publishes its order of the ranks; each member compares
// its own and counts a difference; the last to arrive publishes the verdict.
// Five store operations a member, whatever the group's size.
void World::agree_on_order(c10d::Store& store, const std::vector<int>& ranks, const std::vector<int>& members,
                           const std::string& tag) {
  const int n = static_cast<int>(members.size());
  const std::string mine = list(ranks);
  auto as_string = [](const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); };
  std::string first;
  int64_t disagree = 0;
  try {
    if (rank_ == members.front()) store.set("order", std::vector<uint8_t>(mine.begin(), mine.end()));
    first = as_string(store.get("order"));
    if (first != mine) store.add("disagree", 1);
    if (store.add("arrived", 1) == n) store.set("verdict", std::vector<uint8_t>{1});
    store.wait({"verdict"});
    disagree = store.add("disagree", 0);
  } catch (const std::exception& e) {  // a store's time-out (FileStore's is a plain c10::Error)
    detail::throw_error("", detail::rank_prefix(rank_) + " waited " + seconds(options_.timeout()) +
                                " s for the other members of group '" + tag + "' " + list(members) +
                                " to arrive: do all of them call new_group with this tag and these ranks? (" +
                                detail::message_of(e) + ")");
  }
  SHARDTORCH_CHECK(
      disagree == 0, detail::rank_prefix(rank_), ": the members of group '", tag,
      "' list its ranks in different orders (a member's index in the group is its place in the list): rank ",
      members.front(), " passed ", first, ", ", disagree, " member(s) another order",
      first != mine ? ", this rank " + mine : std::string());
}

void World::rejoin() {
  SHARDTORCH_CHECK(!parent_, detail::rank_prefix(global_rank()),
                   ": rejoin() is for the whole job's World, not one made by subworld() or a DeviceMesh");
  if (size_ == 1) return;
  SHARDTORCH_CHECK(backend_name_ == "gloo", detail::rank_prefix(rank_), ": rejoin() needs Gloo; under ", backend_name_,
                   " a lost peer is not an error a rank can carry on after");
  const std::string why_not = journal_->why_not_replayable();
  SHARDTORCH_CHECK(why_not.empty(), detail::rank_prefix(rank_), ": cannot rejoin a replacement: ", why_not,
                   "; end every rank and start the job again");
  for (auto& c : comms_)
    if (auto comm = c.lock()) comm->disable_checks();
  journal_->disconnect();
  if (progress_) progress_->stop_counting();  // the replacement's would not line up with this rank's
  note_progress("rejoining: waiting for the replacement of a lost rank");
  epoch_ = detail::await_replacement(*base_store_, epoch_, rank_, size_, options_.timeout());
  static_cast<detail::SwitchableStore&>(*store_).point_at(
      c10::make_intrusive<c10d::PrefixStore>(detail::epoch_prefix(epoch_), base_store_));
  journal_->replay(store_, options_.timeout(), rank_);
  note_progress("rejoined");
}

void World::note_progress(const std::string& phase, const std::string& unit) {
  if (progress_) progress_->note(phase, unit);
}

void World::note_step_done() {
  if (progress_) progress_->step_done();
  context_->step_done();
}

void World::barrier() {
  auto t = at::zeros({1}, at::TensorOptions().device(comm_->device()));
  comm_->all_reduce(t, c10d::ReduceOp::SUM, "barrier");
}

}  // namespace shardtorch
