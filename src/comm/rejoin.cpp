#include "comm/rejoin.h"

#include <algorithm>
#include <thread>

#include "base/check.h"
#include "shardtorch/error.h"

namespace shardtorch::detail {

SetupJournal::Held hold(const at::Tensor& t, bool keep) {
  SetupJournal::Held h;
  h.sizes = t.sizes().vec();
  h.options = t.options();
  const bool large = t.numel() * static_cast<int64_t>(t.element_size()) > SetupJournal::kKeptBytes;
  if (keep && !(large && at::isFloatingType(t.scalar_type()))) h.kept = t.detach().clone();
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

c10::intrusive_ptr<c10d::Backend> SwappableBackend::connected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return inner_;
}

c10::intrusive_ptr<c10d::Backend> SwappableBackend::inner() const {
  auto b = connected();
  if (!b)
    throw Error("shardtorch: member " + std::to_string(getRank()) + " of a group of " + std::to_string(getSize()) +
                ": its connection was closed for a rejoin (World::rejoin) that did not complete; this process "
                "cannot take part in the job any more: end it (and, if no rank can rejoin, start the job again)");
  return b;
}

void SwappableBackend::unreplayable(const char* op) {
  if (journal_->recording()) journal_->not_replayable(op);
}

c10::intrusive_ptr<c10d::Work> SwappableBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                     const c10d::AllreduceCoalescedOptions& opts) {
  unreplayable("allreduce_coalesced");
  return inner()->allreduce_coalesced(tensors, opts);
}
c10::intrusive_ptr<c10d::Work> SwappableBackend::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  unreplayable("reduce");
  return inner()->reduce(tensors, opts);
}
c10::intrusive_ptr<c10d::Work> SwappableBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                     std::vector<at::Tensor>& inputs,
                                                                     const c10d::AllgatherOptions& opts) {
  unreplayable("allgather_coalesced");
  return inner()->allgather_coalesced(outputs, inputs, opts);
}
c10::intrusive_ptr<c10d::Work> SwappableBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                 std::vector<at::Tensor>& inputs,
                                                                                 const c10d::AllgatherOptions& opts) {
  unreplayable("allgather_into_tensor_coalesced");
  return inner()->allgather_into_tensor_coalesced(outputs, inputs, opts);
}
c10::intrusive_ptr<c10d::Work> SwappableBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::GatherOptions& opts) {
  unreplayable("gather");
  return inner()->gather(outputs, inputs, opts);
}
c10::intrusive_ptr<c10d::Work> SwappableBackend::scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ScatterOptions& opts) {
  unreplayable("scatter");
  return inner()->scatter(outputs, inputs, opts);
}
c10::intrusive_ptr<c10d::Work> SwappableBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                                const c10d::ReduceScatterOptions& opts) {
  unreplayable("reduce_scatter");
  return inner()->reduce_scatter(outputs, inputs, opts);
}
c10::intrusive_ptr<c10d::Work> SwappableBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  unreplayable("reduce_scatter_tensor_coalesced");
  return inner()->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}
c10::intrusive_ptr<c10d::Work> SwappableBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                               std::vector<int64_t>& output_split_sizes,
                                                               std::vector<int64_t>& input_split_sizes,
                                                               const c10d::AllToAllOptions& opts) {
  unreplayable("alltoall_base");
  return inner()->alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
}
c10::intrusive_ptr<c10d::Work> SwappableBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllToAllOptions& opts) {
  unreplayable("alltoall");
  return inner()->alltoall(outputs, inputs, opts);
}
c10::intrusive_ptr<c10d::Work> SwappableBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  unreplayable("recvAnysource");
  return inner()->recvAnysource(tensors, tag);
}
void SwappableBackend::startCoalescing() {
  unreplayable("startCoalescing");
  inner()->startCoalescing();
}
c10::intrusive_ptr<c10d::Work> SwappableBackend::endCoalescing() { return inner()->endCoalescing(); }
bool SwappableBackend::supportsCoalescing() const { return inner()->supportsCoalescing(); }
void SwappableBackend::abort() {
  if (auto b = connected()) b->abort();
}
void SwappableBackend::shutdown() {
  if (auto b = connected()) b->shutdown();
}

void SwappableBackend::swap(c10::intrusive_ptr<c10d::Backend> inner) {
  std::lock_guard<std::mutex> lock(mu_);
  inner_ = std::move(inner);
}

