#pragma once
// Full state dicts of sharded models in safetensors: the parameters (in the
// master dtype: fp32 under mixed precision) and buffers under the module's own
// names, the format PyTorch's `safetensors.torch.load_file` +
// `load_state_dict` read. Saving gathers one flat parameter at a time (memory
// stays bounded) and rank 0 writes atomically; loading works at any world size
// and strategy: every rank reads only its own shard's elements.
#include <torch/arg.h>
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <vector>

#include "shardtorch/checkpoint/safetensors.h"
#include "shardtorch/export.h"
#include "shardtorch/log.h"
#include "shardtorch/optim.h"

namespace shardtorch {

/// How loading treats what the caller may choose.
struct SHARDTORCH_API LoadOptions {
  /// A saved tensor whose dtype differs from the model's is cast when
  /// checkpoint::is_safe_cast allows it (the same dtype, floating point to
  /// floating point, an integer to a dtype that holds all its values);
  /// otherwise (floating point into an integer buffer, an integer into a
  /// narrower one) the load is refused, naming the tensor and both dtypes,
  /// unless this is true: then it is cast as `Tensor::copy_` casts.
  TORCH_ARG(bool, allow_lossy_casts) = false;
  /// A parameter tied under several names (tok_emb.weight and head.weight)
  /// may be held under two or more of them (a checkpoint of a model that did
  /// not tie them): their values must then be equal, or the load is refused
  /// naming both. A name listed here is what its parameter is loaded from,
  /// and the others it is held under are neither read nor compared. Each
  /// must be a name of a tied parameter of the model that the checkpoint
  /// holds, one per parameter at most.
  TORCH_ARG(std::vector<std::string>, tied_from) = {};
  /// Progress reports of this call (shardtorch/log.h); unset: the
  /// library-wide set_progress_callback, else the default printing.
  TORCH_ARG(ProgressCallback, progress) = nullptr;
};

/// Collective. Rank 0 writes `path`; tied parameters appear under each of their names.
SHARDTORCH_API void save_full_state_dict(torch::nn::Module& root, const std::string& path,
                                         const std::map<std::string, std::string>& metadata = {});
/// Collective. Every rank reads `path` (a shared file system, or a copy per
/// node) and takes its shards; missing or mis-shaped entries are errors naming
/// the file and the parameter. Every rank checks first and the ranks agree: a
/// problem on any rank throws on every rank, with no rank's model changed.
SHARDTORCH_API void load_full_state_dict(torch::nn::Module& root, const std::string& path,
                                         const LoadOptions& options = {});

/// Sharded checkpoints: DIR/rank-R.safetensors holds the element ranges of the
/// parameters (master dtype) and of the optimizer state that rank R owns;
/// DIR/index.json (format version, world size, strategy, step, every
/// parameter's and buffer's shape, and for every tensor the parameter, kind
/// and element range it holds, and every file's size and checksum) says where
/// everything is. Written into DIR.shardtorch-tmp, then swapped in as DIR. Loading works at any world size and
/// strategy: each rank reads the ranges that overlap what it owns now. Collective. `optimizer` may be null (parameters
/// and buffers only). `user_state`: the application's own state to resume with (data-loader position, epoch, RNG seed,
/// learning-rate schedule, ...), strings by key, stored in the index and published atomically with the tensors. It must
/// be the same on every rank (checked: otherwise every rank fails naming the key and the ranks); derive per-rank
/// positions from global ones.
SHARDTORCH_API void save_sharded_checkpoint(torch::nn::Module& root, ShardedOptimizer* optimizer,
                                            const std::string& dir, int64_t step,
                                            const std::map<std::string, std::string>& user_state = {});
/// Collective; returns the saved step. With an optimizer, its state is
/// restored too (the checkpoint must hold state of the same kinds; one with
/// none leaves the optimizer with none). With `user_state`, it receives what
/// was saved (empty for checkpoints without). As for full state dicts, a
/// problem any rank finds (a bad file, a shape that differs, ranks reading
/// different checkpoints) throws on every rank before anything changes.
/// `DIR` is replaced only if it is a checkpoint or an empty directory.
SHARDTORCH_API int64_t load_sharded_checkpoint(torch::nn::Module& root, ShardedOptimizer* optimizer,
                                               const std::string& dir,
                                               std::map<std::string, std::string>* user_state = nullptr,
                                               const LoadOptions& options = {});
/// Whether a sharded checkpoint can be loaded from `dir`: it has an index, or
/// a save interrupted on a file system without RENAME_EXCHANGE left the
/// previous checkpoint aside (`dir`.shardtorch-old), which loading then takes.
/// Use it, not a test of the directory, to decide whether to resume.
SHARDTORCH_API bool sharded_checkpoint_exists(const std::string& dir);
/// Offline: every (parameter or buffer, kind) of a sharded checkpoint
/// assembled whole, keyed "name|kind" (kinds: param, buffer, exp_avg, ...),
/// in its saved dtype. Refuses what load_sharded_checkpoint refuses of the
/// checkpoint itself (a bad index or file, ranges that do not tile, a tensor
/// of a file the index does not list, ranges of one tensor in two dtypes).
SHARDTORCH_API std::map<std::string, at::Tensor> read_sharded_checkpoint(const std::string& dir);

}  // namespace shardtorch
