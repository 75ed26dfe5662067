// shardtorch-convert: checkpoints between PyTorch's distributed checkpoints
// (DCP), Hugging Face's safetensors layouts and shardtorch's own formats, in
// one process and without Python. Tensors go through one at a time (a
// sharded checkpoint's excepted: read whole).
//
//   shardtorch-convert info DCP_DIR
//   shardtorch-convert dcp-to-hf DCP_DIR OUT_DIR [--prefix model.] [--max-file-bytes N] [--dtype bf16]
//   shardtorch-convert dcp-to-safetensors DCP_DIR OUT.safetensors [--prefix model.] [--dtype bf16]
//   shardtorch-convert hf-to-dcp HF_PATH OUT_DIR [--prefix model.]
//   shardtorch-convert sharded-to-dcp SHARDED_DIR OUT_DIR [--prefix model.] [--optimizer-prefix optim.]
//
// docs/checkpoints.md ("Converting") says what each writes.
#include <boost/json.hpp>
#include <boost/program_options.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>

#include "shardtorch/checkpoint.h"
#include "shardtorch/dcp_checkpoint.h"
#include "support/tool_files.h"

namespace po = boost::program_options;
namespace json = boost::json;
namespace ckpt = shardtorch::checkpoint;

namespace {

std::string text_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

std::string dirname_of(const std::string& p) {
  const auto slash = p.rfind('/');
  return slash == std::string::npos ? "." : p.substr(0, slash);
}

std::string basename_of(const std::string& p) {
  const auto slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

// `t` in `dtype` when given and `t` is floating point.
at::ScalarType written_dtype(at::ScalarType t, std::optional<at::ScalarType> dtype) {
  return dtype && at::isFloatingType(t) ? *dtype : t;
}

std::optional<at::ScalarType> dtype_option(const std::string& s) {
  if (s.empty()) return std::nullopt;
  if (s == "bf16" || s == "bfloat16") return at::kBFloat16;
  if (s == "fp16" || s == "float16") return at::kHalf;
  if (s == "fp32" || s == "float32") return at::kFloat;
  throw std::invalid_argument("--dtype '" + s + "': bf16, fp16 or fp32");
}

// The model's tensors of a DCP checkpoint: keys under `prefix`, the prefix
// removed, each read when the writer reaches it.
std::vector<ckpt::PendingTensor> dcp_model_tensors(const ckpt::DcpReader& r, const std::string& prefix,
                                                   std::optional<at::ScalarType> dtype) {
  std::vector<ckpt::PendingTensor> out;
  for (const auto& e : r.entries()) {
    if (!e.tensor || e.name.rfind(prefix, 0) != 0) continue;
    const at::ScalarType to = written_dtype(e.dtype, dtype);
    out.push_back({e.name.substr(prefix.size()), to, e.shape, [&r, name = e.name, to] { return r.read(name).to(to); }});
  }
  if (out.empty())
    throw std::runtime_error("no tensor key starts with '" + prefix +
                             "' (see `info`; --prefix \"\" takes every tensor)");
  return out;
}

int info(const std::string& dir) {
  ckpt::DcpReader r(dir);
  for (const auto& e : r.entries()) {
    if (e.tensor) {
      std::cout << e.name << "  " << c10::toString(e.dtype) << " " << c10::IntArrayRef(e.shape) << "  " << e.chunks
                << (e.chunks == 1 ? " chunk" : " chunks") << "\n";
    } else {
      std::cout << e.name << "  = " << r.read_value(e.name) << "\n";
    }
  }
  return 0;
}

int dcp_to_hf(const std::string& dir, const std::string& out, const std::string& prefix, int64_t max_bytes,
              std::optional<at::ScalarType> dtype) {
  ckpt::DcpReader r(dir);
  auto tensors = dcp_model_tensors(r, prefix, dtype);
  // Files filled in order up to max_bytes (a larger tensor alone), as
  // transformers' save_pretrained does.
  std::vector<std::vector<size_t>> plan(1);
  int64_t in_file = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    int64_t n = static_cast<int64_t>(c10::elementSize(tensors[i].dtype));
    for (int64_t d : tensors[i].shape) n *= d;
    if (!plan.back().empty() && in_file + n > max_bytes) plan.emplace_back(), in_file = 0;
    plan.back().push_back(i);
    in_file += n;
    total += n;
  }
  shardtorch::tools::create_directories(out);
  // The data files an earlier layout's index names: those the new one does
  // not name are removed once it is in place (as save_hf_checkpoint does).
  std::set<std::string> earlier;
  const std::string index_path = out + "/model.safetensors.index.json";
  if (shardtorch::tools::is_regular_file(index_path)) {
    try {
      const json::value v = json::parse(text_of(index_path));
      for (const auto& kv : v.at("weight_map").as_object()) earlier.insert(std::string(kv.value().as_string()));
    } catch (const std::exception& e) {
      throw std::runtime_error("'" + index_path + "' is there but is not an index (" + e.what() +
                               "); remove it or write elsewhere");
    }
  }
  json::object weight_map;
  for (size_t k = 0; k < plan.size(); ++k) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", k + 1, plan.size());
    std::vector<ckpt::PendingTensor> file;
    for (size_t i : plan[k]) {
      file.push_back(tensors[i]);
      weight_map[tensors[i].name] = name;
    }
    ckpt::write_file(out + "/" + name, file, {{"format", "pt"}});
  }
  json::object index{{"metadata", json::object{{"total_size", total}}}, {"weight_map", weight_map}};
  const std::string tmp = out + "/.model.safetensors.index.json.tmp";
  std::ofstream(tmp) << json::serialize(index) << "\n";
  if (std::rename(tmp.c_str(), index_path.c_str()) != 0)
    throw std::runtime_error("cannot write the index in '" + out + "'");
  std::set<std::string> now;
  for (const auto& kv : weight_map) now.insert(std::string(kv.value().as_string()));
  for (const auto& f : earlier)
    if (!now.count(f) && f.find('/') == std::string::npos) std::remove((out + "/" + f).c_str());
  std::cout << "wrote " << tensors.size() << " tensors in " << plan.size() << (plan.size() == 1 ? " file" : " files")
            << " to " << out << "\n";
  return 0;
}

