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
// verdict on its own inputs and targets; with data-parallel replicas, the
// first stages' rows are compared over the dp group before it); when they differ from the last
// step's, each activation is preceded by a header with its dtype and shape,
// and the shapes are kept for the steps that follow.
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <map>
#include <set>
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

// The micro-batches of one step, as every rank of the pipeline group agreed
// on them.
struct StepBatch {
  /// Checks this rank's own inputs and targets, splits them into `m`
  /// micro-batches and posts the agreement (an all-gather over the pipeline
  /// group of every rank's verdict and the inputs' shape). `me`: this rank
  /// and the call, for errors; `training`: gradients will be averaged over
  /// the data-parallel replicas, whose rows must then be equal.
  StepBatch(PipelineRuntime& rt, Comm& comm, int m, const std::string& me, bool training, const at::Tensor& inputs,
            const at::Tensor& targets);
  /// Waits for the agreement and throws on every rank if any rank refused
  /// its inputs or targets; then `headers`, `rows` and `sizes` hold.
  void agree();
  bool agreed() const { return agreed_; }
  /// Whether `a` may run before the agreement: the first stage's forward
  /// (its inputs are its own and checked) and the gather of the stage's
  /// parameters (another group), on a rank that holds no last stage. Nothing
  /// is sent before every rank has agreed.
  bool may_run_before_agreement(const Action& a) const;

  bool headers = false;  // activations are preceded by their shapes
  int64_t rows = 0;
  std::vector<int64_t> sizes;  // rows per micro-batch
  std::vector<at::Tensor> inputs, targets;

 private:
  PipelineRuntime& rt_;
  Comm& comm_;
  const int m_;
  const std::string me_;
  std::string my_error_;
  /// On a first stage with data-parallel replicas: every replica's rows
  /// (-1: refused already) compared, a difference this rank's error.
  void check_replicas(int64_t rows, std::vector<int64_t>& entry);
  bool agreed_ = false, early_ = false;
  at::Tensor mine_, all_;
  PendingWork pending_;
};

// Where this rank is in a step, for its peers' errors (the phase beside the
// stage and micro-batch), and the timeline of its actions.
class StepTrace {
 public:
  StepTrace(PipelineRuntime& rt, World& world)
      : rt_(rt), world_(world), t0_(std::chrono::steady_clock::now()), progress_(WorldAccess::progress(world)) {}
  /// Seconds since the step started.
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count(); }
  // The phase (the unit's forward, a wait) and beside it the stage and micro-batch.
  void at(const std::string& phase, int stage, int mb) {
    if (progress_) progress_->set_context("pipeline " + rt_.where(stage, mb));
    world_.note_progress(phase);
  }
  void record(const Action& a, double start) {
    if (rt_.options.record_timeline()) rt_.timeline.push_back({a, start, seconds()});
  }
  /// The step is done: no stage and micro-batch beside the phase.
  void clear_context() {
    if (progress_) progress_->set_context("");
  }

 private:
  PipelineRuntime& rt_;
  World& world_;
  const std::chrono::steady_clock::time_point t0_;
  Progress* progress_;
};

// One run of a plan on this rank: the agreement on its inputs, its actions
// in order, and what they keep between them, by (stage, micro-batch).
class StepRun {
 public:
  /// Agrees on the step's micro-batches (StepBatch): collective over the pipeline group.
  StepRun(PipelineRuntime& rt, const pipeline::Plan& plan, bool training, const Pipeline::LossFn& loss_fn,
          const at::Tensor& inputs, const at::Tensor& targets)
      : rt_(rt),
        plan_(plan),
        training_(training),
        loss_fn_(loss_fn),
        world_(*rt.mesh->world()),
        comm_(rt.pp->comm()),
        m_(plan.microbatches),
        S_(rt.stages()),
        me_(rank_prefix(world_.global_rank()) + (training ? ": Pipeline::step" : ": Pipeline::evaluate")),
        out_dtype_(rt.options.shard().mixed_precision().output_dtype()),
        sync_(rt.sharded->requires_gradient_sync()),
        trace_(rt, world_),
        batch_(rt, comm_, m_, me_, training, inputs, targets) {}

  /// This rank's actions, then the wait for its sends.
  void run_actions();
  /// The loss, from the last stage to every stage (collective).
  at::Tensor finish();
  /// After a failure: the state that must not outlive the step.
  void abandon();

 private:
  void post_recv(Msg kind, int stage, int mb, int peer_stage);
  at::Tensor take_recv(Msg kind, int stage, int mb, int peer_stage);
  // Forward and Backward return when their compute started (after their receive).
  double forward(const Action& a);
  double backward(const Action& a);
  void send_activation(const Action& a);
  void send_gradient(const Action& a);
  void post_gradient_send(int stage, int mb, const at::Tensor& grad);

