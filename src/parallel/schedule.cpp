// Pipeline schedules: the compute order of each rank (docs/parallelism.md,
// "Schedules"), the transfers that order needs, and a simulation on paper.
#include "shardtorch/schedule.h"

#include <algorithm>
#include <cctype>
#include <sstream>
#include <tuple>

#include "base/check.h"

namespace shardtorch {

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::GPipe:
      return "gpipe";
    case Schedule::OneFOneB:
      return "1f1b";
    case Schedule::Interleaved1F1B:
      return "interleaved_1f1b";
  }
  return "?";
}

Schedule parse_schedule(const std::string& name) {
  std::string n;
  for (char c : name) n += c == '-' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (n == "gpipe") return Schedule::GPipe;
  if (n == "1f1b" || n == "one_f_one_b" || n == "onefoneb") return Schedule::OneFOneB;
  if (n == "interleaved_1f1b" || n == "interleaved") return Schedule::Interleaved1F1B;
  SHARDTORCH_CHECK(false, "shardtorch: unknown pipeline schedule '", name,
                   "'; expected gpipe, 1f1b or interleaved_1f1b");
}

namespace pipeline {

std::string Action::str() const {
  const std::string at = std::to_string(stage) + "." + std::to_string(microbatch);
  switch (kind) {
    case ActionKind::Unshard:
      return "unshard";
    case ActionKind::Forward:
      return "F" + at;
    case ActionKind::Backward:
      return "B" + at + (reduce ? "+reduce" : "");
    case ActionKind::RecvActivation:
      return "recvA" + at + "<" + std::to_string(peer_stage);
    case ActionKind::SendActivation:
      return "sendA" + at + ">" + std::to_string(peer_stage);
    case ActionKind::RecvGradient:
      return "recvG" + at + "<" + std::to_string(peer_stage);
    case ActionKind::SendGradient:
      return "sendG" + at + ">" + std::to_string(peer_stage);
    case ActionKind::SyncTied:
      return "sync_tied";
    case ActionKind::Reshard:
      return "reshard";
  }
  return "?";
}

bool Action::operator==(const Action& o) const {
  return std::tie(kind, stage, microbatch, peer_stage, reduce) ==
         std::tie(o.kind, o.stage, o.microbatch, o.peer_stage, o.reduce);
}

std::string Plan::str() const {
  std::ostringstream os;
  for (size_t r = 0; r < actions.size(); ++r) {
    os << "rank " << r << ":";
    for (const auto& a : actions[r]) os << " " << a.str();
    os << "\n";
  }
  return os.str();
}

std::vector<Action> Plan::compute(int rank) const {
  std::vector<Action> out;
  for (const auto& a : actions.at(rank))
    if (a.kind == ActionKind::Forward || a.kind == ActionKind::Backward) out.push_back(a);
  return out;
}

namespace {

Action compute_action(ActionKind kind, int stage, int mb) {
  Action a;
  a.kind = kind;
  a.stage = stage;
  a.microbatch = mb;
  return a;
}

// The compute order of pipeline rank r (stages as global indices).
std::vector<Action> compute_order(Schedule schedule, int p, int v, int m, int r) {
  std::vector<Action> out;
  auto F = [&](int chunk, int mb) { out.push_back(compute_action(ActionKind::Forward, chunk * p + r, mb)); };
  auto B = [&](int chunk, int mb) { out.push_back(compute_action(ActionKind::Backward, chunk * p + r, mb)); };
  if (schedule == Schedule::GPipe) {
    for (int mb = 0; mb < m; ++mb) F(0, mb);
    for (int mb = 0; mb < m; ++mb) B(0, mb);
    return out;
  }
  if (schedule == Schedule::OneFOneB) {
    const int warmup = std::min(p - 1 - r, m);
    for (int mb = 0; mb < warmup; ++mb) F(0, mb);
    for (int i = 0; i < m - warmup; ++i) {
      F(0, warmup + i);
      B(0, i);
    }
    for (int mb = m - warmup; mb < m; ++mb) B(0, mb);
    return out;
  }
  // Interleaved 1F1B: the k-th forward of a rank is micro-batch
  // (k / (p v)) p + k % p of chunk (k / p) % v; the k-th backward runs the
  // chunks in the reverse order. A warm-up of 2 (p - 1 - r) + (v - 1) p
  // forwards, then one forward and one backward in turn.
  const int total = m * v;
  auto chunk_of = [&](int k, bool forward) {
    const int c = (k % (p * v)) / p;
    return forward ? c : v - 1 - c;
  };
  auto mb_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  const int warmup = std::min(2 * (p - 1 - r) + (v - 1) * p, total);
  for (int k = 0; k < warmup; ++k) F(chunk_of(k, true), mb_of(k));
  for (int i = 0; i < total - warmup; ++i) {
    F(chunk_of(warmup + i, true), mb_of(warmup + i));
    B(chunk_of(i, false), mb_of(i));
  }
  for (int k = total - warmup; k < total; ++k) B(chunk_of(k, false), mb_of(k));
  return out;
}

Action transfer(ActionKind kind, int stage, int mb, int peer) {
  Action a = compute_action(kind, stage, mb);
  a.peer_stage = peer;
  return a;
}

}  // namespace

Plan make_plan(Schedule schedule, int ranks, int chunks, int microbatches, PlanOptions options) {
  SHARDTORCH_CHECK(ranks >= 1 && chunks >= 1 && microbatches >= 1,
                   "shardtorch: a pipeline plan needs at least one rank, ", "chunk and micro-batch (got ", ranks,
                   " ranks, ", chunks, " chunks, ", microbatches, " micro-batches)");
  if (schedule == Schedule::Interleaved1F1B) {
    SHARDTORCH_CHECK(chunks >= 2, "shardtorch: the interleaved 1F1B schedule needs at least 2 chunks per rank (got ",
                     chunks, "); with one chunk use 1f1b");
    SHARDTORCH_CHECK(microbatches % ranks == 0, "shardtorch: the interleaved 1F1B schedule needs a number of ",
                     "micro-batches that is a multiple of the pipeline ranks (got ", microbatches, " for ", ranks,
                     " ranks)");
  } else {
    SHARDTORCH_CHECK(chunks == 1, "shardtorch: the ", schedule_name(schedule),
                     " schedule runs one chunk per rank (got ", chunks, "); for several use interleaved_1f1b");
  }
  Plan plan;
  plan.schedule = schedule;
  plan.ranks = ranks;
  plan.chunks = chunks;
  plan.microbatches = microbatches;
  const int stages = ranks * chunks;
  plan.actions.resize(ranks);
  for (int r = 0; r < ranks; ++r) {
    const auto order = compute_order(schedule, ranks, chunks, microbatches, r);
    std::vector<Action>& out = plan.actions[r];
    // The rank's chunks are one sharded model: its last backward reduces
    // the gradients of every chunk.
    size_t last_backward = order.size();
    for (size_t i = 0; i < order.size(); ++i)
      if (order[i].kind == ActionKind::Backward) last_backward = i;
    if (options.gathers) out.push_back(compute_action(ActionKind::Unshard, -1, -1));
    // The receive of a compute action's input is posted before the compute
    // action ahead of it, so that it arrives while that one runs.
    auto receive_for = [&](const Action& a, std::vector<Action>& into) {
      if (a.kind == ActionKind::Forward && a.stage > 0 && plan.rank_of(a.stage - 1) != r)
        into.push_back(transfer(ActionKind::RecvActivation, a.stage, a.microbatch, a.stage - 1));
      if (a.kind == ActionKind::Backward && a.stage < stages - 1 && plan.rank_of(a.stage + 1) != r)
        into.push_back(transfer(ActionKind::RecvGradient, a.stage, a.microbatch, a.stage + 1));
    };
    if (!order.empty()) receive_for(order[0], out);
    for (size_t i = 0; i < order.size(); ++i) {
      if (i + 1 < order.size()) receive_for(order[i + 1], out);
      Action a = order[i];
      if (i == last_backward) a.reduce = true;
      out.push_back(a);
      if (a.kind == ActionKind::Forward && a.stage < stages - 1 && plan.rank_of(a.stage + 1) != r)
        out.push_back(transfer(ActionKind::SendActivation, a.stage, a.microbatch, a.stage + 1));
      if (a.kind == ActionKind::Backward && a.stage > 0 && plan.rank_of(a.stage - 1) != r)
        out.push_back(transfer(ActionKind::SendGradient, a.stage, a.microbatch, a.stage - 1));
    }
    if (options.gathers) out.push_back(compute_action(ActionKind::Reshard, -1, -1));
    if (options.tied) out.push_back(compute_action(ActionKind::SyncTied, -1, -1));
  }
  return plan;
}

Plan make_forward_plan(int ranks, int chunks, int microbatches, PlanOptions options) {
  SHARDTORCH_CHECK(ranks >= 1 && chunks >= 1 && microbatches >= 1,
                   "shardtorch: a pipeline plan needs at least one rank, ", "chunk and micro-batch (got ", ranks,
                   " ranks, ", chunks, " chunks, ", microbatches, " micro-batches)");
  Plan plan;
  plan.schedule = chunks > 1 ? Schedule::Interleaved1F1B : Schedule::GPipe;
  plan.ranks = ranks;
  plan.chunks = chunks;
  plan.microbatches = microbatches;
  const int stages = ranks * chunks;
  plan.actions.resize(ranks);
  for (int r = 0; r < ranks; ++r) {
    auto& out = plan.actions[r];
    if (options.gathers) out.push_back(compute_action(ActionKind::Unshard, -1, -1));
    for (int mb = 0; mb < microbatches; ++mb)
      for (int c = 0; c < chunks; ++c) {
        const int s = c * ranks + r;
        if (s > 0 && plan.rank_of(s - 1) != r) out.push_back(transfer(ActionKind::RecvActivation, s, mb, s - 1));
        out.push_back(compute_action(ActionKind::Forward, s, mb));
        if (s < stages - 1 && plan.rank_of(s + 1) != r)
          out.push_back(transfer(ActionKind::SendActivation, s, mb, s + 1));
      }
    if (options.gathers) out.push_back(compute_action(ActionKind::Reshard, -1, -1));
  }
  return plan;
}

Simulation simulate(const Plan& plan, double forward, double backward) {
  const int p = plan.ranks, stages = plan.stages(), m = plan.microbatches;
  std::vector<std::vector<Action>> order(p);
  for (int r = 0; r < p; ++r) order[r] = plan.compute(r);
  // When each (kind, stage, micro-batch) finished; -1: not yet.
  auto key = [&](ActionKind k, int stage, int mb) {
    return (static_cast<size_t>(k == ActionKind::Backward) * stages + stage) * m + mb;
  };
  std::vector<double> done(2 * static_cast<size_t>(stages) * m, -1.0);
  Simulation sim;
  sim.busy.assign(p, 0.0);
  sim.times.resize(p);
  sim.peak_in_flight.assign(p, 0);
  std::vector<size_t> next(p, 0);
  std::vector<double> free_at(p, 0.0);
  std::vector<int> in_flight(p, 0);
  size_t remaining = 0;
  for (const auto& o : order) remaining += o.size();
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < p; ++r) {
      while (next[r] < order[r].size()) {
        const Action& a = order[r][next[r]];
        const bool fwd = a.kind == ActionKind::Forward;
        double ready = 0.0;
        if (fwd && a.stage > 0) ready = done[key(ActionKind::Forward, a.stage - 1, a.microbatch)];
        if (!fwd && a.stage < stages - 1) ready = done[key(ActionKind::Backward, a.stage + 1, a.microbatch)];
        if (!fwd && ready >= 0) ready = std::max(ready, done[key(ActionKind::Forward, a.stage, a.microbatch)]);
        if (ready < 0) break;  // its input is not produced yet
        const double start = std::max(free_at[r], ready), end = start + (fwd ? forward : backward);
        sim.times[r].push_back({start, end});
        done[key(a.kind, a.stage, a.microbatch)] = end;
        free_at[r] = end;
        sim.busy[r] += end - start;
        in_flight[r] += fwd ? 1 : -1;
        sim.peak_in_flight[r] = std::max(sim.peak_in_flight[r], in_flight[r]);
        ++next[r];
        --remaining;
        progressed = true;
      }
    }
    if (!progressed) {
      std::ostringstream os;
      os << "shardtorch: the " << schedule_name(plan.schedule) << " plan cannot finish: every rank waits (";
      for (int r = 0; r < p; ++r)
        if (next[r] < order[r].size()) os << "rank " << r << " at " << order[r][next[r]].str() << "; ";
      os << ")";
      SHARDTORCH_CHECK(false, os.str());
    }
  }
  sim.makespan = *std::max_element(free_at.begin(), free_at.end());
  for (int r = 0; r < p; ++r) sim.bubble.push_back(sim.makespan > 0 ? 1.0 - sim.busy[r] / sim.makespan : 0.0);
  return sim;
}

double theoretical_bubble(const Plan& plan) {
  const double p = plan.ranks, m = plan.microbatches, v = plan.chunks;
  return (p - 1) / (v * m + p - 1);
}

}  // namespace pipeline
}  // namespace shardtorch
