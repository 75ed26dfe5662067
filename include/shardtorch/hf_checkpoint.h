#pragma once
// Hugging Face's safetensors layouts, loaded into and saved from a sharded
// model. Loading: a
// directory with model.safetensors.index.json (its "weight_map" says which
// file holds each tensor, files model-0000K-of-0000N.safetensors), or a single
// model.safetensors. Each rank opens only the files holding elements of its
// own shard (and buffers, which every rank keeps whole) and reads only those
// elements, so a deferred model (skip_deferred_init, then shard()) is loaded
// without any rank holding a full tensor it does not own.
// docs/checkpoints.md, "Hugging Face layouts", says what is checked and how
// names and dtypes are matched.
#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shardtorch/export.h"
#include "shardtorch/log.h"

namespace shardtorch {

/// How a Hugging Face checkpoint's tensor names become the model's, and
/// what may differ between the two.
struct SHARDTORCH_API HfLoadOptions {
  /// A checkpoint name to the model's name; nullopt or "" skips the tensor.
  using NameFn = std::function<std::optional<std::string>(const std::string& checkpoint_name)>;
  /// Whether the model's parameter or buffer `model_name` may be absent.
  using Predicate = std::function<bool(const std::string& model_name)>;

  /// A prefix rule: a checkpoint name starting with `from` has it replaced by
  /// `to`. Rules are tried in the order given; the first that matches applies
  /// (one rule per name).
  HfLoadOptions& replace_prefix(std::string from, std::string to) {
    prefix_rules_.emplace_back(std::move(from), std::move(to));
    return *this;
  }
  /// replace_prefix(prefix, ""): "model.layers.0.w" -> "layers.0.w".
  HfLoadOptions& strip_prefix(std::string prefix) { return replace_prefix(std::move(prefix), ""); }
  const std::vector<std::pair<std::string, std::string>>& prefix_rules() const { return prefix_rules_; }

  /// Applied after the prefix rules, to their result.
  TORCH_ARG(NameFn, map_name) = nullptr;

 public:  // TORCH_ARG leaves the access private
  /// Model parameters and buffers the checkpoint may lack: they keep the
  /// values they have (after skip_deferred_init and shard(): zeros). For
  /// adapters, say, that the checkpoint of a base model does not hold.
  /// Without it a missing one is an error.
  HfLoadOptions& allow_missing(bool all) {
    allow_missing_ = all ? Predicate([](const std::string&) { return true; }) : nullptr;
    return *this;
  }
  HfLoadOptions& allow_missing_if(Predicate p) {
    allow_missing_ = std::move(p);
    return *this;
  }
  bool may_be_missing(const std::string& model_name) const { return allow_missing_ && allow_missing_(model_name); }

  /// Checkpoint tensors whose (mapped) name is no parameter or buffer of the
  /// model: an error unless this is true (then they are not read, and listed
  /// in HfLoadReport::unexpected).
  TORCH_ARG(bool, ignore_unexpected) = false;
  /// As LoadOptions::allow_lossy_casts: casts that can change values beyond
  /// rounding (floating point into an integer, an integer into a narrower
  /// one) are refused unless this is true. Floating point into floating
  /// point (a BF16 or F16 file into F32 masters) is always allowed.
  TORCH_ARG(bool, allow_lossy_casts) = false;
  /// As LoadOptions::tied_from, by the model's names: a tied parameter the
  /// checkpoint holds under two or more of them (after the name mapping)
  /// is refused when their values differ, unless one of them is listed here.
  TORCH_ARG(std::vector<std::string>, tied_from) = {};
  /// Progress reports of this call (shardtorch/log.h); unset: the
  /// library-wide set_progress_callback, else the default printing.
  TORCH_ARG(ProgressCallback, progress) = nullptr;

