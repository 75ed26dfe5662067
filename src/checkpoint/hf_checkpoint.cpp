// Hugging Face safetensors layouts (model.safetensors.index.json and its
// files, or one model.safetensors) loaded straight into a sharded model:
// each rank opens the files holding its own elements and reads only those.
#include "shardtorch/hf_checkpoint.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <set>
#include <sstream>

#include "base/files.h"
#include "base/text.h"
#include "runtime/shard_state.h"
#include "checkpoint/agreement.h"
#include "checkpoint/hf_index.h"
#include "checkpoint/tied_names.h"
#include "checkpoint/model_load.h"
#include "checkpoint/model_part.h"
#include "checkpoint/name_mapping.h"
#include "checkpoint/reader_access.h"
#include "checkpoint/text_file.h"
#include "checkpoint/tp_slices.h"
#include "shardtorch/checkpoint/safetensors.h"

namespace shardtorch {
namespace {

using checkpoint::SafetensorsError;

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
    if (files::exists(files::join(path, checkpoint::hf_index::kFileName)))
      return {path, files::join(path, checkpoint::hf_index::kFileName), ""};
    if (files::exists(files::join(path, kSingleName))) return {path, "", kSingleName};
    throw SafetensorsError("Hugging Face checkpoint '" + path + "': the directory holds neither " +
                           checkpoint::hf_index::kFileName + " nor " + kSingleName +
                           " (pass the index or the safetensors file itself)");
  }
  if (ends_with(path, ".json")) return {files::directory_of(path), path, ""};
  return {files::directory_of(path), "", files::filename(path)};
}

// The model's name for a checkpoint name (nullopt: skipped by the mapping).
std::optional<std::string> model_name_of(const std::string& name, const HfLoadOptions& options) {
  return checkpoint::map_checkpoint_name(name, options.prefix_rules(), options.map_name());
}

}  // namespace

namespace {

using checkpoint::Reader;
using checkpoint::TensorRecord;

// Elements [first, first + count) of parameter `p` (flattened) from tensor
// `name` of `file`: of a slice parallelize() split, only the runs of it in
// the whole tensor the checkpoint holds (checkpoint/tp_slices.h).
at::Tensor read_elements(const Reader& file, const std::string& name, const at::Tensor& p, int64_t first,
                         int64_t count) {
  if (auto placement = detail::placement_of(p))
    return checkpoint::read_slice(*placement, first, count,
                                  [&](int64_t from, int64_t n) { return file.read_range(name, from, n); });
  return file.read_range(name, first, count);
}

// A tensor of the checkpoint: its name there and the file it is in.
struct Held {
  std::string name, file;
};

constexpr const char* kHfTiedOption = "HfLoadOptions().tied_from";

// The check phase of one load_hf_checkpoint on this rank: the checkpoint's
// tensors listed, matched against the model's names, then every parameter
// and buffer this rank holds checked and its copy planned (run.changes).
// Into the whole model, or (`part`) into one part of it: the checkpoint's
// names are matched against the whole model's, and the part's tied
// parameters are found under their names on the other parts too.
class HfLoad {
 public:
  HfLoad(torch::nn::Module& root, const HfLoadOptions& options, const checkpoint::ModelPart* part,
         checkpoint::LoadRun& run, HfLoadReport& report)
      : root_(root), options_(options), part_(part), run_(run), state_(*run.state), report_(report) {}

  void list(const std::string& path);
  void match_names();
  void plan_parameters();
  void plan_buffers();

