#include "comm/rejoin.h"

#include <thread>

#include "base/check.h"
#include "shardtorch/error.h"

namespace shardtorch::detail {

SetupJournal::Held hold(const at::Tensor& t, bool keep) {
  SetupJournal::Held h;
  h.sizes = t.sizes().vec();
  h.options = t.options();
  if (keep && t.numel() * static_cast<int64_t>(t.element_size()) <= SetupJournal::kKeptBytes)
    h.kept = t.detach().clone();
  return h;
}

at::Tensor SetupJournal::Held::make() const { return kept.defined() ? kept.clone() : at::zeros(sizes, options); }
at::Tensor SetupJournal::Held::make_out() const { return at::empty(sizes, options); }

namespace {
std::vector<SetupJournal::Held> hold_all(const std::vector<at::Tensor>& ts, bool keep) {
  std::vector<SetupJournal::Held> out;
  for (const auto& t : ts) out.push_back(hold(t, keep));
  return out;
}
std::vector<at::Tensor> make_all(const std::vector<SetupJournal::Held>& hs, bool out) {
  std::vector<at::Tensor> ts;
  for (const auto& h : hs) ts.push_back(out ? h.make_out() : h.make());
  return ts;
}
}  // namespace

SwappableBackend::SwappableBackend(c10::intrusive_ptr<c10d::Backend> inner, std::shared_ptr<SetupJournal> journal,
                                   int id)
    : c10d::Backend(inner->getRank(), inner->getSize()),
      inner_(inner),
      name_(inner->getBackendName()),
      journal_(std::move(journal)),
      id_(id) {}

SwappableBackend::~SwappableBackend() { journal_->forget(id_); }

c10::intrusive_ptr<c10d::Backend> SwappableBackend::inner() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!inner_)
    throw Error("shardtorch: rank " + std::to_string(getRank()) + " of a group of " + std::to_string(getSize()) +
                ": its connection was closed for a rejoin (World::rejoin) and is not made again yet");
  return inner_;
}

void SwappableBackend::swap(c10::intrusive_ptr<c10d::Backend> inner) {
  std::lock_guard<std::mutex> lock(mu_);
  inner_ = std::move(inner);
}

const std::string SwappableBackend::getBackendName() const { return name_; }
void SwappableBackend::setTimeout(std::chrono::milliseconds timeout) { inner()->setTimeout(timeout); }

c10::intrusive_ptr<c10d::Work> SwappableBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  if (journal_->recording()) {
    SetupJournal::Entry e;
    e.kind = SetupJournal::Kind::Broadcast;
    e.backend = id_;
    e.in = hold_all(tensors, /*keep=*/getRank() == opts.rootRank);
    e.root = opts.rootRank;
    journal_->record(std::move(e));
  }
  return inner()->broadcast(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> SwappableBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  if (journal_->recording()) {
    SetupJournal::Entry e;
    e.kind = SetupJournal::Kind::AllReduce;
    e.backend = id_;
    e.in = hold_all(tensors, true);
    e.op = opts.reduceOp;
    journal_->record(std::move(e));
  }
  return inner()->allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> SwappableBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) {
  if (journal_->recording()) {
    SetupJournal::Entry e;
    e.kind = SetupJournal::Kind::AllGather;
    e.backend = id_;
    e.in = hold_all(inputs, true);
    for (const auto& list : outputs) {
      SHARDTORCH_CHECK(list.size() == static_cast<size_t>(getSize()),
                       "shardtorch: internal: an all-gather's outputs are not one per member");
      e.out.push_back(hold(list.front(), false));
    }
    journal_->record(std::move(e));
  }
  return inner()->allgather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> SwappableBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::AllgatherOptions& opts) {
  if (journal_->recording()) {
    SetupJournal::Entry e;
    e.kind = SetupJournal::Kind::AllGatherBase;
    e.backend = id_;
    e.in = {hold(input, true)};
    e.out = {hold(output, false)};
    journal_->record(std::move(e));
  }
  return inner()->_allgather_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> SwappableBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::ReduceScatterOptions& opts) {
  if (journal_->recording()) {
    SetupJournal::Entry e;
    e.kind = SetupJournal::Kind::ReduceScatterBase;
    e.backend = id_;
    e.in = {hold(input, true)};
    e.out = {hold(output, false)};
    e.op = opts.reduceOp;
    journal_->record(std::move(e));
  }
  return inner()->_reduce_scatter_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> SwappableBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  if (journal_->recording()) {
    SetupJournal::Entry e;
    e.kind = SetupJournal::Kind::Send;
    e.backend = id_;
    e.in = hold_all(tensors, true);
    e.root = dst;
    e.tag = tag;
    journal_->record(std::move(e));
  }
  return inner()->send(tensors, dst, tag);
}

