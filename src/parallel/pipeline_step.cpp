// One pipeline step: this rank's actions of the plan, in order
// (docs/parallelism.md, "A step").
//
// Transfers: a receive is posted when its Recv action comes (one compute
// action ahead of the compute that needs it) and waited for by that compute;
// a send goes out after its compute and is waited for when its buffer is no
// longer needed (an activation's before that micro-batch's backward, when
// its receiver must have taken it; a gradient's at the end of the step).
// Shapes: the first stage's inputs are agreed at the start of every step (one
// all-gather over the pipeline group, which also carries every rank's
// verdict on its own inputs and targets); when they differ from the last
// step's, each activation is preceded by a header with its dtype and shape,
// and the shapes are kept for the steps that follow.
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <map>
#include <sstream>

#include "base/check.h"
#include "comm/world_access.h"
#include "parallel/pipeline_runtime.h"
#include "runtime/shard_state.h"

namespace shardtorch::detail {
namespace {

using pipeline::Action;
using pipeline::ActionKind;

constexpr int kMaxDims = 8;
// The step's agreement entry of one rank: [0] what is wrong with this rank's
// inputs or targets (0: nothing), [1] the inputs' dtype, [2] their dims,
// [3, 3 + kMaxDims) their sizes, [11] the targets' rows.
constexpr int kEntry = 12;
constexpr int64_t kBadInputs = 1, kBadTargets = 2;
// A header before an activation: dtype, dims, sizes.
constexpr int kHeader = 2 + kMaxDims;

enum class Msg { Activation = 0, Gradient = 1, Header = 2 };
int tag(Msg kind, int stage, int mb) { return ((mb * 1024 + stage) * 4) + static_cast<int>(kind); }

std::vector<int64_t> header_of(const at::Tensor& t) {
  std::vector<int64_t> h(kHeader, 0);
  h[0] = static_cast<int64_t>(t.scalar_type());
  h[1] = t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) h[2 + d] = t.size(d);
  return h;
}

struct Recv {
  at::Tensor buffer;
  PendingWork work;
  bool header = false;  // `buffer` is a header; the payload is received at the wait
};

struct Send {
  at::Tensor buffer, header;
  PendingWork work, header_work;
};

}  // namespace

at::Tensor PipelineRuntime::step(const at::Tensor& inputs, const at::Tensor& targets, const Pipeline::LossFn& loss_fn) {
  return run(plan, /*training=*/true, inputs, targets, loss_fn);
}

at::Tensor PipelineRuntime::evaluate(const at::Tensor& inputs, const at::Tensor& targets,
                                     const Pipeline::LossFn& loss_fn) {
  c10::NoGradGuard no_grad;
  return run(forward_plan, /*training=*/false, inputs, targets, loss_fn);
}

