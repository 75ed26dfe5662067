#pragma once
// PyTorch distributed checkpoints (torch.distributed.checkpoint, "DCP"): a
// directory with a .metadata file (a pickle) and __R_K.distcp data files,
// as dcp.save writes them from FSDP2, torchtitan and the like. Loaded
// straight into a sharded model (each rank reads only the chunks and byte
// ranges that overlap its own shard) and saved from one (each rank writes
// its own data file, rank 0 the metadata), at any world size. The pickles
// are read by an allow-list reader that executes nothing.
// docs/checkpoints.md, "PyTorch distributed checkpoints", says what is read
// and written, what is refused, and how names and dtypes are matched.
#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shardtorch/checkpoint/safetensors.h"
#include "shardtorch/export.h"
#include "shardtorch/log.h"
#include "shardtorch/optim.h"

namespace shardtorch {

/// How a DCP checkpoint's keys become the model's names. The flattened
/// state dict `{"model": model_state, "optim": optimizer_state}` of
/// torch.distributed.checkpoint.state_dict.get_state_dict has keys
/// "model.<fqn>", "optim.state.<fqn>.<exp_avg|exp_avg_sq|step|...>" and
/// "optim.param_groups.<i>.<key>".
struct SHARDTORCH_API DcpLoadOptions {
  using NameFn = std::function<std::optional<std::string>(const std::string& checkpoint_name)>;
  using Predicate = std::function<bool(const std::string& model_name)>;

  /// The model's keys start with this ("" for a checkpoint of the model's
  /// state dict alone, e.g. dcp.save(model.state_dict(), dir)).
  TORCH_ARG(std::string, model_prefix) = "model.";
  /// The optimizer's: "<optimizer_prefix>state.<fqn>.<kind>". Keys under
  /// neither prefix are not read (DcpLoadReport::ignored lists them).
  TORCH_ARG(std::string, optimizer_prefix) = "optim.";

 public:  // TORCH_ARG leaves the access private
  /// As HfLoadOptions: applied to the fqn (after model_prefix, and inside
  /// the optimizer's keys alike), first matching rule only.
  DcpLoadOptions& replace_prefix(std::string from, std::string to) {
    prefix_rules_.emplace_back(std::move(from), std::move(to));
    return *this;
  }
  DcpLoadOptions& strip_prefix(std::string prefix) { return replace_prefix(std::move(prefix), ""); }
  const std::vector<std::pair<std::string, std::string>>& prefix_rules() const { return prefix_rules_; }
  /// After the prefix rules; nullopt or "" skips the tensor.
  TORCH_ARG(NameFn, map_name) = nullptr;

 public:
  DcpLoadOptions& allow_missing(bool all) {
    allow_missing_ = all ? Predicate([](const std::string&) { return true; }) : nullptr;
    return *this;
  }
  DcpLoadOptions& allow_missing_if(Predicate p) {
    allow_missing_ = std::move(p);
    return *this;
  }
  bool may_be_missing(const std::string& model_name) const { return allow_missing_ && allow_missing_(model_name); }
  /// Model keys whose (mapped) name is no parameter or buffer of the model:
  /// an error unless this is true.
  TORCH_ARG(bool, ignore_unexpected) = false;
  /// As LoadOptions::allow_lossy_casts.
  TORCH_ARG(bool, allow_lossy_casts) = false;
  /// Progress reports of this call (shardtorch/log.h); unset: the
  /// library-wide set_progress_callback, else the default printing.
  TORCH_ARG(ProgressCallback, progress) = nullptr;

