#pragma once
// Internal: what the loaders of a whole model's checkpoint share
// (load_full_state_dict, load_hf_checkpoint, load_dcp_checkpoint): check,
// agree, change, agree. Every rank checks what it will read before any value
// changes; a problem on any rank fails every rank with the model unchanged.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/agreement.h"
#include "runtime/shard_state.h"

namespace shardtorch::checkpoint {

/// One load of `root`, set up in this order: the model's state (its
/// require_state names `operation`), a progress reporter counting file
/// bytes, the file waits over `world` (null: the model's World), the
/// offloaded copies waited for, no grad. The check phase fills `changes`
/// (or `error`) and `fingerprint`; finish() runs the rest, collectively.
struct LoadRun {
  LoadRun(torch::nn::Module& root, const char* operation, const std::string& path, const ProgressCallback& callback,
          World* world);

  std::shared_ptr<detail::ShardState> state;
  detail::ProgressReporter progress;
  World* world;
  detail::FileWaits file_waits;
  std::optional<c10::NoGradGuard> no_grad;
  const std::string what;  // "shardtorch::<operation> '<path>'"
  std::vector<std::function<void()>> changes;
  std::string error, fingerprint;

  /// Collective over `world`: detail::load_agreed.
  void finish();
};

/// Calls piece(flat, i, shard_rank, checks_empty) for parameter i of every
/// flat parameter of a sharded (not replicated) `state`, in order;
/// `checks_empty` is true on the World's rank 0 (a parameter without
/// elements is no rank's piece: rank 0 checks it).
void for_each_flat_param(
    detail::ShardState& state,
    const std::function<void(FlatParam& flat, size_t i, int shard_rank, bool checks_empty)>& piece);

/// Throws SafetensorsError "<where>: <named> has shape S<in_file> but the
/// model's <kind> has shape W (...)" unless `saved` is `want`.
void require_shape(const std::string& where, const std::string& named, const std::string& in_file,
                   c10::IntArrayRef saved, c10::IntArrayRef want, const char* kind);

/// "'<name>' has shape S in the checkpoint but the model's has W", how many
/// other names that both hold differ too (`saved` against `model`), and the
/// question whether the model is built with the checkpoint's configuration.
std::string shapes_differ(const std::string& name, const std::map<std::string, std::vector<int64_t>>& saved,
                          const std::map<std::string, std::vector<int64_t>>& model);

/// Throws SafetensorsError when values saved as `saved` (named `saved_text`
/// in the checkpoint) could change cast into `dtype`, unless `allow_lossy`;
/// `options` names the options class ("LoadOptions") in the message.
void require_castable(const std::string& where, const std::string& named, const std::string& saved_text,
                      const std::string& in_file, at::ScalarType saved, at::ScalarType dtype, const char* kind,
                      bool allow_lossy, const char* options);

}  // namespace shardtorch::checkpoint