  PipelineRuntime& rt_;
  const pipeline::Plan& plan_;
  const bool training_;
  const Pipeline::LossFn& loss_fn_;
  World& world_;
  Comm& comm_;
  const int m_, S_;
  const std::string me_;
  const std::optional<at::ScalarType> out_dtype_;
  // Gradient accumulation over steps: with the model's sync off
  // (ShardedModel::set_requires_gradient_sync(false)) no backward reduces and
  // the tied gradients wait for the step that does.
  const bool sync_;
  StepTrace trace_;
  StepBatch batch_;

  std::map<std::pair<int, int>, at::Tensor> ins_, outs_, losses_;
  std::map<std::pair<int, int>, Recv> recvs_;  // activations by (stage, mb); gradients by (-1 - stage, mb)
  std::map<std::pair<int, int>, Send> act_sends_;
  std::vector<Send> grad_sends_;
  std::set<std::pair<int, int>> sent_in_backward_;  // input gradients sent as their backward computed them
  at::Tensor loss_sum_ = at::zeros({}, at::kDouble);
};

StepBatch::StepBatch(PipelineRuntime& rt, Comm& comm, int m, const std::string& me, bool training,
                     const at::Tensor& inputs, const at::Tensor& targets)
    : rt_(rt), comm_(comm), m_(m), me_(me) {
  const int S = rt.stages();
  const bool first = rt.holds(0), last = rt.holds(S - 1);
  std::vector<int64_t> entry(kEntry, 0);
  if (first) {
    if (!inputs.defined() || inputs.dim() < 1 || inputs.dim() > kMaxDims || inputs.size(0) < m) {
      my_error_ = "the first stage's inputs must be a tensor of 1 to " + std::to_string(kMaxDims) +
                  " dimensions with at least " + std::to_string(m) + " rows (one per micro-batch), got " +
                  (inputs.defined() ? describe(inputs) : std::string("an undefined tensor"));
      entry[0] = kBadInputs;
    } else {
      entry[1] = static_cast<int64_t>(inputs.scalar_type());
      entry[2] = inputs.dim();
      for (int64_t d = 0; d < inputs.dim(); ++d) entry[3 + d] = inputs.size(d);
    }
    if (training && rt.dp->size() > 1) check_replicas(my_error_.empty() ? inputs.size(0) : -1, entry);
  }
  if (last) {
    if (!targets.defined() || targets.dim() < 1) {
      my_error_ = "the last stage's targets must be a tensor of at least one dimension, got " +
                  (targets.defined() ? describe(targets) : std::string("an undefined tensor"));
      entry[0] = kBadTargets;
    } else {
      entry[11] = targets.size(0);
    }
  }
  early_ = first && !last && my_error_.empty();
  mine_ = at::tensor(entry, at::kLong).to(comm.device());
  all_ = at::empty({comm.size() * kEntry}, mine_.options());
  pending_ = comm.all_gather_async(all_, mine_, "the agreement on a pipeline step's inputs");
  if (first && my_error_.empty()) this->inputs = inputs.tensor_split(m, 0);
  if (last && my_error_.empty()) this->targets = targets.tensor_split(m, 0);
}

void StepBatch::check_replicas(int64_t rows, std::vector<int64_t>& entry) {
  Comm& dp = rt_.dp->comm();
  at::Tensor mine = at::tensor({rows}, at::kLong).to(dp.device());
  at::Tensor all = at::empty({dp.size()}, mine.options());
  dp.all_gather_into(all, mine, "the data-parallel replicas' rows of a pipeline step");
  all = all.cpu();
  std::string list;
  bool same = true;
  for (int r = 0; r < dp.size(); ++r) {
    const int64_t n = all[r].item<int64_t>();
    same = same && (n < 0 || rows < 0 || n == rows);
    list += (r ? ", " : "") + std::to_string(n) + " on rank " + std::to_string(dp.global_rank(r));
  }
  if (same) return;
  my_error_ = "the data-parallel replicas' first stages got different numbers of rows (" + list +
              "); their gradients are averaged, which is the whole batch's gradient only when every replica holds "
              "as many rows: give each the same number";
  entry[0] = kBadInputs;
}

bool StepBatch::may_run_before_agreement(const Action& a) const {
  return early_ && ((a.kind == ActionKind::Forward && a.stage == 0) || a.kind == ActionKind::Unshard);
}

