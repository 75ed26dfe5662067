#include "runtime/gradient_reducer.h"

#include "base/errors.h"
#include "runtime/flat_param.h"
#include "runtime/shard_copies.h"
#include "runtime/topology.h"

namespace shardtorch::detail {

void ShardedReducer::reduce(FlatParam& flat, const std::string& label) {
  check_hooks_agree(topology_.world());  // before any collective of it
  const double world = topology_.world().size();
  FlatParam* fp = &flat;
  const std::string what = "gradients of unit '" + label + "' (" + fp->describe() + ")";
  at::Tensor g = fp->grads().take_staging_grad();
  if (g.numel() == 0) {  // a flat of empty parameters: an empty gradient, and nothing to send
    const bool full = strategy_ == Strategy::OptimizerOnly;
    copies_.deliver_gradient(*fp, g, /*owned=*/true, 1.0, full);
    return;
  }
  ++reductions_;
  // fp16 sums of N gradients can overflow: divide before reducing instead of after.
  double post = world;
  if (comm_hook()) {
    // The hook gets the shard group's mean (OptimizerOnly: the world's) and
    // returns the mean over all ranks: it divides by the number of
    // replicas, as DDP's hooks do.
    g.div_(static_cast<double>(topology_.reduce_comm().size()));
    post = 1.0;
  } else if (g.scalar_type() == at::kHalf) {
    g.div_(world);
    post = 1.0;
  }
  ShardCopies* copies = &copies_;
  const int rank = topology_.world().global_rank();
  if (strategy_ == Strategy::OptimizerOnly) {  // every rank keeps the whole gradient
    bucketer_.all_reduce(
        g, topology_.reduce_comm(),
        [fp, post, copies, rank,
         what](const at::Tensor& reduced) {  // the staging gradient, reduced: no one else writes it
          run_naming(
              rank, "reduction callback", [&] { return "adding the all-reduced " + what; },
              [&] { copies->deliver_gradient(*fp, reduced, /*owned=*/true, post, /*full=*/true); });
        },
        what);
    return;
  }
  // HybridShard: summed in the shard group, then across the replicas by
  // the bucketer (one all-reduce per launch) before the callback runs.
  bucketer_.reduce_scatter(
      g, topology_.reduce_comm(),
      [fp, post, copies, rank, what](const at::Tensor& reduced) {  // a view of a bucket's output
        run_naming(
            rank, "reduction callback", [&] { return "adding the reduce-scattered " + what; },
            [&] { copies->deliver_gradient(*fp, reduced, /*owned=*/false, post, /*full=*/false); });
      },
      what, topology_.replica_comm());
}

void ShardedReducer::finish_backward(bool /*sync*/) {
  bucketer_.flush();
  bucketer_.free();
}

}  // namespace shardtorch::detail
