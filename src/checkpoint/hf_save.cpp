// Hugging Face's multi-file safetensors layout written from a sharded model:
// gathered one flat parameter at a time, written by rank 0 into files of at
// most max_file_bytes (each tensor whole in one file), then the index.
#include <boost/json.hpp>
#include <c10/core/GradMode.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "base/check.h"
#include "base/errors.h"
#include "base/files.h"
#include "base/log.h"
#include "runtime/shard_state.h"
#include "checkpoint/hf_index.h"
#include "checkpoint/agreement.h"
#include "checkpoint/model_part.h"
#include "checkpoint/publish.h"
#include "checkpoint/safetensors_format.h"
#include "shardtorch/checkpoint/safetensors.h"
#include "shardtorch/hf_checkpoint.h"
#include "checkpoint/streamed_tensors.h"
#include "checkpoint/tp_slices.h"

namespace shardtorch {
namespace {

// One tensor of the checkpoint: where its values come from, and its name there.
struct Entry {
  std::string name;  // in the checkpoint
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t bytes = 0;
  std::function<at::Tensor()> produce;  // rank 0 only
};

std::string file_name(size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", k + 1, n);
  return buf;
}

// Collective: every rank names the same tensors, in the same order (the
// gathers follow them), and none failed to; otherwise every rank throws,
// naming the rank and, for names, the first that differs.
void agree_on_names(World& world, const std::string& who, const std::string& error, const std::vector<Entry>& entries) {
  std::string mine;
  for (const auto& e : entries) mine += e.name + '\n';
  const auto all = detail::agreed_fingerprints(world, error, who, mine);
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    std::istringstream a(all[0]), b(all[r]);
    std::string x, y;
    int64_t k = 0;
    bool a_more = false, b_more = false;
    for (;; ++k) {
      a_more = static_cast<bool>(std::getline(a, x));
      b_more = static_cast<bool>(std::getline(b, y));
      if (!a_more || !b_more || x != y) break;
    }
    SHARDTORCH_CHECK(false, who, ": the ranks would write different tensors: tensor ", k, " is ",
                     a_more ? "'" + x + "'" : std::string("none (the end)"), " on rank 0 but ",
                     b_more ? "'" + y + "'" : std::string("none (the end)"), " on rank ", r,
                     ". prefix and map_name must give the same names on every rank; nothing was written");
  }
}

void check_options(const std::string& who, const HfSaveOptions& options) {
  SHARDTORCH_CHECK(options.max_file_bytes() > 0, who, ": max_file_bytes must be positive, got ",
                   options.max_file_bytes());
  SHARDTORCH_CHECK(!options.dtype() || at::isFloatingType(*options.dtype()), who,
                   ": dtype must be a floating-point type, got ", *options.dtype());
}

// The items of `tensors` under their names in the checkpoint (prefix,
// map_name), those the mapping or `skip` leaves out left out; `kept` gets the
// indices of the others. Throws if two get one name. `writer`: the entries
// can produce their values (converted to options.dtype()).
std::vector<Entry> name_entries(const checkpoint::StreamedTensors& tensors, const HfSaveOptions& options,
                                const std::string& who, bool writer, std::vector<size_t>& kept,
                                const std::function<bool(const std::string& name)>& skip = nullptr) {
  std::vector<Entry> entries;
  std::set<std::string> taken;
  for (size_t item = 0; item < tensors.items().size(); ++item) {
    const auto& t = tensors.items()[item];
    if (skip && skip(t.name)) continue;
    std::string name = options.prefix() + t.name;
    if (options.map_name()) {
      auto mapped = options.map_name()(name);
      if (!mapped || mapped->empty()) continue;
      name = *mapped;
    }
    SHARDTORCH_CHECK(taken.insert(name).second, who, ": two of the model's tensors are named '", name,
                     "' in the checkpoint (the last is '", t.name, "'): the name mapping must keep names distinct");
    const at::ScalarType out = options.dtype() && at::isFloatingType(t.dtype) ? *options.dtype() : t.dtype;
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    Entry e{name, out, t.shape, numel * static_cast<int64_t>(c10::elementSize(out)), nullptr};
    if (writer)
      e.produce = [produce = t.produce, out] {
        at::Tensor v = produce();
        return v.scalar_type() == out ? v : v.to(out);
      };
    entries.push_back(std::move(e));
    kept.push_back(item);
  }
  return entries;
}

// Tensors of these sizes in files, in order, each file filled until the next
// tensor would pass the limit (a larger tensor alone in its file), as
// transformers' save_pretrained. At least one file, empty if need be.
std::vector<std::vector<size_t>> plan_files(const std::vector<int64_t>& bytes, int64_t max_file_bytes) {
  std::vector<std::vector<size_t>> plan(1);
  int64_t in_file = 0;
  for (size_t e = 0; e < bytes.size(); ++e) {
    if (!plan.back().empty() && in_file + bytes[e] > max_file_bytes) {
      plan.emplace_back();
      in_file = 0;
    }
    plan.back().push_back(e);
    in_file += bytes[e];
  }
  return plan;
}

// Names of the files a save writes before they are renamed into place begin
// with this, then its writer's pid.
const std::string kStagingPrefix = ".shardtorch-staging-";

// Removes what a failed save left in `dir`: the files whose names contain
// `marker` (a staging prefix, with write_file's temporaries of those files).
void remove_staged(const std::string& dir, const std::string& marker) {
  try {
    for (const auto& name : files::list_directory(dir))
      if (name.find(marker) != std::string::npos) files::remove(dir + "/" + name);
  } catch (const std::exception&) {
  }
}

// The last of a save, on one rank: the data files `files` written under
// `staging` + their names are renamed into place, then the index (written
// under its staging name first, so that a reader of the old index never sees
// a half-written file) names `weight_map` (tensor, file); data files of an
// earlier save that the new index does not name are then removed.
void publish_hf(const std::string& dir, const std::string& staging, const std::vector<std::string>& data_files,
                const std::vector<std::pair<std::string, std::string>>& weight_map, int64_t total_bytes) {
  std::ostringstream index;
  index << "{\n  \"metadata\": {\n    \"total_size\": " << total_bytes << "\n  },\n  \"weight_map\": {";
  const char* sep = "\n";
  for (const auto& [tensor, file] : weight_map) {
    index << sep << "    " << checkpoint::quote(tensor) << ": \"" << file << "\"";
    sep = ",\n";
  }
  index << "\n  }\n}\n";
  const std::string index_tmp = dir + "/" + staging + checkpoint::hf_index::kFileName;
  checkpoint::write_text_durably(index_tmp, index.str());
  for (const auto& f : data_files) files::rename(dir + "/" + staging + f, dir + "/" + f);
  files::rename_durably(index_tmp, dir + "/" + checkpoint::hf_index::kFileName);
  static const std::regex ours(R"(model-\d{5}-of-\d{5}\.safetensors)");
  const std::set<std::string> kept(data_files.begin(), data_files.end());
  for (const auto& name : files::list_directory(dir))
    if (std::regex_match(name, ours) && !kept.count(name)) files::remove(dir + "/" + name);
  // Every file of this save is in place: staging files left now are those of
  // an earlier save that was killed.
  remove_staged(dir, kStagingPrefix);
}

}  // namespace