at::Tensor PipelineRuntime::run(const pipeline::Plan& plan, bool training, const at::Tensor& inputs,
                                const at::Tensor& targets, const Pipeline::LossFn& loss_fn) {
  World& world = *mesh->world();
  Comm& comm = pp->comm();
  const int m = plan.microbatches, S = stages();
  const bool first = holds(0), last = holds(S - 1);
  const std::string me = rank_prefix(world.global_rank()) + (training ? ": Pipeline::step" : ": Pipeline::evaluate");
  const auto t0 = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  timeline.clear();

  // ---- The agreement on the step: every rank's verdict, the inputs' shape, the targets' rows.
  std::vector<int64_t> entry(kEntry, 0);
  std::string my_error;
  if (first) {
    if (!inputs.defined() || inputs.dim() < 1 || inputs.dim() > kMaxDims || inputs.size(0) < m) {
      my_error = "the first stage's inputs must be a tensor of 1 to " + std::to_string(kMaxDims) +
                 " dimensions with at least " + std::to_string(m) + " rows (one per micro-batch), got " +
                 (inputs.defined() ? describe(inputs) : std::string("an undefined tensor"));
      entry[0] = kBadInputs;
    } else {
      entry[1] = static_cast<int64_t>(inputs.scalar_type());
      entry[2] = inputs.dim();
      for (int64_t d = 0; d < inputs.dim(); ++d) entry[3 + d] = inputs.size(d);
    }
  }
  if (last) {
    if (!targets.defined() || targets.dim() < 1) {
      my_error = "the last stage's targets must be a tensor of at least one dimension, got " +
                 (targets.defined() ? describe(targets) : std::string("an undefined tensor"));
      entry[0] = kBadTargets;
    } else {
      entry[11] = targets.size(0);
    }
  }
  {
    at::Tensor mine = at::tensor(entry, at::kLong).to(comm.device());
    at::Tensor all = at::empty({comm.size() * kEntry}, mine.options());
    comm.all_gather_into(all, mine, "the agreement on a pipeline step's inputs");
    all = all.cpu();
    const int64_t* a = all.data_ptr<int64_t>();
    const int64_t* in = a + pp_rank_of(0) * kEntry;
    const int64_t* out = a + pp_rank_of(S - 1) * kEntry;
    SHARDTORCH_CHECK(my_error.empty(), me, ": ", my_error);
    for (int r = 0; r < comm.size(); ++r)
      SHARDTORCH_CHECK(a[r * kEntry] == 0, me, ": rank ", pp->global_rank_of(r), " (",
                       a[r * kEntry] == kBadInputs ? "the first stage" : "the last stage", ") refused its ",
                       a[r * kEntry] == kBadInputs ? "inputs" : "targets", " for this step; its error says why");
    SHARDTORCH_CHECK(in[3] == out[11], me, ": the first stage's inputs have ", in[3],
                     " rows but the last stage's targets ", out[11],
                     "; both must hold the same samples (the pipeline's share of the batch)");
    std::vector<int64_t> sig(in + 1, in + 3 + kMaxDims);
    if (sig != signature) {
      signature = sig;
      shapes.clear();  // headers this step
    }
  }
  const bool headers = shapes.empty() && S > 1;
  const int64_t rows = signature[2];
  std::vector<int64_t> sizes(m);
  for (int i = 0; i < m; ++i) sizes[i] = rows / m + (i < rows % m ? 1 : 0);
  std::vector<at::Tensor> mb_inputs, mb_targets;
  if (first) mb_inputs = inputs.tensor_split(m, 0);
  if (last) mb_targets = targets.tensor_split(m, 0);

  // ---- One step's state, by (stage, micro-batch).
  std::map<std::pair<int, int>, at::Tensor> ins, outs, losses;
  std::map<std::pair<int, int>, Recv> recvs;
  std::map<std::pair<int, int>, Send> act_sends;
  std::vector<Send> grad_sends;
  at::Tensor loss_sum = at::zeros({}, at::kDouble);
  const auto out_dtype = options.shard().mixed_precision().output_dtype();
  // Gradient accumulation over steps: with the model's sync off
  // (ShardedModel::set_requires_gradient_sync(false)) no backward reduces and
  // the tied gradients wait for the step that does.
  const bool sync = sharded->requires_gradient_sync();

  // Where this rank is, for its peers' errors: the phase (the unit's forward,
  // a wait) and beside it the stage and micro-batch.
  Progress* progress = WorldAccess::progress(world);
  auto at = [&](const std::string& phase, int stage, int mb) {
    if (progress) progress->set_context("pipeline " + where(stage, mb));
    world.note_progress(phase);
  };
  auto post_recv = [&](Msg kind, int stage, int mb, int peer_stage) {
    auto key = std::make_pair(stage, mb);
    const std::string what = std::string(kind == Msg::Activation ? "the input" : "the gradient of the output") +
                             " of " + where(stage, mb) + " from stage " + std::to_string(peer_stage);
    Recv r;
    if (kind == Msg::Activation && headers) {
      r.buffer = at::empty({kHeader}, at::TensorOptions().dtype(at::kLong).device(comm.device()));
      r.header = true;
      r.work = comm.recv_async(r.buffer, pp_rank_of(peer_stage), tag(Msg::Header, stage, mb), what + " (its shape)");
    } else if (kind == Msg::Activation) {
      const auto& [shape, dtype] = shapes.at(key);
      r.buffer = at::empty(shape, at::TensorOptions().dtype(dtype).device(comm.device()));
      r.work = comm.recv_async(r.buffer, pp_rank_of(peer_stage), tag(Msg::Activation, stage, mb), what);
    } else {
      auto it = outs.find(key);
      if (it == outs.end()) return;  // its forward has not run yet: received when the backward needs it
      r.buffer = at::empty(it->second.sizes(), it->second.options().device(comm.device()));
      r.work = comm.recv_async(r.buffer, pp_rank_of(peer_stage), tag(Msg::Gradient, stage, mb), what);
    }
    (kind == Msg::Activation ? recvs[key] : recvs[{-1 - stage, mb}]) = std::move(r);
  };
  // Waits for what post_recv posted (posting it first if it could not be).
  auto take_recv = [&](Msg kind, int stage, int mb, int peer_stage) -> at::Tensor {
    auto key = kind == Msg::Activation ? std::make_pair(stage, mb) : std::make_pair(-1 - stage, mb);
    if (!recvs.count(key)) post_recv(kind, stage, mb, peer_stage);
    Recv r = std::move(recvs.at(key));
    recvs.erase(key);
    at("pipeline: waiting for " + std::string(kind == Msg::Activation ? "the input" : "the gradient") + " from stage " +
           std::to_string(peer_stage),
       stage, mb);
    comm.wait(r.work);
    if (r.header) {
      at::Tensor h = r.buffer.cpu();
      const int64_t* v = h.data_ptr<int64_t>();
      std::vector<int64_t> shape(v + 2, v + 2 + v[1]);
      const auto dtype = static_cast<at::ScalarType>(v[0]);
      shapes[{stage, mb}] = {shape, dtype};
      at::Tensor buf = at::empty(shape, at::TensorOptions().dtype(dtype).device(comm.device()));
      PendingWork w = comm.recv_async(buf, pp_rank_of(peer_stage), tag(Msg::Activation, stage, mb),
                                      "the input of " + where(stage, mb) + " from stage " + std::to_string(peer_stage));
      comm.wait(w);
      return buf;
    }
    return r.buffer;
  };
  auto record = [&](const Action& a, double start) {
    if (options.record_timeline()) timeline.push_back({a, start, seconds()});
  };

  try {
    for (const Action& a : plan.actions[rank]) {
      const double start = seconds();
      const auto key = std::make_pair(a.stage, a.microbatch);
      switch (a.kind) {
        case ActionKind::Unshard:
          world.note_progress("pipeline: gathering the stage's parameters");
          state->gather_for_step();
          break;
        case ActionKind::Reshard:
          state->release_step_gather();
          break;
        case ActionKind::RecvActivation:
          post_recv(Msg::Activation, a.stage, a.microbatch, a.peer_stage);
          break;
        case ActionKind::RecvGradient:
          post_recv(Msg::Gradient, a.stage, a.microbatch, a.peer_stage);
          break;
        case ActionKind::Forward: {
          at::Tensor x;
          if (a.stage == 0) {
            x = mb_inputs[a.microbatch];
          } else if (holds(a.stage - 1)) {  // the previous stage ran here
            x = outs.at({a.stage - 1, a.microbatch}).detach();
            if (!training) outs.erase({a.stage - 1, a.microbatch});
          } else {
            x = take_recv(Msg::Activation, a.stage, a.microbatch, a.peer_stage >= 0 ? a.peer_stage : a.stage - 1);
          }
          if (a.stage > 0 && x.is_floating_point()) x.requires_grad_(true);
          const double compute = seconds();
          at("pipeline forward", a.stage, a.microbatch);
          at::Tensor y = run_stage(a.stage, x);
          ins[key] = x;
          if (a.stage == S - 1) {
            if (out_dtype && y.is_floating_point() && y.scalar_type() != *out_dtype) y = y.to(*out_dtype);
            at::Tensor l = loss_fn(y, mb_targets[a.microbatch]);
            SHARDTORCH_CHECK(l.defined() && l.numel() == 1, me, ": the loss of ", where(a.stage, a.microbatch),
                             " is not one number (", l.defined() ? describe(l) : std::string("undefined"), ")");
            l = l.reshape({}) * (static_cast<double>(sizes[a.microbatch]) / static_cast<double>(rows));
            loss_sum += l.detach().to(at::kDouble).cpu();
            if (training) losses[key] = l;
          } else {
            outs[key] = y;
          }
          record(a, compute);
          continue;
        }
        case ActionKind::SendActivation: {
          Send s;
          s.buffer = outs.at(key).detach().contiguous();
          if (s.buffer.device() != comm.device()) s.buffer = s.buffer.to(comm.device());
          const std::string what =
              "the output of " + where(a.stage, a.microbatch) + " to stage " + std::to_string(a.peer_stage);
          const auto peer_key = std::make_pair(a.peer_stage, a.microbatch);
          if (headers) {
            shapes[peer_key] = {s.buffer.sizes().vec(), s.buffer.scalar_type()};
            s.header = at::tensor(header_of(s.buffer), at::kLong).to(comm.device());
            s.header_work = comm.send_async(s.header, pp_rank_of(a.peer_stage),
                                            tag(Msg::Header, a.peer_stage, a.microbatch), what + " (its shape)");
          } else {
            // Agreed in an earlier step: the receiver expects this shape and dtype.
            const auto& [shape, dtype] = shapes.at(peer_key);
            SHARDTORCH_CHECK(s.buffer.sizes().vec() == shape && s.buffer.scalar_type() == dtype, me, ": the output of ",
                             where(a.stage, a.microbatch), " is ", describe(s.buffer), " but was ",
                             c10::toString(dtype), c10::IntArrayRef(shape),
                             " in the step that agreed the shapes, with ",
                             "the same inputs; a stage's output shape must follow from its input's alone");
          }
          s.work = comm.send_async(s.buffer, pp_rank_of(a.peer_stage), tag(Msg::Activation, a.peer_stage, a.microbatch),
                                   what);
          act_sends[key] = std::move(s);
          if (!training) outs.erase(key);  // the send holds what it needs
          break;
        }
        case ActionKind::Backward: {
          // Its receiver has taken the output before sending its gradient back.
          if (auto it = act_sends.find(key); it != act_sends.end()) {
            if (it->second.header_work.pending()) comm.wait(it->second.header_work);
            comm.wait(it->second.work);
            act_sends.erase(it);
          }
          at::Tensor root, grad;
          if (a.stage == S - 1) {
            root = losses.at(key);
          } else {
            root = outs.at(key);
            grad = holds(a.stage + 1) ? ins.at({a.stage + 1, a.microbatch}).grad()
                                      : take_recv(Msg::Gradient, a.stage, a.microbatch, a.stage + 1);
            if (grad.defined() && grad.device() != root.device()) grad = grad.to(root.device());
          }
          const double compute = seconds();
          at("pipeline backward", a.stage, a.microbatch);
          sharded->set_requires_gradient_sync(a.reduce && sync);
          if (root.requires_grad()) {
            if (grad.defined() || a.stage == S - 1)
              torch::autograd::backward(
                  {root}, grad.defined() ? torch::autograd::variable_list{grad} : torch::autograd::variable_list{});
          }
          outs.erase(key);
          losses.erase(key);
          if (holds(a.stage + 1)) ins.erase({a.stage + 1, a.microbatch});  // its gradient is used
          record(a, compute);
          continue;
        }
        case ActionKind::SendGradient: {
          at::Tensor x = ins.at(key);
          Send s;
          s.buffer = x.grad().defined() ? x.grad().contiguous() : at::zeros_like(x);
          if (s.buffer.device() != comm.device()) s.buffer = s.buffer.to(comm.device());
          s.work = comm.send_async(s.buffer, pp_rank_of(a.peer_stage), tag(Msg::Gradient, a.stage - 1, a.microbatch),
                                   "the gradient of the input of " + where(a.stage, a.microbatch) + " to stage " +
                                       std::to_string(a.peer_stage));
          grad_sends.push_back(std::move(s));
          ins.erase(key);
          break;
        }
        case ActionKind::SyncTied:
          if (!sync) break;
          world.note_progress("pipeline: summing tied parameters' gradients");
          sync_tied();
          break;
      }
      record(a, start);
    }
    for (auto& s : grad_sends) comm.wait(s.work);
    for (auto& [k, s] : act_sends) {
      if (s.header_work.pending()) comm.wait(s.header_work);
      comm.wait(s.work);
    }
  } catch (...) {
    // The context stays: peers whose transfers fail next read where this rank stopped.
    // The shapes are agreed again in the next step: this one may have stopped between a header and its payload.
    signature.clear();
    shapes.clear();
    sharded->set_requires_gradient_sync(sync);
    state->release_step_gather();
    throw;
  }
  sharded->set_requires_gradient_sync(sync);
  // The loss, from the last stage to every stage.
  at::Tensor loss = loss_sum.to(at::kFloat).reshape({1}).to(comm.device());
  comm.broadcast(loss, pp_rank_of(S - 1), "the pipeline step's loss");
  if (progress) progress->set_context("");
  world.note_progress("pipeline step done");
  return loss.cpu().reshape({});
}

}  // namespace shardtorch::detail