void StepBatch::agree() {
  if (agreed_) return;
  comm_.wait(pending_);
  agreed_ = true;
  const int S = rt_.stages();
  at::Tensor all = all_.cpu();
  const int64_t* a = all.data_ptr<int64_t>();
  const int64_t* in = a + rt_.pp_rank_of(0) * kEntry;
  const int64_t* out = a + rt_.pp_rank_of(S - 1) * kEntry;
  SHARDTORCH_CHECK(my_error_.empty(), me_, ": ", my_error_);
  for (int r = 0; r < comm_.size(); ++r)
    SHARDTORCH_CHECK(a[r * kEntry] == 0, me_, ": rank ", rt_.pp->global_rank_of(r), " (",
                     a[r * kEntry] == kBadInputs ? "the first stage" : "the last stage", ") refused its ",
                     a[r * kEntry] == kBadInputs ? "inputs" : "targets", " for this step; its error says why");
  SHARDTORCH_CHECK(in[3] == out[11], me_, ": the first stage's inputs have ", in[3],
                   " rows but the last stage's targets ", out[11],
                   "; both must hold the same samples (the pipeline's share of the batch)");
  std::vector<int64_t> sig(in + 1, in + 3 + kMaxDims);
  if (sig != rt_.signature) {
    rt_.signature = sig;
    rt_.shapes.clear();  // headers this step
  }
  headers = rt_.shapes.empty() && S > 1;
  rows = rt_.signature[2];
  sizes.resize(m_);
  for (int i = 0; i < m_; ++i) sizes[i] = rows / m_ + (i < rows % m_ ? 1 : 0);
}

void StepRun::post_recv(Msg kind, int stage, int mb, int peer_stage) {
  auto key = std::make_pair(stage, mb);
  const std::string what = std::string(kind == Msg::Activation ? "the input" : "the gradient of the output") + " of " +
                           rt_.where(stage, mb) + " from stage " + std::to_string(peer_stage);
  const int peer = rt_.pp_rank_of(peer_stage);
  Recv r;
  if (kind == Msg::Activation && batch_.headers) {
    r.buffer = at::empty({kHeader}, at::TensorOptions().dtype(at::kLong).device(comm_.device()));
    r.header = true;
    r.work = comm_.recv_async(r.buffer, peer, tag(Msg::Header, stage, mb), what + " (its shape)");
  } else if (kind == Msg::Activation) {
    const auto& [shape, dtype] = rt_.shapes.at(key);
    r.buffer = at::empty(shape, at::TensorOptions().dtype(dtype).device(comm_.device()));
    r.work = comm_.recv_async(r.buffer, peer, tag(Msg::Activation, stage, mb), what);
  } else {
    auto it = outs_.find(key);
    if (it == outs_.end()) return;  // its forward has not run yet: received when the backward needs it
    r.buffer = at::empty(it->second.sizes(), it->second.options().device(comm_.device()));
    r.work = comm_.recv_async(r.buffer, peer, tag(Msg::Gradient, stage, mb), what);
  }
  (kind == Msg::Activation ? recvs_[key] : recvs_[{-1 - stage, mb}]) = std::move(r);
}

// Waits for what post_recv posted (posting it first if it could not be).
at::Tensor StepRun::take_recv(Msg kind, int stage, int mb, int peer_stage) {
  auto key = kind == Msg::Activation ? std::make_pair(stage, mb) : std::make_pair(-1 - stage, mb);
  if (!recvs_.count(key)) post_recv(kind, stage, mb, peer_stage);
  Recv r = std::move(recvs_.at(key));
  recvs_.erase(key);
  trace_.at("pipeline: waiting for " + std::string(kind == Msg::Activation ? "the input" : "the gradient") +
                " from stage " + std::to_string(peer_stage),
            stage, mb);
  comm_.wait(r.work);
  if (!r.header) return r.buffer;
  at::Tensor h = r.buffer.cpu();
  const int64_t* v = h.data_ptr<int64_t>();
  std::vector<int64_t> shape(v + 2, v + 2 + v[1]);
  const auto dtype = static_cast<at::ScalarType>(v[0]);
  rt_.shapes[{stage, mb}] = {shape, dtype};
  at::Tensor buf = at::empty(shape, at::TensorOptions().dtype(dtype).device(comm_.device()));
  PendingWork w =
      comm_.recv_async(buf, rt_.pp_rank_of(peer_stage), tag(Msg::Activation, stage, mb),
                       "the input of " + rt_.where(stage, mb) + " from stage " + std::to_string(peer_stage));
  comm_.wait(w);
  return buf;
}

