// The fault-tolerance manager of one rank: its step's state machine, and the
// parts it drives, each in a file of its own: the quorum requests
// (quorum_requests.h) and where their answers come from (quorum_source.h,
// quorum.h), group rank 0's lighthouse client, heartbeats and store
// (group_primary.h), the cross-replica group (cross_replica_group.h), the
// gradient hook (replica_hook.h) and the heals (heal.h). What a step does:
// docs/fault_tolerance.md.
//
//   Phase:  Idle --begin_step (start_step)--> Computing
//           Computing --begin_decision (should_commit)--> Deciding
//           Deciding --end_decision (committed, not committed, or thrown)--> Idle
#include "shardtorch/ft.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <cstdlib>

#include "base/check.h"
#include "base/env.h"
#include "base/errors.h"
#include "ft/cross_replica_group.h"
#include "ft/group_primary.h"
#include "ft/heal.h"
#include "ft/quorum.h"
#include "ft/quorum_requests.h"
#include "ft/quorum_source.h"
#include "ft/replica_hook.h"
#include "ft/util.h"
#include "optim/replica_optimizer.h"
#include "shard/replica_model.h"
#include "shardtorch/sharded_model.h"

namespace shardtorch::ft {

using detail::Quorum;

struct Manager::Impl : detail::StepLink {
  enum class Phase { Idle, Computing, Deciding };

  Impl(std::shared_ptr<World> w, torch::nn::Module& r, ShardedOptimizer& o, ManagerOptions opts)
      : world(std::move(w)),
        options(std::move(opts)),
        model(r, "shardtorch::ft::Manager"),
        transfer(model, shardtorch::detail::ReplicaOptimizer(o), options.timeout()),
        cross(options.host(), options.timeout()) {}
  // Also runs when the Manager's constructor throws: stops the threads it
  // started and takes its hook off the model (which may train on, or get
  // another Manager).
  ~Impl() override;

  // ---- set up by the constructor
  std::shared_ptr<World> world;
  ManagerOptions options;
  shardtorch::detail::ReplicaModel model;
  detail::Identity me;
  detail::FtLog log;
  detail::StateTransfer transfer;
  detail::CrossReplicaGroup cross;
  std::unique_ptr<detail::GroupPrimary> primary;  // group rank 0's
  std::unique_ptr<detail::QuorumSource> source;
  std::unique_ptr<detail::QuorumRequests> requests;
  c10d::CommHookInterface* hook = nullptr;  // the hook registered on the model, while it is there

  // ---- the step
  Phase phase = Phase::Idle;
  int64_t step = 0;
  StepReport report;
  detail::StepErrors errors;  // of this step's cross-replica work

  // The transitions of the state machine above; each checks its source state.
  void begin_step();
  void begin_decision();
  void end_decision();

