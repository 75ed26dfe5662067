// Sharded checkpoints: per-rank safetensors files of element ranges and a
// Boost.JSON index; loading reassembles whatever ranges a rank owns now.
#include <boost/json.hpp>
#include <c10/core/GradMode.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "../shard_state.h"
#include "shardtorch/checkpoint.h"
#include "shardtorch/optim/cpu_adam.h"

namespace shardtorch {
namespace {

namespace fs = std::filesystem;
namespace json = boost::json;
using checkpoint::SafetensorsError;

constexpr int64_t kFormatVersion = 1;

struct Entry {
  std::string name, kind;  // parameter or buffer name; param, buffer, exp_avg, exp_avg_sq, ...
  int64_t begin = 0, end = 0;
  int64_t step = 0;  // optimizer state: the optimizer's step count for this range
  std::string file, tensor;
};

std::string tensor_key(const Entry& e) { return e.name + "|" + e.kind + "|" + std::to_string(e.begin); }

// FNV-1a over the file's bytes.
std::string checksum(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw SafetensorsError("checkpoint file '" + path + "' is missing");
  uint64_t h = 1469598103934665603ull;
  char buf[1 << 16];
  while (in) {
    in.read(buf, sizeof(buf));
    for (std::streamsize i = 0; i < in.gcount(); ++i) {
      h ^= static_cast<unsigned char>(buf[i]);
      h *= 1099511628211ull;
    }
  }
  std::ostringstream os;
  os << "fnv1a64:" << std::hex << h;
  return os.str();
}

void fsync_path(const std::string& p, bool dir) {
  int fd = ::open(p.c_str(), (dir ? O_DIRECTORY : 0) | O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

std::vector<std::pair<std::string, at::Tensor>> optimizer_kinds(const torch::optim::OptimizerParamState* st) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(st)) {
    out = {{"exp_avg", a->exp_avg()}, {"exp_avg_sq", a->exp_avg_sq()}, {"max_exp_avg_sq", a->max_exp_avg_sq()}};
  } else if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(st)) {
    out = {{"exp_avg", w->exp_avg()}, {"exp_avg_sq", w->exp_avg_sq()}, {"max_exp_avg_sq", w->max_exp_avg_sq()}};
  } else if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(st)) {
    out = {{"momentum_buffer", s->momentum_buffer()}};
  }
  out.erase(std::remove_if(out.begin(), out.end(), [](const auto& kv) { return !kv.second.defined(); }), out.end());
  return out;
}

int64_t step_of(const torch::optim::OptimizerParamState* st) {
  if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(st)) return a->step();
  if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(st)) return w->step();
  return 0;
}

json::object entry_json(const Entry& e) {
  return {{"name", e.name}, {"kind", e.kind}, {"begin", e.begin}, {"end", e.end},
          {"step", e.step}, {"file", e.file}, {"tensor", e.tensor}};
}

Entry entry_from(const json::value& v, const std::string& index) {
  try {
    const auto& o = v.as_object();
    Entry e;
    e.name = json::value_to<std::string>(o.at("name"));
    e.kind = json::value_to<std::string>(o.at("kind"));
    e.begin = o.at("begin").to_number<int64_t>();
    e.end = o.at("end").to_number<int64_t>();
    e.step = o.at("step").to_number<int64_t>();
    e.file = json::value_to<std::string>(o.at("file"));
    e.tensor = json::value_to<std::string>(o.at("tensor"));
    if (e.begin < 0 || e.end < e.begin) throw std::invalid_argument("bad range");
    if (e.file.find('/') != std::string::npos || e.file.find("..") != std::string::npos)
      throw std::invalid_argument("file name outside the checkpoint directory");
    return e;
  } catch (const std::exception& ex) {
    throw SafetensorsError("checkpoint index '" + index + "': malformed entry: " + ex.what());
  }
}

// NoShard: every parameter of the module, each tensor once, saved and loaded
// whole: the trained ones under the names the bucketer knows them by, then
// the others (frozen) under their first name.
std::vector<std::pair<std::string, at::Tensor>> no_shard_params(torch::nn::Module& root, detail::ShardState& state) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::set<const void*> seen;
  for (size_t i = 0; i < state.ddp_params().size(); ++i) {
    out.emplace_back(state.ddp_names()[i], state.ddp_params()[i]);
    seen.insert(state.ddp_params()[i].unsafeGetTensorImpl());
  }
  for (const auto& item : root.named_parameters())
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  return out;
}

