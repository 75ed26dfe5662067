// The fault-tolerance manager: per step a quorum from torchft's lighthouse
// (asked for by a worker thread of the manager's own),
// cross-replica process groups rebuilt when it changes, gradients averaged
// through a communication hook that never throws, heals by send/recv from a
// live peer, and a vote inside the replica group. The state machine is in
// docs/fault_tolerance.md.
#include "shardtorch/ft.h"
#include "comm/backends.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ATen/core/jit_type.h>
#include <boost/json.hpp>
#include <c10/core/GradMode.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <future>
#include <iostream>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "base/check.h"
#include "base/errors.h"
#include "base/log.h"
#include "ft/lighthouse_client.h"
#include "optim/optimizer_state.h"
#include "runtime/shard_state.h"
#include "comm/store_listener.h"
#include "shardtorch/comm_hooks.h"
#include "shardtorch/sharded_model.h"
#include "runtime/unit.h"

namespace shardtorch::ft {
namespace json = boost::json;
using Clock = std::chrono::steady_clock;
using detail::Member;
using shardtorch::detail::ShardState;

namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

std::string random_hex(int n) {
  std::random_device rd;
  std::mt19937_64 g((static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                    static_cast<uint64_t>(Clock::now().time_since_epoch().count()));
  const char* digits = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < n; ++i) s += digits[g() % 16];
  return s;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return "{" + s + "}";
}

// The port the kernel gave a socket bound to port 0.
int bound_port(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  SHARDTORCH_CHECK(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0,
                   "shardtorch::ft: getsockname: ", std::strerror(errno));
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

// Mixed precision as far as it changes what crosses the groups: the dtype of
// the gradients they all-reduce, of the buffers a heal sends, and which
// flats batch norm's parameters are in; and the compute dtype.
std::string describe_precision(const MixedPrecision& mp) {
  if (!mp.param_dtype() && !mp.buffer_dtype()) return "no mixed precision";
  auto name = [](const std::optional<at::ScalarType>& t) {
    return t ? std::string(c10::toString(*t)) : std::string("their own dtype");
  };
  const auto reduce = mp.param_dtype() ? std::optional(mp.reduce_dtype().value_or(*mp.param_dtype())) : std::nullopt;
  return "mixed precision (parameters in " + name(mp.param_dtype()) + ", gradients reduced in " + name(reduce) +
         ", buffers in " + name(mp.buffer_dtype()) + ", batch norm " +
         (mp.keep_batch_norm_fp32() ? "kept in its own dtype" : "cast like the rest") + ")";
}

// What every group must have alike, aspect by aspect, in words (compared
// across groups; the optimizer's hyperparameters as they are when the
// Manager is made).
using Config = std::vector<std::pair<std::string, std::string>>;

Config describe_config(torch::nn::Module& root, ShardState& st, ShardedOptimizer& opt, int world_size) {
  int64_t numel = 0, n = 0;
  std::size_t h = 0;
  for (const auto& item : root.named_parameters()) {
    ++n;
    numel += item.value().numel();
    h = h * 1000003u ^ std::hash<std::string>()(item.key());
    for (auto s : item.value().sizes()) h = h * 31u + static_cast<std::size_t>(s);
  }
  const auto& o = st.options();
  std::ostringstream strategy, params;
  strategy << strategy_name(o.strategy());
  if (o.strategy() == Strategy::HybridShard) strategy << " (shard groups of " << o.hybrid_shard_size() << ")";
  if (o.cpu_offload()) strategy << " with CPU offload";
  params << n << " parameters of " << numel << " elements (names and shapes " << std::hex << (h & 0xffffffffu) << ")";
  return {{"strategy", strategy.str()},
          {"mixed precision", describe_precision(o.mixed_precision())},
          {"world size", std::to_string(world_size) + (world_size == 1 ? " rank" : " ranks")},
          {"parameters", params.str()},
          {"optimizer", shardtorch::detail::describe_optimizer(opt)}};
}

std::string config_text(const Config& c) {
  std::string s;
  for (const auto& [aspect, text] : c) s += (s.empty() ? "" : ", ") + text;
  return s;
}

// Where `a` (group `ga`'s) and `b` (group `gb`'s) differ, aspect by aspect.
std::string config_difference(const std::string& ga, const Config& a, const std::string& gb, const Config& b) {
  std::string s;
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    const std::string aspect = i < a.size() ? a[i].first : b[i].first;
    const std::string x = i < a.size() ? a[i].second : "nothing", y = i < b.size() ? b[i].second : "nothing";
    if (x != y) s += (s.empty() ? "" : "; ") + aspect + ": '" + ga + "' has " + x + ", '" + gb + "' has " + y;
  }
  return s;
}

json::array config_json(const Config& c) {
  json::array a;
  for (const auto& [aspect, text] : c) a.push_back(json::array{json::string(aspect), json::string(text)});
  return a;
}

Config config_of(const json::value& v) {
  Config c;
  for (const auto& x : v.as_array()) {
    const auto& pair = x.as_array();
    c.emplace_back(json::value_to<std::string>(pair.at(0)), json::value_to<std::string>(pair.at(1)));
  }
  return c;
}

// FNV-1a: the same on every machine and build (names a rendezvous that
// every member computes).
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

struct Participant {
  std::string id, group, store_address, held, nonce;
  Config config;
  int64_t step = 0;
  bool restarted = false;
};

// What a quorum request tells the lighthouse that can change between steps,
// taken when the request is made (the worker thread reads no live field).
struct Ask {
  int64_t round = 0, step = 0;
  std::string held;  // the cross-replica group this rank holds ("" none)
};

// One step's quorum as this rank sees it.
struct Quorum {
  int64_t id = 0;
  std::vector<Participant> participants;  // sorted by replica id; without the refused ones
  std::vector<std::string> refused;       // groups refused for their configuration (logged)
  std::string refusal;                    // why, in words
  int me = -1;                            // index among participants
  int64_t max_step = 0;
  std::vector<int> counted;                // participants whose gradients count
  std::vector<std::pair<int, int>> heals;  // (healed, source) participant indices
  std::string config;                      // names the cross-replica group, should it be built now
  bool rebuilt = false;                    // this step built the cross-replica group
  std::string error;                       // the quorum could not be had: the step cannot commit
  bool fatal = false;                      // ... and that is a configuration error: throw
};

std::string encode(const detail::QuorumReply& r) {
  json::array ps;
  for (const auto& p : r.participants)
    ps.push_back(json::object{{"id", p.replica_id}, {"store", p.store_address}, {"step", p.step}, {"data", p.data}});
  return json::serialize(json::object{{"quorum_id", r.quorum_id}, {"participants", ps}});
}

}  // namespace

