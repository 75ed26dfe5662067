// Hugging Face's multi-file safetensors layout, saved and loaded. Every rank
// shards a GPT and save_hf_checkpoint writes it the way transformers'
// save_pretrained does (files of at most --max-file-kb, each tensor whole in
// one file, the tied head saved once, model.safetensors.index.json with its
// weight_map), gathering one flat parameter at a time; then every rank
// builds the GPT deferred, shards it without replaying its initialisation,
// and loads the checkpoint, opening only the files that hold its own
// elements. Launch:
//
//   torchrun --no-python --standalone --nproc-per-node 2 build/examples/hf_checkpoint --dir /tmp/gpt-hf
//   torchrun ... build/examples/hf_checkpoint --dir DIR --no-write --strip-prefix model.   # a checkpoint you have
//
// Prints per rank the files it opened, the bytes it read and its memory by
// category; exits non-zero if the loaded model differs from the one written.
#include <torch/torch.h>

#include <boost/program_options.hpp>

#include <iostream>
#include <map>
#include <sstream>

#include "cli.h"
#include "gpt.h"
#include "shardtorch/hf_checkpoint.h"
#include "shardtorch/shardtorch.h"

namespace po = boost::program_options;

int main(int argc, char** argv) {
  try {
    gpt::Config cfg;
    cfg.vocab = 512;
    cfg.seq_len = 64;
    cfg.d_model = 128;
    cfg.n_layer = 8;
    std::string dir, strategy = "full_shard", strip;
    int64_t max_kb = 256;
    bool no_write = false;
    po::options_description desc("hf_checkpoint: make and load a Hugging Face multi-file safetensors checkpoint");
    desc.add_options()("help", "this text")("dir", po::value(&dir)->required(),
                                            "checkpoint directory (model.safetensors.index.json and its files)")(
        "layers", po::value(&cfg.n_layer)->default_value(cfg.n_layer), "transformer blocks")(
        "d-model", po::value(&cfg.d_model)->default_value(cfg.d_model), "model width")(
        "max-file-kb", po::value(&max_kb)->default_value(max_kb), "largest data file written, KiB")(
        "strategy", po::value(&strategy)->default_value(strategy),
        "full_shard|shard_grad_op|optimizer_only|no_shard|hybrid_shard")(
        "strip-prefix", po::value(&strip), "a prefix to strip from the checkpoint's names (e.g. model.)")(
        "no-write", po::bool_switch(&no_write), "load what is in --dir, write nothing");
    po::variables_map vm;
    po::store(po::parse_command_line(argc, argv, desc), vm);
    if (vm.count("help")) {
      std::cout << desc << "\n";
      return 0;
    }
    po::notify(vm);
    if (cfg.n_layer < 1 || cfg.d_model < 1 || cfg.d_model % cfg.n_head != 0 || max_kb < 1)
      throw std::invalid_argument(
          "--layers, --d-model and --max-file-kb must be at least 1, --d-model a multiple of 4");

    auto world = shardtorch::World::from_env();
    const int rank = world->rank();
    std::map<std::string, double> written;  // each tensor's sum of squares, as written
    if (!no_write) {
      // The model someone trained, sharded, saved in the layout: one flat
      // parameter gathered at a time, rank 0 writing.
      torch::manual_seed(0);
      gpt::GPT source(cfg);
      shardtorch::shard(source, world, shardtorch::ShardOptions().strategy(shardtorch::parse_strategy(strategy)));
      auto saved =
          shardtorch::save_hf_checkpoint(*source, dir, shardtorch::HfSaveOptions().max_file_bytes(max_kb * 1024));
      for (const auto& [n, t] : shardtorch::full_parameters(*source))  // collective
        written[n] = t.to(torch::kDouble).square().sum().item<double>();
      if (rank == 0)
        std::cout << "wrote " << saved.files.size() << " files (" << saved.total_bytes << " bytes) into " << dir
                  << std::endl;
    }

    // Built deferred (nothing allocated), sharded without replaying the
    // initialisation (zeros, overwritten by the load), loaded.
    auto model = shardtorch::deferred([&] { return gpt::GPT(cfg); });
    shardtorch::skip_deferred_init(model);
    auto sharded =
        shardtorch::shard(model, world, shardtorch::ShardOptions().strategy(shardtorch::parse_strategy(strategy)));
    auto options = shardtorch::HfLoadOptions();
    if (!strip.empty()) options.strip_prefix(strip);
    auto report = shardtorch::load_hf_checkpoint(*model, dir, options);
    std::ostringstream os;
    os << "rank " << rank << " opened " << report.files_opened.size() << " files:";
    for (const auto& f : report.files_opened) os << " " << f;
    os << "; read " << report.bytes_read << " bytes\n" << sharded.memory().report();
    std::cout << os.str() << std::flush;

    std::map<std::string, double> loaded;
    for (const auto& [n, t] : shardtorch::full_parameters(*model))  // collective
      loaded[n] = t.to(torch::kDouble).square().sum().item<double>();
    if (!no_write && rank == 0) {
      std::cout << "every tensor's sum of squares " << (written == loaded ? "equals" : "differs from")
                << " what was written" << std::endl;
      if (written != loaded) {
        std::cerr << "hf_checkpoint: the loaded model differs from the one written" << std::endl;
        return 1;
      }
    }
    return 0;
  } catch (...) {
    return cli::report_error("hf_checkpoint");
  }
}
