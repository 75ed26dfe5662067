// A GPT bigger than one rank, built deferred, sharded, loaded or initialised,
// trained a few steps and saved, with each rank's memory measured per phase
// (docs/scale.md). Two modes:
//
//   finetune: a GPT whose base weights are frozen bf16 and whose qkv and proj
//     carry trainable fp32 low-rank adapters (LoRA, written below as a user
//     would), loaded from a Hugging Face multi-file checkpoint of the base
//     (--checkpoint DIR, names "model.<name>"), FullShard; saves the adapters.
//   pretrain: the example GPT (examples/gpt.h) in fp32 with AdamW on every
//     parameter, initialised by its own constructors one unit at a time;
//     saves a sharded checkpoint (parameters and optimizer state).
//
//   torchrun --no-python --standalone --nproc-per-node 4 build/examples/scale_gpt \
//     --mode finetune --layers 26 --d-model 3072 --checkpoint /tmp/base --save /tmp/adapters
//   torchrun --no-python --standalone --nproc-per-node 8 build/examples/scale_gpt \
//     --mode pretrain --layers 20 --d-model 2048 --save /tmp/pretrain-ckpt
//
// --init eager constructs the whole model on every rank instead (the
// comparison; bench/scale/run_scale.py runs it under a memory guard).
// Every rank prints one JSON line per phase (construct, shard, load, step,
// save): peak RSS (VmHWM, reset at each phase's start through
// /proc/self/clear_refs), RSS at its end, and the library's memory
// categories (peaks within the phase); rank 0 prints the planner's
// prediction (shardtorch::plan_memory) and the target. On stderr, rank 0
// shows the progress of shard(), the load and the save as they run (the
// library's default printing; --log-level warning turns it off, debug shows
// every collective, unit gather and file opened).
#include <torch/torch.h>

#include <malloc.h>

#include <cstring>
#include <iostream>
#include <sstream>

#include "cli.h"
#include "gpt.h"
#include "process_memory.h"
#include "shardtorch/shardtorch.h"

namespace {

// ---- the adapter, as a user writes it ---------------------------------------
// y = base(x) + (x A^T) B^T * alpha / r, with base frozen (its dtype) and
// A, B trainable fp32; B starts at zero, so the adapted model starts as the base.
struct LoRALinearImpl : torch::nn::Module {
  LoRALinearImpl(int64_t in, int64_t out, int64_t r, bool bias)
      : base(register_module("base", torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias)))),
        lora_a(register_parameter("lora_a", torch::empty({r, in}, torch::kFloat))),
        lora_b(register_parameter("lora_b", torch::zeros({out, r}, torch::kFloat))),
        scale(2.0) {  // alpha = 2r
    torch::NoGradGuard no_grad;
    torch::nn::init::kaiming_uniform_(lora_a, std::sqrt(5.0));
    for (auto& p : base->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto delta = torch::linear(torch::linear(x.to(torch::kFloat), lora_a), lora_b) * scale;
    return base(x) + delta.to(x.scalar_type());
  }
  torch::nn::Linear base;
  torch::Tensor lora_a, lora_b;
  double scale;
};
TORCH_MODULE(LoRALinear);

// The example GPT's block with adapters on qkv and proj; everything else frozen.
struct LoraBlockImpl : torch::nn::Module {
  LoraBlockImpl(const gpt::Config& c, int64_t r)
      : n_head(c.n_head),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})))),
        qkv(register_module("qkv", LoRALinear(c.d_model, 3 * c.d_model, r, false))),
        proj(register_module("proj", LoRALinear(c.d_model, c.d_model, r, true))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})))),
        fc1(register_module("fc1", torch::nn::Linear(c.d_model, 4 * c.d_model))),
        fc2(register_module("fc2", torch::nn::Linear(4 * c.d_model, c.d_model))) {
    for (auto* m : {ln1.ptr().get(), ln2.ptr().get()})
      for (auto& p : m->parameters()) p.set_requires_grad(false);
    for (auto* m : {fc1.ptr().get(), fc2.ptr().get()})
      for (auto& p : m->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor x) {
    const auto B = x.size(0), T = x.size(1), C = x.size(2), H = n_head, D = C / H;
    auto parts = qkv(ln1(x)).chunk(3, -1);
    auto q = parts[0].view({B, T, H, D}).transpose(1, 2);
    auto k = parts[1].view({B, T, H, D}).transpose(1, 2);
    auto v = parts[2].view({B, T, H, D}).transpose(1, 2);
    auto y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
    x = x + proj(y.transpose(1, 2).reshape({B, T, C}));
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }
  int64_t n_head;
  torch::nn::LayerNorm ln1;
  LoRALinear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
};
SHARDTORCH_MODULE(LoraBlock);