struct Manager::Impl {
  std::shared_ptr<World> world;
  torch::nn::Module& root;
  ShardedOptimizer& opt;
  std::shared_ptr<ShardState> state;
  ManagerOptions options;
  std::string group, replica_id;
  Config configuration;
  bool restarted = false;
  std::string key_prefix;  // in the group's store, per incarnation
  int64_t round = 0;
  int64_t step = 0;
  bool in_step = false;
  StepReport report;
  std::function<std::string()> save_user;
  std::function<void(const std::string&)> load_user;

  // Group rank 0: the lighthouse client, heartbeats, the store server.
  std::unique_ptr<detail::LighthouseClient> lighthouse;
  c10::intrusive_ptr<c10d::TCPStore> store_server;
  std::string store_address;
  std::thread heartbeats;
  std::mutex hb_mu;
  std::condition_variable hb_cv;
  bool stopping = false;

  // The cross-replica group of this rank (rank k of every participating
  // group), its name (unique to the rendezvous that built it; "" none) and
  // its members' replica ids. Every rank of the group holds the same name
  // between steps (a failure drops it on every rank at the vote), so group
  // rank 0 reports the group's in its quorum requests.
  c10::intrusive_ptr<c10d::Backend> pg;
  std::string pg_config;
  std::vector<std::string> pg_members;
  std::shared_future<Quorum> quorum;  // this step's, or the next step's requested after a commit
  Ask asked;                          // what `quorum` was requested with
  bool prefetched = false;            // `quorum` was requested by should_commit() for the next step
  std::mutex step_mu;
  std::string step_error;  // the first failure of this step's cross-replica work

  Impl(std::shared_ptr<World> w, torch::nn::Module& r, ShardedOptimizer& o, ManagerOptions opts)
      : world(std::move(w)), root(r), opt(o), options(std::move(opts)) {}
  // Also runs when the Manager's constructor throws: stops the threads it
  // started and takes its hook off the model (which may train on, or get
  // another Manager).
  ~Impl();
  c10d::CommHookInterface* hook = nullptr;  // the hook registered on the model, while it is there

  void drop_group() {
    pg.reset();
    pg_config.clear();
    pg_members.clear();
  }

  void fail_step(const std::string& why) {
    std::lock_guard<std::mutex> lock(step_mu);
    if (step_error.empty()) step_error = why;
  }