 private:
  std::vector<std::pair<std::string, std::string>> prefix_rules_;
  Predicate allow_missing_;
};

/// What one rank did in load_dcp_checkpoint.
struct SHARDTORCH_API DcpLoadReport {
  std::vector<std::string> files_opened;  // data files this rank opened, as the metadata names them
  int64_t items_opened = 0;               // chunks (torch.save zips) this rank opened
  int64_t bytes_read = 0;                 // tensor bytes this rank read
  std::vector<std::string> missing;       // model names the checkpoint lacks (allowed), kept as they were
  std::vector<std::string> skipped;       // checkpoint keys the mapping skipped
  std::vector<std::string> unexpected;    // model keys ignored (ignore_unexpected): not in the model
  std::vector<std::string> ignored;       // keys under neither prefix, and optimizer keys not read
};

/// Collective. Loads the DCP checkpoint in directory `dir` into the sharded
/// model `root` (after shard(); deferred or not) and, if `optimizer` is not
/// null, its optimizer state (Adam, AdamW: exp_avg, exp_avg_sq,
/// max_exp_avg_sq and step; SGD: momentum_buffer), in the layout of
/// get_state_dict(model, optimizer). Parameter groups' options are not read:
/// the optimizer keeps its own. Each rank reads only the chunks, and the
/// byte ranges within them, that overlap its shard (every buffer, every
/// parameter under NoShard). Every rank checks what it will read and the
/// ranks agree before anything changes: a problem on any rank throws
/// checkpoint::SafetensorsError on every rank, with the model and the
/// optimizer unchanged.
SHARDTORCH_API DcpLoadReport load_dcp_checkpoint(torch::nn::Module& root, ShardedOptimizer* optimizer,
                                                 const std::string& dir, const DcpLoadOptions& options = {});
inline DcpLoadReport load_dcp_checkpoint(torch::nn::Module& root, const std::string& dir,
                                         const DcpLoadOptions& options = {}) {
  return load_dcp_checkpoint(root, nullptr, dir, options);
}

/// How save_dcp_checkpoint names what it writes.
struct SHARDTORCH_API DcpSaveOptions {
  /// The keys as dcp.save({"model": ..., "optim": ...}) writes them: the
  /// first component of each is its top-level key in the nested state dict.
  /// "" writes the model's names alone (the layout of dcp.save(model.state_dict())).
  TORCH_ARG(std::string, model_prefix) = "model.";
  TORCH_ARG(std::string, optimizer_prefix) = "optim.";
  /// Progress reports of this call (shardtorch/log.h); unset: the
  /// library-wide set_progress_callback, else the default printing.
  TORCH_ARG(ProgressCallback, progress) = nullptr;
};

/// What save_dcp_checkpoint wrote (the same on every rank).
struct SHARDTORCH_API DcpSaveReport {
  std::vector<std::string> files;  // data files, one per rank
  int64_t keys = 0;                // entries of the metadata
  int64_t bytes = 0;               // of the data files together
};

/// Collective. Writes the sharded model `root` and, if `optimizer` is not
/// null (Adam, AdamW or SGD), its state and parameter groups as
/// torch.distributed.checkpoint's FileSystemWriter does: each rank writes
/// __<rank>_0.distcp with the pieces of its shard (each a box of its
/// parameter), values held alike by several ranks (buffers, NoShard's
/// parameters, HybridShard's replicas, the optimizer's step and groups)
/// once, and rank 0 writes .metadata last. Python's dcp.load (strict, an
/// FSDP2 model at any world size) and dcp_to_torch_save read the result.
/// The files go into `dir`.shardtorch-tmp, which then replaces `dir` as a
/// sharded checkpoint does (docs/checkpoints.md): `dir` is replaced only if
/// it is a DCP checkpoint (it has .metadata) or an empty directory. A
/// failure on any rank throws on every rank and leaves `dir` as it was.
SHARDTORCH_API DcpSaveReport save_dcp_checkpoint(torch::nn::Module& root, ShardedOptimizer* optimizer,
                                                 const std::string& dir, const DcpSaveOptions& options = {});
inline DcpSaveReport save_dcp_checkpoint(torch::nn::Module& root, const std::string& dir,
                                         const DcpSaveOptions& options = {}) {
  return save_dcp_checkpoint(root, nullptr, dir, options);
}

namespace checkpoint {

/// One key of a DCP checkpoint, from its metadata.
struct SHARDTORCH_API DcpEntryInfo {
  std::string name;
  bool tensor = true;  // false: a pickled Python value (optimizer group options, ...)
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t chunks = 0;
};

/// A DCP checkpoint read in one process (tools, tests): the metadata on
/// open, every chunk when a tensor is read. Refuses what
/// load_dcp_checkpoint refuses of the checkpoint itself.
class SHARDTORCH_API DcpReader {
 public:
  explicit DcpReader(const std::string& dir);
  ~DcpReader();
  DcpReader(const DcpReader&) = delete;
  DcpReader& operator=(const DcpReader&) = delete;

  /// Every key, in the metadata's order.
  std::vector<DcpEntryInfo> entries() const;
  bool contains(const std::string& name) const;
  /// A tensor, whole, assembled from its chunks, in its saved dtype.
  at::Tensor read(const std::string& name) const;
  /// A pickled value as Python's repr writes it ("0.01", "(0.9, 0.999)").
  std::string read_value(const std::string& name) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// A value for write_dcp: its pickle is Python's of the same value.
struct SHARDTORCH_API DcpValue {
  enum class Kind { None, Bool, Int, Float, String, Tuple, List } kind = Kind::None;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<DcpValue> items;
};

/// Writes a DCP checkpoint from one process: `tensors` (each produced when
/// the writer reaches it, written as one chunk) and `values`, into `dir`
/// (made if missing; __0_0.distcp, then .metadata, each synced and renamed
/// into place). Keys are the flattened state dict's; those under the
/// options' prefixes get their nested path as save_dcp_checkpoint writes it
/// ("model.<fqn>", "optim.state.<fqn>.<kind>", "optim.param_groups.<i>.<key>"),
/// so that dcp_to_torch_save nests them; others stay flat.
SHARDTORCH_API void write_dcp(const std::string& dir, const std::vector<PendingTensor>& tensors,
                              const std::vector<std::pair<std::string, DcpValue>>& values = {},
                              const DcpSaveOptions& options = {});

}  // namespace checkpoint
}  // namespace shardtorch