struct LoraGPTImpl : torch::nn::Module {
  LoraGPTImpl(const gpt::Config& c, int64_t r)
      : tok_emb(register_module("tok_emb", torch::nn::Embedding(c.vocab, c.d_model))),
        pos_emb(register_module("pos_emb", torch::nn::Embedding(c.seq_len, c.d_model))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})))) {
    for (int64_t i = 0; i < c.n_layer; ++i) {
      block_list.emplace_back(c, r);
      blocks->push_back(block_list.back());
    }
    for (torch::nn::Module* m :
         std::initializer_list<torch::nn::Module*>{tok_emb.ptr().get(), pos_emb.ptr().get(), ln_f.ptr().get()})
      for (auto& p : m->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor tokens) {
    auto pos = torch::arange(tokens.size(1), tokens.options());
    auto x = tok_emb(tokens) + pos_emb(pos).unsqueeze(0);
    for (auto& b : block_list) x = b(x);
    return torch::linear(ln_f(x), tok_emb->weight);  // the LM head, tied to the token embedding
  }
  torch::nn::Embedding tok_emb, pos_emb;
  torch::nn::ModuleList blocks;
  std::vector<LoraBlock> block_list;
  torch::nn::LayerNorm ln_f;
};
SHARDTORCH_MODULE(LoraGPT);

// ---- measuring ---------------------------------------------------------------
std::string mem_json(const shardtorch::MemorySnapshot& s) {
  std::ostringstream os;
  os << "{";
  const char* sep = "";
  for (int i = 0; i < static_cast<int>(shardtorch::Mem::kCount); ++i) {
    auto m = static_cast<shardtorch::Mem>(i);
    if (s.max(m) == 0 && s.cur(m) == 0) continue;
    os << sep << "\"" << shardtorch::mem_name(m) << "\": [" << s.cur(m) << ", " << s.max(m) << "]";
    sep = ", ";
  }
  os << "}";
  return os.str();
}