  void log(const std::string& line) const {
    if (!options.log() || world->rank() != 0 || !shardtorch::detail::log_enabled(shardtorch::LogLevel::Info)) return;
    const auto now = std::chrono::system_clock::now();
    const std::time_t t = std::chrono::system_clock::to_time_t(now);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
    std::tm tm{};
    ::localtime_r(&t, &tm);
    char stamp[32];
    std::snprintf(stamp, sizeof stamp, "%02d:%02d:%02d.%03d", tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms));
    shardtorch::detail::log(shardtorch::LogLevel::Info,
                            "[shardtorch-ft " + std::string(stamp) + "] group " + group + ": " + line);
  }

  // ---- the quorum: one request at a time, run by a worker thread of the
  // manager's own (requests are rounds, numbered alike on every rank)

  std::thread worker;
  std::mutex worker_mu;
  std::condition_variable worker_cv;
  std::optional<std::pair<Ask, std::promise<Quorum>>> job;  // guarded by worker_mu
  bool worker_stop = false;                                 // guarded by worker_mu
  std::atomic<bool> cancelled{false};                       // the request in flight is abandoned: end its waits
  int64_t posted = -1;  // group rank 0: the last round whose answer is in the group's store

  void worker_loop() {
    std::unique_lock<std::mutex> lock(worker_mu);
    while (true) {
      worker_cv.wait(lock, [this] { return worker_stop || job.has_value(); });
      if (worker_stop) return;
      auto [ask, done] = std::move(*job);
      job.reset();
      lock.unlock();
      try {
        done.set_value(run_quorum(ask));
      } catch (...) {
        done.set_exception(std::current_exception());  // rethrown where the quorum is waited for, as before
      }
      lock.lock();
    }
  }

  // Hands a request to the worker; `quorum` becomes its answer.
  void request_quorum(bool prefetch) {
    asked = Ask{round++, step, pg_config};
    prefetched = prefetch;
    std::promise<Quorum> done;
    quorum = done.get_future().share();
    {
      std::lock_guard<std::mutex> lock(worker_mu);
      job.emplace(asked, std::move(done));
    }
    worker_cv.notify_one();
  }

  // Ends the request in flight (its gRPC call, its wait for group rank 0's
  // answer) and waits for the worker to finish it.
  void abandon_quorum() {
    if (!quorum.valid()) return;
    cancelled = true;
    if (lighthouse) lighthouse->cancel_quorum();
    quorum.wait();  // bounded: the cancelled waits end at once
    quorum = {};
    cancelled = false;
    if (lighthouse) lighthouse->allow_quorum();
  }

  // `nonce`: fresh per request, so that a cross-replica group built from
  // this quorum gets a name no earlier rendezvous had, whatever the
  // lighthouse (a restarted one counts its quorum ids from the start again).
  std::string data_json(const Ask& ask) const {
    return json::serialize(json::object{{"group", group},
                                        {"config", config_json(configuration)},
                                        {"restarted", restarted},
                                        {"held", ask.held},
                                        {"nonce", random_hex(16)}});
  }

  detail::QuorumReply ask_lighthouse(const Ask& ask) {
    Member me{replica_id, store_address, store_address, ask.step, static_cast<uint64_t>(world->size()), data_json(ask)};
    return lighthouse->quorum(me, options.quorum_timeout());
  }

  // Group rank 0 asks the lighthouse and, when the group has other ranks,
  // hands the answer to them through the group's store; they wait for it there.
  std::string group_quorum_text(const Ask& ask) {
    const std::string key = key_prefix + "round/" + std::to_string(ask.round);
    auto& store = *world->store();
    if (world->rank() == 0) {
      std::string text;
      try {
        text = encode(ask_lighthouse(ask));
      } catch (const std::exception& e) {
        text = json::serialize(json::object{{"error", e.what()}});
      }
      if (world->size() == 1 || cancelled) return text;  // nobody reads it
      store.set(key, std::vector<uint8_t>(text.begin(), text.end()));
      // Every rank read the previous posted answer before the vote that
      // followed it, which this rank has passed: drop it, or the store grows
      // every step.
      if (posted >= 0) store.deleteKey(key_prefix + "round/" + std::to_string(posted));
      posted = ask.round;
      return text;
    }
    // Polled, not store.wait(): a blocking wait would hold the store client's
    // lock and stall the training thread's own use of the store.
    const auto deadline = Clock::now() + options.quorum_timeout() + std::chrono::seconds(5);
    while (!store.check({key})) {
      if (cancelled) return json::serialize(json::object{{"error", "cancelled"}});
      if (Clock::now() > deadline)
        return json::serialize(
            json::object{{"error", "rank " + std::to_string(world->rank()) + " of replica group '" + group +
                                       "' did not get the quorum from its group rank 0 within the quorum timeout"}});
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    auto v = store.get(key);
    return std::string(v.begin(), v.end());
  }

  Quorum compute(const Ask& ask) {
    Quorum q;
    json::object o;
    try {
      o = json::parse(group_quorum_text(ask)).as_object();
    } catch (const std::exception& e) {
      q.error = std::string("malformed quorum: ") + e.what();
      return q;
    }
    if (o.contains("error")) {
      q.error = json::value_to<std::string>(o.at("error"));
      q.fatal = true;  // the lighthouse could not be had within its timeout
      return q;
    }
    q.id = o.at("quorum_id").as_int64();
    for (const auto& v : o.at("participants").as_array()) {
      const auto& p = v.as_object();
      Participant x;
      x.id = json::value_to<std::string>(p.at("id"));
      x.store_address = json::value_to<std::string>(p.at("store"));
      x.step = p.at("step").as_int64();
      try {
        auto d = json::parse(json::value_to<std::string>(p.at("data"))).as_object();
        x.group = json::value_to<std::string>(d.at("group"));
        x.config = config_of(d.at("config"));
        x.restarted = d.at("restarted").as_bool();
        x.held = json::value_to<std::string>(d.at("held"));
        x.nonce = json::value_to<std::string>(d.at("nonce"));
      } catch (const std::exception&) {
        q.error = "replica '" + x.id +
                  "' in the quorum is not a shardtorch fault-tolerance manager of this version (its data is not "
                  "shardtorch's); every replica group must run shardtorch::ft::Manager";
        q.fatal = true;
        return q;
      }
      q.participants.push_back(std::move(x));
    }
    std::sort(q.participants.begin(), q.participants.end(), [](auto& a, auto& b) { return a.id < b.id; });
    if (!find_me(q)) return q;
    // Ids are "group:random", so one group's replicas sort side by side.
    for (size_t i = 1; i < q.participants.size(); ++i)
      if (q.participants[i].group == q.participants[i - 1].group) {
        // An incarnation that died within the lighthouse's heartbeat timeout
        // is still a participant: it would never join the group's rendezvous.
        q.error = "the quorum " + join(names(q)) + " holds two replicas of group '" + q.participants[i].group + "' ('" +
                  q.participants[i - 1].id + "' and '" + q.participants[i].id +
                  "'): one is an earlier incarnation that the lighthouse has not yet timed out; the next quorum goes "
                  "without it";
        return q;
      }
    if (!check_configurations(q)) return q;
    for (const auto& p : q.participants) q.max_step = std::max(q.max_step, p.step);
    // Who counts: the groups at the latest step. Before any step committed,
    // one group's weights are everyone's start: the first (by id) that was
    // not restarted. The others are healed from the counted groups.
    const int n = static_cast<int>(q.participants.size());
    if (q.max_step > 0) {
      for (int i = 0; i < n; ++i)
        if (q.participants[i].step == q.max_step) q.counted.push_back(i);
    } else {
      for (int i = 0; i < n && q.counted.empty(); ++i)
        if (!q.participants[i].restarted) q.counted.push_back(i);
      if (q.counted.empty()) {
        q.error = "every replica group in the quorum " + join(names(q)) +
                  " was restarted and none has committed a step: there is no live state to heal from. Load the latest "
                  "checkpoint (then Manager::set_step) in every group, or start the groups afresh (not as restarts)";
        q.fatal = true;
        return q;
      }
    }
    std::set<int> counted(q.counted.begin(), q.counted.end());
    int k = 0;
    for (int i = 0; i < n; ++i)
      if (!counted.count(i)) q.heals.push_back({i, q.counted[static_cast<size_t>(k++) % q.counted.size()]});
    // The name of a cross-replica group built for this quorum: every member
    // computes it from the same requests, and their nonces make it one that
    // no earlier rendezvous had (a restarted lighthouse repeats quorum ids).
    std::string text = std::to_string(q.id);
    for (const auto& p : q.participants) text += "|" + p.id + "@" + p.store_address + "/" + p.held + "/" + p.nonce;
    char hash[17];
    std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(fnv1a(text)));
    q.config = "q" + std::to_string(q.id) + "-" + hash;
    return q;
  }

  // Sets q.me; false (with q.error) if this replica is not in the quorum.
  bool find_me(Quorum& q) const {
    q.me = -1;
    for (size_t i = 0; i < q.participants.size(); ++i)
      if (q.participants[i].id == replica_id) q.me = static_cast<int>(i);
    if (q.me < 0) q.error = "the lighthouse's quorum does not include this replica";
    return q.me >= 0;
  }

  // Groups configured differently (model, strategy, mixed precision, world
  // size, optimizer). The groups already training are the reference: those
  // that hold a cross-replica group, when they hold the same one (each such
  // group was built by a quorum that passed this check), else those at the
  // latest step once a step committed. When they agree, only the groups
  // that differ from them are refused: they throw, and the others go on
  // without them. With no such reference (nothing committed yet) or one
  // that disagrees, every group throws. False when this rank's quorum ends
  // here (q.error set).
  bool check_configurations(Quorum& q) {
    auto& ps = q.participants;
    const Participant& mine = ps[static_cast<size_t>(q.me)];
    bool alike = true;
    for (const auto& p : ps) alike = alike && p.config == mine.config;
    if (alike) return true;
    const std::string advice =
        "Every replica group must build the same model with the same ShardOptions, world size and optimizer "
        "(its hyperparameters included)";
    std::set<std::string> held;
    int64_t max_step = 0;
    for (const auto& p : ps) {
      if (!p.held.empty()) held.insert(p.held);
      max_step = std::max(max_step, p.step);
    }
    std::vector<const Participant*> ref;
    for (const auto& p : ps)
      if (held.size() == 1 ? p.held == *held.begin() : max_step > 0 && p.step == max_step) ref.push_back(&p);
    bool agree = !ref.empty();
    for (const auto* p : ref) agree = agree && p->config == ref.front()->config;
    if (!agree) {
      for (const auto& p : ps)
        if (p.config != mine.config) {
          q.error = "replica groups '" + mine.group + "' and '" + p.group + "' are configured differently (" +
                    config_difference(mine.group, mine.config, p.group, p.config) + "). " + advice +
                    "; with no configuration that the groups already training share to keep, every group stops";
          q.fatal = true;
          return false;
        }
    }
    const Participant& r = *ref.front();
    std::vector<std::string> training;
    for (const auto* p : ref) training.push_back(p->group);
    if (mine.config != r.config) {
      q.error = "replica group '" + mine.group + "' is refused: its configuration differs from that of the groups " +
                "already training " + join(training) + " (" +
                config_difference(mine.group, mine.config, r.group, r.config) + "). " + advice +
                "; the others go on without this one";
      q.fatal = true;
      return false;
    }
    // Copies: `r` is one of the participants moved below.
    const Config reference = r.config;
    const std::string reference_group = r.group;
    std::vector<Participant> kept;
    for (auto& p : ps)
      if (p.config == reference) {
        kept.push_back(std::move(p));
      } else {
        q.refused.push_back(p.group);
        if (q.refusal.empty()) q.refusal = config_difference(p.group, p.config, reference_group, reference);
      }
    ps = std::move(kept);
    return find_me(q);
  }

  static std::vector<std::string> names(const Quorum& q) {
    std::vector<std::string> v;
    for (const auto& p : q.participants) v.push_back(p.group);
    return v;
  }

  // Whether this rank's cross-replica group serves the quorum: every
  // participant holds it (its name is unique to the rendezvous that built
  // it) and its members are the participants.
  bool keeps_group(const Quorum& q) const {
    if (!pg || pg_config.empty() || pg_members != ids(q)) return false;
    for (const auto& p : q.participants)
      if (p.held != pg_config) return false;
    return true;
  }

  static std::vector<std::string> ids(const Quorum& q) {
    std::vector<std::string> v;
    for (const auto& p : q.participants) v.push_back(p.id);
    return v;
  }

  // Builds this rank's cross-replica group unless it keeps the one it holds.
  // On a failure the step cannot commit; the next quorum retries.
  void configure(Quorum& q) {
    if (q.participants.size() <= 1) {
      pg.reset();
      pg_config.clear();
      pg_members.clear();
      return;
    }
    if (keeps_group(q)) return;
    q.rebuilt = true;
    pg.reset();
    pg_config.clear();
    pg_members.clear();
    pg = build_group(q.participants[static_cast<size_t>(q.counted.front())].store_address,
                     "shardtorch-ft/" + q.config + "/rank" + std::to_string(world->rank()), q.me,
                     static_cast<int>(q.participants.size()));
    pg_config = q.config;
    pg_members = ids(q);
  }

  // The rendezvous store of a cross-replica group. A test can make this
  // process fail right after it published its address there
  // (shardtorch::testing::inject_failure("cross-replica rendezvous")), as a
  // member that dies at that moment does.
  class RendezvousStore : public c10d::PrefixStore {
   public:
    using PrefixStore::PrefixStore;
    using Store::set;
    void set(const std::string& key, const std::vector<uint8_t>& value) override {
      PrefixStore::set(key, value);
      shardtorch::detail::failure_point("cross-replica rendezvous");
    }
  };

  // A build on a thread of its own (see build_group).
  struct Build {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    c10::intrusive_ptr<c10d::Backend> pg;
    std::exception_ptr error;
  };

  // Connects to the rendezvous store at `primary` and builds the Gloo group
  // of `size` members as member `index`, waiting at most options.timeout()
  // for it. The build runs on a thread of its own: Gloo's own waits (its
  // store reads, then one connection after the other) can add up to several
  // times its timeout when a member dies after publishing its address. A
  // build given up on ends there by itself, within Gloo's and the store's
  // own timeouts, and drops whatever it built; it holds nothing of the
  // manager's.
  c10::intrusive_ptr<c10d::Backend> build_group(const std::string& primary, const std::string& prefix, int index,
                                                int size) {
    auto b = std::make_shared<Build>();
    const auto timeout = options.timeout();
    const std::string host = options.host();
    auto body = [b, primary, prefix, index, size, timeout, host] {
      c10::intrusive_ptr<c10d::Backend> built;
      std::exception_ptr error;
      try {
        const auto colon = primary.rfind(':');
        c10d::TCPStoreOptions so;
        so.port = static_cast<uint16_t>(std::stoi(primary.substr(colon + 1)));
        so.isServer = false;
        so.waitWorkers = false;
        so.timeout = timeout;
        auto client = c10::make_intrusive<c10d::TCPStore>(primary.substr(0, colon), so);
        auto store = c10::make_intrusive<RendezvousStore>(prefix, client);
        built = shardtorch::detail::make_gloo_backend(store, index, size, timeout, host);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(b->mu);
      b->pg = std::move(built);
      b->error = error;
      b->done = true;
      b->cv.notify_all();
    };
    std::thread(body).detach();
    std::unique_lock<std::mutex> lock(b->mu);
    const auto t0 = Clock::now();
    if (!b->cv.wait_until(lock, t0 + timeout, [&] { return b->done; }))
      SHARDTORCH_CHECK(false, "its members did not all connect within ManagerOptions::timeout (", timeout.count(),
                       " ms): a member may have died after the lighthouse admitted it, or published an address that "
                       "no longer answers. The next quorum builds it again");
    if (b->error) std::rethrow_exception(b->error);
    return std::move(b->pg);
  }

  // Drops every cross-replica rendezvous key but those of `current` from
  // the store this rank serves (the first counted group's rank 0 serves each
  // cross-replica group's rendezvous), or it grows with every
  // reconfiguration. Called after a step committed on a newly built group:
  // every member has finished that group's rendezvous, and any other
  // rendezvous in this store is over or stale (this group is a member of
  // every quorum whose rendezvous it serves, and has not asked for the next
  // one yet); a straggler that builds a stale group fails its step.
  void drop_old_rendezvous(const std::string& current) {
    if (!store_server) return;
    const std::string keep = "shardtorch-ft/" + current + "/";
    try {
      for (const auto& key : store_server->listKeys())
        if (key.rfind("shardtorch-ft/", 0) == 0 && key.rfind(keep, 0) != 0) store_server->deleteKey(key);
    } catch (const std::exception& e) {
      log("could not drop earlier cross-replica groups' keys from this group's store: " +
          shardtorch::detail::message_of(e));
    }
  }

  Quorum run_quorum(const Ask& ask) {
    Quorum q = compute(ask);
    if (!q.error.empty() || cancelled) return q;
    try {
      configure(q);
    } catch (const std::exception& e) {
      q.error = "could not build the cross-replica group of quorum " + std::to_string(q.id) + " " + join(names(q)) +
                ": " + shardtorch::detail::message_of(e);
    }
    return q;
  }

  const Quorum& wait_quorum() {
    // run_quorum's own waits are bounded (quorum_timeout, timeout); this adds a margin.
    const auto bound = options.quorum_timeout() + 2 * options.timeout() + std::chrono::seconds(10);
    SHARDTORCH_CHECK(quorum.valid(),
                     "shardtorch::ft: Manager::start_step() was not called before this backward or "
                     "should_commit() (group '",
                     group, "', rank ", world->rank(), ")");
    SHARDTORCH_CHECK(quorum.wait_for(bound) == std::future_status::ready, "shardtorch::ft: group '", group, "', rank ",
                     world->rank(), ": the quorum of step ", step, " did not finish within ", bound.count(), " ms");
    return quorum.get();
  }

  bool healing(const Quorum& q) const {
    for (auto [healed, source] : q.heals)
      if (healed == q.me) return true;
    return false;
  }

  // ---- the heal: the tensors that make a replica's state, in one order on every group

  std::vector<at::Tensor> model_tensors() {
    std::vector<at::Tensor> out;
    if (state->replicated()) {
      for (const auto& p : state->replicated()->params()) out.push_back(state->record_of(p));
    } else {
      for (auto& u : state->units())
        for (auto& f : u->flats()) out.push_back(f->shard());
    }
    for (const auto& b : root.buffers())
      if (b.defined()) out.push_back(b);
    return out;
  }

  // Sends this rank's state; returns the bytes sent.
  int64_t send_state(int dst, int tag) {
    c10::NoGradGuard no_grad;
    const auto& pieces = opt.views().pieces();
    const auto& st = opt.inner().state();
    const std::string user = save_user ? save_user() : std::string();
    at::Tensor meta = at::zeros({static_cast<int64_t>(2 + 2 * pieces.size())}, at::kLong);
    auto m = meta.accessor<int64_t, 1>();
    m[0] = step;
    m[1] = static_cast<int64_t>(user.size());
    // Gloo sends and receives host memory only (it reads a tensor's data
    // pointer): state on a device goes through a host copy.
    auto host = [](const at::Tensor& t) { return t.to(at::kCPU).contiguous(); };
    std::vector<at::Tensor> out;
    for (auto& t : model_tensors()) out.push_back(host(t));
    for (size_t i = 0; i < pieces.size(); ++i) {
      auto it = st.find(pieces[i].view.unsafeGetTensorImpl());
      if (it == st.end()) continue;
      auto ts = shardtorch::detail::optimizer_state_tensors(it->second.get());
      m[static_cast<int64_t>(2 + 2 * i)] = static_cast<int64_t>(ts.size());
      m[static_cast<int64_t>(3 + 2 * i)] = shardtorch::detail::optimizer_state_step(it->second.get());
      for (auto& [name, t] : ts) out.push_back(host(t));
    }
    if (!user.empty()) {
      at::Tensor u = at::empty({static_cast<int64_t>(user.size())}, at::kByte);
      std::memcpy(u.data_ptr(), user.data(), user.size());
      out.push_back(u);
    }
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<at::Tensor> one{meta};
    works.push_back(pg->send(one, dst, tag));
    for (auto& t : out) {
      std::vector<at::Tensor> v{t};
      works.push_back(pg->send(v, dst, tag));
    }
    for (auto& w : works) w->wait(options.timeout());
    int64_t bytes = static_cast<int64_t>(meta.nbytes());
    for (auto& t : out) bytes += static_cast<int64_t>(t.nbytes());
    return bytes;
  }

  // Receives everything first, then replaces the state: a transfer that fails
  // half-way changes nothing.
  int64_t receive_state(int src, int tag) {
    c10::NoGradGuard no_grad;
    const auto& pieces = opt.views().pieces();
    at::Tensor meta = at::zeros({static_cast<int64_t>(2 + 2 * pieces.size())}, at::kLong);
    std::vector<at::Tensor> one{meta};
    pg->recv(one, src, tag)->wait(options.timeout());
    auto m = meta.accessor<int64_t, 1>();
    std::vector<at::Tensor> dst = model_tensors(), got;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    auto post = [&](at::Tensor t) {
      got.push_back(t);
      std::vector<at::Tensor> v{t};
      works.push_back(pg->recv(v, src, tag));
    };
    // Into host memory (Gloo's receives write through the data pointer);
    // copied to where the state lives once everything arrived.
    auto host_like = [](const at::Tensor& t) { return at::empty(t.sizes(), t.options().device(at::kCPU)); };
    for (auto& t : dst) post(host_like(t));
    for (size_t i = 0; i < pieces.size(); ++i)
      for (int64_t k = 0; k < m[static_cast<int64_t>(2 + 2 * i)]; ++k) post(host_like(pieces[i].view));
    const int64_t user_len = m[1];
    if (user_len > 0) post(at::empty({user_len}, at::kByte));
    int64_t bytes = 0;
    for (const auto& t : got) bytes += static_cast<int64_t>(t.nbytes());
    shardtorch::detail::ProgressReporter progress("heal", "tensors", static_cast<int64_t>(works.size()), bytes);
    for (size_t i = 0; i < works.size(); ++i) {
      works[i]->wait(options.timeout());
      progress.advance(1, static_cast<int64_t>(got[i].nbytes()));
    }
    progress.finish();
    // Everything arrived: replace (under CPU offload once no copy to the
    // device reads the masters any more).
    state->copies().wait_for_offload_copies();
    size_t at = 0;
    for (auto& t : dst) t.copy_(got[at++]);
    auto kind = shardtorch::detail::optimizer_kind(opt);
    auto& st = opt.inner().state();
    for (size_t i = 0; i < pieces.size(); ++i) {
      void* key = pieces[i].view.unsafeGetTensorImpl();
      const int64_t n = m[static_cast<int64_t>(2 + 2 * i)];
      if (n == 0) {
        st.erase(key);
        continue;
      }
      std::vector<at::Tensor> ts(got.begin() + static_cast<long>(at), got.begin() + static_cast<long>(at + n));
      at += static_cast<size_t>(n);
      for (auto& t : ts) t = t.to(pieces[i].view.device());  // the state lives with its piece
      st[key] = shardtorch::detail::make_optimizer_state(*kind, m[static_cast<int64_t>(3 + 2 * i)], ts);
    }
    opt.views().count_optimizer_state(opt.inner());
    if (user_len > 0 && load_user) {
      const at::Tensor& u = got[at];
      load_user(std::string(static_cast<const char*>(u.data_ptr()), static_cast<size_t>(user_len)));
    }
    return m[0];
  }

  void heal(const Quorum& q) {
    for (size_t h = 0; h < q.heals.size(); ++h) {
      auto [healed, source] = q.heals[h];
      const int tag = 7000 + static_cast<int>(h);
      if (source == q.me) {
        const auto t0 = Clock::now();
        const int64_t bytes = send_state(healed, tag);
        log("step " + std::to_string(step) + ": sent this rank's state (" + std::to_string(bytes) + " bytes) to '" +
            q.participants[healed].group + "' in " +
            std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count()) + " ms");
      } else if (healed == q.me) {
        const auto t0 = Clock::now();
        const int64_t from_step = step;
        step = receive_state(source, tag);
        log("healed from '" + q.participants[source].group + "': step " + std::to_string(from_step) + " -> " +
            std::to_string(step) + " in " +
            std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count()) + " ms");
      }
    }
  }
};

