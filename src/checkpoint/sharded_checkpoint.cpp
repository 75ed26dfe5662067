// Sharded checkpoints: per-rank safetensors files of element ranges and a
// Boost.JSON index; loading reassembles whatever ranges a rank owns now.
#include <boost/json.hpp>
#include "base/log.h"
#include "base/check.h"
#include "base/text.h"
#include "checkpoint/model_load.h"
#include <c10/core/GradMode.h>
#include <c10/util/accumulate.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>

#include "base/files.h"
#include "optim/optimizer_state.h"
#include "runtime/shard_state.h"
#include "checkpoint/agreement.h"
#include "checkpoint/checksum.h"
#include "checkpoint/reader_access.h"
#include "checkpoint/index_format.h"
#include "checkpoint/tied_names.h"
#include "checkpoint/tp_slices.h"
#include "checkpoint/model_part.h"
#include "checkpoint/publish.h"
#include "checkpoint/rank_state.h"
#include "shardtorch/checkpoint.h"
#include "shardtorch/optim/cpu_adam.h"

namespace shardtorch {
namespace {

namespace json = boost::json;
using checkpoint::SafetensorsError;
using namespace checkpoint::index_format;

// Reads a whole regular file: through `consume` in pieces. Anything else (a
// FIFO, a directory) is refused before it is read, never waited on.
void read_regular_file(const std::string& path, const std::function<void(const char*, size_t)>& consume) {
  std::string why;
  const int fd = files::open_regular_for_reading(path, why);
  if (fd < 0) throw SafetensorsError("checkpoint file '" + path + "': cannot open: " + why);
  SHARDTORCH_DEBUG("opened '", path, "' for reading");
  std::vector<char> buf(size_t{1} << 20);
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw SafetensorsError("checkpoint file '" + path + "': read failed: " + std::strerror(err));
    }
    if (n == 0) break;
    shardtorch::detail::count_io(n);
    consume(buf.data(), static_cast<size_t>(n));
  }
  ::close(fd);
}

// The file's checksum text with `algorithm` (checksum.h). A read error is an
// error: the checksum of part of the file, recorded in an index, would make
// every load refuse the checkpoint; compared, it would blame the file.
std::string file_checksum(const std::string& path, std::string_view algorithm = checkpoint::checksum::kDefault) {
  checkpoint::checksum::Hasher h(algorithm);
  read_regular_file(path, [&](const char* p, size_t n) { h.update(p, n); });
  return h.text();
}

constexpr const char* kMarker = "index.json";  // what makes a directory a sharded checkpoint
using checkpoint::fsync_path;
using checkpoint::kTmpSuffix;
using checkpoint::normalized;
using checkpoint::write_text_durably;

std::string published_dir(const std::string& dir, bool announce = true) {
  return checkpoint::published_dir(dir, kMarker, announce);
}
void check_replaceable(const std::string& dir) { checkpoint::check_replaceable(dir, kMarker, "shardtorch checkpoint"); }
void publish(const std::string& tmp, const std::string& dir) { checkpoint::publish(tmp, dir, kMarker); }

}  // namespace

bool sharded_checkpoint_exists(const std::string& dir) {
  const std::string d = normalized(dir);
  return files::exists(published_dir(d, /*announce=*/false) + "/index.json");
}

namespace {

using detail::OptimizerKind;

OptimizerKind optimizer_kind(ShardedOptimizer& opt) {
  if (auto k = detail::optimizer_kind(opt)) return *k;
  throw SafetensorsError(
      "sharded checkpoints carry the state of Adam, AdamW and SGD (and the fused CPU Adam and "
      "AdamW); this optimizer's state would be lost: pass a null optimizer to save and load the "
      "parameters alone");
}

// NoShard: every parameter of the module, each tensor once, saved and loaded
// whole: the trained ones under the names the bucketer knows them by, then
// the others (frozen) under their first name.
std::vector<std::pair<std::string, at::Tensor>> no_shard_params(torch::nn::Module& root, detail::ShardState& state) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::set<const void*> seen;
  if (const detail::ReplicatedPath* r = state.path().replicated())
    for (size_t i = 0; i < r->params().size(); ++i) {
      out.emplace_back(r->names()[i], r->params()[i]);
      seen.insert(r->params()[i].unsafeGetTensorImpl());
    }
  for (const auto& item : root.named_parameters())
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  return out;
}

// The parameters parallelize() split (checkpoint/tp_slices.h), by each of
// their names: a range of one is saved and loaded as runs of the whole tensor.
// Of a model part's checkpoint (`root`); none for a null `root` (a rank's own
// snapshot, which holds its slices as they are).
class SplitParams {
 public:
  explicit SplitParams(torch::nn::Module* root) {
    if (root)
      for (const auto& item : root->named_parameters())
        if (auto p = detail::placement_of(item.value())) by_name_.emplace(item.key(), *p);
  }
  /// Elements [begin, begin + length) of parameter `name` as runs of the
  /// tensor the checkpoint holds: one identical run when it is not split.
  std::vector<checkpoint::Run> runs(const std::string& name, int64_t begin, int64_t length) const {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) return {checkpoint::Run{begin, begin, length}};
    return checkpoint::runs_of(it->second, begin, length);
  }
  /// The same runs as the checkpoint saves them: runs of one length at one
  /// distance (a row-wise split slice's rows) as one entry.
  std::vector<checkpoint::Rows> saved(const std::string& name, int64_t begin, int64_t length) const {
    return checkpoint::rows_of(runs(name, begin, length));
  }

 private:
  std::map<std::string, detail::Placement> by_name_;
};

// What this rank holds: element ranges of parameters (and buffers, rank 0)
// and of the optimizer state.
struct Holding {
  std::vector<std::pair<Entry, at::Tensor>> items;
};

