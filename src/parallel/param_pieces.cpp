#include "parallel/param_pieces.h"

#include "runtime/shard_state.h"

namespace shardtorch::detail {

std::vector<ParamPiece> pieces_of(ShardState& state, const at::Tensor& param) {
  std::vector<ParamPiece> out;
  if (state.path().replicated()) {  // NoShard: the whole parameter (its fp32 master under mixed precision)
    at::Tensor record = state.path().record_of(param);
    out.push_back(
        {0, record.numel(), record.view({-1}), record.grad().defined() ? record.grad().view({-1}) : at::Tensor()});
    return out;
  }
  const int rank = state.topology().shard_comm().rank();
  for (auto& u : state.units().all())
    for (auto& f : u->flats())
      for (size_t i = 0; i < f->params().size(); ++i) {
        if (!f->params()[i].is_same(param)) continue;
        if (f->grads().full_grad().defined()) {  // OptimizerOnly: the whole gradient on every rank
          const int64_t numel = f->params()[i].numel();
          at::Tensor value;
          if (auto p = f->layout().piece(i, rank)) value = f->shard().narrow(0, p->shard_offset, p->length);
          out.push_back({0, numel, value, f->grads().full_grad().narrow(0, f->layout().offset(i), numel)});
          return out;
        }
        if (auto p = f->layout().piece(i, rank)) {
          ParamPiece piece{p->param_offset, p->length, f->shard().narrow(0, p->shard_offset, p->length), at::Tensor()};
          if (f->grads().shard_grad().defined())
            piece.grad = f->grads().shard_grad().narrow(0, p->shard_offset, p->length);
          out.push_back(piece);
        }
        return out;
      }
  return out;
}

}  // namespace shardtorch::detail