HfSaveReport save_hf_checkpoint(torch::nn::Module& root, const std::string& dir, const HfSaveOptions& options) {
  auto state = detail::require_state(root, "save_hf_checkpoint");
  if (const auto part = checkpoint::tensor_parallel_part(root, *state, "save_hf_checkpoint"))
    return checkpoint::save_hf_checkpoint(root, dir, options, *part);
  World& world = state->world();
  const std::string who = "shardtorch::save_hf_checkpoint '" + dir + "'";
  check_options(who, options);
  detail::FileWaits file_waits(*state, "save_hf_checkpoint");  // the others wait for rank 0's writes and fsync
  const bool writer = world.rank() == 0;
  c10::NoGradGuard no_grad;

  // Every rank lists the same tensors, in gathering order (gathers are collective).
  checkpoint::StreamedTensors tensors(root, *state, "save_hf_checkpoint", options.tied_once(),
                                      options.include_buffers());
  std::vector<Entry> entries;
  std::vector<size_t> kept;  // items written: only their flats are gathered
  std::string naming_error;  // agreed below: no rank may throw alone before the gathers
  try {
    entries = name_entries(tensors, options, who, writer, kept);
  } catch (const std::exception& e) {
    naming_error = detail::message_of(e);
    entries.clear();
  }
  agree_on_names(world, who, naming_error, entries);
  tensors.keep_only(kept);

  std::vector<int64_t> bytes;
  HfSaveReport report;
  for (const auto& e : entries) {
    bytes.push_back(e.bytes);
    report.total_bytes += e.bytes;
  }
  const auto plan = plan_files(bytes, options.max_file_bytes());
  for (size_t k = 0; k < plan.size(); ++k) report.files.push_back(file_name(k, plan.size()));
  shardtorch::detail::ProgressReporter progress("save_hf_checkpoint", "tensors", static_cast<int64_t>(entries.size()),
                                                report.total_bytes, options.progress());
  progress.count_io();

  std::string error;
  if (writer) {
    // Data files under staging names, then renamed into place, the index
    // last: a reader of the old index never sees a half-written file.
    const std::string staging = kStagingPrefix + std::to_string(::getpid()) + "-";
    try {
      files::create_directories(dir);
      for (size_t k = 0; k < plan.size(); ++k) {
        std::vector<checkpoint::PendingTensor> pending;
        for (size_t e : plan[k])
          pending.push_back(
              {entries[e].name, entries[e].dtype, entries[e].shape, [produce = entries[e].produce, &progress] {
                 at::Tensor t = produce();
                 progress.advance(1);
                 return t;
               }});
        checkpoint::write_file(dir + "/" + staging + report.files[k], pending, {{"format", "pt"}});
      }
      std::vector<std::pair<std::string, std::string>> weight_map;
      for (size_t k = 0; k < plan.size(); ++k)
        for (size_t e : plan[k]) weight_map.emplace_back(entries[e].name, report.files[k]);
      publish_hf(dir, staging, report.files, weight_map, report.total_bytes);
    } catch (const std::exception& e) {
      error = e.what();
      remove_staged(dir, staging);  // what this save left behind; the earlier checkpoint stays as it was
    }
  }
  tensors.finish();  // the other ranks (and rank 0, after a failed write) take part in the gathers
  auto status = at::full({1}, error.empty() ? 0 : 1, at::kInt).to(world.comm().device());
  world.comm().broadcast(status, 0, "save_hf_checkpoint status");
  SHARDTORCH_CHECK(error.empty(), who, ": ", error);
  SHARDTORCH_CHECK(status.cpu().item<int>() == 0, who, ": rank 0 could not write it; its error says why");
  report.tensors = static_cast<int64_t>(entries.size());
  progress.finish();
  return report;
}