// `rank`: this rank's file. A part of a model (`part`) leaves the parameters
// tied to other parts under another name to the part whose name comes first,
// and, at a tp rank other than 0, every tensor but its slices to tp rank 0.
// A slice's range is saved as runs of the whole tensor (SplitParams).
// `whole`: everything this rank holds (none left to a replica) and every
// buffer, in `file` (rank_state.h).
Holding collect(torch::nn::Module& root, detail::ShardState& state, ShardedOptimizer* opt, int rank,
                const checkpoint::ModelPart* part, bool whole = false, const std::string& whole_file = "") {
  Holding h;
  const SplitParams split(part ? &root : nullptr);
  const std::string file = whole ? whole_file : "rank-" + std::to_string(rank) + ".safetensors";
  auto add = [&](const std::string& name, const std::string& kind, const checkpoint::Rows& at, const at::Tensor& t,
                 int64_t step) {
    Entry e{name, kind, at.whole, at.whole + at.length, step, file, "", at.rows, at.stride};
    e.tensor = tensor_key(e);
    h.items.emplace_back(e, t.detach().reshape({-1}));
  };
  auto whole_tensor = [](const at::Tensor& t) { return checkpoint::Rows{0, 0, t.numel()}; };
  // The parameter ranges this rank holds, and which of the ranks holding the
  // same ones it is: its rank (NoShard), its replica group (HybridShard).
  struct Range {
    std::string name;
    int64_t begin;
    at::Tensor values;
  };
  std::vector<Range> ranges;
  int writers = 1, me = 0;
  if (state.path().replicated()) {
    for (const auto& [name, p] : no_shard_params(root, state)) ranges.push_back({name, 0, state.path().record_of(p)});
    writers = state.world().size();
    me = state.world().rank();
  } else {
    const int shard_rank = state.topology().shard_comm().rank();
    for (auto& u : state.units().all())
      for (auto& f : u->flats())
        for (size_t i = 0; i < f->params().size(); ++i)
          if (auto p = f->layout().piece(i, shard_rank))
            ranges.push_back({f->names()[i], p->param_offset, f->shard().narrow(0, p->shard_offset, p->length)});
          else if (f->layout().numel(i) == 0 && shard_rank == 0)  // no rank owns a piece: listed once, empty
            ranges.push_back({f->names()[i], 0, f->shard().narrow(0, 0, 0)});
    if (state.topology().replica_comm()) {
      writers = state.topology().replica_comm()->size();
      me = state.topology().replica_comm()->rank();
    }
  }
  if (whole) writers = 1, me = 0;
  if (part)
    ranges.erase(std::remove_if(ranges.begin(), ranges.end(),
                                [&](const Range& r) { return part->saved_by_another_part(r.name); }),
                 ranges.end());
  std::vector<int64_t> sizes;
  for (const auto& r : ranges) sizes.push_back(r.values.numel());
  const std::vector<int> owner = checkpoint::spread_over_writers(sizes, writers);
  // A range's optimizer state goes with it: (name, first element) written here.
  std::set<std::pair<std::string, int64_t>> written;
  for (size_t k = 0; k < ranges.size(); ++k) {
    if (owner[k] != me) continue;
    const Range& r = ranges[k];
    const at::Tensor flat = r.values.detach().reshape({-1});
    for (const auto& run : split.saved(r.name, r.begin, flat.numel()))
      add(r.name, "param", run, flat.narrow(0, run.local - r.begin, run.length * run.rows), 0);
    written.insert({ranges[k].name, ranges[k].begin});
  }
  if (opt) {
    const auto& st = opt->inner().state();
    for (const auto& piece : opt->views().pieces()) {
      if (!written.count({piece.name, piece.param_offset})) continue;
      auto it = st.find(piece.view.unsafeGetTensorImpl());
      if (it == st.end()) continue;
      int64_t step = detail::optimizer_state_step(it->second.get());
      for (auto& [kind, t] : detail::optimizer_state_tensors(it->second.get())) {
        const at::Tensor flat = t.detach().reshape({-1});
        for (const auto& run : split.saved(piece.name, piece.param_offset, piece.length))
          add(piece.name, kind, run, flat.narrow(0, run.local - piece.param_offset, run.length * run.rows), step);
      }
    }
  }
  if (whole || state.world().rank() == 0)  // the buffers, once per model (per part, at tp rank 0)
    for (const auto& item : root.named_buffers())
      if (item.value().defined() && !(part && part->left_to_tp_rank_0(item.key())))
        add(item.key(), "buffer", whole_tensor(item.value()), item.value(), 0);
  return h;
}

// Parameters (under every name: a tied one has several) and buffers of the
// model, with their shapes. A sharded parameter keeps its sizes while freed.
std::map<std::string, std::vector<int64_t>> model_shapes(torch::nn::Module& root) {
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& item : root.named_parameters()) out[item.key()] = item.value().sizes().vec();
  for (const auto& item : root.named_buffers())
    if (item.value().defined()) out[item.key()] = item.value().sizes().vec();
  return out;
}

std::string quoted(std::string_view s) {
  std::string out(1, '\'');
  out.append(s.data(), s.size());
  out.push_back('\'');
  return out;
}

using detail::shape_text;

// " in R rows of stride S" for an entry of several runs, else "".
std::string rows_text(const Entry& e) {
  if (e.rows == 1) return "";
  return " in " + std::to_string(e.rows) + " rows of stride " + std::to_string(e.stride);
}

// Every saved range lies within its tensor's recorded shape (and the
// tensor has one): a range past the end would otherwise go unread.
void check_entries_within_shapes(const Index& idx, const std::string& dir) {
  if (!idx.shapes) return;
  for (const auto& e : idx.entries) {
    auto it = idx.shapes->find(e.name);
    if (it == idx.shapes->end())
      throw SafetensorsError("checkpoint '" + dir + "': '" + e.name + "' has no shape in the index");
    const int64_t numel = c10::multiply_integers(it->second);
    if (e.begin < 0 || reach(e) > numel || e.begin > e.end)
      throw SafetensorsError("checkpoint '" + dir + "': '" + e.name + "' (" + e.kind + ") is saved as elements [" +
                             std::to_string(e.begin) + ", " + std::to_string(e.end) + ")" + rows_text(e) +
                             " but has shape " + shape_text(it->second) + " (" + std::to_string(numel) + " elements)");
  }
}

// Before anything is loaded: the checkpoint must hold this model. Shapes that
// differ, parameters or buffers it lacks, and tensors the model has no name
// for are errors naming them (element counts alone would let a transposed or
// resized weight load, scrambled).
// A part of a model (`part`) is checked against the whole model: a tensor
// another part holds is no error here (that part checks its shape).
void check_model_against(torch::nn::Module& root, const Index& idx, const std::string& dir,
                         const checkpoint::ModelPart* part) {
  const auto mine = part ? part->shapes : model_shapes(root);
  for (const auto& e : idx.entries)
    if (!mine.count(e.name))
      throw SafetensorsError("checkpoint '" + dir + "': unexpected tensor '" + e.name + "' (" + e.kind +
                             "): no parameter or buffer of the model has that name");
  if (!idx.shapes) return;
  for (const auto& [name, shape] : *idx.shapes) {
    auto it = mine.find(name);
    if (it == mine.end())
      throw SafetensorsError("checkpoint '" + dir + "': unexpected tensor '" + name +
                             "': no parameter or buffer of the model has that name");
    if (it->second != shape)
      throw SafetensorsError("checkpoint '" + dir + "': " + checkpoint::shapes_differ(name, *idx.shapes, mine));
  }
  check_entries_within_shapes(idx, dir);
  for (const auto& [names_of, names] : detail::parameter_names(root)) {
    (void)names_of;
    auto saved = [&](const std::string& n) {
      if (!part) return idx.shapes->count(n) > 0;
      const auto all = part->names_of(n);
      return std::any_of(all.begin(), all.end(), [&](const std::string& m) { return idx.shapes->count(m) > 0; });
    };
    if (std::none_of(names.begin(), names.end(), saved))
      throw SafetensorsError("checkpoint '" + dir + "': no entry for parameter '" + names.front() + "'");
  }
  for (const auto& item : root.named_buffers())
    if (item.value().defined() && !idx.shapes->count(item.key()))
      throw SafetensorsError("checkpoint '" + dir + "': no entry for buffer '" + item.key() + "'");
}

