#include "checkpoint/model_load.h"

#include "base/text.h"
#include "runtime/flat_param.h"

#include "shardtorch/checkpoint/safetensors.h"

namespace shardtorch::checkpoint {
using detail::shape_text;

LoadRun::LoadRun(torch::nn::Module& root, const char* operation, const std::string& path,
                 const ProgressCallback& callback, World* world_arg)
    : state(detail::require_state(root, operation)),
      progress(operation, "tensors", 0, 0, callback),
      world(world_arg ? world_arg : &state->world()),
      file_waits(*state, operation, world_arg),
      what(std::string("shardtorch::") + operation + " '" + path + "'") {
  progress.count_io();
  state->copies().wait_for_offload_copies();
  no_grad.emplace();
}

void LoadRun::finish() { detail::load_agreed(*state, error, fingerprint, changes, what, world, &progress); }

void require_shape(const std::string& where, const std::string& named, const std::string& in_file,
                   c10::IntArrayRef saved, c10::IntArrayRef want, const char* kind) {
  if (saved != want)
    throw SafetensorsError(where + ": " + named + " has shape " + shape_text(saved) + in_file + " but the model's " +
                           kind + " has shape " + shape_text(want) +
                           " (is the model built with the checkpoint's configuration?)");
}

std::string shapes_differ(const std::string& name, const std::map<std::string, std::vector<int64_t>>& saved,
                          const std::map<std::string, std::vector<int64_t>>& model) {
  std::vector<std::string> others;
  for (const auto& [n, shape] : saved) {
    auto it = model.find(n);
    if (n != name && it != model.end() && it->second != shape) others.push_back(n);
  }
  return "'" + name + "' has shape " + shape_text(saved.at(name)) + " in the checkpoint but the model's has " +
         shape_text(model.at(name)) + detail::and_more(others, "differ") +
         "; is the model built with the checkpoint's configuration?";
}

void require_castable(const std::string& where, const std::string& named, const std::string& saved_text,
                      const std::string& in_file, at::ScalarType saved, at::ScalarType dtype, const char* kind,
                      bool allow_lossy, const char* options) {
  if (!allow_lossy && !is_safe_cast(saved, dtype))
    throw SafetensorsError(where + ": " + named + " is " + saved_text + in_file + " but the model's " + kind + " is " +
                           dtype_text(dtype) + ", and a cast from " + saved_text + " to " + dtype_text(dtype) +
                           " can change values: refused (" + options + "().allow_lossy_casts(true) casts anyway)");
}

void for_each_flat_param(detail::ShardState& state, const std::function<void(FlatParam&, size_t, int, bool)>& piece) {
  const int rank = state.topology().shard_comm().rank();
  const bool checks_empty = state.world().rank() == 0;
  for (auto& u : state.units().all())
    for (auto& f : u->flats())
      for (size_t i = 0; i < f->params().size(); ++i) piece(*f, i, rank, checks_empty);
}

}  // namespace shardtorch::checkpoint