double StepRun::forward(const Action& a) {
  const auto key = std::make_pair(a.stage, a.microbatch);
  at::Tensor x;
  if (a.stage == 0) {
    x = batch_.inputs[a.microbatch];
  } else if (rt_.holds(a.stage - 1)) {  // the previous stage ran here
    x = outs_.at({a.stage - 1, a.microbatch}).detach();
    if (!training_) outs_.erase({a.stage - 1, a.microbatch});
  } else {
    x = take_recv(Msg::Activation, a.stage, a.microbatch, a.peer_stage >= 0 ? a.peer_stage : a.stage - 1);
  }
  if (a.stage > 0 && x.is_floating_point()) x.requires_grad_(true);
  const double compute = trace_.seconds();
  trace_.at("pipeline forward", a.stage, a.microbatch);
  at::Tensor y = rt_.run_stage(a.stage, x);
  ins_[key] = x;
  if (a.stage != S_ - 1) {
    outs_[key] = y;
    return compute;
  }
  if (out_dtype_ && y.is_floating_point() && y.scalar_type() != *out_dtype_) y = y.to(*out_dtype_);
  at::Tensor l = loss_fn_(y, batch_.targets[a.microbatch]);
  SHARDTORCH_CHECK(l.defined() && l.numel() == 1, me_, ": the loss of ", rt_.where(a.stage, a.microbatch),
                   " is not one number (", l.defined() ? describe(l) : std::string("undefined"), ")");
  l = l.reshape({}) * (static_cast<double>(batch_.sizes[a.microbatch]) / static_cast<double>(batch_.rows));
  loss_sum_ += l.detach().to(at::kDouble).cpu();
  if (training_) losses_[key] = l;
  return compute;
}

void StepRun::send_activation(const Action& a) {
  const auto key = std::make_pair(a.stage, a.microbatch);
  Send s;
  s.buffer = outs_.at(key).detach().contiguous();
  if (s.buffer.device() != comm_.device()) s.buffer = s.buffer.to(comm_.device());
  const std::string what =
      "the output of " + rt_.where(a.stage, a.microbatch) + " to stage " + std::to_string(a.peer_stage);
  const auto peer_key = std::make_pair(a.peer_stage, a.microbatch);
  const int peer = rt_.pp_rank_of(a.peer_stage);
  if (batch_.headers) {
    rt_.shapes[peer_key] = {s.buffer.sizes().vec(), s.buffer.scalar_type()};
    s.header = at::tensor(header_of(s.buffer), at::kLong).to(comm_.device());
    s.header_work =
        comm_.send_async(s.header, peer, tag(Msg::Header, a.peer_stage, a.microbatch), what + " (its shape)");
  } else {
    // Agreed in an earlier step: the receiver expects this shape and dtype.
    const auto& [shape, dtype] = rt_.shapes.at(peer_key);
    SHARDTORCH_CHECK(s.buffer.sizes().vec() == shape && s.buffer.scalar_type() == dtype, me_, ": the output of ",
                     rt_.where(a.stage, a.microbatch), " is ", describe(s.buffer), " but was ", c10::toString(dtype),
                     c10::IntArrayRef(shape), " in the step that agreed the shapes, with ",
                     "the same inputs; a stage's output shape must follow from its input's alone");
  }
  s.work = comm_.send_async(s.buffer, peer, tag(Msg::Activation, a.peer_stage, a.microbatch), what);
  act_sends_[key] = std::move(s);
  if (!training_) outs_.erase(key);  // the send holds what it needs
}

double StepRun::backward(const Action& a) {
  const auto key = std::make_pair(a.stage, a.microbatch);
  // Its receiver has taken the output before sending its gradient back.
  if (auto it = act_sends_.find(key); it != act_sends_.end()) {
    if (it->second.header_work.pending()) comm_.wait(it->second.header_work);
    comm_.wait(it->second.work);
    act_sends_.erase(it);
  }
  at::Tensor root, grad;
  if (a.stage == S_ - 1) {
    root = losses_.at(key);
  } else {
    root = outs_.at(key);
    grad = rt_.holds(a.stage + 1) ? ins_.at({a.stage + 1, a.microbatch}).grad()
                                  : take_recv(Msg::Gradient, a.stage, a.microbatch, a.stage + 1);
    if (grad.defined() && grad.device() != root.device()) grad = grad.to(root.device());
  }
  const double compute = trace_.seconds();
  trace_.at("pipeline backward", a.stage, a.microbatch);
  // The input's gradient leaves as soon as the backward computes it, before
  // the backward's end (where the last one reduces the stage's gradients):
  // the previous stage waits for it. On the CPU, where the hook runs on this
  // thread; elsewhere SendGradient sends it.
  if (a.stage > 0 && !rt_.holds(a.stage - 1) && comm_.device().is_cpu()) {
    at::Tensor x = ins_.at(key);
    if (x.requires_grad())
      x.register_hook([this, stage = a.stage, mb = a.microbatch](const at::Tensor& g) {
        post_gradient_send(stage, mb, g);
        sent_in_backward_.insert({stage, mb});
        return at::Tensor();
      });
  }
  rt_.sharded->set_requires_gradient_sync(a.reduce && sync_);
  if (root.requires_grad() && (grad.defined() || a.stage == S_ - 1))
    torch::autograd::backward({root},
                              grad.defined() ? torch::autograd::variable_list{grad} : torch::autograd::variable_list{});
  outs_.erase(key);
  losses_.erase(key);
  if (rt_.holds(a.stage + 1)) ins_.erase({a.stage + 1, a.microbatch});  // its gradient is used
  return compute;
}