Index read_index(const std::string& dir) {
  const std::string path = dir + "/index.json";
  if (!files::exists(path))
    throw SafetensorsError("checkpoint '" + dir + "': no index.json (not a checkpoint, or an unfinished one)");
  std::string text;
  read_regular_file(path, [&](const char* p, size_t n) { text.append(p, n); });
  return parse_index(text, path);
}

// Opens (and checks) the files of a checkpoint on demand.
class Files {
 public:
  Files(std::string dir, const Index& idx) : dir_(std::move(dir)), idx_(idx) {}
  const checkpoint::Reader& get(const std::string& name) {
    auto it = open_.find(name);
    if (it != open_.end()) return *it->second;
    const std::string path = dir_ + "/" + name;
    if (!files::exists(path)) throw SafetensorsError("checkpoint '" + dir_ + "': shard file '" + name + "' is missing");
    if (const std::string kind = files::irregular_kind(path); !kind.empty())
      throw SafetensorsError("checkpoint '" + dir_ + "': shard file '" + name + "' is " + kind +
                             ", not a regular file (copy the checkpoint again)");
    const auto& [size, sum] = idx_.files.at(name);
    if (const int64_t actual = files::file_size(path); actual != size)
      throw SafetensorsError("checkpoint '" + dir_ + "': '" + name + "' has " + std::to_string(actual) +
                             " bytes, the index says " + std::to_string(size));
    // The step before the checksum: a shard copied in from another save of
    // the same model fails both, and "from step 2" says what went wrong.
    auto r = std::make_unique<checkpoint::Reader>(path);
    auto file_step = checkpoint::ReaderAccess::header(*r).metadata.find("step");
    if (file_step == checkpoint::ReaderAccess::header(*r).metadata.end() ||
        file_step->second != std::to_string(idx_.step))
      throw SafetensorsError(
          "checkpoint '" + dir_ + "': '" + name + "' is from step " +
          (file_step == checkpoint::ReaderAccess::header(*r).metadata.end() ? std::string("?") : file_step->second) +
          " but the index is for step " + std::to_string(idx_.step));
    if (file_checksum(path, checkpoint::checksum::algorithm_of(sum)) != sum)
      throw SafetensorsError("checkpoint '" + dir_ + "': '" + name + "' does not match its checksum in the index");
    // Every tensor of the file is one the index lists: a tensor whose
    // entries were taken out of the index would otherwise be left out
    // without a word (by read_sharded_checkpoint, or as optimizer state).
    if (listed_.empty())
      for (const auto& e : idx_.entries) listed_.insert({e.file, e.tensor});
    for (const auto& t : checkpoint::ReaderAccess::header(*r).tensors)
      if (!listed_.count({name, t.name}))
        throw SafetensorsError("checkpoint '" + dir_ + "': '" + name + "' holds '" + t.name +
                               "', which the index does not list (an edited index, or a file of another save?)");
    return *open_.emplace(name, std::move(r)).first->second;
  }

 private:
  std::string dir_;
  const Index& idx_;
  std::set<std::pair<std::string, std::string>> listed_;  // (file, tensor) of every entry
  std::map<std::string, std::unique_ptr<checkpoint::Reader>> open_;
};

// The saved ranges that make up one destination: elements [begin, begin +
// numel) of name's `kind`.
struct Fill {
  struct Copy {
    const Entry* entry;
    int64_t from, to, length;  // entry-relative source offset, destination offset, elements
  };
  std::vector<Copy> copies;
  int64_t step = 0;  // the largest optimizer step among them
};

// The tensor an index entry names, after checking that its file holds it
// with the entry's element count (an index that claims more would make a
// reader allocate or read what is not there).
const checkpoint::TensorRecord& saved_record(Files& files, const Entry& e, const std::string& dir) {
  const auto* r = checkpoint::ReaderAccess::header(files.get(e.file)).find(e.tensor);
  if (r == nullptr)
    throw SafetensorsError("checkpoint '" + dir + "': '" + e.file + "' has no tensor '" + e.tensor +
                           "', which the index lists");
  int64_t n = 1;
  for (int64_t d : r->shape) n *= d;  // the reader checked that this does not overflow
  if (n != saved_numel(e))
    throw SafetensorsError("checkpoint '" + dir + "': '" + e.tensor + "' in '" + e.file + "' has " + std::to_string(n) +
                           " elements but the index says [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                           ")" + rows_text(e));
  return *r;
}

// The ranges of `fill` must tile the destination [begin, begin + numel): in
// order, each starting where the one before ended (lengths that add up are
// not enough: [0, 50) twice would leave [50, 100) unwritten).
Fill plan_fill_checked(Fill fill, int64_t numel, const std::string& name, const std::string& kind, int64_t begin,
                       const std::string& dir) {
  const int64_t end = begin + numel;
  std::sort(fill.copies.begin(), fill.copies.end(),
            [](const Fill::Copy& a, const Fill::Copy& b) { return a.to < b.to; });
  int64_t next = 0;
  for (const auto& c : fill.copies) {
    if (c.to != next) {
      const bool gap = c.to > next;
      throw SafetensorsError("checkpoint '" + dir + "': elements [" + std::to_string(begin + std::min(next, c.to)) +
                             ", " + std::to_string(begin + std::max(next, c.to)) + ") of '" + name + "' (" + kind +
                             ") are " + (gap ? "not all saved (a missing shard?)" : "saved more than once"));
    }
    next = c.to + c.length;
  }
  if (next != numel)
    throw SafetensorsError("checkpoint '" + dir + "': elements [" + std::to_string(begin + next) + ", " +
                           std::to_string(end) + ") of '" + name + "' (" + kind +
                           ") are not all saved (a missing shard?)");
  return fill;
}