int64_t peak_sum(const shardtorch::MemorySnapshot& s) {
  int64_t n = 0;
  for (int i = 0; i < static_cast<int>(shardtorch::Mem::kCount); ++i) n += s.peak[static_cast<size_t>(i)];
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    gpt::Config cfg;
    cfg.vocab = 32000;
    cfg.seq_len = 64;
    cfg.d_model = 1024;
    cfg.n_head = 16;
    cfg.n_layer = 4;
    std::string mode = "finetune", init = "deferred", checkpoint, save, stop_after, log_level;
    int64_t rank_r = 8, batch = 1, tokens_per_seq = 32;
    int steps = 2;
    bool bf16 = false;
    boost::program_options::options_description desc("options");
    desc.add_options()("help", "this text")("mode", boost::program_options::value(&mode)->default_value(mode),
                                            "finetune|pretrain")(
        "init", boost::program_options::value(&init)->default_value(init), "deferred|eager")(
        "layers", cli::number_option(cfg.n_layer, "--layers"), "transformer blocks")(
        "d-model", cli::number_option(cfg.d_model, "--d-model"), "model width")(
        "heads", cli::number_option(cfg.n_head, "--heads"), "attention heads")(
        "vocab", cli::number_option(cfg.vocab, "--vocab"), "vocabulary")(
        "seq", cli::number_option(cfg.seq_len, "--seq"), "position embedding length")(
        "tokens", cli::number_option(tokens_per_seq, "--tokens"), "tokens per sequence in training (<= --seq)")(
        "batch", cli::number_option(batch, "--batch"), "sequences per rank per step")(
        "lora-rank", cli::number_option(rank_r, "--lora-rank"), "adapter rank (finetune)")(
        "steps", cli::number_option(steps, "--steps"), "optimizer steps")(
        "bf16", boost::program_options::bool_switch(&bf16),
        "pretrain: bf16 mixed precision (fp32 masters and optimizer state)")(
        "checkpoint", boost::program_options::value(&checkpoint), "finetune: the base model in Hugging Face's layout")(
        "save", boost::program_options::value(&save),
        "where to save (finetune: the adapters; pretrain: a sharded checkpoint)")(
        "stop-after", boost::program_options::value(&stop_after), "construct|shard|load: end after that phase")(
        "log-level", boost::program_options::value(&log_level),
        "quiet|error|warning|info|debug (default: SHARDTORCH_LOG_LEVEL, else info: rank 0 shows the progress of "
        "shard(), the load and the save on stderr)");
    if (!cli::parse_command_line(argc, argv, desc, "scale_gpt: a GPT bigger than a rank (launch with torchrun)"))
      return 0;
    if (mode != "finetune" && mode != "pretrain") throw std::invalid_argument("--mode must be finetune or pretrain");
    if (init != "deferred" && init != "eager") throw std::invalid_argument("--init must be deferred or eager");
    if (tokens_per_seq > cfg.seq_len) throw std::invalid_argument("--tokens must be at most --seq");
    if (!log_level.empty()) shardtorch::set_log_level(shardtorch::parse_log_level(log_level));
    const bool finetune = mode == "finetune", deferred = init == "deferred";
    // glibc keeps freed heap memory resident and raises its mmap threshold as
    // large blocks are freed; a fixed threshold makes RSS follow the live bytes.
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
    auto world = shardtorch::World::from_env();
    const int rank = world->rank(), N = world->size();
    const int64_t baseline = process_memory::resident_bytes();
    const bool resets = process_memory::reset_peak();
    std::shared_ptr<shardtorch::ShardedModel> sharded;
    auto phase = [&](const std::string& name, auto&& body) {
      world->barrier();
      process_memory::reset_peak();
      if (sharded) sharded->reset_peak_memory();
      auto t0 = std::chrono::steady_clock::now();
      body();
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::ostringstream os;
      os << "{\"rank\": " << rank << ", \"phase\": \"" << name << "\", \"seconds\": " << secs
         << ", \"vmhwm\": " << process_memory::peak_resident_bytes()
         << ", \"vmrss\": " << process_memory::resident_bytes() << ", \"baseline\": " << baseline
         << ", \"hwm_reset\": " << (resets ? "true" : "false");
      if (sharded)
        os << ", \"lib_peak_sum\": " << peak_sum(sharded->memory()) << ", \"lib\": " << mem_json(sharded->memory());
      os << "}\n";
      std::cout << os.str() << std::flush;
      world->barrier();
    };

    // 1. Construct. finetune: bf16 base weights (the default dtype while
    //    constructing), fp32 adapters (their own dtype).
    torch::manual_seed(0);
    std::shared_ptr<torch::nn::Module> root;
    LoraGPT lora{nullptr};
    gpt::GPT full{nullptr};
    phase("construct", [&] {
      if (finetune) {
        auto make = [&] {
          const auto dflt = c10::get_default_dtype();
          c10::set_default_dtype(caffe2::TypeMeta::Make<at::BFloat16>());
          LoraGPT m(cfg, rank_r);
          c10::set_default_dtype(dflt);
          return m;
        };
        lora = deferred ? shardtorch::deferred(make) : make();
        root = lora.ptr();
      } else {
        auto make = [&] { return gpt::GPT(cfg); };
        full = deferred ? shardtorch::deferred(make) : make();
        root = full.ptr();
      }
    });
    // finetune: the base comes from the checkpoint, so its construction is
    // not replayed (zeros until loaded); the adapters' is (A random, B zero).
    if (finetune && deferred) {
      for (auto& m : root->modules()) {
        if (dynamic_cast<torch::nn::LinearImpl*>(m.get()) || dynamic_cast<torch::nn::EmbeddingImpl*>(m.get()) ||
            dynamic_cast<torch::nn::LayerNormImpl*>(m.get()))
          shardtorch::skip_deferred_init(*m);
      }
    }

    int64_t numel = 0, trainable = 0;
    for (const auto& p : root->parameters()) {
      numel += p.numel();
      if (p.requires_grad()) trainable += p.numel();
    }
    auto options = shardtorch::ShardOptions()
                       .strategy(shardtorch::Strategy::FullShard)
                       .sync_module_states(false);  // every rank makes the same values
    if (bf16)  // pretrain: fp32 masters and AdamW state, bf16 gathers, compute and gradient reductions
      options.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16).output_dtype(at::kFloat));
    const auto units = shardtorch::unit_specs(*root);
    const auto plan = shardtorch::plan_memory(units, {options, N, finetune ? 2 : 2, false});
    int64_t largest_unit = 0;
    for (const auto& u : units) {
      int64_t b = 0;
      for (const auto& f : u.flats) b += (f.numel + N - 1) / N * N * static_cast<int64_t>(c10::elementSize(f.dtype));
      largest_unit = std::max(largest_unit, b);
    }
    if (rank == 0) {
      std::ostringstream os;
      os << "{\"model\": {\"mode\": \"" << mode << "\", \"init\": \"" << init << "\", \"world\": " << N
         << ", \"layers\": " << cfg.n_layer << ", \"d_model\": " << cfg.d_model << ", \"vocab\": " << cfg.vocab
         << ", \"params\": " << numel << ", \"trainable\": " << trainable << ", \"units\": " << units.size()
         << ", \"largest_unit_bytes\": " << largest_unit
         << "}, \"plan\": {\"params\": " << plan.of(shardtorch::Mem::ShardedParams)
         << ", \"model_state\": " << plan.model_state() << ", \"startup_deferred\": " << plan.startup_deferred
         << ", \"startup_eager\": " << plan.startup_eager << ", \"step_peak\": " << plan.device_peak() << "}}\n";
      std::cout << os.str() << std::flush;
    }
    if (stop_after == "construct") return 0;

    // 2. Shard: one unit at a time.
    phase("shard",
          [&] { sharded = std::make_shared<shardtorch::ShardedModel>(shardtorch::shard(*root, world, options)); });
    if (stop_after == "shard") return 0;

    // 3. Load (finetune): each rank reads only its elements of the files that hold them.
    phase("load", [&] {
      if (!finetune || checkpoint.empty()) return;
      auto report = shardtorch::load_hf_checkpoint(
          *root, checkpoint,
          shardtorch::HfLoadOptions()
              .strip_prefix("model.")
              .map_name([](const std::string& n) -> std::optional<std::string> {  // PEFT-style: the base under "base."
                for (const char* l : {".qkv.", ".proj."}) {
                  auto at = n.find(l);
                  if (at != std::string::npos)
                    return n.substr(0, at + std::strlen(l)) + "base." + n.substr(at + std::strlen(l));
                }
                return n;
              })
              .allow_missing_if([](const std::string& n) { return n.find("lora_") != std::string::npos; }));
      if (rank == 0)
        std::cout << "{\"loaded_files\": " << report.files_opened.size() << ", \"missing\": " << report.missing.size()
                  << "}\n"
                  << std::flush;
    });
    if (stop_after == "load") return 0;

    // 4. Steps: tokens counting up from a random start (a task whose loss can fall).
    auto opt = shardtorch::AdamW(*root, torch::optim::AdamWOptions(finetune ? 1e-3 : 3e-4));
    torch::manual_seed(1000 + rank);
    auto start = torch::randint(0, cfg.vocab, {batch, 1}, torch::kLong);
    auto tokens = (start + torch::arange(tokens_per_seq, torch::kLong)).remainder(cfg.vocab);
    phase("step", [&] {
      for (int s = 0; s < steps; ++s) {
        auto t0 = std::chrono::steady_clock::now();
        opt->zero_grad();
        at::Tensor logits = finetune ? lora(tokens) : full(tokens);
        auto loss = gpt::lm_loss(logits.to(torch::kFloat), tokens);
        loss.backward();
        opt->step();
        auto mean = loss.detach().clone();
        world->comm().all_reduce(mean, c10d::ReduceOp::SUM, "loss");
        if (rank == 0)
          std::cout << "{\"step\": " << s << ", \"loss\": " << mean.item<double>() / N
                    << ", \"seconds\": " << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()
                    << "}\n"
                    << std::flush;
      }
    });

    // 5. Save.
    phase("save", [&] {
      if (save.empty()) return;
      if (finetune) {
        shardtorch::save_hf_checkpoint(*root, save,
                                       shardtorch::HfSaveOptions().include_buffers(false).map_name(
                                           [](const std::string& n) -> std::optional<std::string> {
                                             if (n.find("lora_") == std::string::npos) return std::nullopt;
                                             return n;
                                           }));
      } else {
        shardtorch::save_sharded_checkpoint(*root, opt.get(), save, steps);
      }
    });
    return 0;
  } catch (...) {
    return cli::report_error("scale_gpt");
  }
}