 private:
  std::vector<std::pair<std::string, std::string>> prefix_rules_;
  Predicate allow_missing_;
};

/// What one rank did in load_hf_checkpoint.
struct SHARDTORCH_API HfLoadReport {
  std::vector<std::string> files_opened;  // this rank's, as the index names them, in the order opened
  int64_t bytes_read = 0;                 // tensor bytes this rank read
  std::vector<std::string> missing;       // model names the checkpoint lacks (allowed), kept as they were
  std::vector<std::string> skipped;       // checkpoint names the mapping skipped
  std::vector<std::string> unexpected;    // checkpoint names ignored (ignore_unexpected): not in the model
};

/// Collective. Loads `path` into the sharded model `root` (after shard()):
/// `path` is a directory holding model.safetensors.index.json (the
/// multi-file layout) or model.safetensors, an index file itself, or a
/// single safetensors file. Every rank reads the index and checks that every
/// file it names exists; a rank opens a data file only if it holds elements
/// of this rank's shard (or a buffer, or under NoShard anything) and reads
/// only those elements. Every rank checks what it will read (names, shapes,
/// dtypes, that a tensor is in the file the index names) and the ranks agree
/// before anything changes: a problem on any rank throws on every rank
/// (checkpoint::SafetensorsError naming that rank), the model unchanged.
/// Tied parameters are loaded from the first of their names the checkpoint
/// holds.
SHARDTORCH_API HfLoadReport load_hf_checkpoint(torch::nn::Module& root, const std::string& path,
                                               const HfLoadOptions& options = {});

/// How save_hf_checkpoint names and stores the model's tensors.
struct SHARDTORCH_API HfSaveOptions {
  /// A checkpoint name (after the prefix) to the name written; nullopt or ""
  /// leaves the tensor out.
  using NameFn = std::function<std::optional<std::string>(const std::string& name)>;
  /// Prepended to every model name ("model." for transformers' layouts).
  TORCH_ARG(std::string, prefix) = "";
  TORCH_ARG(NameFn, map_name) = nullptr;
  /// The largest data file, in bytes of tensor data (transformers' default,
  /// 5 GB); a larger tensor is alone in its file.
  TORCH_ARG(int64_t, max_file_bytes) = 5'000'000'000;
  /// Floating-point tensors are written in this dtype (e.g. at::kBFloat16);
  /// unset: as the model holds them (fp32 masters).
  TORCH_ARG(std::optional<at::ScalarType>, dtype) = std::nullopt;
  /// A tied parameter under its first name only (as transformers saves
  /// them; load_hf_checkpoint loads it into every name), or under each.
  TORCH_ARG(bool, tied_once) = true;
  /// The model's buffers too.
  TORCH_ARG(bool, include_buffers) = true;
  /// Progress reports of this call (shardtorch/log.h); unset: the
  /// library-wide set_progress_callback, else the default printing.
  TORCH_ARG(ProgressCallback, progress) = nullptr;
};

/// What save_hf_checkpoint wrote (the same on every rank).
struct SHARDTORCH_API HfSaveReport {
  std::vector<std::string> files;  // data files, in order
  int64_t total_bytes = 0;         // tensor data, the index's total_size
  int64_t tensors = 0;
};

/// Collective. Writes the sharded model `root` into directory `dir` (made if
/// missing) in Hugging Face's multi-file layout: model-0000K-of-0000N
/// .safetensors files (metadata "format": "pt") filled in order up to
/// max_file_bytes, each tensor whole in one file, and
/// model.safetensors.index.json with "total_size" and "weight_map". Flat
/// parameters are gathered one at a time and rank 0 writes each tensor as it
/// comes: no rank holds more than one gathered flat parameter. The data files
/// are written under staging names and renamed into place, the index last;
/// data files of an earlier save that the new index does not name are then
/// removed (other files in `dir` are left alone). A failure on rank 0 throws
/// on every rank, and leaves an earlier checkpoint in `dir` as it was.
SHARDTORCH_API HfSaveReport save_hf_checkpoint(torch::nn::Module& root, const std::string& dir,
                                               const HfSaveOptions& options = {});

}  // namespace shardtorch
