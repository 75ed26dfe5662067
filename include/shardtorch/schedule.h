#pragma once
// Pipeline schedules as data: for each pipeline rank, the list of actions it
// runs in one training step (forwards and backwards of micro-batches, the
// sends and receives between stages, and for sharded stages the gathers and
// reductions). A Pipeline (shardtorch/pipeline.h) runs the list; a program
// or a test can print it, check it and simulate it (docs/parallelism.md).
//
// Stages and ranks: with `ranks` pipeline ranks and `chunks` model chunks
// per rank there are ranks x chunks stages, placed in loops: stage s runs on
// pipeline rank s % ranks as that rank's chunk s / ranks (Megatron-LM's and
// PyTorch's interleaved placement; with one chunk, stage s is rank s).
#include <cstdint>
#include <string>
#include <vector>

#include "shardtorch/export.h"

namespace shardtorch {

/// GPipe: every forward, then every backward (activation memory grows with
/// the micro-batches). OneFOneB: after a warm-up of (ranks - 1 - rank)
/// forwards each rank alternates one forward and one backward, so at most
/// ranks - rank micro-batches are in flight. Interleaved1F1B: 1F1B over
/// several chunks per rank (Megatron-LM's interleaved schedule), whose bubble
/// is the chunk count times smaller; the micro-batches must be a multiple of
/// the ranks.
enum class Schedule { GPipe, OneFOneB, Interleaved1F1B };

/// "gpipe", "1f1b", "interleaved_1f1b"
SHARDTORCH_API const char* schedule_name(Schedule s);
/// The names above (any case, '-' for '_', "interleaved" alone); throws on others.
SHARDTORCH_API Schedule parse_schedule(const std::string& name);

namespace pipeline {

enum class ActionKind {
  Unshard,         // all-gather the rank's parameters for the step (FullShard, HybridShard)
  Forward,         // the stage's forward of one micro-batch
  Backward,        // its backward (with `reduce`: the rank's last; gradients reduced over dp at its end)
  RecvActivation,  // post the receive of a forward's input from `peer_stage` (waited for by the Forward)
  SendActivation,  // send a forward's output to `peer_stage`
  RecvGradient,    // post the receive of the gradient of a forward's output from `peer_stage`
  SendGradient,    // send the gradient of a forward's input to `peer_stage`
  SyncTied,        // sum the gradients of parameters tied across stages (after every reduction)
  Reshard,         // free what Unshard gathered (after the reduction)
};

struct SHARDTORCH_API Action {
  ActionKind kind = ActionKind::Forward;
  int stage = -1;       // the stage it belongs to (-1: Unshard, Reshard, SyncTied, which are the rank's)
  int microbatch = -1;  // -1 for the actions of a whole step
  int peer_stage = -1;  // sends and receives: the other stage
  bool reduce = false;  // Backward: the rank's last backward of the step
  /// "F3.1" (forward of micro-batch 1 at stage 3), "B3.1", "B3.1+reduce",
  /// "recvA2.1<1" (receive stage 2's input of micro-batch 1 from stage 1),
  /// "sendA2.1>3", "recvG...", "sendG...", "unshard", "reshard", "sync_tied".
  std::string str() const;
  bool operator==(const Action& o) const;
};

struct SHARDTORCH_API PlanOptions {
  /// The rank gathers its parameters for the step and frees them after
  /// (FullShard, HybridShard): Unshard and Reshard actions.
  bool gathers = false;
  /// Some parameters are tied across stages on different ranks: SyncTied.
  bool tied = false;
};

struct SHARDTORCH_API Plan {
  Schedule schedule = Schedule::OneFOneB;
  int ranks = 1, chunks = 1, microbatches = 1;
  std::vector<std::vector<Action>> actions;  // by pipeline rank

  int stages() const { return ranks * chunks; }
  int rank_of(int stage) const { return stage % ranks; }
  int chunk_of(int stage) const { return stage / ranks; }
  /// One line per rank: "rank 0: unshard F0.0 sendA0.0>1 ...".
  std::string str() const;
  /// The compute actions (Forward, Backward) of `rank`, in order.
  std::vector<Action> compute(int rank) const;
};

/// The plan of `schedule` for `ranks` pipeline ranks with `chunks` chunks
/// each and `microbatches` micro-batches a step. Throws shardtorch::Error on
/// a combination the schedule does not support (GPipe and OneFOneB take one
/// chunk, Interleaved1F1B two or more and micro-batches a multiple of ranks).
SHARDTORCH_API Plan make_plan(Schedule schedule, int ranks, int chunks, int microbatches, PlanOptions options = {});

/// Forwards only (evaluation): every rank runs its stages' forwards of
/// micro-batch 0, then of 1, ..., with the transfers they need; `options`'
/// gathers add Unshard and Reshard, `tied` is ignored.
SHARDTORCH_API Plan make_forward_plan(int ranks, int chunks, int microbatches, PlanOptions options = {});

/// A plan run on paper: each rank runs its compute actions in order, a
/// forward taking `forward` time units and a backward `backward`, each
/// starting when its rank is free and its input has arrived (sends take no
/// time and never block).
struct SHARDTORCH_API Simulation {
  double makespan = 0;
  std::vector<double> busy;    // per rank: time computing
  std::vector<double> bubble;  // per rank: 1 - busy / makespan
  /// Per rank, per compute action (in plan order): start and end.
  std::vector<std::vector<std::pair<double, double>>> times;
  /// At most this many micro-batches forwarded and not yet backwarded, per rank
  /// (what bounds its activation memory).
  std::vector<int> peak_in_flight;
};
/// Throws shardtorch::Error naming the waiting actions if the plan cannot
/// finish (a rank waits for an input no rank will produce before it waits).
SHARDTORCH_API Simulation simulate(const Plan& plan, double forward = 1.0, double backward = 2.0);

/// The bubble theory gives for the plan's schedule: (p - 1) / (m + p - 1) for
/// GPipe and 1F1B, (p - 1) / (v m + p - 1) interleaved with v chunks (forward
/// and backward times in any ratio, transfers free).
SHARDTORCH_API double theoretical_bubble(const Plan& plan);

}  // namespace pipeline
}  // namespace shardtorch
