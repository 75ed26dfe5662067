// Hugging Face's multi-file safetensors layout written from a sharded model:
// gathered one flat parameter at a time, written by rank 0 into files of at
// most max_file_bytes (each tensor whole in one file), then the index.
#include <c10/core/GradMode.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "base/check.h"
#include "base/errors.h"
#include "base/files.h"
#include "runtime/shard_state.h"
#include "checkpoint/agreement.h"
#include "checkpoint/safetensors_format.h"
#include "shardtorch/checkpoint/safetensors.h"
#include "shardtorch/hf_checkpoint.h"
#include "checkpoint/streamed_tensors.h"

namespace shardtorch {
namespace {

constexpr const char* kIndexName = "model.safetensors.index.json";

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

}  // namespace

HfSaveReport save_hf_checkpoint(torch::nn::Module& root, const std::string& dir, const HfSaveOptions& options) {
  auto state = detail::require_state(root, "save_hf_checkpoint");
  World& world = state->world();
  const std::string who = "shardtorch::save_hf_checkpoint '" + dir + "'";
  SHARDTORCH_CHECK(options.max_file_bytes() > 0, who, ": max_file_bytes must be positive, got ",
                   options.max_file_bytes());
  SHARDTORCH_CHECK(!options.dtype() || at::isFloatingType(*options.dtype()), who,
                   ": dtype must be a floating-point type, got ", *options.dtype());
  detail::FileWaits file_waits(*state);  // the others wait for rank 0's writes and fsync
  const bool writer = world.rank() == 0;
  c10::NoGradGuard no_grad;

  // Every rank lists the same tensors, in gathering order (gathers are collective).
  checkpoint::StreamedTensors tensors(root, *state, "save_hf_checkpoint", options.tied_once(),
                                      options.include_buffers());
  std::vector<Entry> entries;
  std::vector<size_t> kept;  // items written: only their flats are gathered
  std::set<std::string> taken;
  std::string naming_error;  // agreed below: no rank may throw alone before the gathers
  try {
    for (size_t item = 0; item < tensors.items().size(); ++item) {
      const auto& t = tensors.items()[item];
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
  } catch (const std::exception& e) {
    naming_error = detail::message_of(e);
  }
  agree_on_names(world, who, naming_error, entries);
  tensors.keep_only(kept);

  // Files in order, each filled until the next tensor would pass the limit
  // (a larger tensor alone in its file), as transformers' save_pretrained.
  std::vector<std::vector<size_t>> plan(1);
  int64_t in_file = 0;
  HfSaveReport report;
  for (size_t e = 0; e < entries.size(); ++e) {
    if (!plan.back().empty() && in_file + entries[e].bytes > options.max_file_bytes()) {
      plan.emplace_back();
      in_file = 0;
    }
    plan.back().push_back(e);
    in_file += entries[e].bytes;
    report.total_bytes += entries[e].bytes;
  }
  for (size_t k = 0; k < plan.size(); ++k) report.files.push_back(file_name(k, plan.size()));

  std::string error;
  if (writer) {
    // Data files under staging names, then renamed into place, the index
    // last: a reader of the old index never sees a half-written file.
    const std::string staging = ".shardtorch-staging-" + std::to_string(::getpid()) + "-";
    try {
      files::create_directories(dir);
      for (size_t k = 0; k < plan.size(); ++k) {
        std::vector<checkpoint::PendingTensor> pending;
        for (size_t e : plan[k])
          pending.push_back({entries[e].name, entries[e].dtype, entries[e].shape, entries[e].produce});
        checkpoint::write_file(dir + "/" + staging + report.files[k], pending, {{"format", "pt"}});
      }
      std::ostringstream index;
      index << "{\n  \"metadata\": {\n    \"total_size\": " << report.total_bytes << "\n  },\n  \"weight_map\": {";
      const char* sep = "\n";
      for (size_t k = 0; k < plan.size(); ++k)
        for (size_t e : plan[k]) {
          index << sep << "    " << checkpoint::quote(entries[e].name) << ": \"" << report.files[k] << "\"";
          sep = ",\n";
        }
      index << "\n  }\n}\n";
      const std::string index_tmp = dir + "/" + staging + kIndexName;
      {
        std::ofstream out(index_tmp, std::ios::binary | std::ios::trunc);
        out << index.str();
        out.flush();
        SHARDTORCH_CHECK(out.good(), "cannot write '", index_tmp, "'");
      }
      files::sync(index_tmp);
      for (size_t k = 0; k < plan.size(); ++k)
        files::rename(dir + "/" + staging + report.files[k], dir + "/" + report.files[k]);
      files::rename_durably(index_tmp, dir + "/" + kIndexName);
      // Data files of an earlier save that the new index does not name.
      static const std::regex ours(R"(model-\d{5}-of-\d{5}\.safetensors)");
      const std::set<std::string> kept(report.files.begin(), report.files.end());
      for (const auto& name : files::list_directory(dir))
        if (std::regex_match(name, ours) && !kept.count(name)) files::remove(dir + "/" + name);
    } catch (const std::exception& e) {
      error = e.what();
      try {  // what this save left behind; the earlier checkpoint stays as it was
        for (const auto& name : files::list_directory(dir))
          if (name.find(staging) != std::string::npos)
            files::remove(dir + "/" + name);  // with write_file's temporaries
      } catch (const std::exception&) {
      }
    }
  }
  tensors.finish();  // the other ranks (and rank 0, after a failed write) take part in the gathers
  auto status = at::full({1}, error.empty() ? 0 : 1, at::kInt).to(world.comm().device());
  world.comm().broadcast(status, 0, "save_hf_checkpoint status");
  SHARDTORCH_CHECK(error.empty(), who, ": ", error);
  SHARDTORCH_CHECK(status.cpu().item<int>() == 0, who, ": rank 0 could not write it; its error says why");
  report.tensors = static_cast<int64_t>(entries.size());
  return report;
}

}  // namespace shardtorch
