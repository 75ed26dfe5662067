// Full state dicts: gathered one flat parameter at a time, written by rank 0;
// loaded by every rank reading only its own shard's elements.
#include <c10/core/GradMode.h>
#include "base/check.h"

#include <functional>
#include <optional>
#include <set>
#include <sstream>

#include "runtime/shard_state.h"
#include "checkpoint/agreement.h"
#include "checkpoint/reader_access.h"
#include "checkpoint/streamed_tensors.h"
#include "checkpoint/tied_names.h"
#include "shardtorch/checkpoint.h"

namespace shardtorch {
namespace {

using NameMap = std::map<const void*, std::vector<std::string>>;

}  // namespace

void save_full_state_dict(torch::nn::Module& root, const std::string& path,
                          const std::map<std::string, std::string>& user_metadata) {
  auto state = detail::require_state(root, "save_full_state_dict");
  detail::FileWaits file_waits(*state);  // the others wait for rank 0's writes and fsync
  World& world = state->world();
  // Checked on every rank before any collective (the metadata is the same on every rank).
  for (const auto& [key, value] : user_metadata) {
    SHARDTORCH_CHECK(key.rfind("shardtorch_", 0) != 0, "shardtorch::save_full_state_dict '", path, "': metadata key '",
                     key, "' is reserved (keys starting with shardtorch_ are the library's)");
    SHARDTORCH_CHECK(key != "format" || value == "pt", "shardtorch::save_full_state_dict '", path,
                     "': metadata \"format\" is \"pt\" (what Hugging Face's loaders require), not '", value, "'");
  }
  const bool writer = world.rank() == 0;
  c10::NoGradGuard no_grad;
  checkpoint::StreamedTensors tensors(root, *state, "save_full_state_dict", /*tied_once=*/false);

  std::string error;
  if (writer) {
    std::vector<checkpoint::PendingTensor> pending;
    for (const auto& t : tensors.items()) pending.push_back({t.name, t.dtype, t.shape, t.produce});
    // "format": "pt" is what Hugging Face's loaders require of a PyTorch
    // state dict; our own keys carry a prefix no user key may take.
    auto metadata = user_metadata;
    metadata["format"] = "pt";
    metadata["shardtorch_format"] = "full state dict v1";
    metadata["shardtorch_strategy"] = strategy_name(state->strategy());
    metadata["shardtorch_world_size"] = std::to_string(world.size());
    try {
      checkpoint::write_file(path, pending, metadata);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  tensors.finish();  // the other ranks (and rank 0, after a failed write) take part in the gathers
  auto status = at::full({1}, error.empty() ? 0 : 1, at::kInt).to(world.comm().device());
  world.comm().broadcast(status, 0, "save_full_state_dict status");
  SHARDTORCH_CHECK(error.empty(), "shardtorch::save_full_state_dict: ", error);
  SHARDTORCH_CHECK(status.cpu().item<int>() == 0, "shardtorch::save_full_state_dict: rank 0 could not write '", path,
                   "'");
}

void load_full_state_dict(torch::nn::Module& root, const std::string& path, const LoadOptions& options) {
  auto state = detail::require_state(root, "load_full_state_dict");
  detail::FileWaits file_waits(*state);
  state->wait_for_offload_copies();
  c10::NoGradGuard no_grad;
  const std::string what = "shardtorch::load_full_state_dict '" + path + "'";
  // Check, agree, change, agree (as load_sharded_checkpoint): every rank
  // validates the file and matches every name and shape before any value
  // changes; a problem on any rank fails every rank with the model unchanged.
  std::optional<checkpoint::Reader> reader;
  std::vector<std::function<void()>> changes;
  std::string error, fingerprint;
  try {
    state->check_outside_summon();
    reader.emplace(path);
    // What ranks reading their own copies can compare cheaply: the layout
    // and the metadata (where an application keeps its step).
    fingerprint = "a file of " + std::to_string(checkpoint::ReaderAccess::header(*reader).tensors.size()) +
                  " tensors from byte " + std::to_string(checkpoint::ReaderAccess::header(*reader).data_start);
    for (const auto& [k, v] : checkpoint::ReaderAccess::header(*reader).metadata) fingerprint += ", " + k + "=" + v;
    NameMap names = detail::parameter_names(root);
    const std::string file_where = "safetensors file '" + path + "'";
    constexpr const char* kOption = "LoadOptions().tied_from";
    checkpoint::check_tied_from(names, options.tied_from(), file_where, kOption);
    std::set<std::string> used;
    // The shape, and a dtype the values can be cast into (docs/checkpoints.md).
    auto check_shape = [&](const std::string& n, c10::IntArrayRef want, at::ScalarType dtype,
                           const char* what = "parameter") {
      const auto* r = checkpoint::ReaderAccess::header(*reader).find(n);
      if (c10::IntArrayRef(r->shape) != want) {
        std::ostringstream os;
        os << "safetensors file '" << path << "': '" << n << "' has shape " << c10::IntArrayRef(r->shape)
           << " but the model's " << what << " has " << want;
        throw checkpoint::SafetensorsError(os.str());
      }
      const at::ScalarType saved = checkpoint::scalar_type(r->dtype);
      if (!options.allow_lossy_casts() && !checkpoint::is_safe_cast(saved, dtype))
        throw checkpoint::SafetensorsError(
            "safetensors file '" + path + "': '" + n + "' is " + r->dtype + " but the model's " + what + " is " +
            checkpoint::dtype_text(dtype) + ", and a cast from " + r->dtype + " to " + checkpoint::dtype_text(dtype) +
            " can change values: refused (LoadOptions().allow_lossy_casts(true) casts anyway)");
    };
    // The name `p` is read from. Every name of it the file holds counts as
    // used; the others a tied parameter is held under must hold the same
    // values, compared over elements [first, first + count) here (each rank
    // compares its own part: every rank's error fails every rank).
    auto source_of = [&](const at::Tensor& p, c10::IntArrayRef shape, at::ScalarType dtype, int64_t first,
                         int64_t count) -> std::string {
      const auto& ns = names[p.unsafeGetTensorImpl()];
      for (const auto& n : ns) used.insert(n);
      auto t = checkpoint::tied_source(
          ns, [&](const std::string& n) { return reader->contains(n); }, options.tied_from(), file_where, kOption);
      if (!t)
        throw checkpoint::SafetensorsError(file_where + ": no entry for parameter '" +
                                           (ns.empty() ? std::string("?") : ns.front()) + "'");
      check_shape(t->source, shape, dtype);
      for (const auto& other : t->others) {
        check_shape(other, shape, dtype);
        if (count > 0)
          checkpoint::require_equal_tied(reader->read_range(t->source, first, count),
                                         reader->read_range(other, first, count), dtype, t->source, other, first,
                                         file_where, kOption);
      }
      return t->source;
    };
    checkpoint::Reader* file = &*reader;
    if (state->ddp()) {
      std::set<const void*> done;
      for (const auto& item : root.named_parameters()) {
        at::Tensor p = item.value();
        if (!done.insert(p.unsafeGetTensorImpl()).second) continue;  // tied: loaded once
        const auto [first, count] = checkpoint::share_of(p.numel(), state->world().rank(), state->world().size());
        std::string n = source_of(p, p.sizes(), state->record_of(p).scalar_type(), first, count);
        changes.push_back(
            [state, file, p, n] { state->load_record(p, file->read(n)); });  // the fp32 master under mixed precision
      }
    } else {
      const int rank = state->shard_comm().rank();
      for (auto& u : state->units())
        for (auto& f : u->flats())
          for (size_t i = 0; i < f->params().size(); ++i) {
            auto piece = f->layout().piece(i, rank);
            std::string n = source_of(f->params()[i], f->layout().shape(i), f->dtype(), piece ? piece->param_offset : 0,
                                      piece ? piece->length : 0);
            if (!piece) continue;
            at::Tensor dst = f->shard().narrow(0, piece->shard_offset, piece->length);
            changes.push_back([file, dst, n, piece]() mutable {
              dst.copy_(file->read_range(n, piece->param_offset, piece->length));
            });
          }
    }
    for (const auto& item : root.named_buffers()) {
      if (!item.value().defined()) continue;
      if (!reader->contains(item.key()))
        throw checkpoint::SafetensorsError("safetensors file '" + path + "': no entry for buffer '" + item.key() + "'");
      check_shape(item.key(), item.value().sizes(), item.value().scalar_type(), "buffer");
      used.insert(item.key());
      changes.push_back([file, b = item.value(), n = item.key()]() mutable { b.copy_(file->read(n)); });
    }
    for (const auto& t : checkpoint::ReaderAccess::header(*reader).tensors) {
      if (!used.count(t.name))
        throw checkpoint::SafetensorsError("safetensors file '" + path + "': unexpected tensor '" + t.name +
                                           "' (no parameter or buffer of the model has that name)");
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  detail::load_agreed(*state, error, fingerprint, changes, what);
}

}  // namespace shardtorch