 private:
  void list_index();
  void list_single();
  std::string prefix_hint(const std::set<std::string>& model_names) const;
  std::string others_unexpected(const std::string& first, const std::set<std::string>& model_names) const;
  Reader& open(const std::string& file);
  Reader* reader_of(const Held& s) const { return readers_.at(s.file).get(); }
  void missing(const std::string& m, const char* kind);
  bool ties_word_embeddings() const;
  const TensorRecord& check(const Held& s, const std::string& m, c10::IntArrayRef want, at::ScalarType dtype,
                            const char* kind);
  const Held* source_of(const at::Tensor& p, c10::IntArrayRef shape, at::ScalarType dtype, int64_t first,
                        int64_t count);
  std::string first_name(const at::Tensor& p) {
    const auto& ns = names_[p.unsafeGetTensorImpl()];
    return ns.empty() ? std::string("?") : ns.front();
  }
  void plan_replicated();
  void plan_piece(FlatParam& f, size_t i, int rank, bool checks_empty);

  torch::nn::Module& root_;
  const HfLoadOptions& options_;
  const checkpoint::ModelPart* part_;
  checkpoint::LoadRun& run_;
  detail::ShardState& state_;
  HfLoadReport& report_;
  Source src_;
  std::string where_;                                         // starts every error
  std::map<std::string, std::unique_ptr<Reader>> readers_;    // by file name, as the index names it
  std::vector<std::pair<std::string, std::string>> entries_;  // the checkpoint's tensors: (name, file)
  std::map<std::string, Held> by_model_;                      // by the model's name
  checkpoint::ParameterNames names_;
};

// The checkpoint at `path`: its tensors and the file each is in, and what
// the ranks compare of it (run.fingerprint).
void HfLoad::list(const std::string& path) {
  src_ = resolve(path);
  where_ = src_.index.empty() ? "safetensors file '" + files::join(src_.dir, src_.single) + "'"
                              : "Hugging Face checkpoint '" + src_.index + "'";
  if (!src_.index.empty())
    list_index();
  else
    list_single();
}

void HfLoad::list_index() {
  auto idx = checkpoint::hf_index::parse(read_index_text(src_.index), src_.index);
  entries_ = std::move(idx.weight_map);
  std::set<std::string> names;
  for (const auto& [n, f] : entries_) names.insert(f);
  // Every file the index names, on every rank (a stat, not an open): a
  // missing one fails every rank alike, whichever rank would read it.
  for (const auto& f : names) {
    const std::string full = files::join(src_.dir, f);
    if (!files::exists(full))
      throw SafetensorsError(where_ + ": its weight_map names '" + f + "', which is not in '" + src_.dir +
                             "' (copy every file of the checkpoint, or fix the index)");
    const std::string kind = files::irregular_kind(full);
    if (!kind.empty()) throw SafetensorsError(where_ + ": '" + f + "' is " + kind + ", not a regular file");
  }
  run_.fingerprint =
      "an index of " + std::to_string(entries_.size()) + " tensors in " + std::to_string(names.size()) + " files";
  for (const auto& [k, v] : idx.metadata) run_.fingerprint += ", " + k + "=" + v;
}

void HfLoad::list_single() {
  const auto& h = checkpoint::ReaderAccess::header(open(src_.single));
  for (const auto& t : h.tensors) entries_.emplace_back(t.name, src_.single);
  run_.fingerprint =
      "a file of " + std::to_string(h.tensors.size()) + " tensors from byte " + std::to_string(h.data_start);
  for (const auto& [k, v] : h.metadata) run_.fingerprint += ", " + k + "=" + v;
}

Reader& HfLoad::open(const std::string& file) {
  auto& r = readers_[file];
  if (!r) {
    r = std::make_unique<Reader>(files::join(src_.dir, file));
    report_.files_opened.push_back(file);
  }
  return *r;
}

// Each checkpoint name onto the model's (by_model_), skipped by the
// mapping, or unexpected.
void HfLoad::match_names() {
  const std::set<std::string> model_names = checkpoint::model_names(root_, part_);
  for (const auto& [c, f] : entries_) {
    auto m = model_name_of(c, options_);
    if (!m) {
      report_.skipped.push_back(c);
      continue;
    }
    if (!model_names.count(*m)) {
      if (options_.ignore_unexpected()) {
        report_.unexpected.push_back(c);
        continue;
      }
      throw SafetensorsError(where_ + ": unexpected tensor '" + c + "'" + (*m != c ? " (mapped to '" + *m + "')" : "") +
                             ": the model has no parameter or buffer of that name" + others_unexpected(c, model_names) +
                             prefix_hint(model_names) +
                             " (map the checkpoint's names with "
                             "HfLoadOptions().strip_prefix/replace_prefix/map_name, skip it by mapping it to "
                             "nullopt, or pass ignore_unexpected(true))");
    }
    auto [it, fresh] = by_model_.emplace(*m, Held{c, f});
    if (!fresh)
      throw SafetensorsError(where_ + ": tensors '" + it->second.name + "' and '" + c + "' both map to the model's '" +
                             *m + "' (change the name mapping so that at most one does, or skip the other)");
  }
}

// ", and N more the model has no name for ('a', 'b', ...)" beside `first`, or "".
std::string HfLoad::others_unexpected(const std::string& first, const std::set<std::string>& model_names) const {
  std::vector<std::string> others;
  for (const auto& [c, f] : entries_) {
    auto m = model_name_of(c, options_);
    if (c != first && m && !model_names.count(*m)) others.push_back(c);
  }
  return detail::and_more(others, "the model has no name for");
}

// The common cause of an unexpected name: the checkpoint's names carry a
// prefix the model's do not. Any of its names shows it (one may be an extra).
std::string HfLoad::prefix_hint(const std::set<std::string>& model_names) const {
  for (const auto& [c2, f2] : entries_) {
    auto m2 = model_name_of(c2, options_);
    if (!m2 || model_names.count(*m2)) continue;
    for (const auto& name : model_names)
      if (ends_with(*m2, "." + name))
        return " (the checkpoint's '" + *m2 + "' is the model's '" + name + "' behind a prefix: strip_prefix(\"" +
               m2->substr(0, m2->size() - name.size()) + "\")?)";
  }
  return "";
}

// Whether config.json beside the checkpoint ties the word embeddings
// (transformers' tie_word_embeddings, true when the file leaves it out: the
// head is not saved).
bool HfLoad::ties_word_embeddings() const {
  const std::string config = files::join(src_.dir, "config.json");
  if (!files::is_regular_file(config)) return false;
  try {
    const std::string text = checkpoint::read_text_file(config, "config.json", 1 << 20, "larger than 1 MB");
    const auto at = text.find("\"tie_word_embeddings\"");
    if (at == std::string::npos) return true;
    const auto value = text.find_first_not_of(" \t\r\n:", at + 21);
    return value != std::string::npos && text.compare(value, 4, "true") == 0;
  } catch (const std::exception&) {
    return false;  // a hint only
  }
}

void HfLoad::missing(const std::string& m, const char* kind) {
  if (options_.may_be_missing(m)) {
    report_.missing.push_back(m);
    return;
  }
  std::string hint;
  for (const auto& [c, f] : entries_)
    if (ends_with(c, "." + m)) {
      hint = " (the checkpoint has '" + c + "': strip_prefix(\"" + c.substr(0, c.size() - m.size()) + "\")?)";
      break;
    }
  bool matrix = false;  // only a matrix can be an output projection
  for (const auto& item : root_.named_parameters())
    if (item.key() == m) matrix = item.value().dim() == 2;
  if (hint.empty() && matrix && ties_word_embeddings())
    hint =
        " (the checkpoint's config.json ties the word embeddings (tie_word_embeddings, true unless it says "
        "false): the output projection is not saved, the input embedding's weight stands for it. If '" +
        m +
        "' is the model's output projection, tie it to its input embedding (one tensor, a "
        "shardtorch::TiedLinear head); allowing it to be missing would leave it at its initial values)";
  throw SafetensorsError(where_ + ": no tensor for the model's " + kind + " '" + m + "'" + hint +
                         "; map the checkpoint's names onto the model's (HfLoadOptions().strip_prefix, "
                         "replace_prefix, map_name), or allow it to be missing (allow_missing, allow_missing_if)");
}

// The record of `s` in its file (opened now), its shape and a dtype it can be cast into.
const TensorRecord& HfLoad::check(const Held& s, const std::string& m, c10::IntArrayRef want, at::ScalarType dtype,
                                  const char* kind) {
  const auto* rec = checkpoint::ReaderAccess::header(open(s.file)).find(s.name);
  if (rec == nullptr)
    throw SafetensorsError(where_ + ": the index puts '" + s.name + "' in '" + s.file +
                           "', but that file has no such tensor (are the index and the files from the same "
                           "checkpoint?)");
  const std::string named = "'" + s.name + "'" + (s.name != m ? " (the model's '" + m + "')" : "");
  const std::string in_file = " in '" + s.file + "'";
  checkpoint::require_shape(where_, named, in_file, rec->shape, want, kind);
  checkpoint::require_castable(where_, named, rec->dtype, in_file, checkpoint::scalar_type(rec->dtype), dtype, kind,
                               options_.allow_lossy_casts(), "HfLoadOptions");
  return *rec;
}

// Where `p` is read from (null: nowhere). A tied parameter held under two
// or more of its names must hold the same values under each, as this rank
// compares over elements [first, first + count) (every rank's error fails
// every rank), unless tied_from says which name to take.
const Held* HfLoad::source_of(const at::Tensor& p, c10::IntArrayRef shape, at::ScalarType dtype, int64_t first,
                              int64_t count) {
  const auto& ns = names_[p.unsafeGetTensorImpl()];
  auto t = checkpoint::tied_source(
      ns, [&](const std::string& n) { return by_model_.count(n) > 0; }, options_.tied_from(), where_, kHfTiedOption);
  if (!t) return nullptr;
  const Held& s = by_model_.at(t->source);
  for (const auto& other : t->others) {
    const Held& o = by_model_.at(other);
    check(s, t->source, shape, dtype, "parameter");
    check(o, other, shape, dtype, "parameter");
    if (count > 0)
      checkpoint::require_equal_tied(read_elements(*reader_of(s), s.name, p, first, count),
                                     read_elements(*reader_of(o), o.name, p, first, count), dtype, t->source, other,
                                     first, where_, kHfTiedOption);
  }
  return &s;
}

void HfLoad::plan_parameters() {
  names_ = checkpoint::parameter_names(root_, part_);
  checkpoint::check_tied_from(names_, options_.tied_from(), where_, kHfTiedOption);
  if (state_.path().replicated()) {
    plan_replicated();
    return;
  }
  checkpoint::for_each_flat_param(
      state_, [this](FlatParam& f, size_t i, int rank, bool checks_empty) { plan_piece(f, i, rank, checks_empty); });
}

// Every rank holds everything: every file it names is read.
void HfLoad::plan_replicated() {
  std::set<const void*> done;
  for (const auto& item : root_.named_parameters()) {
    at::Tensor p = item.value();
    if (!done.insert(p.unsafeGetTensorImpl()).second) continue;  // tied: loaded once
    const at::ScalarType dtype = state_.path().record_of(p).scalar_type();
    const std::vector<int64_t> shape = checkpoint::saved_shape(p);  // a slice's whole tensor's
    const auto [first, count] = checkpoint::share_of(p.numel(), state_.world().rank(), state_.world().size());
    const Held* s = source_of(p, shape, dtype, first, count);
    if (s == nullptr) {
      missing(item.key(), "parameter");
      continue;
    }
    const auto& rec = check(*s, item.key(), shape, dtype, "parameter");
    if (!detail::placement_of(p)) {
      report_.bytes_read += static_cast<int64_t>(rec.end - rec.begin);
      run_.changes.push_back(
          [state = run_.state, file = reader_of(*s), p, n = s->name] { state->path().load_record(p, file->read(n)); });
      continue;
    }
    report_.bytes_read += p.numel() * static_cast<int64_t>(checkpoint::dtype_size(rec.dtype));
    run_.changes.push_back([state = run_.state, file = reader_of(*s), p, n = s->name] {
      state->path().load_record(p, read_elements(*file, n, p, 0, p.numel()).view(p.sizes()));
    });
  }
}

// Parameter `i` of `f`: this rank's piece of it. Only a rank with a piece
// opens the files (and compares tied names).
void HfLoad::plan_piece(FlatParam& f, size_t i, int rank, bool checks_empty) {
  const at::Tensor& p = f.params()[i];
  auto piece = f.layout().piece(i, rank);
  const bool mine = piece || (f.layout().numel(i) == 0 && checks_empty);
  const std::vector<int64_t> shape = checkpoint::saved_shape(p);  // a slice's whole tensor's
  const Held* s =
      mine ? source_of(p, shape, f.dtype(), piece ? piece->param_offset : 0, piece ? piece->length : 0) : nullptr;
  if (!mine) {
    bool any = false;
    for (const auto& n : names_[p.unsafeGetTensorImpl()]) any = any || by_model_.count(n);
    if (!any) missing(first_name(p), "parameter");
    return;  // not this rank's: not opened
  }
  if (s == nullptr) {
    missing(first_name(p), "parameter");
    return;
  }
  const auto& rec = check(*s, first_name(p), shape, f.dtype(), "parameter");
  if (!piece || piece->length == 0) return;
  report_.bytes_read += piece->length * static_cast<int64_t>(checkpoint::dtype_size(rec.dtype));
  at::Tensor dst = f.shard().narrow(0, piece->shard_offset, piece->length);
  run_.changes.push_back([file = reader_of(*s), dst, n = s->name, piece, p]() mutable {
    dst.copy_(read_elements(*file, n, p, piece->param_offset, piece->length));
  });
}

// Every rank keeps every buffer whole.
void HfLoad::plan_buffers() {
  for (const auto& item : root_.named_buffers()) {
    if (!item.value().defined()) continue;
    auto it = by_model_.find(item.key());
    if (it == by_model_.end()) {
      missing(item.key(), "buffer");
      continue;
    }
    const auto& rec = check(it->second, item.key(), item.value().sizes(), item.value().scalar_type(), "buffer");
    report_.bytes_read += static_cast<int64_t>(rec.end - rec.begin);
    run_.changes.push_back(
        [file = reader_of(it->second), b = item.value(), n = it->second.name]() mutable { b.copy_(file->read(n)); });
  }
}

// load_hf_checkpoint, into the whole model or (`part`) into one part of it.
HfLoadReport load_hf(torch::nn::Module& root, const std::string& path, const HfLoadOptions& options,
                     const checkpoint::ModelPart* part) {
  checkpoint::LoadRun run(root, "load_hf_checkpoint", path, options.progress(), part ? part->world.get() : nullptr);
  HfLoadReport report;
  HfLoad load(root, options, part, run, report);  // holds the readers the changes read from
  try {
    run.state->summons().check_outside();
    load.list(path);
    load.match_names();
    load.plan_parameters();
    load.plan_buffers();
  } catch (const std::exception& e) {
    run.error = e.what();
  }
  run.finish();
  return report;
}

}  // namespace

HfLoadReport load_hf_checkpoint(torch::nn::Module& root, const std::string& path, const HfLoadOptions& options) {
  auto state = detail::require_state(root, "load_hf_checkpoint");
  const auto part = checkpoint::tensor_parallel_part(root, *state, "load_hf_checkpoint");
  return load_hf(root, path, options, part ? &*part : nullptr);
}

namespace checkpoint {

HfLoadReport load_hf_checkpoint(torch::nn::Module& root, const std::string& path, const HfLoadOptions& options,
                                const ModelPart& part) {
  return load_hf(root, path, options, &part);
}

}  // namespace checkpoint

}  // namespace shardtorch
