#include "agreement.h"

#include "../shard_state.h"
#include "safetensors_format.h"

namespace shardtorch::detail {

using checkpoint::SafetensorsError;

void agree_on_errors(World& world, const std::string& error, const std::string& what, const std::string& fingerprint) {
  const auto reports = world.comm().all_gather_strings(error.empty() ? "=" + fingerprint : "!" + error, what);
  for (size_t r = 0; r < reports.size(); ++r)
    if (!reports[r].empty() && reports[r][0] == '!')
      throw SafetensorsError(what + ": rank " + std::to_string(r) + ": " + reports[r].substr(1));
  for (size_t r = 1; r < reports.size(); ++r)
    if (reports[r] != reports[0])
      throw SafetensorsError(what + ": rank " + std::to_string(r) + " read " + reports[r].substr(1) + " but rank 0 read " +
                             reports[0].substr(1) + " (every rank must see the same checkpoint)");
}

void load_agreed(ShardState& state, const std::string& error, const std::string& fingerprint,
                 const std::vector<std::function<void()>>& changes, const std::string& what) {
  agree_on_errors(state.world(), error, what, fingerprint);
  std::string failed;
  try {
    for (const auto& change : changes) change();
  } catch (const std::exception& e) {
    failed = std::string(e.what()) + " (the model is partly loaded: load a checkpoint again before training)";
  }
  agree_on_errors(state.world(), failed, what);
  state.after_optimizer_step();  // persistent full buffers are rebuilt, stale full copies freed
}

FileWaits::FileWaits(ShardState& state) {
  for (Comm* c : state.topology().comms())
    raised_.push_back(std::make_unique<Comm::TimeoutAtLeast>(*c, state.world().file_timeout()));
}

}  // namespace shardtorch::detail