  const Quorum& wait_quorum() override;
  c10d::Backend* cross_group() override { return cross.backend(); }
  void fail_step(const std::string& why) override { errors.fail(why); }
  Quorum run_quorum(const detail::Ask& ask, const std::atomic<bool>& cancelled);
  std::string exchange(const Quorum& q, StepReport& rep);
  bool vote(bool ok);
  void settle(const Quorum& q, StepReport& rep, const std::string& error, int64_t before_heal);
  std::string where() const { return "group '" + me.group + "', rank " + std::to_string(world->rank()); }
};

// ---- setting up

namespace {

// Fills in the options from the environment and checks them; returns the
// restart count.
int resolve_options(ManagerOptions& o, int rank) {
  using shardtorch::detail::env;
  if (o.lighthouse().empty())
    o.lighthouse(env("SHARDTORCH_FT_LIGHTHOUSE").value_or(env("TORCHFT_LIGHTHOUSE").value_or("")));
  if (o.replica_group().empty())
    o.replica_group(env("SHARDTORCH_FT_REPLICA_GROUP").value_or(env("REPLICA_GROUP_ID").value_or("")));
  SHARDTORCH_CHECK(!o.replica_group().empty(), "shardtorch::ft::Manager: rank ", rank,
                   ": no replica group name: pass ManagerOptions::replica_group or set SHARDTORCH_FT_REPLICA_GROUP "
                   "(the same on every rank of a group and across its restarts)");
  SHARDTORCH_CHECK(o.replica_group().find(':') == std::string::npos, "shardtorch::ft::Manager: replica group name '",
                   o.replica_group(), "' contains ':'");
  return std::atoi(env("TORCHELASTIC_RESTART_COUNT").value_or("0").c_str());
}

// Every rank of the group must agree on the group name and the incarnation;
// group rank 0 names the replica and starts its services, and the others
// learn the replica's id from it (they find it among the quorum's participants).
void agree_on_identity(Manager::Impl& m, int restarts) {
  auto& me = m.me;
  Comm& comm = m.world->comm();
  auto names = comm.all_gather_strings(me.group + "/" + std::to_string(restarts), "shardtorch::ft group name");
  for (size_t r = 0; r < names.size(); ++r)
    SHARDTORCH_CHECK(names[r] == names[0], "shardtorch::ft::Manager: ranks 0 and ", r,
                     " of one World name different replica groups or restarts: '", names[0], "' and '", names[r], "'");
  me.key_prefix = "shardtorch-ft/" + me.group + "/incarnation" + std::to_string(restarts) + "/";
  if (m.world->rank() == 0) {
    const auto& o = m.options;
    me.replica_id = me.group + ":" + detail::random_hex(12);
    m.primary = std::make_unique<detail::GroupPrimary>(o.lighthouse(), o.host(), o.timeout(), me.replica_id,
                                                       o.heartbeat_interval());
  }
  me.replica_id = comm.all_gather_strings(me.replica_id, "shardtorch::ft replica id")[0];
}

// Registers the hook and starts the quorum worker.
void start(Manager::Impl& m, torch::nn::Module& root) {
  auto h = std::make_unique<detail::ReplicaHook>(&m, sharded_model(root).comm_hook_group());
  c10d::CommHookInterface* registered = h.get();
  sharded_model(root).register_comm_hook(std::move(h));
  m.hook = registered;
  m.source = std::make_unique<detail::QuorumSource>(m.world, m.primary.get(), m.me, m.options.quorum_timeout());
  std::function<void()> cancel, allow;
  if (auto* p = m.primary.get()) {
    cancel = [p] { p->lighthouse().cancel_quorum(); };
    allow = [p] { p->lighthouse().allow_quorum(); };
  }
  m.requests = std::make_unique<detail::QuorumRequests>(
      [&m](const detail::Ask& a, const std::atomic<bool>& cancelled) { return m.run_quorum(a, cancelled); },
      std::move(cancel), std::move(allow));
}

}  // namespace

Manager::Impl::~Impl() {
  requests.reset();  // first: its worker uses the rest
  primary.reset();
  // The hook points here: off the model before this goes.
  model.unregister_comm_hook(hook);
}

// ---- the step

void Manager::Impl::begin_step() {
  SHARDTORCH_CHECK(phase == Phase::Idle, "shardtorch::ft: ", where(),
                   ": start_step() twice without should_commit() between them");
  // An optimizer that steps during the backward would update before the vote.
  SHARDTORCH_CHECK(!model.optimizer_steps_in_backward(), "shardtorch::ft: ", where(),
                   ": the optimizer steps during the backward (ShardedOptimizer::"
                   "overlap_with_backward), before the group votes on the step: turn the overlap off under fault "
                   "tolerance, where should_commit() decides whether the optimizer steps");
  phase = Phase::Computing;
  errors.clear();
}

void Manager::Impl::begin_decision() {
  SHARDTORCH_CHECK(phase == Phase::Computing, "shardtorch::ft: ", where(), ": should_commit() without start_step()");
  phase = Phase::Deciding;
}

void Manager::Impl::end_decision() {
  TORCH_INTERNAL_ASSERT(phase == Phase::Deciding, "shardtorch::ft: end_decision while not deciding");
  phase = Phase::Idle;
}

const Quorum& Manager::Impl::wait_quorum() {
  // run_quorum's own waits are bounded (quorum_timeout, timeout); this adds a margin.
  const auto bound = options.quorum_timeout() + 2 * options.timeout() + std::chrono::seconds(10);
  SHARDTORCH_CHECK(requests && requests->requested() != detail::Requested::None,
                   "shardtorch::ft: Manager::start_step() was not called before this backward or "
                   "should_commit() (",
                   where(), ")");
  SHARDTORCH_CHECK(requests->wait(bound), "shardtorch::ft: ", where(), ": the quorum of step ", step,
                   " did not finish within ", bound.count(), " ms");
  return requests->get();
}

// On the worker thread: the quorum, then this rank's cross-replica group for it.
Quorum Manager::Impl::run_quorum(const detail::Ask& ask, const std::atomic<bool>& cancelled) {
  Quorum q = detail::compute_quorum(source->text(ask, cancelled), me.replica_id);
  if (!q.error.empty() || cancelled) return q;
  try {
    cross.configure(q, world->rank());
  } catch (const std::exception& e) {
    q.error = "could not build the cross-replica group of quorum " + std::to_string(q.id) + " " +
              detail::join(detail::names(q)) + ": " + shardtorch::detail::message_of(e);
  }
  return q;
}

// The step's cross-replica work once the quorum holds: the reductions'
// outcome, then the heals. Returns why the step cannot commit ("" it can).
std::string Manager::Impl::exchange(const Quorum& q, StepReport& rep) {
  for (int i : q.counted) rep.counted.push_back(q.participants[static_cast<size_t>(i)].group);
  for (auto [h, s] : q.heals) rep.healed.push_back(q.participants[static_cast<size_t>(h)].group);
  std::string error = errors.first();
  if (error.empty() && !q.heals.empty() && cross.backend()) {
    try {
      transfer.heal(q, *cross.backend(), step, log);
    } catch (const std::exception& e) {
      error = std::string("the heal failed: ") + shardtorch::detail::message_of(e);
    }
  }
  return error;
}

// Every rank of the group votes, inside the group (its own world); a group
// of one rank decides alone. True when every rank's `ok` is.
bool Manager::Impl::vote(bool ok) {
  if (world->size() == 1) return ok;
  // On the group's device: NCCL reduces device memory only.
  at::Tensor t = at::full({1}, ok ? 1 : 0, at::kInt).to(world->comm().device());
  world->comm().all_reduce(t, c10d::ReduceOp::MIN, "shardtorch::ft vote");
  return t.item<int>() == 1;
}

// After the vote: the step counts, or every rank goes back to where it was.
void Manager::Impl::settle(const Quorum& q, StepReport& rep, const std::string& error, int64_t before_heal) {
  if (rep.committed) {
    // Every rank of the group received its state (the vote says so): the
    // full parameters made from the old shards go (collective in the group).
    if (detail::heals_me(q)) model.replace_end();
    ++step;
    if (q.rebuilt && primary) primary->drop_old_rendezvous(cross.name(), log);
    return;
  }
  // Every rank of the group drops its cross-replica group, its own part
  // failed or not: group rank 0's next request says it holds none, and
  // every rank of every group in the next quorum builds a new one.
  cross.drop();
  // Another rank of the group may not have received its state: this rank
  // goes back to its own step, so that the next quorum heals the group again.
  if (detail::heals_me(q)) rep.step = step = before_heal;
  rep.error = error.empty() ? "another rank of the group failed" : error;
  log("step " + std::to_string(rep.step) + " not committed: " + rep.error);
}

// ---- Manager

Manager::Manager(std::shared_ptr<World> world, torch::nn::Module& root, ShardedOptimizer& opt, ManagerOptions options)
    : impl_(std::make_unique<Impl>(std::move(world), root, opt, std::move(options))) {
  Impl& m = *impl_;
  const int restarts = resolve_options(m.options, m.world->rank());
  m.me.group = m.options.replica_group();
  m.me.restarted = m.options.restarted().value_or(restarts > 0);
  m.log = detail::FtLog(m.options.log() && m.world->rank() == 0, m.me.group);
  m.me.config = detail::describe_config(root, m.model.options(), shardtorch::detail::ReplicaOptimizer(opt).describe(),
                                        m.world->size());
  agree_on_identity(m, restarts);
  start(m, root);
  m.log("replica " + m.me.replica_id + " (" + detail::config_text(m.me.config) + ")" +
        (m.me.restarted ? ", restarted" : "") + ", lighthouse " +
        (m.primary ? m.primary->lighthouse().address() : std::string("-")));
}

std::vector<std::string> detail::served_store_keys(const Manager& m) {
  return m.impl_->primary ? m.impl_->primary->store_keys() : std::vector<std::string>{};
}

Manager::~Manager() = default;

void Manager::start_step() {
  Impl& m = *impl_;
  m.begin_step();
  auto& r = *m.requests;
  if (r.requested() == detail::Requested::NextStep) {
    if (r.asked().step == m.step) {  // what start_step() would ask
      r.take();
      return;
    }
    // set_step() moved the step after the request went out: a quorum with
    // the old step may already have reached the other groups, which would
    // then wait for this rank in their all-reduce. Drop the cross-replica
    // group, so that they fail at once, and ask again.
    r.abandon();
    m.cross.drop();
  }
  r.ask(m.step, m.cross.name());
}

bool Manager::should_commit() {
  Impl& m = *impl_;
  m.begin_decision();
  struct Leave {
    Impl& m;
    ~Leave() { m.end_decision(); }
  } leave{m};
  const Quorum& q = m.wait_quorum();
  StepReport rep;
  rep.step = m.step;
  rep.quorum_id = q.id;
  rep.reconfigured = q.rebuilt;
  if (q.fatal) {
    // Every rank of every group computes the same: each throws the same error.
    m.report = rep;
    m.report.error = q.error;
    const std::string said = "shardtorch::ft: ";  // the lighthouse client's errors begin with it too: said once
    SHARDTORCH_CHECK(false, said, m.where(), ": ", q.error.rfind(said, 0) == 0 ? q.error.substr(said.size()) : q.error);
  }
  rep.refused = q.refused;
  const int64_t before_heal = m.step;
  const std::string error = q.error.empty() ? m.exchange(q, rep) : q.error;
  // Dropped now, not after the vote: peers still waiting on this rank see
  // its connections close and fail at once instead of at their timeout.
  if (!error.empty()) m.cross.drop();
  rep.step = m.step;  // a healed group's is its source's
  rep.committed = m.vote(error.empty());
  m.settle(q, rep, error, before_heal);
  if (m.report.quorum_id != rep.quorum_id && error.empty())
    m.log("quorum " + std::to_string(q.id) + ": " + detail::join(rep.counted) + " counted" +
          (rep.healed.empty() ? "" : ", " + detail::join(rep.healed) + " healed") + " at step " +
          std::to_string(rep.step) +
          (q.refused.empty()
               ? ""
               : "; refused " + detail::join(q.refused) + ", configured differently (" + q.refusal + ")"));
  m.report = rep;
  // The next step's quorum, asked for now with what start_step() would send
  // (the step and the group held are final here): it runs during the
  // optimizer step, the data loading and the next forward.
  if (m.options.prefetch_quorum()) m.requests->prefetch(m.step, m.cross.name());
  return rep.committed;
}

int64_t Manager::step() const { return impl_->step; }
void Manager::set_step(int64_t step) {
  SHARDTORCH_CHECK(step >= 0 && impl_->phase == Impl::Phase::Idle, "shardtorch::ft::Manager::set_step(", step,
                   "): a step count (>= 0) between steps");
  impl_->step = step;
}
const StepReport& Manager::last_step() const { return impl_->report; }
void Manager::set_user_state(std::function<std::string()> save, std::function<void(const std::string&)> load) {
  impl_->transfer.set_user_state({std::move(save), std::move(load)});
}
const std::string& Manager::replica_group() const { return impl_->me.group; }

}  // namespace shardtorch::ft