// What this rank holds: element ranges of parameters (and buffers, rank 0)
// and of the optimizer state.
struct Holding {
  std::vector<std::pair<Entry, at::Tensor>> items;
};

Holding collect(torch::nn::Module& root, detail::ShardState& state, ShardedOptimizer* opt, int rank) {
  Holding h;
  // Replicated strategies: one writer. HybridShard: the first replica group.
  bool writes_params = true;
  if (state.ddp()) writes_params = rank == 0;
  if (state.replica_comm() && state.replica_comm()->rank() != 0) writes_params = false;
  const std::string file = "rank-" + std::to_string(rank) + ".safetensors";
  auto add = [&](const std::string& name, const std::string& kind, int64_t begin, const at::Tensor& t, int64_t step) {
    Entry e{name, kind, begin, begin + t.numel(), step, file, ""};
    e.tensor = tensor_key(e);
    h.items.emplace_back(e, t.detach().reshape({-1}));
  };
  if (writes_params) {
    if (state.ddp()) {
      for (const auto& [name, p] : no_shard_params(root, state)) add(name, "param", 0, state.record_of(p), 0);
    } else {
      const int shard_rank = state.shard_comm().rank();
      for (auto& u : state.units())
        for (auto& f : u->flats())
          for (size_t i = 0; i < f->params().size(); ++i)
            if (auto p = f->layout().piece(i, shard_rank))
              add(f->names()[i], "param", p->param_offset, f->shard().narrow(0, p->shard_offset, p->length), 0);
            else if (f->layout().numel(i) == 0 && shard_rank == 0)  // no rank owns a piece: listed once, empty
              add(f->names()[i], "param", 0, f->shard().narrow(0, 0, 0), 0);
    }
    if (opt) {
      const auto& st = opt->inner().state();
      for (const auto& piece : opt->views().pieces()) {
        auto it = st.find(piece.view.unsafeGetTensorImpl());
        if (it == st.end()) continue;
        int64_t step = step_of(it->second.get());
        for (auto& [kind, t] : optimizer_kinds(it->second.get())) add(piece.name, kind, piece.param_offset, t, step);
      }
    }
  }
  if (rank == 0)
    for (const auto& item : root.named_buffers())
      if (item.value().defined()) add(item.key(), "buffer", 0, item.value(), 0);
  return h;
}

struct Index {
  int64_t version = 0, world_size = 0, step = 0;
  std::string strategy;
  std::vector<Entry> entries;
  std::map<std::string, std::pair<int64_t, std::string>> files;  // name -> (size, checksum)
  std::map<std::string, std::string> user_state;
};

Index read_index(const std::string& dir) {
  const std::string path = dir + "/index.json";
  std::ifstream in(path);
  if (!in) throw SafetensorsError("checkpoint '" + dir + "': no index.json (not a checkpoint, or an unfinished one)");
  std::stringstream ss;
  ss << in.rdbuf();
  boost::system::error_code ec;
  json::value v = json::parse(ss.str(), ec);
  if (ec) throw SafetensorsError("checkpoint index '" + path + "': " + ec.message());
  Index idx;
  try {
    const auto& o = v.as_object();
    idx.version = o.at("format_version").to_number<int64_t>();
    if (idx.version > kFormatVersion)
      throw SafetensorsError("checkpoint index '" + path + "': format version " + std::to_string(idx.version) +
                             " is newer than this shardtorch reads (" + std::to_string(kFormatVersion) + ")");
    idx.world_size = o.at("world_size").to_number<int64_t>();
    idx.step = o.at("step").to_number<int64_t>();
    idx.strategy = json::value_to<std::string>(o.at("strategy"));
    for (const auto& f : o.at("files").as_array()) {
      const auto& fo = f.as_object();
      idx.files[json::value_to<std::string>(fo.at("name"))] = {fo.at("size").to_number<int64_t>(),
                                                               json::value_to<std::string>(fo.at("checksum"))};
    }
    for (const auto& e : o.at("entries").as_array()) idx.entries.push_back(entry_from(e, path));
    if (const auto* u = o.if_contains("user_state")) {  // absent in checkpoints saved without it
      for (const auto& [k, v] : u->as_object()) {
        if (!v.is_string())
          throw SafetensorsError("checkpoint index '" + path + "': user_state '" + std::string(k) + "' is not a string");
        idx.user_state[std::string(k)] = json::value_to<std::string>(v);
      }
    }
  } catch (const SafetensorsError&) {
    throw;
  } catch (const std::exception& e) {
    throw SafetensorsError("checkpoint index '" + path + "': malformed: " + e.what());
  }
  for (const auto& e : idx.entries)
    if (!idx.files.count(e.file))
      throw SafetensorsError("checkpoint index '" + path + "': entry '" + e.tensor + "' names unlisted file '" + e.file + "'");
  return idx;
}