// The cross-replica reduction. Never fails: an error marks the step, which
// the vote then rejects.
class FtHook : public c10d::CommHookInterface {
 public:
  FtHook(Manager::Impl* m, c10::intrusive_ptr<c10d::Backend> inner) : m_(m), inner_(std::move(inner)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor buffer = bucket.getBuffer();
    Manager::Impl* m = m_;
    if (!inner_ || inner_->getSize() <= 1) return across(m, buffer);
    // NoShard with several ranks per group: the group's own mean first, then
    // across the groups when it completes (the backward goes on meanwhile).
    try {
      buffer.div_(inner_->getSize());
      std::vector<at::Tensor> v{buffer};
      return inner_->allreduce(v)->getFuture()->thenAsync(
          [m, buffer](c10::ivalue::Future& f) {
            if (f.hasError()) {
              m->fail_step("the all-reduce inside the group failed: " + f.tryRetrieveErrorMessage());
              return completed_future(buffer);
            }
            return across(m, buffer);
          },
          c10::TensorType::get());
    } catch (const std::exception& e) {
      m->fail_step(std::string("the all-reduce inside the group failed: ") + shardtorch::detail::message_of(e));
      return completed_future(buffer);
    }
  }

  at::Tensor parseHookResult(const c10::IValue& result) override { return result.toTensor(); }

