// Full state dicts: gathered one flat parameter at a time, written by rank 0;
// loaded by every rank reading only its own shard's elements.
#include <boost/json.hpp>
#include <c10/core/GradMode.h>

#include "base/check.h"
#include "base/log.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <set>
#include <sstream>

#include "runtime/shard_state.h"
#include "checkpoint/agreement.h"
#include "checkpoint/model_load.h"
#include "checkpoint/model_part.h"
#include "checkpoint/reader_access.h"
#include "checkpoint/streamed_tensors.h"
#include "checkpoint/tied_names.h"
#include "checkpoint/tp_slices.h"
#include "shardtorch/checkpoint.h"

namespace shardtorch {
namespace {

using NameMap = std::map<const void*, std::vector<std::string>>;
namespace json = boost::json;

// Checked on every rank before any collective (the metadata is the same on every rank).
// The bytes of a tensor of `dtype` and `shape`.
int64_t tensor_bytes(at::ScalarType dtype, const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  return numel * static_cast<int64_t>(c10::elementSize(dtype));
}

void check_user_metadata(const std::string& path, const std::map<std::string, std::string>& user_metadata) {
  for (const auto& [key, value] : user_metadata) {
    SHARDTORCH_CHECK(key.rfind("shardtorch_", 0) != 0, "shardtorch::save_full_state_dict '", path, "': metadata key '",
                     key, "' is reserved (keys starting with shardtorch_ are the library's)");
    SHARDTORCH_CHECK(key != "format" || value == "pt", "shardtorch::save_full_state_dict '", path,
                     "': metadata \"format\" is \"pt\" (what Hugging Face's loaders require), not '", value, "'");
  }
}

// "format": "pt" is what Hugging Face's loaders require of a PyTorch state
// dict; our own keys carry a prefix no user key may take.
std::map<std::string, std::string> file_metadata(const std::map<std::string, std::string>& user_metadata,
                                                 Strategy strategy, int world_size) {
  auto metadata = user_metadata;
  metadata["format"] = "pt";
  metadata["shardtorch_format"] = "full state dict v1";
  metadata["shardtorch_strategy"] = strategy_name(strategy);
  metadata["shardtorch_world_size"] = std::to_string(world_size);
  return metadata;
}

}  // namespace

void save_full_state_dict(torch::nn::Module& root, const std::string& path,
                          const std::map<std::string, std::string>& user_metadata) {
  auto state = detail::require_state(root, "save_full_state_dict");
  if (auto part = checkpoint::tensor_parallel_part(root, *state, "save_full_state_dict"))
    return checkpoint::save_full_state_dict(root, path, user_metadata, *part);
  detail::FileWaits file_waits(*state, "save_full_state_dict");  // the others wait for rank 0's writes and fsync
  World& world = state->world();
  check_user_metadata(path, user_metadata);
  const bool writer = world.rank() == 0;
  c10::NoGradGuard no_grad;
  checkpoint::StreamedTensors tensors(root, *state, "save_full_state_dict", /*tied_once=*/false);
  int64_t bytes_total = 0;
  for (const auto& t : tensors.items()) bytes_total += tensor_bytes(t.dtype, t.shape);
  shardtorch::detail::ProgressReporter progress("save_full_state_dict", "tensors",
                                                static_cast<int64_t>(tensors.items().size()), bytes_total);
  progress.count_io();

  std::string error;
  if (writer) {
    std::vector<checkpoint::PendingTensor> pending;
    for (const auto& t : tensors.items())
      pending.push_back({t.name, t.dtype, t.shape, [produce = t.produce, &progress] {
                           at::Tensor v = produce();
                           progress.advance(1);
                           return v;
                         }});
    const auto metadata = file_metadata(user_metadata, state->options().strategy(), world.size());
    try {
      checkpoint::write_file(path, pending, metadata);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  tensors.finish();  // the other ranks (and rank 0, after a failed write) take part in the gathers
  auto status = at::full({1}, error.empty() ? 0 : 1, at::kInt).to(world.comm().device());
  world.comm().broadcast(status, 0, "save_full_state_dict status");
  SHARDTORCH_CHECK(error.empty(), "shardtorch::save_full_state_dict: ", error);
  SHARDTORCH_CHECK(status.cpu().item<int>() == 0, "shardtorch::save_full_state_dict: rank 0 could not write '", path,
                   "'");
  progress.finish();
}

namespace {

constexpr const char* kFullTiedOption = "LoadOptions().tied_from";

// The check phase of one load_full_state_dict on this rank: the file opened,
// every parameter and buffer this rank holds matched by name and shape and
// its copy planned (run.changes), then every tensor of the file accounted
// for. Of the whole model, or (`part`) of one part of it.
class FullLoad {
 public:
  FullLoad(torch::nn::Module& root, const std::string& path, const LoadOptions& options,
           const checkpoint::ModelPart* part, checkpoint::LoadRun& run)
      : root_(root),
        path_(path),
        options_(options),
        part_(part),
        run_(run),
        state_(*run.state),
        file_where_("safetensors file '" + path + "'") {}

  void open();
  void plan_parameters();
  void plan_buffers();
  void check_unexpected() const;

 private:
  void check_shape(const std::string& n, c10::IntArrayRef want, at::ScalarType dtype,
                   const char* what = "parameter") const;
  std::string source_of(const at::Tensor& p, c10::IntArrayRef shape, at::ScalarType dtype, int64_t first,
                        int64_t count);
  void plan_replicated();

  torch::nn::Module& root_;
  const std::string& path_;
  const LoadOptions& options_;
  const checkpoint::ModelPart* part_;
  checkpoint::LoadRun& run_;
  detail::ShardState& state_;
  const std::string file_where_;
  std::optional<checkpoint::Reader> reader_;
  NameMap names_;
  std::set<std::string> used_;  // the file's names some parameter or buffer takes
};

// The file, and what ranks reading their own copies can compare cheaply:
// the layout and the metadata (where an application keeps its step).
void FullLoad::open() {
  reader_.emplace(path_);
  const auto& header = checkpoint::ReaderAccess::header(*reader_);
  run_.fingerprint =
      "a file of " + std::to_string(header.tensors.size()) + " tensors from byte " + std::to_string(header.data_start);
  for (const auto& [k, v] : header.metadata) run_.fingerprint += ", " + k + "=" + v;
  names_ = checkpoint::parameter_names(root_, part_);
  checkpoint::check_tied_from(names_, options_.tied_from(), file_where_, kFullTiedOption);
}

// The shape, and a dtype the values can be cast into (docs/checkpoints.md).
void FullLoad::check_shape(const std::string& n, c10::IntArrayRef want, at::ScalarType dtype, const char* what) const {
  const auto* r = checkpoint::ReaderAccess::header(*reader_).find(n);
  checkpoint::require_shape("safetensors file '" + path_ + "'", "'" + n + "'", " in the file", r->shape, want, what);
  checkpoint::require_castable(file_where_, "'" + n + "'", r->dtype, "", checkpoint::scalar_type(r->dtype), dtype, what,
                               options_.allow_lossy_casts(), "LoadOptions");
}

// The name `p` is read from. Every name of it the file holds counts as
// used; the others a tied parameter is held under must hold the same
// values, compared over elements [first, first + count) here (each rank
// compares its own part: every rank's error fails every rank).
std::string FullLoad::source_of(const at::Tensor& p, c10::IntArrayRef shape, at::ScalarType dtype, int64_t first,
                                int64_t count) {
  // A slice's elements [first, first + count) are runs of the whole tensor's.
  const auto& ns = names_[p.unsafeGetTensorImpl()];
  for (const auto& n : ns) used_.insert(n);
  auto t = checkpoint::tied_source(
      ns, [&](const std::string& n) { return reader_->contains(n); }, options_.tied_from(), file_where_,
      kFullTiedOption);
  if (!t)
    throw checkpoint::SafetensorsError(file_where_ + ": no entry for parameter '" +
                                       (ns.empty() ? std::string("?") : ns.front()) + "'");
  check_shape(t->source, shape, dtype);
  for (const auto& other : t->others) {
    check_shape(other, shape, dtype);
    for (const auto& r : checkpoint::saved_runs(p, first, count))
      checkpoint::require_equal_tied(reader_->read_range(t->source, r.whole, r.length),
                                     reader_->read_range(other, r.whole, r.length), dtype, t->source, other, r.whole,
                                     file_where_, kFullTiedOption);
  }
  return t->source;
}

void FullLoad::plan_parameters() {
  if (state_.path().replicated()) {
    plan_replicated();
    return;
  }
  checkpoint::Reader* file = &*reader_;
  const int rank = state_.topology().shard_comm().rank();
  for (auto& u : state_.units().all())
    for (auto& f : u->flats())
      for (size_t i = 0; i < f->params().size(); ++i) {
        auto piece = f->layout().piece(i, rank);
        const at::Tensor& p = f->params()[i];
        std::string n = source_of(p, checkpoint::saved_shape(p), f->dtype(), piece ? piece->param_offset : 0,
                                  piece ? piece->length : 0);
        if (!piece) continue;
        at::Tensor dst = f->shard().narrow(0, piece->shard_offset, piece->length);
        run_.changes.push_back(
            [file, dst, n, runs = checkpoint::saved_runs(p, piece->param_offset, piece->length)]() mutable {
              for (const auto& r : runs)
                dst.narrow(0, r.local - runs.front().local, r.length).copy_(file->read_range(n, r.whole, r.length));
            });
      }
}

void FullLoad::plan_replicated() {
  checkpoint::Reader* file = &*reader_;
  std::set<const void*> done;
  for (const auto& item : root_.named_parameters()) {
    at::Tensor p = item.value();
    if (!done.insert(p.unsafeGetTensorImpl()).second) continue;  // tied: loaded once
    const auto [first, count] = checkpoint::share_of(p.numel(), state_.world().rank(), state_.world().size());
    std::string n = source_of(p, checkpoint::saved_shape(p), state_.path().record_of(p).scalar_type(), first, count);
    run_.changes.push_back([state = run_.state, file, p, n] {
      at::Tensor v = file->read(n);
      if (auto slice = detail::placement_of(p)) v = checkpoint::take_slice(v, *slice);
      state->path().load_record(p, v);  // the fp32 master under mixed precision
    });
  }
}

void FullLoad::plan_buffers() {
  checkpoint::Reader* file = &*reader_;
  for (const auto& item : root_.named_buffers()) {
    if (!item.value().defined()) continue;
    if (!reader_->contains(item.key()))
      throw checkpoint::SafetensorsError("safetensors file '" + path_ + "': no entry for buffer '" + item.key() + "'");
    check_shape(item.key(), item.value().sizes(), item.value().scalar_type(), "buffer");
    used_.insert(item.key());
    run_.changes.push_back([file, b = item.value(), n = item.key()]() mutable { b.copy_(file->read(n)); });
  }
}

void FullLoad::check_unexpected() const {
  for (const auto& t : checkpoint::ReaderAccess::header(*reader_).tensors) {
    if (!used_.count(t.name) && !(part_ && part_->shapes.count(t.name)))  // another part's: checked there
      throw checkpoint::SafetensorsError("safetensors file '" + path_ + "': unexpected tensor '" + t.name +
                                         "' (no parameter or buffer of the model has that name)");
  }
}

// load_full_state_dict, of the whole model or (`part`) of one part of it.
void load_full(torch::nn::Module& root, const std::string& path, const LoadOptions& options,
               const checkpoint::ModelPart* part) {
  checkpoint::LoadRun run(root, "load_full_state_dict", path, options.progress(), part ? part->world.get() : nullptr);
  FullLoad load(root, path, options, part, run);  // holds the file the changes read from
  try {
    run.state->summons().check_outside();
    load.open();
    load.plan_parameters();
    load.plan_buffers();
    load.check_unexpected();
  } catch (const std::exception& e) {
    run.error = e.what();
  }
  run.finish();
}

}  // namespace

void load_full_state_dict(torch::nn::Module& root, const std::string& path, const LoadOptions& options) {
  auto state = detail::require_state(root, "load_full_state_dict");
  const auto part = checkpoint::tensor_parallel_part(root, *state, "load_full_state_dict");
  load_full(root, path, options, part ? &*part : nullptr);
}

namespace checkpoint {

void load_full_state_dict(torch::nn::Module& root, const std::string& path, const LoadOptions& options,
                          const ModelPart& part) {
  load_full(root, path, options, &part);
}

namespace {

// Every leader's list of its tensors (name, dtype, shape), in the order it sends them.
std::string tensor_list(const StreamedTensors& tensors) {
  json::array mine;
  for (const auto& t : tensors.items()) {
    json::array shape;
    for (int64_t d : t.shape) shape.push_back(d);
    mine.push_back(json::array{json::value(t.name), static_cast<int64_t>(t.dtype), shape});
  }
  return json::serialize(mine);
}

// Another part's tensors, as rank 0 receives them from its leader.
struct Remote {
  int rank;
  std::vector<PendingTensor> items;  // name, dtype, shape
  size_t received = 0;
};

// Rank 0: the other parts' leaders and their tensors, from every rank's list.
std::vector<Remote> remotes_of(const std::vector<std::string>& lists) {
  std::vector<Remote> remotes;
  for (int r = 1; r < static_cast<int>(lists.size()); ++r) {
    if (lists[r].empty()) continue;
    Remote remote{r, {}, 0};
    const json::value list = json::parse(lists[r]);
    for (const auto& v : list.as_array()) {
      const auto& a = v.as_array();
      std::vector<int64_t> shape;
      for (const auto& d : a.at(2).as_array()) shape.push_back(d.as_int64());
      remote.items.push_back(
          {json::value_to<std::string>(a.at(0)), static_cast<at::ScalarType>(a.at(1).as_int64()), shape, nullptr});
    }
    remotes.push_back(std::move(remote));
  }
  return remotes;
}

std::string transfer_what(World& world, int from, const std::string& name) {
  return "tensor '" + name + "' of rank " + std::to_string(world.global_rank_of(from)) +
         "'s part for save_full_state_dict";
}

// The next tensor of `remote`, received (a tensor without elements is not sent).
at::Tensor receive(World& world, Remote& remote) {
  Comm& comm = world.comm();
  const PendingTensor& item = remote.items[remote.received++];
  at::Tensor t = at::empty(item.shape, at::TensorOptions().dtype(item.dtype).device(comm.device()));
  if (t.numel() > 0) {
    PendingWork w = comm.recv_async(t, remote.rank, static_cast<int>(remote.received - 1),
                                    transfer_what(world, remote.rank, item.name));
    comm.wait(w);
  }
  return t.cpu();  // the writer takes CPU bytes
}

// Rank 0: the file, its own part's tensors first, then each other part's
// as its leader sends them; every remote tensor received even when the
// write fails. Returns the write's error ("" if none).
std::string write_with_parts(World& world, StreamedTensors& tensors, std::vector<Remote>& remotes,
                             const std::string& path, const std::map<std::string, std::string>& metadata,
                             shardtorch::detail::ProgressReporter& progress) {
  std::vector<PendingTensor> pending;
  for (const auto& t : tensors.items())
    pending.push_back({t.name, t.dtype, t.shape, [produce = t.produce, &progress] {
                         at::Tensor v = produce();
                         progress.advance(1);
                         return v;
                       }});
  for (size_t i = 0; i < remotes.size(); ++i)
    for (size_t k = 0; k < remotes[i].items.size(); ++k) {
      const auto& item = remotes[i].items[k];
      pending.push_back({item.name, item.dtype, item.shape, [&, i, k] {
                           tensors.finish();  // rank 0's own part is written: its last gathered flat is freed
                           SHARDTORCH_CHECK(remotes[i].received == k,
                                            "shardtorch: internal: save_full_state_dict "
                                            "took another part's tensors out of order");
                           at::Tensor v = receive(world, remotes[i]);
                           progress.advance(1);
                           return v;
                         }});
    }
  std::string error;
  try {
    write_file(path, pending, metadata);
  } catch (const std::exception& e) {
    error = e.what();
  }
  tensors.finish();
  for (auto& remote : remotes)  // what a failed write did not take: the leaders send everything
    while (remote.received < remote.items.size()) receive(world, remote);
  return error;
}

// Another part's leader: each of its tensors to rank 0, in order.
void send_part(World& world, const StreamedTensors& tensors, shardtorch::detail::ProgressReporter& progress) {
  Comm& comm = world.comm();
  for (size_t k = 0; k < tensors.items().size(); ++k) {
    const auto& item = tensors.items()[k];
    at::Tensor t = item.produce();
    if (t.numel() == 0) continue;
    t = t.to(comm.device(), item.dtype).contiguous();  // what rank 0 receives into
    PendingWork w = comm.send_async(t, 0, static_cast<int>(k), transfer_what(world, world.rank(), item.name));
    comm.wait(w);
    progress.advance(1, static_cast<int64_t>(t.nbytes()));
  }
}

}  // namespace

// One file for every part: rank 0 of part.world writes it. Its own part's
// tensors it gathers as the whole model's save does; every other part's
// leader (rank 0 of that part's World) gathers its part's the same way and
// sends each tensor to rank 0 when rank 0's writer reaches it, so that no
// rank holds more than one gathered flat parameter and one received tensor.
// No rank but rank 0 writes, and no file system is shared.
void save_full_state_dict(torch::nn::Module& root, const std::string& path,
                          const std::map<std::string, std::string>& user_metadata, const ModelPart& part) {
  auto state = detail::require_state(root, "save_full_state_dict");
  World& world = *part.world;
  // Leaders wait for rank 0 to reach their tensors.
  detail::FileWaits file_waits(*state, "save_full_state_dict", &world);
  check_user_metadata(path, user_metadata);
  // A part's leader sends its tensors to rank 0; at a tp rank other than 0
  // it sends its slices to its tp rank 0 instead (StreamedTensors).
  const bool writer = world.rank() == 0, feeder = state->world().rank() == 0 && part.tp_rank != 0,
             leader = state->world().rank() == 0 && !feeder;
  SHARDTORCH_CHECK(!writer || leader, "shardtorch: internal: rank 0 of the parts is not rank 0 of its own part");
  c10::NoGradGuard no_grad;
  StreamedTensors tensors(root, *state, "save_full_state_dict", /*tied_once=*/false, /*buffers=*/true, &part);
  const auto lists = detail::agreed_fingerprints(world, "", "shardtorch::save_full_state_dict: the parts' tensors",
                                                 leader ? tensor_list(tensors) : "");
  std::vector<Remote> remotes = writer ? remotes_of(lists) : std::vector<Remote>{};
  // Rank 0 counts every tensor it writes, a leader those it sends, the
  // other ranks their part's (done when their gathers are).
  int64_t count = static_cast<int64_t>(tensors.items().size()), bytes_total = 0;
  for (const auto& t : tensors.items()) bytes_total += tensor_bytes(t.dtype, t.shape);
  for (const auto& remote : remotes) {
    count += static_cast<int64_t>(remote.items.size());
    for (const auto& t : remote.items) bytes_total += tensor_bytes(t.dtype, t.shape);
  }
  shardtorch::detail::ProgressReporter progress("save_full_state_dict", "tensors", count, bytes_total);
  if (writer) progress.count_io();
  std::string error;
  if (writer) {
    auto metadata = file_metadata(user_metadata, state->options().strategy(), world.size());
    metadata["shardtorch_layout"] = part.layout;
    error = write_with_parts(world, tensors, remotes, path, metadata, progress);
  } else if (leader) {
    send_part(world, tensors, progress);
  } else if (feeder) {
    tensors.feed_tp_rank_0();
  }
  tensors.finish();  // every rank of every part takes part in its part's gathers
  Comm& comm = world.comm();
  auto status = at::full({1}, error.empty() ? 0 : 1, at::kInt).to(comm.device());
  comm.broadcast(status, 0, "save_full_state_dict status");
  SHARDTORCH_CHECK(error.empty(), "shardtorch::save_full_state_dict: ", error);
  SHARDTORCH_CHECK(status.cpu().item<int>() == 0, "shardtorch::save_full_state_dict: rank ", world.global_rank_of(0),
                   " could not write '", path, "'");
  progress.finish();
}

}  // namespace checkpoint
}  // namespace shardtorch