const std::string SwappableBackend::getBackendName() const { return name_; }
void SwappableBackend::setTimeout(std::chrono::milliseconds timeout) { inner()->setTimeout(timeout); }

c10::intrusive_ptr<c10d::Work> SwappableBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  if (journal_->recording())
    journal_->record({.kind = SetupJournal::Kind::Broadcast,
                      .backend = id_,
                      .in = hold_all(tensors, /*keep=*/getRank() == opts.rootRank),
                      .root = opts.rootRank});
  return inner()->broadcast(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> SwappableBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  if (journal_->recording())
    journal_->record(
        {.kind = SetupJournal::Kind::AllReduce, .backend = id_, .in = hold_all(tensors, true), .op = opts.reduceOp});
  return inner()->allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> SwappableBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) {
  if (journal_->recording()) {
    SetupJournal::Entry e{.kind = SetupJournal::Kind::AllGather, .backend = id_, .in = hold_all(inputs, true)};
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
  if (journal_->recording())
    journal_->record({.kind = SetupJournal::Kind::AllGatherBase,
                      .backend = id_,
                      .in = {hold(input, true)},
                      .out = {hold(output, false)}});
  return inner()->_allgather_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> SwappableBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::ReduceScatterOptions& opts) {
  if (journal_->recording())
    journal_->record({.kind = SetupJournal::Kind::ReduceScatterBase,
                      .backend = id_,
                      .in = {hold(input, true)},
                      .out = {hold(output, false)},
                      .op = opts.reduceOp});
  return inner()->_reduce_scatter_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> SwappableBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  if (journal_->recording())
    journal_->record(
        {.kind = SetupJournal::Kind::Send, .backend = id_, .in = hold_all(tensors, true), .root = dst, .tag = tag});
  return inner()->send(tensors, dst, tag);
}

c10::intrusive_ptr<c10d::Work> SwappableBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  if (journal_->recording())
    journal_->record(
        {.kind = SetupJournal::Kind::Recv, .backend = id_, .out = hold_all(tensors, false), .root = src, .tag = tag});
  return inner()->recv(tensors, src, tag);
}

c10::intrusive_ptr<c10d::Work> SwappableBackend::barrier(const c10d::BarrierOptions& opts) {
  if (journal_->recording()) journal_->record({.kind = SetupJournal::Kind::Barrier, .backend = id_});
  return inner()->barrier(opts);
}

c10::intrusive_ptr<SwappableBackend> SetupJournal::connect(std::shared_ptr<SetupJournal> self, Connect connect,
                                                           const c10::intrusive_ptr<c10d::Store>& store,
                                                           const std::string& what) {
  auto inner = connect(store);
  std::lock_guard<std::mutex> lock(mu_);
  if (!recording_.load() && why_not_.empty())
    why_not_ = "the connection of " + what +
               " was made after the set-up (after the first Snapshots::restore(), "
               "optimizer step or forward of a sharded model): make every group before restore()";
  const int id = static_cast<int>(connects_.size());
  auto b = c10::make_intrusive<SwappableBackend>(std::move(inner), std::move(self), id);
  connects_.push_back(std::move(connect));
  alive_.push_back(b.get());
  entries_.push_back({.kind = Kind::Connect, .backend = id});
  return b;
}

void SetupJournal::record(Entry e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!recording_.load()) return;
  for (const auto& h : e.in)
    if (h.kept.defined()) bytes_ += static_cast<int64_t>(h.kept.nbytes());
  entries_.push_back(std::move(e));
  if (static_cast<int64_t>(entries_.size()) > kMaxEntries || bytes_ > kMaxBytes) {
    recording_.store(false);
    if (why_not_.empty())
      why_not_ = "the set-up issued more collectives (" + std::to_string(entries_.size()) + ", " +
                 std::to_string(bytes_ >> 20) + " MiB of inputs kept) than are kept to answer a replacement";
    entries_.clear();
    entries_.shrink_to_fit();
  }
}

void SetupJournal::not_replayable(const std::string& op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (recording_.load() && why_not_.empty())
    why_not_ = "the set-up used " + op + ", which is not kept to answer a replacement";
}