int dcp_to_safetensors(const std::string& dir, const std::string& out, const std::string& prefix,
                       std::optional<at::ScalarType> dtype) {
  ckpt::DcpReader r(dir);
  auto tensors = dcp_model_tensors(r, prefix, dtype);
  ckpt::write_file(out, tensors, {{"format", "pt"}});
  std::cout << "wrote " << tensors.size() << " tensors to " << out << "\n";
  return 0;
}

// A Hugging Face checkpoint: a directory (index or model.safetensors), an
// index file, or one safetensors file (shardtorch's full state dicts too).
int hf_to_dcp(const std::string& path, const std::string& out, const std::string& prefix,
              std::optional<at::ScalarType> dtype) {
  std::vector<std::pair<std::string, std::string>> where;  // tensor -> file
  std::string dir = path;
  auto from_index = [&](const std::string& index) {
    dir = dirname_of(index);
    const auto v = json::parse(text_of(index));
    for (const auto& kv : v.at("weight_map").as_object())
      where.emplace_back(std::string(kv.key()), std::string(kv.value().as_string()));
  };
  auto from_file = [&](const std::string& file) {
    dir = dirname_of(file);
    ckpt::Reader r(file);
    for (const auto& n : r.names()) where.emplace_back(n, basename_of(file));
  };
  if (ends_with(path, ".json"))
    from_index(path);
  else if (ends_with(path, ".safetensors"))
    from_file(path);
  else if (shardtorch::tools::is_regular_file(path + "/model.safetensors.index.json"))
    from_index(path + "/model.safetensors.index.json");
  else
    from_file(path + "/model.safetensors");
  std::map<std::string, std::unique_ptr<ckpt::Reader>> readers;
  auto reader = [&](const std::string& file) -> ckpt::Reader& {
    auto& r = readers[file];
    if (!r) r = std::make_unique<ckpt::Reader>(dir + "/" + file);
    return *r;
  };
  std::vector<ckpt::PendingTensor> tensors;
  for (const auto& [name, file] : where) {
    const auto info = reader(file).info(name);
    const at::ScalarType to = written_dtype(info.dtype, dtype);
    tensors.push_back({prefix + name, to, info.shape,
                       [&reader, file = file, name = name, to] { return reader(file).read(name).to(to); }});
  }
  ckpt::write_dcp(out, tensors, {}, shardtorch::DcpSaveOptions().model_prefix(prefix));
  std::cout << "wrote " << tensors.size() << " tensors to " << out << "\n";
  return 0;
}