c10::intrusive_ptr<c10d::Work> SwappableBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  if (journal_->recording()) {
    SetupJournal::Entry e;
    e.kind = SetupJournal::Kind::Recv;
    e.backend = id_;
    e.out = hold_all(tensors, false);
    e.root = src;
    e.tag = tag;
    journal_->record(std::move(e));
  }
  return inner()->recv(tensors, src, tag);
}

c10::intrusive_ptr<c10d::Work> SwappableBackend::barrier(const c10d::BarrierOptions& opts) {
  if (journal_->recording()) {
    SetupJournal::Entry e;
    e.kind = SetupJournal::Kind::Barrier;
    e.backend = id_;
    journal_->record(std::move(e));
  }
  return inner()->barrier(opts);
}

c10::intrusive_ptr<SwappableBackend> SetupJournal::connect(std::shared_ptr<SetupJournal> self, Connect connect,
                                                           const c10::intrusive_ptr<c10d::Store>& store) {
  auto inner = connect(store);
  std::lock_guard<std::mutex> lock(mu_);
  const int id = static_cast<int>(connects_.size());
  auto b = c10::make_intrusive<SwappableBackend>(std::move(inner), std::move(self), id);
  connects_.push_back(std::move(connect));
  alive_.push_back(b.get());
  Entry e;
  e.kind = Kind::Connect;
  e.backend = id;
  entries_.push_back(std::move(e));
  return b;
}

void SetupJournal::record(Entry e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (recording_.load()) entries_.push_back(std::move(e));
}

void SetupJournal::disconnect() {
  std::vector<c10::intrusive_ptr<c10d::Backend>> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto* b : alive_)
      if (b) {
        std::lock_guard<std::mutex> inner_lock(b->mu_);
        old.push_back(std::move(b->inner_));
      }
  }
  old.clear();  // destroyed here: their connections close
}

void SetupJournal::forget(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  alive_[static_cast<size_t>(id)] = nullptr;
}

size_t SetupJournal::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

