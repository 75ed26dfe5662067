// A GPT built without allocating it (deferred construction), sharded so that
// each rank makes only its own shards, and trained a few steps. Launch:
//
//   torchrun --no-python --standalone --nproc-per-node 2 build/examples/large_gpt
//   torchrun --no-python --standalone --nproc-per-node 2 build/examples/large_gpt --layers 24 --d-model 1024
//
// Prints shard()'s progress (a unit at a time) on rank 0, and per rank the
// resident memory (VmRSS, and its peak VmHWM) after each phase beside the model's fp32 size: construction adds nothing,
// shard() adds this rank's shards and at most a few units in passing, never the model. Exits non-zero if the loss did
// not fall.
#include <torch/torch.h>

#include <malloc.h>

#include <iomanip>
#include <iostream>
#include <sstream>

#include "cli.h"
#include "gpt.h"
#include "process_memory.h"
#include "shardtorch/deferred.h"
#include "shardtorch/shardtorch.h"

int main(int argc, char** argv) {
  try {
    gpt::Config cfg;
    cfg.vocab = 512;
    cfg.seq_len = 64;
    cfg.d_model = 512;
    cfg.n_layer = 12;
    int steps = 8;
    std::string strategy = "full_shard";
    boost::program_options::options_description desc("options");
    desc.add_options()("help", "this text")("layers", cli::number_option(cfg.n_layer, "--layers"),
                                            "transformer blocks")(
        "d-model", cli::number_option(cfg.d_model, "--d-model"), "model width")(
        "steps", cli::number_option(steps, "--steps"), "optimizer steps")(
        "strategy", boost::program_options::value(&strategy)->default_value(strategy),
        "full_shard|shard_grad_op|optimizer_only|no_shard|hybrid_shard");
    if (!cli::parse_command_line(argc, argv, desc,
                                 "large_gpt: a GPT built deferred, sharded, trained (launch with torchrun)"))
      return 0;
    // glibc keeps freed heap memory resident and raises its mmap threshold as
    // large blocks are freed; a fixed threshold makes VmRSS follow the live
    // bytes, so that the figures below show what the program holds.
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
    auto world = shardtorch::World::from_env();
    const int rank = world->rank();
    auto report = [&](const std::string& phase) {
      std::ostringstream os;
      os << "rank " << rank << " after " << phase << ": VmRSS " << process_memory::mib(process_memory::resident_bytes())
         << " MiB, peak VmHWM " << process_memory::mib(process_memory::peak_resident_bytes()) << " MiB\n";
      std::cout << os.str() << std::flush;
    };
    report("start");

    // 1. Construct: the model's code is unchanged; nothing is allocated.
    torch::manual_seed(0);
    auto model = shardtorch::deferred([&] { return gpt::GPT(cfg); });
    int64_t numel = 0;
    for (const auto& p : model->parameters()) numel += p.numel();
    if (rank == 0)
      std::cout << "GPT: " << cfg.n_layer << " blocks, d_model " << cfg.d_model << ", " << numel / 1000000
                << "M parameters (" << numel * 4 / (1 << 20) << " MiB in fp32), " << shardtorch::count_deferred(*model)
                << " deferred tensors" << std::endl;
    report("deferred construction");

    // 2. Shard: each unit is made whole in turn (its construction replayed,
    //    bitwise what eager construction gives), sliced, and freed. Its
    //    progress, here through a callback of our own (without one, rank 0
    //    prints a progress line of its own to stderr when shard() takes more
    //    than 2 s; docs/api.md, "Progress and logs").
    auto progress = [rank](const shardtorch::ProgressUpdate& u) {
      if (rank != 0 || (u.done == 0 && !u.finished)) return;
      std::ostringstream os;
      os << std::fixed << std::setprecision(2) << u.operation << ": " << u.done << "/" << u.total << " " << u.unit
         << ", " << u.bytes_done / (1 << 20) << "/" << u.bytes_total / (1 << 20) << " MiB, " << u.elapsed_s << " s";
      if (!u.finished) os << ", " << u.eta_s << " s left";
      std::cout << os.str() << std::endl;
    };
    auto sharded = shardtorch::shard(
        model, world, shardtorch::ShardOptions().strategy(shardtorch::parse_strategy(strategy)).progress(progress));
    report("shard()");
    if (rank == 0) std::cout << sharded.memory().report() << std::flush;

    // 3. Train on a task whose loss can fall: tokens counting up from a random start.
    auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(3e-3));
    const int64_t batch = 4;
    torch::manual_seed(1000 + rank);  // this rank's batch, the same at every step
    auto start = torch::randint(0, cfg.vocab, {batch, 1}, torch::kLong);
    auto tokens = (start + torch::arange(cfg.seq_len, torch::kLong)).remainder(cfg.vocab);
    double first = 0, last = 0;
    for (int s = 0; s < steps; ++s) {
      opt->zero_grad();
      auto logits = model(tokens);
      auto loss = torch::nn::functional::cross_entropy(logits.slice(1, 0, -1).reshape({-1, cfg.vocab}),
                                                       tokens.slice(1, 1).reshape({-1}));
      loss.backward();
      opt->step();
      auto mean = loss.detach().clone();
      world->comm().all_reduce(mean, c10d::ReduceOp::SUM, "loss");
      const double l = mean.item<double>() / world->size();
      if (s == 0) first = l;
      last = l;
      if (rank == 0) std::cout << "step " << s << " loss " << l << std::endl;
    }
    report("training");
    if (steps >= 4 && !(last < first)) {
      if (rank == 0) std::cerr << "large_gpt: the loss did not fall (" << first << " -> " << last << ")" << std::endl;
      return 1;
    }
    return 0;
  } catch (...) {
    return cli::report_error("large_gpt");
  }
}
