// What the library asks of deferred construction beyond shardtorch/deferred.h.
#pragma once

#include <ATen/ATen.h>

#include <functional>

namespace shardtorch::detail {

/// Makes the deferred tensor `t` stand for part of its value (a
/// tensor-parallel slice: parallelize() of a deferred model): its shape
/// becomes `shape`, and materialising it gives take(v) of the value v its
/// recorded construction gives (zeros of `shape` after skip_deferred_init).
/// Operations recorded on `t` afterwards would see the whole value: call it
/// on a model about to be sharded. The tensor keeps its identity.
void defer_part(const at::Tensor& t, c10::IntArrayRef shape, std::function<at::Tensor(const at::Tensor&)> take);

/// Whether a shardtorch::DeferredInit lives on the calling thread (its
/// tensor factories make deferred, meta tensors: no collective can run).
bool deferred_init_live();

}  // namespace shardtorch::detail
