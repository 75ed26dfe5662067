#pragma once
// Internal: what lets the ranks of a World that lost one carry on with a
// replacement process, without restarting (World::rejoin, docs/fault_tolerance.md,
// "Survivors that stay alive").
//
//   SwappableBackend: a World's or group's backend whose connection can be
//     replaced by a new one of the same members; every Comm keeps it.
//   SetupJournal: the set-up's connections and collectives, in order, up to
//     the end of the set-up (the first Snapshots::restore() or optimizer
//     step). A replacement runs the program's set-up from its start; the
//     survivors answer it by running the journal again on new connections:
//     the same collectives, with the same inputs where they were small (up
//     to kKeptBytes each) and zeros of the same shape where not (a
//     parameter's broadcast, whose value restore() replaces).
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace shardtorch::detail {

class SetupJournal;

class SwappableBackend final : public c10d::Backend {
 public:
  SwappableBackend(c10::intrusive_ptr<c10d::Backend> inner, std::shared_ptr<SetupJournal> journal, int id);
  ~SwappableBackend() override;

  /// The connection in use; throws between disconnect() and the replay.
  c10::intrusive_ptr<c10d::Backend> inner() const;
  /// Collectives from now on go to `inner`; nothing may be in flight on
  /// this backend meanwhile.
  void swap(c10::intrusive_ptr<c10d::Backend> inner);

  const std::string getBackendName() const override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;

 private:
  friend class SetupJournal;  // disconnect()
  mutable std::mutex mu_;
  c10::intrusive_ptr<c10d::Backend> inner_;
  const std::string name_;  // the backend's ("gloo", "nccl")
  std::shared_ptr<SetupJournal> journal_;
  const int id_;
};

class SetupJournal {
 public:
  /// A tensor this large or smaller is kept whole; a larger one by its shape.
  static constexpr int64_t kKeptBytes = 64 * 1024;
  /// Makes a backend's connection again, in `store` (the new epoch's).
  using Connect = std::function<c10::intrusive_ptr<c10d::Backend>(const c10::intrusive_ptr<c10d::Store>& store)>;

  enum class Kind { Connect, Broadcast, AllReduce, AllGather, AllGatherBase, ReduceScatterBase, Send, Recv, Barrier };
  /// A tensor as the replay makes it again.
  struct Held {
    at::Tensor kept;  // a copy (small), else undefined
    std::vector<int64_t> sizes;
    at::TensorOptions options;
    at::Tensor make() const;      // the copy, or zeros of the shape
    at::Tensor make_out() const;  // an output of the shape
  };
  struct Entry {
    Kind kind = Kind::Connect;
    int backend = 0;
    std::vector<Held> in, out;
    c10d::ReduceOp op = c10d::ReduceOp::SUM;
    int64_t root = 0;  // a broadcast's root; a send's or receive's peer
    int tag = 0;
  };

  /// Connects with `connect` in `store` and wraps the connection; the journal
  /// keeps `connect` (in order) for replay().
  c10::intrusive_ptr<SwappableBackend> connect(std::shared_ptr<SetupJournal> self, Connect connect,
                                               const c10::intrusive_ptr<c10d::Store>& store);
  /// Records `e` (on the calling thread, before the collective runs) while
  /// the set-up lasts.
  void record(Entry e);
  bool recording() const { return recording_.load(); }
  /// The set-up is over: nothing is recorded from now on, and the copies kept so far stay.
  void end_setup() { recording_.store(false); }

  /// Drops every connection: a peer still waiting in a collective with this
  /// rank fails at once (its connections close) instead of at its timeout.
  void disconnect();
  /// Connects every backend again in `store`, in the order they were made,
  /// runs the set-up's collectives on them in order, and swaps each
  /// SwappableBackend still alive to its new connection. Each collective
  /// waits at most `timeout`.
  void replay(const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds timeout);

  size_t size() const;

 private:
  friend class SwappableBackend;
  void forget(int id);  // a SwappableBackend destroyed

  mutable std::mutex mu_;
  std::atomic<bool> recording_{true};
  std::vector<Entry> entries_;
  std::vector<Connect> connects_;         // by backend id
  std::vector<SwappableBackend*> alive_;  // by backend id; null once destroyed
};

/// A tensor held for replay: kept whole when small.
SetupJournal::Held hold(const at::Tensor& t, bool keep);

// Epochs: the World's connections of its first set-up are epoch 0; each
// replacement opens the next (a counter in the store), and every rank then
// connects again under the epoch's prefix once all `size` ranks are there.
// A second replacement arriving meanwhile moves every rank on to its epoch.
std::string epoch_prefix(int64_t epoch);
/// A replacement's side: opens a new epoch and waits (at most `timeout`)
/// until every rank is there. Returns the epoch agreed on.
int64_t join_as_replacement(c10d::Store& base, int rank, int size, std::chrono::milliseconds timeout);
/// A survivor's side: waits (at most `timeout`) for a replacement to open an
/// epoch after `epoch`, then for every rank to be there. Returns the epoch.
int64_t await_replacement(c10d::Store& base, int64_t epoch, int rank, int size, std::chrono::milliseconds timeout);

}  // namespace shardtorch::detail