namespace checkpoint {
namespace {

namespace json = boost::json;

// Every part's names, as the ranks agreed on them.
struct PartLists {
  std::vector<int> leaders;                                         // ranks in part.world, in order
  std::vector<std::vector<std::pair<std::string, int64_t>>> lists;  // each leader's (name, bytes)
  int64_t staging_pid = 0;                                          // rank 0's
};

// One data file of a save by parts: its leader's tensors, in its order.
struct PartFile {
  int leader;                   // rank in part.world
  std::vector<size_t> tensors;  // indices into the leader's list
};

// Collective over `world`: every rank's names (its part's leader's global
// rank first). The ranks of a part must name the same tensors (they gather
// together), and no two parts one tensor; otherwise every rank throws.
PartLists agree_part_names(World& world, detail::ShardState& state, const std::string& who,
                           const std::string& naming_error, const std::vector<Entry>& entries) {
  json::array mine;
  for (const auto& e : entries) mine.push_back(json::array{json::value(e.name), e.bytes});
  const json::object report_mine{
      {"leader", state.world().global_rank_of(0)}, {"pid", static_cast<int64_t>(::getpid())}, {"entries", mine}};
  const auto all = detail::agreed_fingerprints(world, naming_error, who, json::serialize(report_mine));
  PartLists out;
  std::map<int64_t, std::string> part_names;  // by leader: its names, as every rank of the part must have them
  std::map<std::string, int> taken;           // name -> the leader's rank writing it
  for (int r = 0; r < world.size(); ++r) {
    const json::object o = json::parse(all[r]).as_object();
    if (r == 0) out.staging_pid = o.at("pid").as_int64();
    const int64_t lead = o.at("leader").as_int64();
    const std::string names = json::serialize(o.at("entries"));
    auto [it, fresh] = part_names.emplace(lead, names);
    SHARDTORCH_CHECK(fresh || it->second == names, who, ": the ranks of one part would write different tensors (rank ",
                     world.global_rank_of(r), " and rank ", lead,
                     "); prefix and map_name must give the same names on every rank; nothing was written");
    if (lead != world.global_rank_of(r)) continue;
    out.leaders.push_back(r);
    out.lists.emplace_back();
    for (const auto& v : o.at("entries").as_array()) {
      const auto& a = v.as_array();
      const std::string name = json::value_to<std::string>(a.at(0));
      auto [t, first] = taken.emplace(name, r);
      SHARDTORCH_CHECK(first, who, ": two parts of the model would write tensor '", name, "' (rank ",
                       world.global_rank_of(t->second), "'s and rank ", world.global_rank_of(r),
                       "'s); the name mapping must keep names distinct; nothing was written");
      out.lists.back().emplace_back(name, a.at(1).as_int64());
    }
  }
  return out;
}

// The files: each leader's, planned as one model's, numbered in order
// (their names in report.files, with the totals).
std::vector<PartFile> plan_part_files(const PartLists& parts, const HfSaveOptions& options, HfSaveReport& report) {
  std::vector<PartFile> plan;
  for (size_t l = 0; l < parts.leaders.size(); ++l) {
    std::vector<int64_t> bytes;
    for (const auto& [name, b] : parts.lists[l]) {
      bytes.push_back(b);
      report.total_bytes += b;
      ++report.tensors;
    }
    if (bytes.empty()) continue;
    for (auto& f : plan_files(bytes, options.max_file_bytes())) plan.push_back({parts.leaders[l], std::move(f)});
  }
  if (plan.empty()) plan.push_back({0, {}});  // nothing to write: one empty file (rank 0's), as the whole model's save
  for (size_t k = 0; k < plan.size(); ++k) report.files.push_back(file_name(k, plan.size()));
  return plan;
}

// A leader's files, under `staging` names in `dir`: those it has written
// (by name), or its error in `error`.
std::vector<std::string> write_part_files(World& world, const std::string& dir, const std::string& staging,
                                          const std::vector<PartFile>& plan, const std::vector<Entry>& entries,
                                          const HfSaveReport& report, std::string& error,
                                          shardtorch::detail::ProgressReporter& progress) {
  std::vector<std::string> written;
  try {
    files::create_directories(dir);
    size_t next = 0;  // this leader's next entry
    for (size_t k = 0; k < plan.size(); ++k) {
      if (plan[k].leader != world.rank()) continue;
      std::vector<PendingTensor> pending;
      for (size_t i = 0; i < plan[k].tensors.size(); ++i, ++next) {
        const Entry& e = entries.at(next);
        pending.push_back({e.name, e.dtype, e.shape, [produce = e.produce, &progress] {
                             at::Tensor t = produce();
                             progress.advance(1);
                             return t;
                           }});
      }
      written.push_back(report.files[k]);
      write_file(dir + "/" + staging + report.files[k], pending, {{"format", "pt"}});
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  return written;
}

// Collective over `world`: when any rank failed to write its part, every
// rank removes what it wrote and throws, naming the first.
void agree_part_files(World& world, const std::string& who, const std::string& dir, const std::string& staging,
                      const std::string& error, const std::vector<std::string>& written) {
  const auto written_ok = world.comm().all_gather_strings(error, "save_hf_checkpoint: the parts' files");
  int failed = -1;
  for (int r = 0; r < world.size() && failed < 0; ++r)
    if (!written_ok[r].empty()) failed = r;
  if (failed < 0) return;
  for (const auto& f : written) remove_staged(dir, staging + f);  // the earlier checkpoint stays as it was
  detail::agree_on_errors(world, "", who);                        // the files are gone before any rank returns
  SHARDTORCH_CHECK(false, who, ": rank ", world.global_rank_of(failed),
                   " could not write its part: ", written_ok[failed]);
}

// Rank 0: the files in place, the index last.
void publish_parts(const std::string& dir, const std::string& staging, const PartLists& parts,
                   const std::vector<PartFile>& plan, const HfSaveReport& report, std::string& error) {
  try {
    std::vector<std::pair<std::string, std::string>> weight_map;
    std::vector<size_t> next(parts.leaders.size(), 0);
    for (size_t k = 0; k < plan.size(); ++k) {
      const size_t l = static_cast<size_t>(std::find(parts.leaders.begin(), parts.leaders.end(), plan[k].leader) -
                                           parts.leaders.begin());
      for (size_t i = 0; i < plan[k].tensors.size(); ++i)
        weight_map.emplace_back(parts.lists[l][next[l]++].first, report.files[k]);
    }
    publish_hf(dir, staging, report.files, weight_map, report.total_bytes);
  } catch (const std::exception& e) {
    error = e.what();
    remove_staged(dir, staging);
  }
}

}  // namespace

// Every part's leader (rank 0 of its own World) writes its part's tensors
// into files of their own, gathered one flat parameter at a time; the files
// are numbered over the whole model, in the order of the leaders' ranks in
// part.world. Rank 0 of part.world then renames them into place and writes
// the index, as the whole model's save does. The directory must be one file
// system for every leader (as for sharded checkpoints). Of a tensor-parallel
// model, the leaders at tp rank 0 write the whole tensors, the others' slices
// sent to them (StreamedTensors); the leaders at other tp ranks write none.
HfSaveReport save_hf_checkpoint(torch::nn::Module& root, const std::string& dir, const HfSaveOptions& options,
                                const ModelPart& part) {
  auto state = detail::require_state(root, "save_hf_checkpoint");
  World& world = *part.world;
  const std::string who = "shardtorch::save_hf_checkpoint '" + dir + "'";
  check_options(who, options);
  // The others wait for the writers and rank 0's renames.
  detail::FileWaits file_waits(*state, "save_hf_checkpoint", &world);
  const bool leader = state->world().rank() == 0;
  c10::NoGradGuard no_grad;

  // A tied parameter under its first part's name only, with tied_once; at a
  // tp rank other than 0, the slices alone.
  StreamedTensors tensors(root, *state, "save_hf_checkpoint", options.tied_once(), options.include_buffers(), &part);
  const bool feeds = part.tp_rank != 0;  // its leader sends the slices to tp rank 0's, and writes nothing
  std::vector<Entry> entries;
  std::vector<size_t> kept;
  std::string naming_error;
  try {
    entries = name_entries(tensors, options, who, leader && !feeds, kept, [&](const std::string& name) {
      return part.left_to_tp_rank_0(name) || (options.tied_once() && part.saved_by_another_part(name));
    });
  } catch (const std::exception& e) {
    naming_error = detail::message_of(e);
    entries.clear();
  }
  const PartLists parts = agree_part_names(world, *state, who, naming_error, feeds ? std::vector<Entry>{} : entries);
  tensors.keep_only(kept);
  HfSaveReport report;
  const std::vector<PartFile> plan = plan_part_files(parts, options, report);
  const std::string staging = kStagingPrefix + std::to_string(parts.staging_pid) + "-";
  // Every rank counts its part's tensors: a leader as it writes them, the
  // others when their gathers are done.
  int64_t part_bytes = 0;
  for (const auto& e : entries) part_bytes += e.bytes;
  shardtorch::detail::ProgressReporter progress("save_hf_checkpoint", "tensors", static_cast<int64_t>(entries.size()),
                                                part_bytes, options.progress());
  if (leader) progress.count_io();

  // Each leader writes its files under staging names.
  std::string error;
  std::vector<std::string> written;  // this rank's files, by name
  if (leader && !feeds) written = write_part_files(world, dir, staging, plan, entries, report, error, progress);
  if (leader && feeds) {
    try {
      tensors.feed_tp_rank_0();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  tensors.finish();  // every rank of every part takes part in its part's gathers
  agree_part_files(world, who, dir, staging, error, written);
  if (world.rank() == 0) publish_parts(dir, staging, parts, plan, report, error);
  detail::agree_after_publish(world, error, who, dir);
  progress.finish();
  return report;
}

}  // namespace checkpoint
}  // namespace shardtorch
