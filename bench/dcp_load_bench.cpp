// dcp_load_bench: a large PyTorch distributed checkpoint (written by
// bench/dcp/save_large.py) loaded into a deferred shardtorch model under
// torchrun --no-python, FullShard. Each rank prints one JSON line: the load's
// time, its memory (peak resident memory during the load above what the
// process held before the model was made) against its shard plus the
// largest chunk it read, and whether the loaded values match the sums
// save_large.py recorded. bench/dcp/run_dcp_bench.py runs it (make dcp-bench).
//
//   torchrun --no-python --standalone --nproc-per-node 4 build/bench/dcp_load_bench --dir D --layers 16 --width 8192
#include <sys/resource.h>
#include <torch/torch.h>

#include <boost/json.hpp>
#include <boost/program_options.hpp>
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>

#include "shardtorch/shardtorch.h"

namespace po = boost::program_options;
namespace json = boost::json;

namespace {

// One layer: a square weight, its own unit (as fully_shard on each layer).
struct SquareImpl : torch::nn::Module {
  SquareImpl(int64_t width, torch::Dtype dtype) {
    weight = register_parameter("weight", torch::empty({width, width}, torch::TensorOptions().dtype(dtype)));
  }
  torch::Tensor forward(torch::Tensor x) { return torch::matmul(x, weight.t()); }
  torch::Tensor weight;
};
SHARDTORCH_MODULE(Square);

struct StackImpl : torch::nn::Module {
  StackImpl(int layers, int64_t width, torch::Dtype dtype) {
    for (int i = 0; i < layers; ++i) blocks->push_back(Square(width, dtype));
    register_module("layers", blocks);
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : *blocks) x = b->as<Square>()->forward(x);
    return x;
  }
  torch::nn::ModuleList blocks;
};
SHARDTORCH_MODULE(Stack);

// Resident memory now and at its peak (VmRSS, VmHWM), in bytes.
std::pair<int64_t, int64_t> rss() {
  std::ifstream in("/proc/self/status");
  std::string line;
  int64_t now = 0, peak = 0;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) now = std::stoll(line.substr(6)) * 1024;
    if (line.rfind("VmHWM:", 0) == 0) peak = std::stoll(line.substr(6)) * 1024;
  }
  return {now, peak};
}

// Resets VmHWM to the current resident size (Linux: write 5 to clear_refs).
void reset_peak() { std::ofstream("/proc/self/clear_refs") << "5"; }

}  // namespace

int main(int argc, char** argv) {
  std::string dir, dtype_name = "fp32";
  int layers = 16;
  int64_t width = 8192;
  po::options_description opts("dcp_load_bench");
  opts.add_options()("dir", po::value(&dir)->required(), "the DCP checkpoint")("layers", po::value(&layers))(
      "width", po::value(&width))("dtype", po::value(&dtype_name), "fp32 or bf16");
  po::variables_map vm;
  po::store(po::parse_command_line(argc, argv, opts), vm);
  po::notify(vm);
  const torch::Dtype dtype = dtype_name == "bf16" ? torch::kBFloat16 : torch::kFloat;
  at::set_num_threads(1);

  auto world = shardtorch::World::from_env();
  const int64_t before_model = rss().first;
  Stack model = shardtorch::deferred([&] { return Stack(layers, width, dtype); });
  shardtorch::skip_deferred_init(model);
  shardtorch::shard(model, *world);
  const int64_t shard_bytes = [&] {
    int64_t n = 0;
    for (const auto& u : shardtorch::sharded_model(*model).units())
      for (const auto& l : u.layouts) n += l.shard_numel();
    return n * static_cast<int64_t>(c10::elementSize(dtype));
  }();
  // The largest chunk of the checkpoint (one item), as the writer recorded it.
  const json::value written = json::parse([&] {
    std::ifstream in(dir + "/bench.json");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }());
  const int64_t chunk_bytes = written.at("largest_chunk_bytes").as_int64();
  world->barrier();
  reset_peak();
  const int64_t before_load = rss().first;
  const auto t0 = std::chrono::steady_clock::now();
  // save_large.py saves model.state_dict() itself: its keys have no "model." prefix.
  auto report = shardtorch::load_dcp_checkpoint(*model, dir, shardtorch::DcpLoadOptions().model_prefix(""));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t peak = rss().second;
  world->barrier();

  // The values: element k of layer i's weight is ((k % 1000) - 500) / 1000 *
  // (i + 1), computed in float64 and rounded to the dtype, as the writer
  // made them. Every piece of this rank's shards must equal that, bitwise.
  shardtorch::detail::ShardViews views(*model);
  views.take_rest();
  int64_t wrong = 0;
  for (const auto& piece : views.pieces()) {
    const int layer = std::stoi(piece.name.substr(std::string("layers.").size()));
    const torch::Tensor k = torch::arange(piece.param_offset, piece.param_offset + piece.length, torch::kLong);
    const torch::Tensor want = ((k.remainder(1000) - 500).to(torch::kDouble) / 1000.0 * (layer + 1)).to(dtype);
    if (!torch::equal(piece.view.reshape({-1}), want)) ++wrong;
  }
  std::ostringstream os;
  os << "{\"rank\": " << world->rank() << ", \"world\": " << world->size() << ", \"seconds\": " << seconds
     << ", \"shard_bytes\": " << shard_bytes << ", \"largest_chunk_bytes\": " << chunk_bytes
     << ", \"rss_before_model\": " << before_model << ", \"rss_before_load\": " << before_load
     << ", \"peak_rss_during_load\": " << peak << ", \"bytes_read\": " << report.bytes_read
     << ", \"items_opened\": " << report.items_opened << ", \"pieces\": " << views.pieces().size()
     << ", \"pieces_wrong\": " << wrong << "}";
  std::cout << os.str() + "\n" << std::flush;  // one write: the ranks share the launcher's pipe
  return wrong == 0 ? 0 : 1;
}