// Checks that the saved ranges cover the destination exactly, that their
// dtype may be cast into `into` (checkpoint::is_safe_cast, unless
// `allow_lossy`), and opens (and so checks) every file they are in; reads no
// tensor data.
Fill plan_fill(int64_t numel, const std::string& name, const std::string& kind, int64_t begin, const Index& idx,
               Files& files, const std::string& dir, at::ScalarType into, bool allow_lossy) {
  const int64_t end = begin + numel;
  Fill fill;
  const auto found = idx.ranges.find({name, kind});
  if (found == idx.ranges.end()) return plan_fill_checked(std::move(fill), numel, name, kind, begin, dir);
  const Index::Ranges& ranges = found->second;
  // The first entry that may reach into [begin, end): entries are ordered by
  // begin, so it lies before the first that begins at or after `begin`, as
  // far back as an earlier entry's end reaches past `begin` (all of them
  // when nothing is copied: the optimizer's step still counts).
  size_t first = 0;
  if (numel > 0) {
    first = std::lower_bound(ranges.order.begin(), ranges.order.end(), begin,
                             [&](size_t i, int64_t b) { return idx.entries[i].begin < b; }) -
            ranges.order.begin();
    while (first > 0 && ranges.max_end[first - 1] > begin) --first;
  }
  for (size_t k = first; k < ranges.order.size(); ++k) {
    const auto& e = idx.entries[ranges.order[k]];
    if (numel > 0 && e.begin >= end) break;
    if (numel == 0) fill.step = std::max(fill.step, e.step);  // nothing to copy; the optimizer's step still counts
    // The entry's runs that meet [begin, end): run i is [e.begin + i * s,
    // e.begin + i * s + length).
    const int64_t length = e.end - e.begin, s = e.rows == 1 ? length : e.stride;
    if (length == 0 || numel == 0 || reach(e) <= begin) continue;
    const int64_t past = begin - e.begin - length;  // run i ends after `begin` when i * s > past
    const int64_t first_run = past < 0 ? 0 : past / s + 1;
    const int64_t end_run = std::min(e.rows, (end - e.begin - 1) / s + 1);  // and starts before `end` below this
    bool checked = false;
    for (int64_t i = first_run; i < end_run; ++i) {
      const int64_t at = e.begin + i * s, lo = std::max(begin, at), hi = std::min(end, at + length);
      if (lo >= hi) continue;
      if (!checked) {
        const std::string& dtype = saved_record(files, e, dir).dtype;
        if (!allow_lossy && !checkpoint::is_safe_cast(checkpoint::scalar_type(dtype), into))
          throw SafetensorsError("checkpoint '" + dir + "': '" + name + "' (" + kind + ") is saved as " + dtype +
                                 " in '" + e.file + "' but the model's is " + checkpoint::dtype_text(into) +
                                 ", and a cast from " + dtype + " to " + checkpoint::dtype_text(into) +
                                 " can change values: refused (LoadOptions().allow_lossy_casts(true) casts anyway)");
        checked = true;
      }
      fill.copies.push_back({&e, i * length + lo - at, lo - begin, hi - lo});
    }
    if (checked) fill.step = std::max(fill.step, e.step);
  }
  return plan_fill_checked(std::move(fill), numel, name, kind, begin, dir);
}

// plan_fill of a destination whose elements [begin, begin + numel) are
// `runs` of the saved tensor (SplitParams::runs).
Fill plan_runs(const std::vector<checkpoint::Run>& runs, int64_t numel, const std::string& name,
               const std::string& kind, int64_t begin, const Index& idx, Files& files, const std::string& dir,
               at::ScalarType into, bool allow_lossy) {
  if (runs.empty()) return plan_fill(numel, name, kind, begin, idx, files, dir, into, allow_lossy);
  Fill fill;
  for (const auto& run : runs) {
    Fill part = plan_fill(run.length, name, kind, run.whole, idx, files, dir, into, allow_lossy);
    for (auto c : part.copies) {
      c.to += run.local - begin;
      fill.copies.push_back(c);
    }
    fill.step = std::max(fill.step, part.step);
  }
  return fill;
}

void run_fill(at::Tensor dst, const Fill& fill, Files& files) {
  for (const auto& c : fill.copies)
    dst.narrow(0, c.to, c.length).copy_(files.get(c.entry->file).read_range(c.entry->tensor, c.from, c.length));
}

}  // namespace