 private:
  // `buffer` (this group's mean) summed over the cross-replica group and
  // divided by the groups that count; a healed group sends zeros.
  static c10::intrusive_ptr<c10::ivalue::Future> across(Manager::Impl* m, at::Tensor buffer) {
    try {
      const Quorum& q = m->wait_quorum();
      if (!q.error.empty()) return completed_future(buffer);
      if (m->healing(q)) buffer.zero_();
      const double counted = static_cast<double>(q.counted.size());
      if (!m->pg) {
        buffer.div_(counted);
        return completed_future(buffer);
      }
      std::vector<at::Tensor> v{buffer};
      return m->pg->allreduce(v)->getFuture()->then(
          [m, buffer, counted](c10::ivalue::Future& f) {
            if (f.hasError()) {
              m->fail_step("a cross-replica all-reduce failed: " + f.tryRetrieveErrorMessage());
            } else {
              buffer.div_(counted);
            }
            return c10::IValue(buffer);
          },
          c10::TensorType::get());
    } catch (const std::exception& e) {
      m->fail_step(std::string("the cross-replica reduction failed: ") + shardtorch::detail::message_of(e));
      return completed_future(buffer);
    }
  }

  Manager::Impl* m_;
  c10::intrusive_ptr<c10d::Backend> inner_;
};