// Opens (and checks) the files of a checkpoint on demand.
class Files {
 public:
  Files(std::string dir, const Index& idx) : dir_(std::move(dir)), idx_(idx) {}
  const checkpoint::Reader& get(const std::string& name) {
    auto it = open_.find(name);
    if (it != open_.end()) return *it->second;
    const std::string path = dir_ + "/" + name;
    if (!fs::exists(path)) throw SafetensorsError("checkpoint '" + dir_ + "': shard file '" + name + "' is missing");
    const auto& [size, sum] = idx_.files.at(name);
    if (static_cast<int64_t>(fs::file_size(path)) != size)
      throw SafetensorsError("checkpoint '" + dir_ + "': '" + name + "' has " + std::to_string(fs::file_size(path)) +
                             " bytes, the index says " + std::to_string(size));
    if (checksum(path) != sum)
      throw SafetensorsError("checkpoint '" + dir_ + "': '" + name + "' does not match its checksum in the index");
    auto r = std::make_unique<checkpoint::Reader>(path);
    auto file_step = r->header().metadata.find("step");
    if (file_step == r->header().metadata.end() || file_step->second != std::to_string(idx_.step))
      throw SafetensorsError("checkpoint '" + dir_ + "': '" + name + "' is from step " +
                             (file_step == r->header().metadata.end() ? std::string("?") : file_step->second) +
                             " but the index is for step " + std::to_string(idx_.step));
    return *open_.emplace(name, std::move(r)).first->second;
  }

 private:
  std::string dir_;
  const Index& idx_;
  std::map<std::string, std::unique_ptr<checkpoint::Reader>> open_;
};

// Fills dst (the elements [begin, begin + dst.numel()) of name's `kind`) from
// every saved range that overlaps it; returns the largest step seen.
int64_t fill(at::Tensor dst, const std::string& name, const std::string& kind, int64_t begin, const Index& idx,
             Files& files, const std::string& dir) {
  const int64_t end = begin + dst.numel();
  int64_t covered = 0, step = 0;
  for (const auto& e : idx.entries) {
    if (e.name != name || e.kind != kind) continue;
    int64_t lo = std::max(begin, e.begin), hi = std::min(end, e.end);
    if (lo >= hi) continue;
    at::Tensor part = files.get(e.file).read_range(e.tensor, lo - e.begin, hi - lo);
    dst.narrow(0, lo - begin, hi - lo).copy_(part);
    covered += hi - lo;
    step = std::max(step, e.step);
  }
  if (covered != dst.numel())
    throw SafetensorsError("checkpoint '" + dir + "': elements [" + std::to_string(begin) + ", " + std::to_string(end) +
                           ") of '" + name + "' (" + kind + ") are " +
                           (covered < dst.numel() ? "not all saved (a missing shard?)" : "saved more than once"));
  return step;
}

}  // namespace