// read_sharded_checkpoint's "name|kind" tensors as a DCP checkpoint: the
// parameters and buffers under `prefix`, the optimizer state as
// get_state_dict lays it out (with each parameter's step from the index).
int sharded_to_dcp(const std::string& dir, const std::string& out, const std::string& prefix,
                   const std::string& optim_prefix, std::optional<at::ScalarType> dtype) {
  auto all = shardtorch::read_sharded_checkpoint(dir);
  std::map<std::string, int64_t> steps;  // parameter -> its optimizer step
  // The index of what was read: the previous checkpoint, set aside by a save
  // interrupted between its two renames, when `dir` has none (docs/checkpoints.md).
  std::string plain = dir;  // "ck/" is "ck"
  while (plain.size() > 1 && plain.back() == '/') plain.pop_back();
  const std::string aside = plain + ".shardtorch-old";
  const bool set_aside = !shardtorch::tools::is_regular_file(dir + "/index.json") &&
                         shardtorch::tools::is_regular_file(aside + "/index.json");
  const auto index = json::parse(text_of((set_aside ? aside : dir) + "/index.json"));
  for (const auto& e : index.at("entries").as_array()) {
    const auto& o = e.as_object();
    const std::string kind(o.at("kind").as_string());
    if (kind == "param" || kind == "buffer") continue;
    auto& s = steps[std::string(o.at("name").as_string())];
    s = std::max(s, o.at("step").as_int64());
  }
  std::vector<ckpt::PendingTensor> tensors;
  for (auto& [key, t] : all) {
    const auto bar = key.rfind('|');
    const std::string name = key.substr(0, bar), kind = key.substr(bar + 1);
    const bool model = kind == "param" || kind == "buffer";
    const std::string to = model ? prefix + name : optim_prefix + "state." + name + "." + kind;
    const at::ScalarType as = model ? written_dtype(t.scalar_type(), dtype) : t.scalar_type();  // state as trained
    tensors.push_back({to, as, t.sizes().vec(), [t = t, as] { return t.to(as); }});
  }
  for (const auto& [name, step] : steps)
    if (all.count(name + "|exp_avg"))
      tensors.push_back({optim_prefix + "state." + name + ".step", at::kFloat, {}, [step = step] {
                           return at::full({}, static_cast<double>(step), at::kFloat);
                         }});
  ckpt::write_dcp(out, tensors, {}, shardtorch::DcpSaveOptions().model_prefix(prefix).optimizer_prefix(optim_prefix));
  std::cout << "wrote " << tensors.size() << " tensors to " << out << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string command, in, out, prefix = "model.", optim_prefix = "optim.", dtype;
  int64_t max_bytes = 5'000'000'000;
  po::options_description opts(
      "shardtorch-convert COMMAND IN [OUT] [options]; COMMAND: info, dcp-to-hf, "
      "dcp-to-safetensors, hf-to-dcp, sharded-to-dcp");
  opts.add_options()("help", "this text")("command", po::value(&command), "the command (first positional argument)")(
      "in", po::value(&in), "the checkpoint read (second positional argument)")(
      "out", po::value(&out), "what is written (third positional argument)")(
      "prefix", po::value(&prefix)->default_value("model."),
      "the model's keys in the DCP checkpoint start with this (\"\" for none)")(
      "optimizer-prefix", po::value(&optim_prefix)->default_value("optim."), "the optimizer's (sharded-to-dcp)")(
      "max-file-bytes", po::value(&max_bytes)->default_value(5'000'000'000), "dcp-to-hf: the largest data file")(
      "dtype", po::value(&dtype),
      "floating-point tensors written in this dtype (bf16, fp16, fp32); sharded-to-dcp: the model's only, the "
      "optimizer state stays as trained");
  po::positional_options_description pos;
  pos.add("command", 1).add("in", 1).add("out", 1);
  try {
    po::variables_map vm;
    po::store(po::command_line_parser(argc, argv).options(opts).positional(pos).run(), vm);
    po::notify(vm);
    if (vm.count("help") || command.empty() || in.empty()) {
      std::cout << opts << "\n";
      return vm.count("help") ? 0 : 2;  // asked for, or a usage error
    }
    if (command != "info" && out.empty()) throw std::invalid_argument(command + " needs IN and OUT");
    if (max_bytes <= 0) throw std::invalid_argument("--max-file-bytes must be positive");
    if (command == "info") return info(in);
    if (command == "dcp-to-hf") return dcp_to_hf(in, out, prefix, max_bytes, dtype_option(dtype));
    if (command == "dcp-to-safetensors") return dcp_to_safetensors(in, out, prefix, dtype_option(dtype));
    if (command == "hf-to-dcp") return hf_to_dcp(in, out, prefix, dtype_option(dtype));
    if (command == "sharded-to-dcp") return sharded_to_dcp(in, out, prefix, optim_prefix, dtype_option(dtype));
    throw std::invalid_argument("unknown command '" + command + "'");
  } catch (const std::exception& e) {
    std::cerr << "shardtorch-convert: " << e.what() << "\n";
    return 1;
  }
}
