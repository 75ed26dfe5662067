#pragma once
// Internal: what lets the ranks of a World that lost one carry on with a
// replacement process, without restarting (World::rejoin, docs/fault_tolerance.md,
// "Survivors that stay alive").
//
//   SwappableBackend: a World's or group's backend whose connection can be
//     replaced by a new one of the same members; every Comm keeps it.
//   SetupJournal: the set-up's connections and collectives, in order, up to
//     the end of the set-up (the first Snapshots::restore(), optimizer step
//     or forward of a sharded model). A replacement runs the program's
//     set-up from its start; the survivors answer it by running the journal
//     again on new connections: the same collectives with the same inputs,
//     except floating-point inputs larger than kKeptBytes (parameters and
//     their shards, whose values restore() replaces), sent as zeros of their
//     shape, and what a broadcast's non-root members send.
//   SwitchableStore: the World's store, which a rejoin points at the new
//     epoch's prefix (groups and subworlds made over it follow).
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

  /// The connection in use; throws between disconnect() and the end of a
  /// replay (a rejoin that failed leaves it so).
  c10::intrusive_ptr<c10d::Backend> inner() const;
  /// The connection in use, or null there.
  c10::intrusive_ptr<c10d::Backend> connected() const;
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

  // Forwarded, not replayable: used during the set-up, they make a rejoin
  // refuse (SetupJournal::check_replayable).
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  bool supportsCoalescing() const override;
  void abort() override;
  void shutdown() override;

 private:
  void unreplayable(const char* op);
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
    std::vector<Held> in = {}, out = {};
    c10d::ReduceOp op = c10d::ReduceOp::SUM;
    int64_t root = 0;  // a broadcast's root; a send's or receive's peer
    int tag = 0;
  };

  /// Connects with `connect` in `store` and wraps the connection; the journal
  /// keeps `connect` (in order) for replay(). `what` names it in errors.
  c10::intrusive_ptr<SwappableBackend> connect(std::shared_ptr<SetupJournal> self, Connect connect,
                                               const c10::intrusive_ptr<c10d::Store>& store, const std::string& what);
  /// Records `e` (on the calling thread, before the collective runs) while
  /// the set-up lasts.
  void record(Entry e);
  bool recording() const { return recording_.load(); }
  /// The set-up is over: nothing is recorded from now on, and the copies kept so far stay.
  void end_setup() { recording_.store(false); }
  /// While recording: `op` cannot be replayed.
  void not_replayable(const std::string& op);
  /// Why a replay would not answer a replacement's set-up (a connection
  /// made after it, an operation that cannot be replayed, a set-up too
  /// long to keep); "" when it would.
  std::string why_not_replayable() const;

  /// Drops every connection: a peer still waiting in a collective with this
  /// rank fails at once (its connections close) instead of at its timeout.
  void disconnect();
  /// Connects every backend again in `store`, in the order they were made,
  /// runs the set-up's collectives on them in order, and swaps each
  /// SwappableBackend still alive to its new connection. Each collective
  /// waits at most `timeout`.
  void replay(const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds timeout, int rank);

 private:
  friend class SwappableBackend;
  void forget(int id);  // a SwappableBackend destroyed
  void replay_one(const Entry& e, std::vector<c10::intrusive_ptr<c10d::Backend>>& made,
                  const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds timeout);

  /// The most a journal keeps before it gives up recording (and a rejoin refuses).
  static constexpr int64_t kMaxEntries = 1000000, kMaxBytes = int64_t{256} << 20;

  mutable std::mutex mu_;
  std::atomic<bool> recording_{true};
  std::vector<Entry> entries_;
  int64_t bytes_ = 0;
  std::string why_not_;                   // the first reason a replay would not answer
  std::vector<Connect> connects_;         // by backend id
  std::vector<SwappableBackend*> alive_;  // by backend id; null once destroyed
};

/// A tensor held for replay: `keep` false, its shape; else a copy, unless
/// it is floating-point and larger than kKeptBytes (its shape).
SetupJournal::Held hold(const at::Tensor& t, bool keep);

/// A c10d::Store that forwards to the store it points at now.
class SwitchableStore final : public c10d::Store {
 public:
  explicit SwitchableStore(c10::intrusive_ptr<c10d::Store> store);
  using c10d::Store::compareSet;
  using c10d::Store::set;
  void point_at(c10::intrusive_ptr<c10d::Store> store);
  c10::intrusive_ptr<c10d::Store> current() const;

  c10::intrusive_ptr<c10d::Store> clone() override;
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  void setTimeout(const std::chrono::milliseconds& timeout) override;
  void append(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string>& keys) override;
  void multiSet(const std::vector<std::string>& keys, const std::vector<std::vector<uint8_t>>& values) override;
  bool hasExtendedApi() const override;

 private:
  mutable std::mutex mu_;
  c10::intrusive_ptr<c10d::Store> store_;
};

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
