#include "parallel/tp_replicas.h"

#include <c10/core/GradMode.h>

#include <set>
#include <sstream>

#include "base/check.h"
#include "checkpoint/checksum.h"
#include "deferred/deferred_session.h"
#include "parallel/param_pieces.h"
#include "runtime/placement.h"
#include "runtime/shard_state.h"
#include "shardtorch/deferred.h"
#include "shardtorch/tensor_parallel.h"

namespace shardtorch {
namespace detail {
namespace {

std::string checksum_of(const at::Tensor& t) {
  const at::Tensor c = t.detach().contiguous().cpu();
  return checkpoint::checksum::of(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

// One line per parameter compared: its name, then the checksum of this rank's values.
std::vector<std::pair<std::string, std::string>> fingerprints(torch::nn::Module& root, bool unsplit_only) {
  std::shared_ptr<ShardState> state = lookup_model(root);
  std::vector<std::pair<std::string, std::string>> out;
  std::set<const void*> seen;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second || is_deferred(p)) continue;
    if (unsplit_only && placement_of(p)) continue;
    std::string sum;
    if (state) {
      for (const auto& piece : pieces_of(*state, p))
        if (piece.value.defined()) sum += std::to_string(piece.offset) + ":" + checksum_of(piece.value) + " ";
    } else {
      sum = checksum_of(p);
    }
    out.emplace_back(item.key(), sum);
  }
  return out;
}

}  // namespace

int64_t require_same_parameters(torch::nn::Module& root, World& tp, bool unsplit_only, const std::string& who,
                                const std::string& why) {
  c10::NoGradGuard no_grad;
  const auto mine = fingerprints(root, unsplit_only);
  std::ostringstream text;
  for (const auto& [name, sum] : mine) text << name << "\t" << sum << "\n";
  const auto all = tp.comm().all_gather_strings(text.str(), "checksums of the parameters whole on every rank");
  for (int r = 1; r < tp.size(); ++r) {
    if (all[r] == all[0]) continue;
    std::istringstream a(all[0]), b(all[r]);
    std::string la, lb;
    while (std::getline(a, la) && std::getline(b, lb) && la == lb) {
    }
    const std::string name = la.substr(0, la.find('\t'));
    SHARDTORCH_CHECK(false, rank_prefix(tp.global_rank()), ": ", who, ": parameter '", name, "' differs between rank ",
                     tp.global_rank_of(0), " and rank ", tp.global_rank_of(r), " of the tensor-parallel group; ", why);
  }
  return static_cast<int64_t>(mine.size());
}

}  // namespace detail

int64_t check_replicated(torch::nn::Module& root, const std::shared_ptr<World>& tp) {
  SHARDTORCH_CHECK(tp, "shardtorch::check_replicated: no tensor-parallel World");
  return detail::require_same_parameters(
      root, *tp, /*unsplit_only=*/true, "shardtorch::check_replicated",
      "parallelize() left it whole, so every rank of the group must hold the same values: the ranks of a "
      "tensor-parallel group take the same batch, and their optimizers the same steps");
}

}  // namespace shardtorch