void save_sharded_checkpoint(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir, int64_t step,
                             const std::map<std::string, std::string>& user_state) {
  auto state = detail::require_state(root, "save_sharded_checkpoint");
  World& world = state->world();
  c10::NoGradGuard no_grad;
  const std::string tmp = dir + ".tmp";
  if (world.rank() == 0) {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  world.barrier();
  Holding h = collect(root, *state, opt, world.rank());
  const std::string file = "rank-" + std::to_string(world.rank()) + ".safetensors";
  std::string error;
  json::array mine;
  try {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (auto& [e, t] : h.items) {
      tensors.emplace_back(e.tensor, t);
      mine.push_back(entry_json(e));
    }
    checkpoint::save_file(tmp + "/" + file, tensors, {{"step", std::to_string(step)}, {"rank", std::to_string(world.rank())}});
  } catch (const std::exception& e) {
    error = e.what();
  }
  json::object user;
  for (const auto& [k, v] : user_state) user[k] = v;
  json::object report{{"error", error}, {"entries", mine}, {"user_state", user}};
  if (error.empty()) {
    report["file"] = json::object{{"name", file},
                                  {"size", static_cast<int64_t>(fs::file_size(tmp + "/" + file))},
                                  {"checksum", checksum(tmp + "/" + file)}};
  }
  auto reports = world.comm().all_gather_strings(json::serialize(report), "save_sharded_checkpoint index");
  std::string failed;
  json::array files, entries;
  for (size_t r = 0; r < reports.size(); ++r) {
    json::object o = json::parse(reports[r]).as_object();
    std::string err = json::value_to<std::string>(o.at("error"));
    if (!err.empty() && failed.empty()) failed = "rank " + std::to_string(r) + ": " + err;
    if (o.contains("file")) files.push_back(o.at("file"));
    for (auto& e : o.at("entries").as_array()) entries.push_back(e);
    if (failed.empty() && o.at("user_state") != json::value(user)) {
      // Every rank sees every report, so every rank fails alike.
      std::string key = "(the set of keys)";
      const auto& theirs = o.at("user_state").as_object();
      for (const auto& [k, v] : user)
        if (!theirs.contains(k) || theirs.at(k) != v) key = "'" + std::string(k) + "'";
      for (const auto& [k, v] : theirs)
        if (!user.contains(k)) key = "'" + std::string(k) + "'";
      failed = "rank " + std::to_string(r) + ": its user_state differs from rank " + std::to_string(world.rank()) +
               "'s at " + key + " (user_state must be the same on every rank)";
    }
  }
  TORCH_CHECK(failed.empty(), "shardtorch::save_sharded_checkpoint: writing '", dir, "' failed on ", failed);
  if (world.rank() == 0) {
    json::object index{{"format_version", kFormatVersion}, {"format", "shardtorch sharded checkpoint"},
                       {"world_size", world.size()}, {"strategy", strategy_name(state->strategy())},
                       {"step", step}, {"files", files}, {"entries", entries}, {"user_state", user}};
    json::array units;
    if (!state->ddp())
      for (auto& u : state->units()) {
        json::array flats;
        for (auto& f : u->flats()) {
          json::array names;
          for (auto& n : f->names()) names.push_back(json::value(n));
          flats.push_back(json::object{{"params", names}, {"numel", f->layout().total_numel()},
                                       {"padded_numel", f->layout().padded_numel()}});
        }
        units.push_back(json::object{{"name", u->label()}, {"flats", flats}});
      }
    index["units"] = units;
    {
      std::ofstream out(tmp + "/index.json");
      out << json::serialize(index);
    }
    fsync_path(tmp + "/index.json", false);
    fsync_path(tmp, true);
    // Publish atomically: a previous checkpoint at `dir` is swapped with the
    // complete new one in one step (renameat2 RENAME_EXCHANGE), so `dir` is
    // always one whole checkpoint or the other, whenever the process dies.
    if (fs::exists(dir)) {
      if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) != 0)
        throw SafetensorsError("checkpoint '" + dir + "': could not swap in the new checkpoint: " + std::strerror(errno));
      fs::remove_all(tmp);  // now the previous checkpoint
    } else {
      fs::rename(tmp, dir);
    }
    fs::path parent = fs::path(dir).has_parent_path() ? fs::path(dir).parent_path() : fs::path(".");
    fsync_path(parent.string(), true);
  }
  world.barrier();
}