Manager::Manager(std::shared_ptr<World> world, torch::nn::Module& root, ShardedOptimizer& opt, ManagerOptions options)
    : impl_(std::make_unique<Impl>(std::move(world), root, opt, std::move(options))) {
  Impl& m = *impl_;
  auto& o = m.options;
  if (o.lighthouse().empty())
    o.lighthouse(env("SHARDTORCH_FT_LIGHTHOUSE").value_or(env("TORCHFT_LIGHTHOUSE").value_or("")));
  if (o.replica_group().empty())
    o.replica_group(env("SHARDTORCH_FT_REPLICA_GROUP").value_or(env("REPLICA_GROUP_ID").value_or("")));
  SHARDTORCH_CHECK(!o.replica_group().empty(), "shardtorch::ft::Manager: rank ", m.world->rank(),
                   ": no replica group name: pass ManagerOptions::replica_group or set SHARDTORCH_FT_REPLICA_GROUP "
                   "(the same on every rank of a group and across its restarts)");
  SHARDTORCH_CHECK(o.replica_group().find(':') == std::string::npos, "shardtorch::ft::Manager: replica group name '",
                   o.replica_group(), "' contains ':'");
  m.group = o.replica_group();
  const int restarts = std::atoi(env("TORCHELASTIC_RESTART_COUNT").value_or("0").c_str());
  m.restarted = o.restarted().value_or(restarts > 0);
  m.state = shardtorch::detail::require_state(root, "shardtorch::ft::Manager");
  m.configuration = describe_config(root, *m.state, opt, m.world->size());
  // Every rank of the group must agree on the group name and the incarnation.
  auto names =
      m.world->comm().all_gather_strings(m.group + "/" + std::to_string(restarts), "shardtorch::ft group name");
  for (size_t r = 0; r < names.size(); ++r)
    SHARDTORCH_CHECK(names[r] == names[0], "shardtorch::ft::Manager: ranks 0 and ", r,
                     " of one World name different replica groups or restarts: '", names[0], "' and '", names[r], "'");
  m.key_prefix = "shardtorch-ft/" + m.group + "/incarnation" + std::to_string(restarts) + "/";
  if (m.world->rank() == 0) {
    // Bound to `host` alone (c10d's TCPStore would listen on every interface).
    const int fd = shardtorch::detail::listen_socket(o.host(), 0);
    const int port = bound_port(fd);
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(port);
    so.isServer = true;
    so.waitWorkers = false;
    so.numWorkers = std::nullopt;
    so.timeout = o.timeout();
    so.masterListenFd = fd;  // c10d owns it from here
    m.store_server = c10::make_intrusive<c10d::TCPStore>(o.host(), so);
    m.store_address = o.host() + ":" + std::to_string(port);
    m.replica_id = m.group + ":" + random_hex(12);
    m.lighthouse = std::make_unique<detail::LighthouseClient>(o.lighthouse());
    m.heartbeats = std::thread([&m] {
      std::unique_lock<std::mutex> lock(m.hb_mu);
      while (!m.stopping) {
        lock.unlock();
        try {
          m.lighthouse->heartbeat(m.replica_id, std::chrono::seconds(1));
        } catch (const std::exception&) {
          // The quorum reports an unreachable lighthouse; a missed beat is only late.
        }
        lock.lock();
        m.hb_cv.wait_for(lock, m.options.heartbeat_interval(), [&m] { return m.stopping; });
      }
    });
  }
  // The other ranks learn the replica id from rank 0 (they name it in the quorum's participants).
  auto ids = m.world->comm().all_gather_strings(m.replica_id, "shardtorch::ft replica id");
  m.replica_id = ids[0];
  auto hook = std::make_unique<FtHook>(&m, sharded_model(root).comm_hook_group());
  c10d::CommHookInterface* registered = hook.get();
  sharded_model(root).register_comm_hook(std::move(hook));
  m.hook = registered;
  m.worker = std::thread([&m] { m.worker_loop(); });
  m.log("replica " + m.replica_id + " (" + config_text(m.configuration) + ")" + (m.restarted ? ", restarted" : "") +
        ", lighthouse " + (m.world->rank() == 0 ? m.lighthouse->address() : std::string("-")));
}