void StepRun::post_gradient_send(int stage, int mb, const at::Tensor& grad) {
  Send s;
  s.buffer = grad.contiguous();
  if (s.buffer.device() != comm_.device()) s.buffer = s.buffer.to(comm_.device());
  s.work = comm_.send_async(
      s.buffer, rt_.pp_rank_of(stage - 1), tag(Msg::Gradient, stage - 1, mb),
      "the gradient of the input of " + rt_.where(stage, mb) + " to stage " + std::to_string(stage - 1));
  grad_sends_.push_back(std::move(s));
}

void StepRun::send_gradient(const Action& a) {
  const auto key = std::make_pair(a.stage, a.microbatch);
  if (sent_in_backward_.erase(key) == 0) {
    at::Tensor x = ins_.at(key);
    post_gradient_send(a.stage, a.microbatch, x.grad().defined() ? x.grad() : at::zeros_like(x));
  }
  ins_.erase(key);
}

void StepRun::run_actions() {
  for (const Action& a : plan_.actions[rt_.rank]) {
    if (!batch_.agreed() && !batch_.may_run_before_agreement(a)) batch_.agree();
    double start = trace_.seconds();
    switch (a.kind) {
      case ActionKind::Unshard:
        world_.note_progress("pipeline: gathering the stage's parameters");
        rt_.state->gathers().gather_for_step();
        break;
      case ActionKind::Reshard:
        rt_.state->gathers().release_step_gather();
        break;
      case ActionKind::RecvActivation:
        post_recv(Msg::Activation, a.stage, a.microbatch, a.peer_stage);
        break;
      case ActionKind::RecvGradient:
        post_recv(Msg::Gradient, a.stage, a.microbatch, a.peer_stage);
        break;
      case ActionKind::Forward:
        start = forward(a);
        break;
      case ActionKind::SendActivation:
        send_activation(a);
        break;
      case ActionKind::Backward:
        start = backward(a);
        break;
      case ActionKind::SendGradient:
        send_gradient(a);
        break;
      case ActionKind::SyncTied:
        if (!sync_) break;
        world_.note_progress("pipeline: summing tied parameters' gradients");
        rt_.sync_tied();
        break;
    }
    trace_.record(a, start);
  }
  batch_.agree();
  for (auto& s : grad_sends_) comm_.wait(s.work);
  for (auto& [k, s] : act_sends_) {
    if (s.header_work.pending()) comm_.wait(s.header_work);
    comm_.wait(s.work);
  }
  rt_.sharded->set_requires_gradient_sync(sync_);
}

at::Tensor StepRun::finish() {
  at::Tensor loss = loss_sum_.to(at::kFloat).reshape({1}).to(comm_.device());
  comm_.broadcast(loss, rt_.pp_rank_of(S_ - 1), "the pipeline step's loss");
  trace_.clear_context();
  world_.note_progress("pipeline step done");
  return loss.cpu().reshape({});
}

void StepRun::abandon() {
  // The context stays: peers whose transfers fail next read where this rank stopped.
  // The shapes are agreed again in the next step: this one may have stopped between a header and its payload.
  rt_.signature.clear();
  rt_.shapes.clear();
  rt_.sharded->set_requires_gradient_sync(sync_);
  rt_.state->gathers().release_step_gather();
}

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
  timeline.clear();
  timeline_of_evaluation = !training;
  StepRun run(*this, plan, training, loss_fn, inputs, targets);  // agrees on the inputs (StepBatch)
  try {
    run.run_actions();
  } catch (...) {
    run.abandon();
    if (auto* progress = WorldAccess::progress(*mesh->world())) progress->raised();  // for peers, if it ends here
    throw;
  }
  return run.finish();
}

}  // namespace shardtorch::detail
