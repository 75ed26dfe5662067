#include "parallel/tp_comm.h"

#include <torch/csrc/autograd/custom_function.h>

#include "base/check.h"

namespace shardtorch::detail::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group's Comm travels in the context as an address: the layer that
// launched the forward keeps its World (and so the Comm) alive.
int64_t address(Comm& comm) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(&comm)); }
Comm& comm_of(AutogradContext* ctx) {
  return *reinterpret_cast<Comm*>(static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
}
std::string what_of(AutogradContext* ctx) { return ctx->saved_data["what"].toStringRef(); }
int64_t dim_of(AutogradContext* ctx) { return ctx->saved_data["dim"].toInt(); }

at::Tensor summed(const at::Tensor& x, Comm& comm, const std::string& what) {
  at::Tensor t = x.contiguous().clone();
  comm.all_reduce(t, c10d::ReduceOp::SUM, what);
  return t;
}

// Dimension `dim` of `x` splits evenly over the group.
void check_divides(const at::Tensor& x, int64_t dim, Comm& comm, const std::string& what) {
  SHARDTORCH_CHECK(x.size(dim) % comm.size() == 0, rank_prefix(comm.global_rank(comm.rank())), ": ", what,
                   ": dimension ", dim, " of ", describe(x), " is not a multiple of the tensor-parallel group's ",
                   comm.size(), " ranks");
}

at::Tensor chunk_of(const at::Tensor& x, int64_t dim, Comm& comm, const std::string& what) {
  check_divides(x, dim, comm, what);
  const int64_t len = x.size(dim) / comm.size();
  return x.narrow(dim, comm.rank() * len, len).contiguous();
}

at::Tensor scattered(const at::Tensor& x, int64_t dim, Comm& comm, const std::string& what) {
  check_divides(x, dim, comm, what);
  const int64_t n = comm.size();
  at::Tensor in = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] /= n;
  at::Tensor out = at::empty(shape, in.options());
  comm.reduce_scatter_into(out, in, what);
  return out.movedim(0, dim).contiguous();
}

struct CopyToGroup : torch::autograd::Function<CopyToGroup> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t comm, std::string what) {
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["what"] = what;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {summed(g[0], comm_of(ctx), what_of(ctx) + " (the input's gradient)"), at::Tensor(), at::Tensor()};
  }
};

struct ReduceFromGroup : torch::autograd::Function<ReduceFromGroup> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, int64_t comm, std::string what) {
    return summed(x, *reinterpret_cast<Comm*>(static_cast<intptr_t>(comm)), what);
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor(), at::Tensor()}; }
};

// Forward applies `forward_op` along `dim` over the group, backward applies
// `backward_op` to the gradient (its adjoint).
using DimOp = at::Tensor (*)(const at::Tensor&, int64_t, Comm&, const std::string&);
template <DimOp forward_op, DimOp backward_op>
struct AlongDim : torch::autograd::Function<AlongDim<forward_op, backward_op>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t comm, std::string what, int64_t dim) {
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["what"] = what;
    ctx->saved_data["dim"] = dim;
    return forward_op(x, dim, *reinterpret_cast<Comm*>(static_cast<intptr_t>(comm)), what);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {backward_op(g[0], dim_of(ctx), comm_of(ctx), what_of(ctx) + " (the gradient)"), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};
using GatherDim = AlongDim<all_gather_along, chunk_of>;
using SplitDim = AlongDim<chunk_of, all_gather_along>;
using GatherForColumn = AlongDim<all_gather_along, scattered>;
using ReduceScatter = AlongDim<scattered, all_gather_along>;

int64_t positive(int64_t dim, const at::Tensor& x) { return dim < 0 ? dim + x.dim() : dim; }

}  // namespace

at::Tensor all_gather_along(const at::Tensor& x, int64_t dim, Comm& comm, const std::string& what) {
  dim = positive(dim, x);
  at::Tensor in = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] *= comm.size();
  at::Tensor out = at::empty(shape, in.options());
  comm.all_gather_into(out, in, what);
  return out.movedim(0, dim).contiguous();
}

at::Tensor copy_to_group(const at::Tensor& x, Comm& comm, const std::string& what) {
  if (comm.size() == 1) return x;
  return CopyToGroup::apply(x, address(comm), what);
}

at::Tensor reduce_from_group(const at::Tensor& x, Comm& comm, const std::string& what) {
  if (comm.size() == 1) return x;
  return ReduceFromGroup::apply(x, address(comm), what);
}

at::Tensor gather_dim(const at::Tensor& x, int64_t dim, Comm& comm, const std::string& what) {
  if (comm.size() == 1) return x;
  return GatherDim::apply(x, address(comm), what, positive(dim, x));
}

at::Tensor split_dim(const at::Tensor& x, int64_t dim, Comm& comm, const std::string& what) {
  if (comm.size() == 1) return x;
  return SplitDim::apply(x, address(comm), what, positive(dim, x));
}

at::Tensor gather_for_column(const at::Tensor& x, int64_t dim, Comm& comm, const std::string& what) {
  if (comm.size() == 1) return x;
  return GatherForColumn::apply(x, address(comm), what, positive(dim, x));
}

at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, Comm& comm, const std::string& what) {
  if (comm.size() == 1) return x;
  return ReduceScatter::apply(x, address(comm), what, positive(dim, x));
}

}  // namespace shardtorch::detail::tp
