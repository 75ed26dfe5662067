#include "checkpoint/agreement.h"

#include <algorithm>
#include <exception>

#include "runtime/shard_state.h"
#include "checkpoint/safetensors_format.h"
#include "shardtorch/collectives.h"
#include "shardtorch/error.h"

namespace shardtorch::detail {

using checkpoint::SafetensorsError;

namespace {
// The collective's name without the path that `what` quotes ("shardtorch::load_full_state_dict '/a/b'"):
// ranks may read the same checkpoint through different paths, and with
// WorldOptions::check_collectives the name is part of the fingerprint.
std::string without_path(const std::string& what) {
  const auto quote = what.find(" '");
  return quote == std::string::npos ? what : what.substr(0, quote);
}
}  // namespace

std::vector<std::string> agreed_fingerprints(World& world, const std::string& error, const std::string& what,
                                             const std::string& fingerprint) {
  auto reports = world.comm().all_gather_strings(error.empty() ? "=" + fingerprint : "!" + error,
                                                 without_path(what) + ": agreement");
  for (size_t r = 0; r < reports.size(); ++r)
    if (!reports[r].empty() && reports[r][0] == '!')
      throw SafetensorsError(what + ": rank " + std::to_string(world.global_rank_of(static_cast<int>(r))) + ": " +
                             reports[r].substr(1));
  for (auto& report : reports) report.erase(0, 1);
  return reports;
}

void agree_on_errors(World& world, const std::string& error, const std::string& what, const std::string& fingerprint) {
  const auto prints = agreed_fingerprints(world, error, what, fingerprint);
  for (size_t r = 1; r < prints.size(); ++r)
    if (prints[r] != prints[0])
      throw SafetensorsError(what + ": rank " + std::to_string(world.global_rank_of(static_cast<int>(r))) + " read " +
                             prints[r] + " but rank " + std::to_string(world.global_rank_of(0)) + " read " + prints[0] +
                             " (every rank must see the same checkpoint)");
}

void agree_after_publish(World& world, const std::string& error, const std::string& what, const std::string& dir) {
  try {
    agree_on_errors(world, error, what);
  } catch (const SafetensorsError&) {  // a rank's own error: nothing was published
    throw;
  } catch (const CollectivesDiverged&) {
    throw;
  } catch (const Error& e) {  // the agreement's collective failed
    if (world.rank() != 0 || !error.empty()) throw;
    throw Error(std::string(e.what()) + " (rank 0 had published the checkpoint '" + dir +
                "' before this failure: it is complete and loads)");
  }
}

void load_agreed(ShardState& state, const std::string& error, const std::string& fingerprint,
                 const std::vector<std::function<void()>>& changes, const std::string& what, World* world,
                 ProgressReporter* progress) {
  World& over = world ? *world : state.world();
  agree_on_errors(over, error, what, fingerprint);
  state.optimizer().before_update();  // a snapshot being copied in the background is copied first
  if (progress) progress->set_totals(static_cast<int64_t>(changes.size()), 0);
  std::string failed;
  try {
    for (const auto& change : changes) {
      change();
      if (progress) progress->advance(1);
    }
  } catch (const std::exception& e) {
    failed = std::string(e.what()) + " (the model is partly loaded: load a checkpoint again before training)";
  }
  agree_on_errors(over, failed, what);
  state.optimizer().after_optimizer_step();  // persistent full buffers are rebuilt, stale full copies freed
  if (progress) progress->finish();
}

FileWaits::FileWaits(ShardState& state, const std::string& operation, World* also)
    : worlds_{&state.world()}, operation_(operation), exceptions_(std::uncaught_exceptions()) {
  if (also && also != &state.world()) worlds_.push_back(also);
  for (World* w : worlds_) w->note_progress(operation_);
  std::vector<Comm*> comms = state.topology().comms();
  if (also && std::find(comms.begin(), comms.end(), &also->comm()) == comms.end()) comms.push_back(&also->comm());
  for (Comm* c : comms) raised_.push_back(std::make_unique<Comm::TimeoutAtLeast>(*c, state.world().file_timeout()));
}

FileWaits::~FileWaits() {
  // While an exception unwinds, the record stays as the failure wrote it: a
  // new note would mark a survivor that gave up as running again, and a
  // slower survivor would blame it once it has exited.
  if (std::uncaught_exceptions() > exceptions_) return;
  try {
    for (World* w : worlds_) w->note_progress(operation_ + " done");
  } catch (const std::exception&) {  // a progress note is never worth a failure
  }
}

}  // namespace shardtorch::detail
