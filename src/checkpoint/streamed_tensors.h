#pragma once
// Internal: a sharded model's parameters and buffers as tensors a writer on
// rank 0 produces one at a time (save_full_state_dict, save_hf_checkpoint).
// Flat parameters are all-gathered in a fixed order, each when the writer
// first reaches one of its tensors, the previous one freed first; every rank
// calls finish() to take part in the gathers the writer did not reach.
//
// Of a tensor-parallel model's part (checkpoint/tp_slices.h), a parameter
// parallelize() split is an item of its whole shape: produce(), on the
// part's tp rank 0, receives the other tp ranks' slices and assembles the
// whole; the leader of a part at another tp rank holds the split items alone
// and sends their slices with feed_tp_rank_0(), in the same order.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "runtime/placement.h"

namespace shardtorch {
class FlatParam;
namespace detail {
class ShardState;
}

namespace checkpoint {

struct ModelPart;

class StreamedTensors {
 public:
  struct Item {
    std::string name;  // the model's
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    std::function<at::Tensor()> produce;         // call on rank 0 only, in order
    int64_t flat = -1;                           // the flat parameter it is part of (-1: none)
    std::optional<detail::Placement> placement;  // a split parameter's (shape: the whole's)
  };
  /// Every parameter (a tied one under each name, or its first only with
  /// `tied_once`) in gathering order, then, with `buffers`, every buffer.
  /// `purpose` names the caller in the all-gathers' descriptions.
  /// With `part`: of that part of a model (tensor parallelism).
  StreamedTensors(torch::nn::Module& root, detail::ShardState& state, std::string purpose, bool tied_once,
                  bool buffers = true, const ModelPart* part = nullptr);
  StreamedTensors(const StreamedTensors&) = delete;
  StreamedTensors& operator=(const StreamedTensors&) = delete;

  const std::vector<Item>& items() const { return items_; }
  /// Only the flat parameters of these items (indices into items()) are
  /// gathered: every rank must pass the same list, before any produce().
  void keep_only(const std::vector<size_t>& items);
  /// The all-gathers not yet made (every rank; after the writer, or its failure).
  void finish();
  /// The leader of a part at a tp rank other than 0: every item's slice to
  /// tp rank 0, in order, as that rank's produce() takes them (only the
  /// items keep_only() kept, which tp rank 0 keeps alike).
  void feed_tp_rank_0();

 private:
  void gather_through(size_t k);  // every needed flat up to k, in order; k's is then current_
  void gather(size_t k);
  void split_items(const ModelPart& part);
  at::Tensor assemble(size_t k, const at::Tensor& mine);  // tp rank 0: item k whole

  detail::ShardState& state_;
  std::string purpose_;
  std::vector<FlatParam*> flats_;
  std::vector<std::string> labels_;  // each flat's unit
  size_t gathered_ = 0;              // flats before this one are gathered or skipped
  std::vector<bool> needed_;         // per flat
  std::vector<bool> kept_;           // per item (keep_only; empty: all)
  at::Tensor current_;               // the last gathered flat parameter, full
  std::vector<Item> items_;
  std::vector<int> split_tags_;  // per item: its place among the split ones (-1: none), alike on every tp rank
  bool assembles_ = false;       // the leader of a part at tp rank 0 with split items
  size_t assembled_ = 0;         // items before this one are assembled (or not split)
};

}  // namespace checkpoint
}  // namespace shardtorch
