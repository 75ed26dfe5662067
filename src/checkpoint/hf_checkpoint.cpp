// Hugging Face safetensors layouts (model.safetensors.index.json and its
// files, or one model.safetensors) loaded straight into a sharded model:
// each rank opens the files holding its own elements and reads only those.
#include "shardtorch/hf_checkpoint.h"

#include <c10/core/GradMode.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <set>
#include <sstream>

#include "base/files.h"
#include "runtime/shard_state.h"
#include "checkpoint/agreement.h"
#include "checkpoint/hf_index.h"
#include "checkpoint/tied_names.h"
#include "checkpoint/model_part.h"
#include "checkpoint/name_mapping.h"
#include "checkpoint/reader_access.h"
#include "checkpoint/text_file.h"
#include "shardtorch/checkpoint/safetensors.h"

namespace shardtorch {
namespace {

using checkpoint::SafetensorsError;

constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

// The index file's text; never a blocking open (a FIFO is refused at once).
std::string read_index_text(const std::string& path) {
  return checkpoint::read_text_file(path, "Hugging Face index", checkpoint::kMaxHeaderBytes,
                                    "larger than 100 MB; not an index");
}

// Where the checkpoint is: data files are relative to `dir`; `index` is the
// index file ("" for one safetensors file, `single`).
struct Source {
  std::string dir, index, single;
};

using checkpoint::ends_with;

Source resolve(const std::string& path) {
  if (files::is_directory(path)) {
    if (files::exists(files::join(path, kIndexName))) return {path, files::join(path, kIndexName), ""};
    if (files::exists(files::join(path, kSingleName))) return {path, "", kSingleName};
    throw SafetensorsError("Hugging Face checkpoint '" + path + "': the directory holds neither " + kIndexName +
                           " nor " + kSingleName + " (pass the index or the safetensors file itself)");
  }
  if (ends_with(path, ".json")) return {files::directory_of(path), path, ""};
  return {files::directory_of(path), "", files::filename(path)};
}

std::string shape_text(c10::IntArrayRef s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

// The model's name for a checkpoint name (nullopt: skipped by the mapping).
std::optional<std::string> model_name_of(const std::string& name, const HfLoadOptions& options) {
  return checkpoint::map_checkpoint_name(name, options.prefix_rules(), options.map_name());
}

}  // namespace

namespace {

// load_hf_checkpoint, into the whole model or (`part`) into one part of it:
// the checkpoint's names are matched against the whole model's, and the
// part's tied parameters are found under their names on the other parts too.
HfLoadReport load_hf(torch::nn::Module& root, const std::string& path, const HfLoadOptions& options,
                     const checkpoint::ModelPart* part) {
  auto state = detail::require_state(root, "load_hf_checkpoint");
  shardtorch::detail::ProgressReporter progress("load_hf_checkpoint", "tensors", 0, 0, options.progress());
  progress.count_io();
  World* world = part ? part->world.get() : &state->world();
  detail::FileWaits file_waits(*state, world);
  state->copies().wait_for_offload_copies();
  c10::NoGradGuard no_grad;
  const std::string what = "shardtorch::load_hf_checkpoint '" + path + "'";
  // Check, agree, change, agree (as the other loaders): every rank checks
  // what it will read before any value changes; a problem on any rank fails
  // every rank with the model unchanged.
  HfLoadReport report;
  std::map<std::string, std::unique_ptr<checkpoint::Reader>> readers;  // by file name, as the index names it
  std::vector<std::function<void()>> changes;
  std::string error, fingerprint;
  try {
    state->check_outside_summon();
    const Source src = resolve(path);
    const std::string where = src.index.empty() ? "safetensors file '" + files::join(src.dir, src.single) + "'"
                                                : "Hugging Face checkpoint '" + src.index + "'";
    auto open = [&](const std::string& file) -> checkpoint::Reader& {
      auto& r = readers[file];
      if (!r) {
        r = std::make_unique<checkpoint::Reader>(files::join(src.dir, file));
        report.files_opened.push_back(file);
      }
      return *r;
    };

    // The checkpoint's tensors and the file each is in.
    std::vector<std::pair<std::string, std::string>> entries;
    if (!src.index.empty()) {
      auto idx = checkpoint::hf_index::parse(read_index_text(src.index), src.index);
      entries = std::move(idx.weight_map);
      std::set<std::string> names;
      for (const auto& [n, f] : entries) names.insert(f);
      // Every file the index names, on every rank (a stat, not an open): a
      // missing one fails every rank alike, whichever rank would read it.
      for (const auto& f : names) {
        const std::string full = files::join(src.dir, f);
        if (!files::exists(full))
          throw SafetensorsError(where + ": its weight_map names '" + f + "', which is not in '" + src.dir +
                                 "' (copy every file of the checkpoint, or fix the index)");
        const std::string kind = files::irregular_kind(full);
        if (!kind.empty()) throw SafetensorsError(where + ": '" + f + "' is " + kind + ", not a regular file");
      }
      fingerprint =
          "an index of " + std::to_string(entries.size()) + " tensors in " + std::to_string(names.size()) + " files";
      for (const auto& [k, v] : idx.metadata) fingerprint += ", " + k + "=" + v;
    } else {
      const auto& h = checkpoint::ReaderAccess::header(open(src.single));
      for (const auto& t : h.tensors) entries.emplace_back(t.name, src.single);
      fingerprint =
          "a file of " + std::to_string(h.tensors.size()) + " tensors from byte " + std::to_string(h.data_start);
      for (const auto& [k, v] : h.metadata) fingerprint += ", " + k + "=" + v;
    }

    // Checkpoint names onto the model's.
    std::set<std::string> model_names;
    for (const auto& item : root.named_parameters()) model_names.insert(item.key());
    for (const auto& item : root.named_buffers())
      if (item.value().defined()) model_names.insert(item.key());
    if (part)  // the other parts' names are the model's too
      for (const auto& [name, shape] : part->shapes) model_names.insert(name);
    struct Source1 {
      std::string name, file;  // in the checkpoint
    };
    std::map<std::string, Source1> by_model;
    for (const auto& [c, f] : entries) {
      auto m = model_name_of(c, options);
      if (!m) {
        report.skipped.push_back(c);
        continue;
      }
      if (!model_names.count(*m)) {
        if (options.ignore_unexpected()) {
          report.unexpected.push_back(c);
          continue;
        }
        // The common case: the checkpoint's names carry a prefix the model's
        // do not. Any of its names shows it (this one may be an extra).
        std::string hint;
        for (const auto& [c2, f2] : entries) {
          auto m2 = model_name_of(c2, options);
          if (!m2 || model_names.count(*m2)) continue;
          for (const auto& name : model_names)
            if (ends_with(*m2, "." + name)) {
              hint = " (the checkpoint's '" + *m2 + "' is the model's '" + name + "' behind a prefix: strip_prefix(\"" +
                     m2->substr(0, m2->size() - name.size()) + "\")?)";
              break;
            }
          if (!hint.empty()) break;
        }
        throw SafetensorsError(where + ": unexpected tensor '" + c + "'" +
                               (*m != c ? " (mapped to '" + *m + "')" : "") +
                               ": the model has no parameter or buffer of that name" + hint +
                               " (map the checkpoint's names with "
                               "HfLoadOptions().strip_prefix/replace_prefix/map_name, skip it by mapping it to "
                               "nullopt, or pass ignore_unexpected(true))");
      }
      auto [it, fresh] = by_model.emplace(*m, Source1{c, f});
      if (!fresh)
        throw SafetensorsError(where + ": tensors '" + it->second.name + "' and '" + c + "' both map to the model's '" +
                               *m + "' (change the name mapping so that at most one does, or skip the other)");
    }

    auto missing = [&](const std::string& m, const char* kind) {
      if (options.may_be_missing(m)) {
        report.missing.push_back(m);
        return;
      }
      std::string hint;
      for (const auto& [c, f] : entries)
        if (ends_with(c, "." + m)) {
          hint = " (the checkpoint has '" + c + "': strip_prefix(\"" + c.substr(0, c.size() - m.size()) + "\")?)";
          break;
        }
      throw SafetensorsError(where + ": no tensor for the model's " + kind + " '" + m + "'" + hint +
                             "; map the checkpoint's names onto the model's (HfLoadOptions().strip_prefix, "
                             "replace_prefix, map_name), or allow it to be missing (allow_missing, allow_missing_if)");
    };
    // The record of `s` in its file (opened now), its shape and a dtype it can be cast into.
    auto check = [&](const Source1& s, const std::string& m, c10::IntArrayRef want, at::ScalarType dtype,
                     const char* kind) -> const checkpoint::TensorRecord& {
      const auto* rec = checkpoint::ReaderAccess::header(open(s.file)).find(s.name);
      if (rec == nullptr)
        throw SafetensorsError(where + ": the index puts '" + s.name + "' in '" + s.file +
                               "', but that file has no such tensor (are the index and the files from the same "
                               "checkpoint?)");
      const std::string named = "'" + s.name + "'" + (s.name != m ? " (the model's '" + m + "')" : "");
      if (c10::IntArrayRef(rec->shape) != want)
        throw SafetensorsError(where + ": " + named + " has shape " + shape_text(rec->shape) + " in '" + s.file +
                               "' but the model's " + kind + " has shape " + shape_text(want) +
                               " (is the model built with the checkpoint's configuration?)");
      const at::ScalarType saved = checkpoint::scalar_type(rec->dtype);
      if (!options.allow_lossy_casts() && !checkpoint::is_safe_cast(saved, dtype))
        throw SafetensorsError(where + ": " + named + " is " + rec->dtype + " in '" + s.file + "' but the model's " +
                               kind + " is " + checkpoint::dtype_text(dtype) + ", and a cast from " + rec->dtype +
                               " to " + checkpoint::dtype_text(dtype) +
                               " can change values: refused (HfLoadOptions().allow_lossy_casts(true) casts anyway)");
      return *rec;
    };
    auto reader_of = [&](const Source1& s) { return readers.at(s.file).get(); };

    auto names = detail::parameter_names(root);
    if (part)  // a tied parameter is found under its names on the other parts too
      for (auto& [impl, ns] : names) {
        std::vector<std::string> all;
        for (const auto& n : ns)
          for (const auto& m : part->names_of(n))
            if (std::find(all.begin(), all.end(), m) == all.end()) all.push_back(m);
        ns = std::move(all);
      }
    constexpr const char* kOption = "HfLoadOptions().tied_from";
    checkpoint::check_tied_from(names, options.tied_from(), where, kOption);
    // Where `p` is read from (null: nowhere). A tied parameter held under
    // two or more of its names must hold the same values under each, as this
    // rank compares over elements [first, first + count) (every rank's error
    // fails every rank), unless tied_from says which name to take.
    auto source_of = [&](const at::Tensor& p, c10::IntArrayRef shape, at::ScalarType dtype, int64_t first,
                         int64_t count) -> const Source1* {
      const auto& ns = names[p.unsafeGetTensorImpl()];
      auto t = checkpoint::tied_source(
          ns, [&](const std::string& n) { return by_model.count(n) > 0; }, options.tied_from(), where, kOption);
      if (!t) return nullptr;
      const Source1& s = by_model.at(t->source);
      for (const auto& other : t->others) {
        const Source1& o = by_model.at(other);
        check(s, t->source, shape, dtype, "parameter");
        check(o, other, shape, dtype, "parameter");
        if (count > 0)
          checkpoint::require_equal_tied(reader_of(s)->read_range(s.name, first, count),
                                         reader_of(o)->read_range(o.name, first, count), dtype, t->source, other, first,
                                         where, kOption);
      }
      return &s;
    };
    auto first_name = [&](const at::Tensor& p) {
      const auto& ns = names[p.unsafeGetTensorImpl()];
      return ns.empty() ? std::string("?") : ns.front();
    };
    if (state->replicated()) {  // every rank holds everything: every file it names is read
      std::set<const void*> done;
      for (const auto& item : root.named_parameters()) {
        at::Tensor p = item.value();
        if (!done.insert(p.unsafeGetTensorImpl()).second) continue;  // tied: loaded once
        const at::ScalarType dtype = state->record_of(p).scalar_type();
        const auto [first, count] = checkpoint::share_of(p.numel(), state->world().rank(), state->world().size());
        const Source1* s = source_of(p, p.sizes(), dtype, first, count);
        if (s == nullptr) {
          missing(item.key(), "parameter");
          continue;
        }
        const auto& rec = check(*s, item.key(), p.sizes(), dtype, "parameter");
        report.bytes_read += static_cast<int64_t>(rec.end - rec.begin);
        changes.push_back([state, file = reader_of(*s), p, n = s->name] { state->load_record(p, file->read(n)); });
      }
    } else {
      const int rank = state->topology().shard_comm().rank();
      const bool checks_empty = state->world().rank() == 0;  // an empty parameter is no rank's: rank 0 checks it
      for (auto& u : state->units())
        for (auto& f : u->flats())
          for (size_t i = 0; i < f->params().size(); ++i) {
            const at::Tensor& p = f->params()[i];
            auto piece = f->layout().piece(i, rank);
            const bool mine = piece || (f->layout().numel(i) == 0 && checks_empty);
            // Only a rank with a piece opens the files (and compares tied names).
            const Source1* s = mine ? source_of(p, f->layout().shape(i), f->dtype(), piece ? piece->param_offset : 0,
                                                piece ? piece->length : 0)
                                    : nullptr;
            if (!mine) {
              bool any = false;
              for (const auto& n : names[p.unsafeGetTensorImpl()]) any = any || by_model.count(n);
              if (!any) missing(first_name(p), "parameter");
              continue;  // not this rank's: not opened
            }
            if (s == nullptr) {
              missing(first_name(p), "parameter");
              continue;
            }
            const auto& rec = check(*s, first_name(p), f->layout().shape(i), f->dtype(), "parameter");
            if (!piece || piece->length == 0) continue;
            report.bytes_read += piece->length * static_cast<int64_t>(checkpoint::dtype_size(rec.dtype));
            at::Tensor dst = f->shard().narrow(0, piece->shard_offset, piece->length);
            changes.push_back([file = reader_of(*s), dst, n = s->name, piece]() mutable {
              dst.copy_(file->read_range(n, piece->param_offset, piece->length));
            });
          }
    }
    for (const auto& item : root.named_buffers()) {  // every rank keeps every buffer whole
      if (!item.value().defined()) continue;
      auto it = by_model.find(item.key());
      if (it == by_model.end()) {
        missing(item.key(), "buffer");
        continue;
      }
      const auto& rec = check(it->second, item.key(), item.value().sizes(), item.value().scalar_type(), "buffer");
      report.bytes_read += static_cast<int64_t>(rec.end - rec.begin);
      changes.push_back(
          [file = reader_of(it->second), b = item.value(), n = it->second.name]() mutable { b.copy_(file->read(n)); });
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  detail::load_agreed(*state, error, fingerprint, changes, what, world, &progress);
  return report;
}

}  // namespace

HfLoadReport load_hf_checkpoint(torch::nn::Module& root, const std::string& path, const HfLoadOptions& options) {
  return load_hf(root, path, options, nullptr);
}

namespace checkpoint {

HfLoadReport load_hf_checkpoint(torch::nn::Module& root, const std::string& path, const HfLoadOptions& options,
                                const ModelPart& part) {
  return load_hf(root, path, options, &part);
}

}  // namespace checkpoint

}  // namespace shardtorch