std::vector<std::string> detail::served_store_keys(const Manager& m) {
  return m.impl_->store_server ? m.impl_->store_server->listKeys() : std::vector<std::string>{};
}

Manager::Impl::~Impl() {
  // A request in flight (the next step's, asked for by the last
  // should_commit()) is cancelled, not waited for: it may never be answered.
  abandon_quorum();
  {
    std::lock_guard<std::mutex> lock(worker_mu);
    worker_stop = true;
  }
  worker_cv.notify_all();
  if (worker.joinable()) worker.join();
  {
    std::lock_guard<std::mutex> lock(hb_mu);
    stopping = true;
  }
  hb_cv.notify_all();
  if (heartbeats.joinable()) heartbeats.join();
  // The hook points here: off the model before this goes.
  if (hook && state && state->reducer().comm_hook() == hook) state->reducer().set_comm_hook(nullptr);
}

Manager::~Manager() = default;

void Manager::start_step() {
  Impl& m = *impl_;
  SHARDTORCH_CHECK(!m.in_step, "shardtorch::ft: group '", m.group, "', rank ", m.world->rank(),
                   ": start_step() twice without should_commit() between them");
  // An optimizer that steps during the backward would update before the vote.
  SHARDTORCH_CHECK(!m.state->copies().gradient_listener(), "shardtorch::ft: group '", m.group, "', rank ",
                   m.world->rank(),
                   ": the optimizer steps during the backward (ShardedOptimizer::"
                   "overlap_with_backward), before the group votes on the step: turn the overlap off under fault "
                   "tolerance, where should_commit() decides whether the optimizer steps");
  m.in_step = true;
  {
    std::lock_guard<std::mutex> lock(m.step_mu);
    m.step_error.clear();
  }
  if (m.prefetched && m.quorum.valid()) {
    m.prefetched = false;
    if (m.asked.step == m.step) return;  // what start_step() would ask
    // set_step() moved the step after the request went out: a quorum with
    // the old step may already have reached the other groups, which would
    // then wait for this rank in their all-reduce. Drop the cross-replica
    // group, so that they fail at once, and ask again.
    m.abandon_quorum();
    m.drop_group();
  }
  m.request_quorum(/*prefetch=*/false);
}