std::string SetupJournal::why_not_replayable() const {
  std::lock_guard<std::mutex> lock(mu_);
  return why_not_;
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

void SetupJournal::replay(const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds timeout, int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<c10::intrusive_ptr<c10d::Backend>> made(connects_.size());
  static const char* const kNames[] = {"connection", "broadcast",         "all-reduce",
                                       "all-gather", "all-gather (flat)", "reduce-scatter (flat)",
                                       "send",       "receive",           "barrier"};
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    try {
      replay_one(e, made, store, timeout);
    } catch (const std::exception& ex) {
      throw Error(rank_prefix(rank) +
                  " could not answer its replacement's set-up: " + kNames[static_cast<int>(e.kind)] + " " +
                  std::to_string(i + 1) + " of " + std::to_string(entries_.size()) +
                  " of this rank's own set-up failed (does the replacement run "
                  "the same program, with the same set-up up to Snapshots::restore()?): " +
                  ex.what());
    }
  }
  for (size_t id = 0; id < made.size(); ++id)
    if (alive_[id]) alive_[id]->swap(made[id]);
}

void SetupJournal::replay_one(const Entry& e, std::vector<c10::intrusive_ptr<c10d::Backend>>& made,
                              const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds timeout) {
  if (e.kind == Kind::Connect) {
    made[static_cast<size_t>(e.backend)] = connects_[static_cast<size_t>(e.backend)](store);
    return;
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

SwitchableStore::SwitchableStore(c10::intrusive_ptr<c10d::Store> store)
    : c10d::Store(store->getTimeout()), store_(std::move(store)) {}
void SwitchableStore::point_at(c10::intrusive_ptr<c10d::Store> store) {
  std::lock_guard<std::mutex> lock(mu_);
  store_ = std::move(store);
}
c10::intrusive_ptr<c10d::Store> SwitchableStore::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return store_;
}
c10::intrusive_ptr<c10d::Store> SwitchableStore::clone() { return current()->clone(); }
void SwitchableStore::set(const std::string& key, const std::vector<uint8_t>& value) { current()->set(key, value); }
std::vector<uint8_t> SwitchableStore::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                                 const std::vector<uint8_t>& desired) {
  return current()->compareSet(key, expected, desired);
}
std::vector<uint8_t> SwitchableStore::get(const std::string& key) { return current()->get(key); }
int64_t SwitchableStore::add(const std::string& key, int64_t value) { return current()->add(key, value); }
bool SwitchableStore::deleteKey(const std::string& key) { return current()->deleteKey(key); }
bool SwitchableStore::check(const std::vector<std::string>& keys) { return current()->check(keys); }
int64_t SwitchableStore::getNumKeys() { return current()->getNumKeys(); }
void SwitchableStore::wait(const std::vector<std::string>& keys) { current()->wait(keys); }
void SwitchableStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  current()->wait(keys, timeout);
}
void SwitchableStore::setTimeout(const std::chrono::milliseconds& timeout) {
  c10d::Store::setTimeout(timeout);
  current()->setTimeout(timeout);
}
void SwitchableStore::append(const std::string& key, const std::vector<uint8_t>& value) {
  current()->append(key, value);
}
std::vector<std::vector<uint8_t>> SwitchableStore::multiGet(const std::vector<std::string>& keys) {
  return current()->multiGet(keys);
}
void SwitchableStore::multiSet(const std::vector<std::string>& keys, const std::vector<std::vector<uint8_t>>& values) {
  current()->multiSet(keys, values);
}
bool SwitchableStore::hasExtendedApi() const { return current()->hasExtendedApi(); }

std::string epoch_prefix(int64_t epoch) { return "epoch/" + std::to_string(epoch); }

namespace {

constexpr const char* kEpochKey = "rejoin/epoch";
std::string arrived_key(int64_t epoch) { return "rejoin/" + std::to_string(epoch) + "/arrived"; }
std::string seconds_of(std::chrono::milliseconds t) {
  return std::to_string(t.count() / 1000) + "." + std::to_string(t.count() % 1000 / 100) + " s";
}

// How often each rank reads the store while it waits: every 5 ms in jobs of
// up to 20 ranks, less often in larger ones, so that the store serves about
// eight reads per millisecond whatever the job's size (up to 200 ms apart).
std::chrono::milliseconds poll_interval(int size) { return std::chrono::milliseconds(std::clamp(size / 4, 5, 200)); }

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
      std::this_thread::sleep_for(poll_interval(size));
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
    std::this_thread::sleep_for(2 * poll_interval(size));
    latest = base.add(kEpochKey, 0);
  }
  return settle(base, latest, rank, size, deadline, timeout);
}

}  // namespace shardtorch::detail
