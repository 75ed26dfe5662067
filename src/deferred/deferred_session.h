// What the library asks of deferred construction beyond shardtorch/deferred.h.
#pragma once

namespace shardtorch::detail {

/// Whether a shardtorch::DeferredInit lives on the calling thread (its
/// tensor factories make deferred, meta tensors: no collective can run).
bool deferred_init_live();

}  // namespace shardtorch::detail