void SetupJournal::replay(const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<c10::intrusive_ptr<c10d::Backend>> made(connects_.size());
  for (const Entry& e : entries_) {
    if (e.kind == Kind::Connect) {
      made[static_cast<size_t>(e.backend)] = connects_[static_cast<size_t>(e.backend)](store);
      continue;
    }
    auto& b = made[static_cast<size_t>(e.backend)];
    SHARDTORCH_CHECK(b, "shardtorch: internal: the set-up's journal uses a backend before it connects it");
    c10::intrusive_ptr<c10d::Work> w;
    std::vector<at::Tensor> in = make_all(e.in, false), out = make_all(e.out, true);
    switch (e.kind) {
      case Kind::Broadcast: {
        c10d::BroadcastOptions o;
        o.rootRank = e.root;
        o.timeout = timeout;
        w = b->broadcast(in, o);
        break;
      }
      case Kind::AllReduce: {
        c10d::AllreduceOptions o;
        o.reduceOp = e.op;
        o.timeout = timeout;
        w = b->allreduce(in, o);
        break;
      }
      case Kind::AllGather: {
        std::vector<std::vector<at::Tensor>> outs;
        for (const auto& h : e.out) {
          outs.emplace_back();
          for (int r = 0; r < b->getSize(); ++r) outs.back().push_back(h.make_out());
        }
        c10d::AllgatherOptions o;
        o.timeout = timeout;
        w = b->allgather(outs, in, o);
        break;
      }
      case Kind::AllGatherBase: {
        c10d::AllgatherOptions o;
        o.timeout = timeout;
        w = b->_allgather_base(out[0], in[0], o);
        break;
      }
      case Kind::ReduceScatterBase: {
        c10d::ReduceScatterOptions o;
        o.reduceOp = e.op;
        o.timeout = timeout;
        w = b->_reduce_scatter_base(out[0], in[0], o);
        break;
      }
      case Kind::Send:
        w = b->send(in, static_cast<int>(e.root), e.tag);
        break;
      case Kind::Recv:
        w = b->recv(out, static_cast<int>(e.root), e.tag);
        break;
      case Kind::Barrier: {
        c10d::BarrierOptions o;
        o.timeout = timeout;
        w = b->barrier(o);
        break;
      }
      case Kind::Connect:
        break;
    }
    w->wait(timeout);
  }
  for (size_t id = 0; id < made.size(); ++id)
    if (alive_[id]) alive_[id]->swap(made[id]);
}

std::string epoch_prefix(int64_t epoch) { return "epoch/" + std::to_string(epoch); }

namespace {

constexpr const char* kEpochKey = "rejoin/epoch";
std::string arrived_key(int64_t epoch) { return "rejoin/" + std::to_string(epoch) + "/arrived"; }
std::string seconds_of(std::chrono::milliseconds t) {
  return std::to_string(t.count() / 1000) + "." + std::to_string(t.count() % 1000 / 100) + " s";
}

// Every rank arrives at `epoch`, or moves on to a later one opened meanwhile.
int64_t settle(c10d::Store& base, int64_t epoch, int rank, int size, std::chrono::steady_clock::time_point deadline,
               std::chrono::milliseconds timeout) {
  for (;;) {
    base.add(arrived_key(epoch), 1);
    for (;;) {
      const int64_t latest = base.add(kEpochKey, 0);
      if (latest > epoch) {
        epoch = latest;
        break;
      }
      const int64_t arrived = base.add(arrived_key(epoch), 0);
      if (arrived >= size) return epoch;
      if (std::chrono::steady_clock::now() > deadline)
        throw Error(rank_prefix(rank) + " waited " + seconds_of(timeout) + " for every rank to join again after a " +
                    "rank was lost (epoch " + std::to_string(epoch) + "): " + std::to_string(arrived) + " of " +
                    std::to_string(size) + " arrived; a rank still running must call Snapshots::rejoin() (or " +
                    "World::rejoin()) after its step failed, and each lost rank needs a replacement started " +
                    "with SHARDTORCH_REJOIN=1");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
}

}  // namespace

int64_t join_as_replacement(c10d::Store& base, int rank, int size, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  return settle(base, base.add(kEpochKey, 1), rank, size, deadline, timeout);
}

int64_t await_replacement(c10d::Store& base, int64_t epoch, int rank, int size, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int64_t latest = base.add(kEpochKey, 0);
  while (latest <= epoch) {
    if (std::chrono::steady_clock::now() > deadline)
      throw Error(rank_prefix(rank) + " waited " + seconds_of(timeout) + " for a replacement of the lost rank to " +
                  "join: start it with SHARDTORCH_REJOIN=1 (the same program, rank and store; " +
                  "docs/fault_tolerance.md, \"Survivors that stay alive\")");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    latest = base.add(kEpochKey, 0);
  }
  return settle(base, latest, rank, size, deadline, timeout);
}

}  // namespace shardtorch::detail