namespace {

// Rank 0, first: the staging directory `tmp`, new and empty, once `dir` is
// known to be replaceable. The error, or "".
std::string prepare_staging(const std::string& dir, const std::string& tmp) {
  try {
    check_replaceable(dir);
    files::remove_all(tmp);
    files::create_directories(tmp);
    checkpoint::crash_point("staging directory created");
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

json::object user_json(const std::map<std::string, std::string>& user_state) {
  json::object user;
  for (const auto& [k, v] : user_state) user[k] = v;
  return user;
}

// Writes this rank's shard file into `tmp`; returns its report to the other
// ranks: the file (name, size, checksum), its entries, and what every rank
// must pass alike (a rank with another step would write a file the index
// refuses, and one without the optimizer would leave its ranges without
// state; either checkpoint would replace a good one and never load). A
// failure to write is the report's error.
json::object write_rank_file(const Holding& h, const std::string& tmp, int rank, int64_t step, const json::object& user,
                             const std::string& opt_kind) {
  const std::string file = "rank-" + std::to_string(rank) + ".safetensors";
  std::string error;
  json::array mine;
  json::object report;
  int64_t bytes = 0;
  for (const auto& item : h.items) bytes += static_cast<int64_t>(item.second.nbytes());
  // This rank's file and its checksum (the file read again).
  shardtorch::detail::ProgressReporter progress("save_sharded_checkpoint", "files", 1, 2 * bytes);
  progress.set_bytes_words("written and read back");  // the checksum's read: twice the file
  progress.count_io();
  try {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (auto& [e, t] : h.items) {
      tensors.emplace_back(e.tensor, t);
      mine.push_back(entry_json(e));
    }
    checkpoint::save_file(tmp + "/" + file, tensors, {{"step", std::to_string(step)}, {"rank", std::to_string(rank)}},
                          /*remove_stale_temporaries=*/false);  // the staging directory is new
    report["file"] = json::object{
        {"name", file}, {"size", files::file_size(tmp + "/" + file)}, {"checksum", file_checksum(tmp + "/" + file)}};
    progress.finish();
  } catch (const std::exception& e) {
    error = e.what();
  }
  report["error"] = error;
  report["entries"] = mine;
  report["user_state"] = user;
  report["step"] = step;
  report["optimizer"] = opt_kind;
  return report;
}

// Every rank's report merged: the files and entries of the index, or the
// first failure (a rank's error, or a step, optimizer or user_state other
// than this rank's). Every rank sees every report, so every rank fails alike.
struct MergedReports {
  json::array files, entries;
  std::string failed;
};

MergedReports merge_reports(const std::vector<std::string>& reports, int rank, int64_t step,
                            const std::string& opt_kind, const json::object& user) {
  MergedReports m;
  std::string& failed = m.failed;
  for (size_t r = 0; r < reports.size(); ++r) {
    json::object o = json::parse(reports[r]).as_object();
    std::string err = json::value_to<std::string>(o.at("error"));
    if (!err.empty() && failed.empty()) failed = "rank " + std::to_string(r) + ": " + err;
    if (o.contains("file")) m.files.push_back(o.at("file"));
    for (auto& e : o.at("entries").as_array()) m.entries.push_back(e);
    if (failed.empty() && o.at("step").as_int64() != step)
      failed = "rank " + std::to_string(r) + ": it saves step " + std::to_string(o.at("step").as_int64()) +
               " but rank " + std::to_string(rank) + " saves step " + std::to_string(step) +
               " (the step must be the same on every rank)";
    if (failed.empty() && json::value_to<std::string>(o.at("optimizer")) != opt_kind)
      failed = "rank " + std::to_string(r) + ": it saves optimizer " + json::value_to<std::string>(o.at("optimizer")) +
               " but rank " + std::to_string(rank) + " saves optimizer " + opt_kind +
               " (pass the same optimizer, or none, on every rank)";
    if (failed.empty() && o.at("user_state") != json::value(user)) {
      std::string key = "(the set of keys)";
      const auto& theirs = o.at("user_state").as_object();
      for (const auto& [k, v] : user)
        if (!theirs.contains(k) || theirs.at(k) != v) key = quoted(k);
      for (const auto& [k, v] : theirs)
        if (!user.contains(k)) key = quoted(k);
      failed = "rank " + std::to_string(r) + ": its user_state differs from rank " + std::to_string(rank) + "'s at " +
               key + " (user_state must be the same on every rank)";
    }
  }
  return m;
}

// The units' flat parameters (informational: loading does not read them).
json::array units_json(detail::ShardState& state) {
  json::array units;
  if (!state.path().replicated())
    for (auto& u : state.units().all()) {
      json::array flats;
      for (auto& f : u->flats()) {
        json::array names;
        for (auto& n : f->names()) names.push_back(json::value(n));
        flats.push_back(json::object{
            {"params", names}, {"numel", f->layout().total_numel()}, {"padded_numel", f->layout().padded_numel()}});
      }
      units.push_back(json::object{{"name", u->label()}, {"flats", flats}});
    }
  return units;
}

// The index of the checkpoint: format, world, strategy, step, files,
// entries, user state, every tensor's shape (`shapes`: the whole model's),
// and the units' flat parameters.
json::object index_json(const std::map<std::string, std::vector<int64_t>>& model, Strategy strategy, int world_size,
                        int64_t step, MergedReports merged, const json::object& user, json::array units) {
  json::object index{{"format_version", format_version_of(merged.entries)},
                     {"format", "shardtorch sharded checkpoint"},
                     {"world_size", world_size},
                     {"strategy", strategy_name(strategy)},
                     {"step", step},
                     {"files", std::move(merged.files)},
                     {"entries", std::move(merged.entries)},
                     {"user_state", user}};
  json::object shapes;
  for (const auto& [name, shape] : model) {
    json::array dims;
    for (int64_t d : shape) dims.push_back(d);
    shapes[name] = dims;
  }
  index["shapes"] = shapes;
  index["units"] = std::move(units);
  return index;
}

// Rank 0, last: the index written into `tmp`, synced, and `tmp` published as
// `dir`. The error, or "" (the attempt is removed unless it was published).
std::string write_index_and_publish(const std::function<json::object()>& index, const std::string& tmp,
                                    const std::string& dir) {
  try {
    write_text_durably(tmp + "/index.json", json::serialize(index()));
    fsync_path(tmp, true);
    checkpoint::crash_point("index written");
    publish(tmp, dir);
    checkpoint::crash_point("published");
  } catch (const std::exception& e) {
    files::remove_all_quietly(tmp);  // the attempt, unless publish() had moved it in already
    return e.what();
  }
  return "";
}

}  // namespace

namespace {

// save_sharded_checkpoint, of the whole model or (`part`) of one part of it:
// every rank of every part writes its file, rank-R for its rank R in
// part->world, and the index is the whole model's.
void save_sharded(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir_arg, int64_t step,
                  const std::map<std::string, std::string>& user_state, const checkpoint::ModelPart* part) {
  auto state = detail::require_state(root, "save_sharded_checkpoint");
  World& world = part ? *part->world : state->world();
  detail::FileWaits file_waits(*state, "save_sharded_checkpoint", &world);  // each rank waits for the slowest writer
  c10::NoGradGuard no_grad;
  const std::string dir = normalized(dir_arg);
  const std::string what = "shardtorch::save_sharded_checkpoint '" + dir + "'";
  const std::string tmp = dir + kTmpSuffix;
  if (opt) optimizer_kind(*opt);  // the same on every rank: each throws alike, before any collective
  // Every step one rank alone takes ends in an agreement: a failure there
  // fails every rank with its message, and nothing is published.
  detail::agree_on_errors(world, world.rank() == 0 ? prepare_staging(dir, tmp) : "", what);
  const json::object user = user_json(user_state);
  const std::string opt_kind = opt ? detail::optimizer_kind_name(optimizer_kind(*opt)) : "none";
  json::object report =
      write_rank_file(collect(root, *state, opt, world.rank(), part), tmp, world.rank(), step, user, opt_kind);
  if (part && state->world().rank() == 0 && part->tp_rank == 0)
    report["units"] = units_json(*state);  // each part's, once
  auto reports = world.comm().all_gather_strings(json::serialize(report), "save_sharded_checkpoint index");
  checkpoint::crash_point("reports gathered");
  MergedReports merged = merge_reports(reports, world.rank(), step, opt_kind, user);
  if (!merged.failed.empty() && world.rank() == 0) files::remove_all(tmp);
  SHARDTORCH_CHECK(merged.failed.empty(), "shardtorch::save_sharded_checkpoint: writing '", dir, "' failed on ",
                   merged.failed);
  std::string error;
  if (world.rank() == 0)
    error = write_index_and_publish(
        [&] {
          json::array units;
          if (!part) units = units_json(*state);
          for (const auto& r : reports) {
            const json::value report = json::parse(r);
            if (const auto* u = report.as_object().if_contains("units"))
              for (const auto& unit : u->as_array()) units.push_back(unit);
          }
          json::object index = index_json(part ? part->shapes : model_shapes(root), state->options().strategy(),
                                          world.size(), step, std::move(merged), user, std::move(units));
          if (part) index["layout"] = part->layout;
          return index;
        },
        tmp, dir);
  detail::agree_after_publish(world, error, what, dir);
}

}  // namespace

void save_sharded_checkpoint(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir, int64_t step,
                             const std::map<std::string, std::string>& user_state) {
  auto state = detail::require_state(root, "save_sharded_checkpoint");
  const auto part = checkpoint::tensor_parallel_part(root, *state, "save_sharded_checkpoint");
  save_sharded(root, opt, dir, step, user_state, part ? &*part : nullptr);
}

namespace checkpoint {

std::string publish_rank_files(const GatherStrings& gather, int rank, const std::string& file,
                               const std::string& entries, Strategy strategy,
                               const std::map<std::string, std::vector<int64_t>>& shapes, int64_t step,
                               const std::map<std::string, std::string>& user_state, const std::string& dir_arg) {
  const std::string dir = normalized(dir_arg), tmp = dir + kTmpSuffix;
  // The first rank's error of a phase, the same on every rank.
  auto first_error = [&gather](const std::string& mine, const std::string& what) {
    const auto all = gather(mine, what);
    for (size_t r = 0; r < all.size(); ++r)
      if (!all[r].empty()) return "rank " + std::to_string(r) + ": " + all[r];
    return std::string();
  };
  const std::string staged =
      first_error(rank == 0 ? prepare_staging(dir, tmp) : "", "publishing rank files: the staging directory");
  if (!staged.empty()) return staged;
  // What several ranks hold whole (buffers, NoShard's parameters, a shard
  // in each replica group) is written once, by the lowest of them.
  const auto lists = gather(entries, "publishing rank files: the entries");
  std::set<std::string> seen, mine;  // (name, kind, range); this rank's tensors written
  json::array kept;
  for (size_t r = 0; r < lists.size(); ++r) {
    const json::value list = json::parse(lists[r]);
    for (const auto& e : list.as_array()) {
      const auto& o = e.as_object();
      const std::string key = json::serialize(o.at("name")) + json::serialize(o.at("kind")) +
                              json::serialize(o.at("begin")) + json::serialize(o.at("end"));
      if (!seen.insert(key).second || static_cast<int>(r) != rank) continue;
      kept.push_back(e);
      mine.insert(json::value_to<std::string>(o.at("tensor")));
    }
  }
  const json::object user = user_json(user_state);
  const std::string name = "rank-" + std::to_string(rank) + ".safetensors", copy = tmp + "/" + name;
  json::object report{
      {"error", ""}, {"entries", kept}, {"user_state", user}, {"step", step}, {"optimizer", "as saved"}};
  try {
    checkpoint::Reader reader(file);
    std::vector<checkpoint::PendingTensor> pending;
    for (const auto& t : reader.tensors())
      if (mine.count(t.name))
        pending.push_back({t.name, t.dtype, t.shape, [&reader, n = t.name] { return reader.read(n); }});
    checkpoint::write_file(copy, pending, {{"step", std::to_string(step)}, {"rank", std::to_string(rank)}},
                           /*remove_stale_temporaries=*/false);
    report["file"] = json::object{{"name", name}, {"size", files::file_size(copy)}, {"checksum", file_checksum(copy)}};
  } catch (const std::exception& e) {
    report["error"] = e.what();
  }
  const auto reports = gather(json::serialize(report), "publishing rank files: the index");
  MergedReports merged = merge_reports(reports, rank, step, "as saved", user);
  if (!merged.failed.empty()) {
    if (rank == 0) files::remove_all_quietly(tmp);
    return merged.failed;
  }
  std::string error;
  if (rank == 0)
    error = write_index_and_publish(
        [&] {
          return index_json(shapes, strategy, static_cast<int>(reports.size()), step, std::move(merged), user,
                            json::array{});
        },
        tmp, dir);
  return first_error(error, "publishing rank files: the index written");
}

}  // namespace checkpoint

namespace {

using Changes = std::vector<std::function<void()>>;

// The name a parameter's values are saved under, from the name the loader
// knows it by: that name, or another name of the same tensor (a tied
// parameter saved once, under another of its names), or (a part of a model)
// the name it has on another part.
class SavedNames {
 public:
  SavedNames(torch::nn::Module& root, const Index& idx, const checkpoint::ModelPart* part) {
    for (const auto& e : idx.entries)
      if (e.kind == "param") saved_.insert(e.name);
    for (const auto& [impl, names] : detail::parameter_names(root)) {
      (void)impl;
      std::vector<std::string> all;
      for (const auto& n : names)
        for (const auto& m : part ? part->names_of(n) : std::vector<std::string>{n})
          if (std::find(all.begin(), all.end(), m) == all.end()) all.push_back(m);
      for (const auto& n : names) others_[n] = all;
    }
  }
  /// The first of `name`'s names with saved ranges; `name` itself if none
  /// has any (its fill then says what is missing).
  const std::string& operator()(const std::string& name) const {
    if (saved_.count(name)) return name;
    auto it = others_.find(name);
    if (it != others_.end())
      for (const auto& n : it->second)
        if (saved_.count(n)) return n;
    return name;
  }

 private:
  std::set<std::string> saved_;
  std::map<std::string, std::vector<std::string>> others_;
};

// Plans one destination's fill from this load's index and files.
struct FillPlanner {
  const Index& idx;
  Files& files;
  const std::string& dir;
  bool allow_lossy;
  const SavedNames& saved;
  const SplitParams& split;
  // A tied parameter read (with its optimizer state) under another of its
  // names than the one this model keeps it under (plan_tied).
  std::map<std::string, std::string> read_as = {};
  /// The name `name`'s values and state are read under: plan_tied's choice,
  /// else the first of its names with saved ranges.
  const std::string& source(const std::string& name) const {
    auto it = read_as.find(name);
    return it == read_as.end() ? saved(name) : it->second;
  }
  /// Elements [begin, begin + numel) of the model's parameter or buffer
  /// `own`, read under `name` (a source()).
  Fill operator()(int64_t numel, const std::string& name, const std::string& kind, int64_t begin, at::ScalarType into,
                  const std::string& own) const {
    return plan_runs(split.runs(own, begin, numel), numel, name, kind, begin, idx, files, dir, into, allow_lossy);
  }
};

// A tied parameter the checkpoint holds under two or more of its names (a
// checkpoint of a model that did not tie them): the values must be equal
// (this rank compares the elements it loads; any rank's error fails every
// rank), unless LoadOptions::tied_from names the one to read. Fills
// `plan.read_as` where the name read is not the one this model keeps.
void plan_tied(torch::nn::Module& root, detail::ShardState& state, FillPlanner& plan,
               const std::vector<std::string>& tied_from) {
  constexpr const char* kOption = "LoadOptions().tied_from";
  const std::string where = "checkpoint '" + plan.dir + "'";
  const auto names = detail::parameter_names(root);
  checkpoint::check_tied_from(names, tied_from, where, kOption);
  std::set<std::string> held;
  for (const auto& e : plan.idx.entries)
    if (e.kind == "param") held.insert(e.name);
  auto one = [&](const std::string& kept, const at::Tensor& p, int64_t first, int64_t count, at::ScalarType dtype) {
    const auto& ns = names.at(p.unsafeGetTensorImpl());
    if (ns.size() < 2) return;
    auto t = checkpoint::tied_source(
        ns, [&](const std::string& n) { return held.count(n) > 0; }, tied_from, where, kOption);
    if (!t) return;  // none held: the fill says what is missing
    if (t->source != kept) plan.read_as[kept] = t->source;
    for (const auto& other : t->others) {
      if (count == 0) continue;
      at::Tensor a = at::empty({count}, at::TensorOptions().dtype(dtype)), b = at::empty_like(a);
      const auto runs = plan.split.runs(kept, first, count);
      run_fill(a, plan_runs(runs, count, t->source, "param", first, plan.idx, plan.files, plan.dir, dtype, true),
               plan.files);
      run_fill(b, plan_runs(runs, count, other, "param", first, plan.idx, plan.files, plan.dir, dtype, true),
               plan.files);
      checkpoint::require_equal_tied(a, b, dtype, t->source, other, first, where, kOption);
    }
  };
  if (state.path().replicated()) {
    for (const auto& [name, p] : no_shard_params(root, state)) {
      const auto [first, count] = checkpoint::share_of(p.numel(), state.world().rank(), state.world().size());
      one(name, p, first, count, state.path().record_of(p).scalar_type());
    }
    return;
  }
  const int shard_rank = state.topology().shard_comm().rank();
  for (auto& u : state.units().all())
    for (auto& f : u->flats())
      for (size_t i = 0; i < f->params().size(); ++i) {
        auto piece = f->layout().piece(i, shard_rank);
        one(f->names()[i], f->params()[i], piece ? piece->param_offset : 0, piece ? piece->length : 0, f->dtype());
      }
}

// The parameters this rank holds: whole under NoShard (into the fp32 master
// under mixed precision), the ranges of its shards otherwise.
void plan_parameters(torch::nn::Module& root, detail::ShardState& state, const FillPlanner& plan, Changes& changes) {
  Files* files = &plan.files;
  detail::ShardState* st = &state;
  if (state.path().replicated()) {
    for (const auto& [name, p] : no_shard_params(root, state)) {
      const at::Tensor record = state.path().record_of(p);  // the fp32 master under mixed precision
      changes.push_back([st, files, p, record,
                         fill = plan(record.numel(), plan.source(name), "param", 0, record.scalar_type(), name)] {
        at::Tensor t = at::empty({record.numel()}, record.options());
        run_fill(t, fill, *files);
        st->path().load_record(p, t);
      });
    }
    return;
  }
  const int shard_rank = state.topology().shard_comm().rank();
  for (auto& u : state.units().all())
    for (auto& f : u->flats())
      for (size_t i = 0; i < f->params().size(); ++i)
        if (auto p = f->layout().piece(i, shard_rank)) {
          at::Tensor dst = f->shard().narrow(0, p->shard_offset, p->length);
          changes.push_back([files, dst,
                             fill = plan(p->length, plan.source(f->names()[i]), "param", p->param_offset, f->dtype(),
                                         f->names()[i])] { run_fill(dst, fill, *files); });
        }
}

void plan_buffers(torch::nn::Module& root, const FillPlanner& plan, Changes& changes) {
  Files* files = &plan.files;
  for (const auto& item : root.named_buffers()) {
    if (!item.value().defined()) continue;
    at::Tensor b = item.value();
    changes.push_back(
        [files, b, fill = plan(b.numel(), item.key(), "buffer", 0, b.scalar_type(), item.key())]() mutable {
          at::Tensor t = at::empty({b.numel()}, b.options());
          run_fill(t, fill, *files);
          b.copy_(t.view(b.sizes()));
        });
  }
}

// The optimizer state of the pieces this rank's optimizer steps.
void plan_optimizer_state(ShardedOptimizer& opt, const FillPlanner& plan, Changes& changes) {
  const Index& idx = plan.idx;
  const std::string& dir = plan.dir;
  std::set<std::string> saved_kinds;
  for (const auto& e : idx.entries)
    if (e.kind != "param" && e.kind != "buffer") saved_kinds.insert(e.kind);
  const OptimizerKind kind = optimizer_kind(opt);
  const bool adam = kind == OptimizerKind::AdamW || kind == OptimizerKind::Adam;
  const bool sgd = kind == OptimizerKind::SGD;
  if (!saved_kinds.empty() &&
      !((adam && saved_kinds.count("exp_avg")) || (sgd && saved_kinds.count("momentum_buffer"))))
    throw SafetensorsError("checkpoint '" + dir + "' holds optimizer state of another kind of optimizer");
  // A parameter that never had a gradient has no optimizer state (the
  // optimizer skipped it) and none was saved: it gets none now either. A
  // checkpoint without any optimizer state (saved without the optimizer,
  // or before its first step) leaves the optimizer with none: a fresh start.
  const std::string first_kind = adam ? "exp_avg" : "momentum_buffer";
  // Per name: groups may differ in amsgrad, so some parameters have a
  // max_exp_avg_sq and others none.
  std::set<std::string> with_state, with_max;
  for (const auto& e : idx.entries) {
    if (e.kind == first_kind) with_state.insert(e.name);
    if (e.kind == "max_exp_avg_sq") with_max.insert(e.name);
  }
  // A group with amsgrad needs each parameter's max_exp_avg_sq: a
  // checkpoint of an optimizer without it would load, and step() fail.
  const std::set<const void*> amsgrad = detail::amsgrad_params(opt);
  auto* st = &opt.inner().state();
  Files* files = &plan.files;
  for (const auto& piece : opt.views().pieces()) {
    void* key = piece.view.unsafeGetTensorImpl();
    const std::string& source = plan.source(piece.name);  // a tied parameter's state comes with its values
    if (!with_state.count(source)) {
      changes.push_back([st, key] { st->erase(key); });
      continue;
    }
    if (amsgrad.count(key) && !with_max.count(source))
      throw SafetensorsError("checkpoint '" + dir + "': '" + piece.name +
                             "' is in a parameter group with amsgrad, "
                             "but the checkpoint has no max_exp_avg_sq for it (it was saved by an optimizer "
                             "without amsgrad for it)");
    std::vector<std::string> kinds =
        adam ? std::vector<std::string>{"exp_avg", "exp_avg_sq"} : std::vector<std::string>{"momentum_buffer"};
    if (adam && with_max.count(source)) kinds.push_back("max_exp_avg_sq");
    std::vector<Fill> fills;
    for (const auto& k : kinds)
      fills.push_back(plan(piece.length, source, k, piece.param_offset, piece.view.scalar_type(), piece.name));
    // The state takes the piece's shape: a NoShard piece is the whole
    // parameter, and torch::optim adds its gradient into the state in
    // place (a flat state made step() fail after a resume).
    changes.push_back([st, files, key, fills, kind, options = piece.view.options(), length = piece.length,
                       shape = piece.view.sizes().vec()] {
      std::vector<at::Tensor> t;
      for (const auto& fill : fills) {
        at::Tensor flat = at::empty({length}, options);
        run_fill(flat, fill, *files);
        t.push_back(flat.view(shape));
      }
      (*st)[key] = detail::make_optimizer_state(kind, fills.front().step, t);
    });
  }
}

}  // namespace

namespace {

// load_sharded_checkpoint, of the whole model or (`part`) of one part of it.
int64_t load_sharded(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir_arg,
                     std::map<std::string, std::string>* user_state, const LoadOptions& options,
                     const checkpoint::ModelPart* part) {
  auto state = detail::require_state(root, "load_sharded_checkpoint");
  shardtorch::detail::ProgressReporter progress("load_sharded_checkpoint", "tensors", 0, 0, options.progress());
  progress.count_io();
  World* world = part ? part->world.get() : &state->world();
  detail::FileWaits file_waits(*state, "load_sharded_checkpoint", world);  // and for the slowest reader
  state->copies().wait_for_offload_copies();
  c10::NoGradGuard no_grad;
  std::string dir = normalized(dir_arg);
  const std::string what = "shardtorch::load_sharded_checkpoint '" + dir + "'";
  // Check, agree, change, agree. First every rank checks everything it will
  // read (the index, and every file it needs: size, checksum, step; that
  // saved ranges cover each destination exactly; names and shapes) and plans
  // the copies, changing nothing. If any rank found a problem, or the ranks
  // read different checkpoints, every rank throws and every model is as it
  // was. Then the copies run, and the ranks agree once more.
  Index idx;
  std::optional<Files> files;
  Changes changes;
  std::string error;
  try {
    state->summons().check_outside();
    dir = published_dir(dir);
    idx = read_index(dir);
    files.emplace(dir, idx);
    check_model_against(root, idx, dir, part);
    const SavedNames saved(root, idx, part);
    const SplitParams split(part ? &root : nullptr);
    FillPlanner plan{idx, *files, dir, options.allow_lossy_casts(), saved, split};
    plan_tied(root, *state, plan, options.tied_from());
    plan_parameters(root, *state, plan, changes);
    plan_buffers(root, plan, changes);
    if (opt) plan_optimizer_state(*opt, plan, changes);
  } catch (const std::exception& e) {
    error = e.what();
  }
  detail::load_agreed(*state, error, idx.fingerprint, changes, what, world, &progress);
  if (opt) opt->views().count_optimizer_state(opt->inner());
  if (user_state) *user_state = idx.user_state;
  return idx.step;
}

}  // namespace

namespace checkpoint {

std::vector<std::pair<index_format::Entry, at::Tensor>> rank_state(torch::nn::Module& root, ShardedOptimizer* opt,
                                                                   const std::string& file) {
  auto state = detail::require_state(root, "snapshot");
  c10::NoGradGuard no_grad;
  if (opt) optimizer_kind(*opt);
  return collect(root, *state, opt, state->world().rank(), nullptr, /*whole=*/true, file).items;
}

std::map<std::string, std::vector<int64_t>> model_shapes_of(torch::nn::Module& root) { return model_shapes(root); }

std::string strategy_of(torch::nn::Module& root) {
  return strategy_name(detail::require_state(root, "snapshot")->options().strategy());
}

void load_rank_state(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir, const Index& idx,
                     const std::string& fingerprint, const std::string& prior_error, bool keep) {
  auto state = detail::require_state(root, "snapshot restore");
  detail::FileWaits file_waits(*state, "snapshot restore");
  state->copies().wait_for_offload_copies();
  c10::NoGradGuard no_grad;
  const std::string what = "shardtorch::Snapshots::restore '" + dir + "'";
  std::optional<Files> files;
  Changes changes;
  std::string error = prior_error;
  if (error.empty() && !keep) {
    try {
      state->summons().check_outside();
      files.emplace(dir, idx);
      check_model_against(root, idx, dir, nullptr);
      const SavedNames saved(root, idx, nullptr);
      const SplitParams split(nullptr);
      FillPlanner plan{idx, *files, dir, /*allow_lossy=*/false, saved, split};
      plan_parameters(root, *state, plan, changes);
      plan_buffers(root, plan, changes);
      if (opt) plan_optimizer_state(*opt, plan, changes);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  detail::load_agreed(*state, error, fingerprint, changes, what);
  if (opt) opt->views().count_optimizer_state(opt->inner());
}

}  // namespace checkpoint

int64_t load_sharded_checkpoint(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir,
                                std::map<std::string, std::string>* user_state, const LoadOptions& options) {
  auto state = detail::require_state(root, "load_sharded_checkpoint");
  const auto part = checkpoint::tensor_parallel_part(root, *state, "load_sharded_checkpoint");
  return load_sharded(root, opt, dir, user_state, options, part ? &*part : nullptr);
}

namespace checkpoint {

void save_sharded_checkpoint(torch::nn::Module& root, ShardedOptimizer* optimizer, const std::string& dir, int64_t step,
                             const std::map<std::string, std::string>& user_state, const ModelPart& part) {
  save_sharded(root, optimizer, dir, step, user_state, &part);
}

int64_t load_sharded_checkpoint(torch::nn::Module& root, ShardedOptimizer* optimizer, const std::string& dir,
                                std::map<std::string, std::string>* user_state, const LoadOptions& options,
                                const ModelPart& part) {
  return load_sharded(root, optimizer, dir, user_state, options, &part);
}

}  // namespace checkpoint

std::map<std::string, at::Tensor> read_sharded_checkpoint(const std::string& dir_arg) {
  const std::string dir = published_dir(normalized(dir_arg));
  Index idx = read_index(dir);
  Files files(dir, idx);
  // Every file, also one no entry names any more: its tensors must all be
  // listed (as load_sharded_checkpoint, this refuses what it cannot account for).
  for (const auto& [name, size_and_sum] : idx.files) files.get(name);
  // Each (name, kind) has the shape the index records for the name (the
  // optimizer's state has its parameter's); its element count, not the
  // largest saved end, is what the ranges must cover. Checkpoints written
  // before shapes were recorded come back flat.
  struct Whole {
    std::vector<int64_t> shape;
    std::optional<at::ScalarType> dtype;  // of its first range: every other must have it too
  };
  check_entries_within_shapes(idx, dir);
  std::map<std::pair<std::string, std::string>, Whole> wholes;
  for (const auto& e : idx.entries) {
    Whole& w = wholes[{e.name, e.kind}];
    const at::ScalarType dtype = checkpoint::scalar_type(saved_record(files, e, dir).dtype);
    if (w.dtype && *w.dtype != dtype)
      throw SafetensorsError("checkpoint '" + dir + "': '" + e.name + "' (" + e.kind + ") is saved in " +
                             checkpoint::dtype_text(*w.dtype) + " and, in '" + e.file + "', in " +
                             checkpoint::dtype_text(dtype) + " (a file of another save?)");
    w.dtype = dtype;
    if (idx.shapes) {
      w.shape = idx.shapes->at(e.name);
    } else {
      w.shape = {std::max(w.shape.empty() ? int64_t{0} : w.shape[0], reach(e))};
    }
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& [key, w] : wholes) {
    const int64_t n = c10::multiply_integers(w.shape);
    Fill fill = plan_fill(n, key.first, key.second, 0, idx, files, dir, *w.dtype, /*allow_lossy=*/false);
    at::Tensor t = at::empty({n}, at::TensorOptions().dtype(*w.dtype));
    run_fill(t, fill, files);
    out[key.first + "|" + key.second] = t.view(w.shape);
  }
  return out;
}

}  // namespace shardtorch