int64_t load_sharded_checkpoint(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir,
                                std::map<std::string, std::string>* user_state) {
  auto state = detail::require_state(root, "load_sharded_checkpoint");
  state->wait_for_offload_copies();
  c10::NoGradGuard no_grad;
  Index idx = read_index(dir);
  Files files(dir, idx);
  if (state->ddp()) {
    for (const auto& [name, p] : no_shard_params(root, *state)) {
      const at::Tensor record = state->record_of(p);  // the fp32 master under mixed precision
      at::Tensor t = at::empty({record.numel()}, record.options());
      fill(t, name, "param", 0, idx, files, dir);
      state->load_record(p, t);
    }
  } else {
    const int shard_rank = state->shard_comm().rank();
    for (auto& u : state->units())
      for (auto& f : u->flats())
        for (size_t i = 0; i < f->params().size(); ++i)
          if (auto p = f->layout().piece(i, shard_rank))
            fill(f->shard().narrow(0, p->shard_offset, p->length), f->names()[i], "param", p->param_offset, idx, files, dir);
  }
  for (const auto& item : root.named_buffers()) {
    if (!item.value().defined()) continue;
    at::Tensor t = at::empty({item.value().numel()}, item.value().options());
    fill(t, item.key(), "buffer", 0, idx, files, dir);
    at::Tensor(item.value()).copy_(t.view(item.value().sizes()));
  }
  if (opt) {
    std::set<std::string> saved_kinds;
    for (const auto& e : idx.entries)
      if (e.kind != "param" && e.kind != "buffer") saved_kinds.insert(e.kind);
    auto& st = opt->inner().state();
    // The state classes each optimizer keeps (the fused CPU ones keep torch::optim's).
    torch::optim::Optimizer* inner = &opt->inner();
    const bool adamw = dynamic_cast<torch::optim::AdamW*>(inner) || dynamic_cast<FusedAdamW*>(inner);
    const bool adam = adamw || dynamic_cast<torch::optim::Adam*>(inner) || dynamic_cast<FusedAdam*>(inner);
    const bool sgd = dynamic_cast<torch::optim::SGD*>(inner) != nullptr;
    if (!saved_kinds.empty()) {
      bool fits = (adam && saved_kinds.count("exp_avg")) || (sgd && saved_kinds.count("momentum_buffer"));
      TORCH_CHECK(fits, "shardtorch::load_sharded_checkpoint: '", dir, "' holds optimizer state of another kind of optimizer");
    }
    // A parameter that never had a gradient has no optimizer state (the
    // optimizer skipped it) and none was saved: it gets none now either.
    const std::string first_kind = adam ? "exp_avg" : "momentum_buffer";
    std::set<std::string> with_state;
    for (const auto& e : idx.entries)
      if (e.kind == first_kind) with_state.insert(e.name);
    for (const auto& piece : opt->views().pieces()) {
      if (saved_kinds.empty()) break;
      auto make = [&](const std::string& kind, int64_t* step) {
        at::Tensor t = at::empty({piece.length}, piece.view.options());
        int64_t s = fill(t, piece.name, kind, piece.param_offset, idx, files, dir);
        if (step) *step = s;
        return t;
      };
      void* key = piece.view.unsafeGetTensorImpl();
      if (!with_state.count(piece.name)) {
        st.erase(key);
        continue;
      }
      if (adam) {
        int64_t step = 0;
        at::Tensor m = make("exp_avg", &step), v = make("exp_avg_sq", nullptr);
        at::Tensor vmax = saved_kinds.count("max_exp_avg_sq") ? make("max_exp_avg_sq", nullptr) : at::Tensor();
        if (adamw) {
          auto s = std::make_unique<torch::optim::AdamWParamState>();
          s->step(step).exp_avg(m).exp_avg_sq(v);
          if (vmax.defined()) s->max_exp_avg_sq(vmax);
          st[key] = std::move(s);
        } else {
          auto s = std::make_unique<torch::optim::AdamParamState>();
          s->step(step).exp_avg(m).exp_avg_sq(v);
          if (vmax.defined()) s->max_exp_avg_sq(vmax);
          st[key] = std::move(s);
        }
      } else if (sgd) {
        auto s = std::make_unique<torch::optim::SGDParamState>();
        s->momentum_buffer(make("momentum_buffer", nullptr));
        st[key] = std::move(s);
      }
    }
  }
  state->after_optimizer_step();  // persistent full buffers are rebuilt, stale full copies freed
  if (user_state) *user_state = idx.user_state;
  return idx.step;
}

std::map<std::string, at::Tensor> read_sharded_checkpoint(const std::string& dir) {
  Index idx = read_index(dir);
  Files files(dir, idx);
  std::map<std::string, int64_t> sizes;
  std::map<std::string, at::ScalarType> dtypes;
  for (const auto& e : idx.entries) {
    std::string key = e.name + "|" + e.kind;
    sizes[key] = std::max(sizes[key], e.end);
    dtypes[key] = checkpoint::scalar_type(files.get(e.file).header().find(e.tensor)->dtype);
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& [key, n] : sizes) {
    auto bar = key.find('|');
    at::Tensor t = at::empty({n}, at::TensorOptions().dtype(dtypes[key]));
    fill(t, key.substr(0, bar), key.substr(bar + 1), 0, idx, files, dir);
    out[key] = t;
  }
  return out;
}

}  // namespace shardtorch
