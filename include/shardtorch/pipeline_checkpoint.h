#pragma once
// Checkpoints of a pipelined model (shardtorch/pipeline.h) in the formats of
// shardtorch/checkpoint.h, shardtorch/hf_checkpoint.h and
// shardtorch/dcp_checkpoint.h, with the
// unsplit model's names: a checkpoint saved at one layout (pipeline ranks x
// data-parallel ranks, chunks, split, strategy) loads at any other, into the
// unsplit model (sharded, or not at all for the full state dict and Hugging
// Face layouts) or into PyTorch (DCP), and the unsplit model's loads into a
// pipeline.
//
//   shardtorch::save_sharded_checkpoint(pipe, opt.get(), "ck", step);  // every rank of the mesh
//   step = shardtorch::load_sharded_checkpoint(pipe, opt.get(), "ck");
//
// Each is collective over the mesh's World: every rank calls it, with the
// same arguments. Every stage saves its own parameters and buffers; a
// parameter tied across stages on different ranks (a GPT's token embedding
// and LM head) is saved once, under its name on its first stage, where the
// unsplit model's save writes it once (sharded checkpoints, and Hugging Face
// layouts with tied_once), and loaded into every stage that holds it. As for
// the unsplit model, a problem on any rank throws on every rank before
// anything changes (loading), and a failed save leaves the previous
// checkpoint (saving). docs/checkpoints.md, "Pipelines".
#include <cstdint>
#include <map>
#include <string>

#include "shardtorch/checkpoint.h"
#include "shardtorch/dcp_checkpoint.h"
#include "shardtorch/export.h"
#include "shardtorch/hf_checkpoint.h"
#include "shardtorch/optim.h"
#include "shardtorch/pipeline.h"

namespace shardtorch {

/// One safetensors file holding the whole model, as save_full_state_dict
/// writes the unsplit model's (a tied parameter under each of its names).
/// Rank 0 of the mesh writes it: its own stages' tensors gathered one flat
/// parameter at a time, every other pipeline rank's gathered the same way by
/// that rank's first data-parallel rank and sent to rank 0 one tensor at a
/// time, as its writer reaches them.
SHARDTORCH_API void save_full_state_dict(Pipeline& pipe, const std::string& path,
                                         const std::map<std::string, std::string>& metadata = {});
/// Every rank reads `path` and takes its stages' shards; a tied parameter is
/// read under any of its names the file holds.
SHARDTORCH_API void load_full_state_dict(Pipeline& pipe, const std::string& path, const LoadOptions& options = {});

/// DIR/rank-R.safetensors for every rank R of the mesh, each with the element
/// ranges (and optimizer state) of its stages' parameters it owns, and one
/// index for the whole model. `optimizer`: over pipe.module(), or null.
SHARDTORCH_API void save_sharded_checkpoint(Pipeline& pipe, ShardedOptimizer* optimizer, const std::string& dir,
                                            int64_t step, const std::map<std::string, std::string>& user_state = {});
/// Any sharded checkpoint of the same model (pipelined at any layout, or
/// not); returns the saved step.
SHARDTORCH_API int64_t load_sharded_checkpoint(Pipeline& pipe, ShardedOptimizer* optimizer, const std::string& dir,
                                               std::map<std::string, std::string>* user_state = nullptr,
                                               const LoadOptions& options = {});

/// Hugging Face's multi-file layout: each pipeline rank's first data-parallel
/// rank writes its stages' tensors into data files of their own (numbered
/// over the whole model, pipeline rank by pipeline rank); rank 0 of the mesh
/// then renames them into place and writes the index. `dir` must be one
/// directory for every writer (a shared file system), as for sharded
/// checkpoints.
SHARDTORCH_API HfSaveReport save_hf_checkpoint(Pipeline& pipe, const std::string& dir,
                                               const HfSaveOptions& options = {});
/// As load_hf_checkpoint into the unsplit model: names are matched against
/// the whole model's; each rank reads only what its stages hold.
SHARDTORCH_API HfLoadReport load_hf_checkpoint(Pipeline& pipe, const std::string& path,
                                               const HfLoadOptions& options = {});

/// A PyTorch distributed checkpoint of the whole model, as
/// save_dcp_checkpoint writes the unsplit model's: every rank R of the mesh
/// writes the pieces of its stages' parameters (and their optimizer state)
/// it owns into DIR/__R_0.distcp, rank 0 the metadata; a tied parameter is
/// saved under each of its names, its optimizer state under its first.
/// PyTorch's dcp.load reads it into the unsplit model. `optimizer`: over
/// pipe.module(), or null.
SHARDTORCH_API DcpSaveReport save_dcp_checkpoint(Pipeline& pipe, ShardedOptimizer* optimizer, const std::string& dir,
                                                 const DcpSaveOptions& options = {});
/// Any DCP checkpoint of the same model (PyTorch's, the unsplit model's, a
/// pipeline's at any layout); names are matched against the whole model's
/// (a name no stage holds is unexpected), each rank reading only the chunks
/// its stages' shards overlap.
SHARDTORCH_API DcpLoadReport load_dcp_checkpoint(Pipeline& pipe, ShardedOptimizer* optimizer, const std::string& dir,
                                                 const DcpLoadOptions& options = {});

}  // namespace shardtorch