bool Manager::should_commit() {
  Impl& m = *impl_;
  SHARDTORCH_CHECK(m.in_step, "shardtorch::ft: group '", m.group, "', rank ", m.world->rank(),
                   ": should_commit() without start_step()");
  m.in_step = false;
  const Quorum& q = m.wait_quorum();
  StepReport rep;
  rep.step = m.step;
  rep.quorum_id = q.id;
  rep.reconfigured = q.rebuilt;
  std::string error = q.error;
  const int64_t before_heal = m.step;
  if (q.fatal) {
    // Every rank of every group computes the same: each throws the same error.
    m.report = rep;
    m.report.error = error;
    SHARDTORCH_CHECK(false, "shardtorch::ft: group '", m.group, "', rank ", m.world->rank(), ": ", error);
  }
  rep.refused = q.refused;
  if (error.empty()) {
    for (int i : q.counted) rep.counted.push_back(q.participants[static_cast<size_t>(i)].group);
    for (auto [h, s] : q.heals) rep.healed.push_back(q.participants[static_cast<size_t>(h)].group);
    {
      std::lock_guard<std::mutex> lock(m.step_mu);
      error = m.step_error;
    }
    if (error.empty() && !q.heals.empty() && m.pg) {
      try {
        m.heal(q);
      } catch (const std::exception& e) {
        error = std::string("the heal failed: ") + shardtorch::detail::message_of(e);
      }
    }
  }
  // Dropped now, not after the vote: peers still waiting on this rank see
  // its connections close and fail at once instead of at their timeout.
  if (!error.empty()) m.drop_group();
  rep.step = m.step;  // a healed group's is its source's
  // The vote: every rank of the group, inside the group (its own world); a
  // group of one rank decides alone.
  rep.committed = error.empty();
  if (m.world->size() > 1) {
    // On the group's device: NCCL reduces device memory only.
    at::Tensor ok = at::full({1}, error.empty() ? 1 : 0, at::kInt).to(m.world->comm().device());
    m.world->comm().all_reduce(ok, c10d::ReduceOp::MIN, "shardtorch::ft vote");
    rep.committed = ok.item<int>() == 1;
  }
  if (rep.committed) {
    // Every rank of the group received its state (the vote says so): the
    // full parameters made from the old shards go (collective in the group).
    if (m.healing(q)) m.state->after_shards_replaced();
    ++m.step;
    if (q.rebuilt) m.drop_old_rendezvous(m.pg_config);
  } else {
    // Every rank of the group drops its cross-replica group, its own part
    // failed or not: group rank 0's next request says it holds none, and
    // every rank of every group in the next quorum builds a new one.
    m.drop_group();
    // Another rank of the group may not have received its state: this rank
    // goes back to its own step, so that the next quorum heals the group again.
    if (m.healing(q)) rep.step = m.step = before_heal;
    rep.error = error.empty() ? "another rank of the group failed" : error;
    m.log("step " + std::to_string(rep.step) + " not committed: " + rep.error);
  }
  if (m.report.quorum_id != rep.quorum_id && error.empty())
    m.log("quorum " + std::to_string(q.id) + ": " + join(rep.counted) + " counted" +
          (rep.healed.empty() ? "" : ", " + join(rep.healed) + " healed") + " at step " + std::to_string(rep.step) +
          (q.refused.empty() ? "" : "; refused " + join(q.refused) + ", configured differently (" + q.refusal + ")"));
  m.report = rep;
  // The next step's quorum, asked for now with what start_step() would send
  // (the step and the group held are final here): it runs during the
  // optimizer step, the data loading and the next forward.
  if (m.options.prefetch_quorum()) m.request_quorum(/*prefetch=*/true);
  return rep.committed;
}

int64_t Manager::step() const { return impl_->step; }
void Manager::set_step(int64_t step) {
  SHARDTORCH_CHECK(step >= 0 && !impl_->in_step, "shardtorch::ft::Manager::set_step(", step,
                   "): a step count (>= 0) between steps");
  impl_->step = step;
}
const StepReport& Manager::last_step() const { return impl_->report; }
void Manager::set_user_state(std::function<std::string()> save, std::function<void(const std::string&)> load) {
  impl_->save_user = std::move(save);
  impl_->load_user = std::move(load);
}
const std::string& Manager::replica_group() const { return impl_->group; }

ReplicaSampler::ReplicaSampler(int64_t dataset_size, int64_t groups, int64_t group_index, int rank, int world_size,
                               int64_t batch_size)
    : batch_(batch_size) {
  SHARDTORCH_CHECK(groups > 0 && group_index >= 0 && group_index < groups && world_size > 0 && rank >= 0 &&
                       rank < world_size && batch_size > 0,
                   "shardtorch::ft::ReplicaSampler: group ", group_index, " of ", groups, ", rank ", rank, " of ",
                   world_size, ", batch ", batch_size, ": out of range");
  const int64_t part = dataset_size / groups, sub = part / world_size;
  SHARDTORCH_CHECK(sub > 0, "shardtorch::ft::ReplicaSampler: ", dataset_size, " samples are too few for ", groups,
                   " groups of ", world_size, " ranks");
  begin_ = group_index * part + rank * sub;
  length_ = sub;
}

std::vector<int64_t> ReplicaSampler::batch(int64_t step) const {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < batch_; ++i) out.push_back(begin_ + (step * batch_ + i) % length_);
  return out;
}

}  // namespace shardtorch::ft
