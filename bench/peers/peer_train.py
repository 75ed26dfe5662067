"""PyTorch peers of build/bench/gpt_bench: trains the GPT of examples/gpt.h with
DistributedDataParallel or FSDP2 (fully_shard) on CPU with Gloo (or, with
--device cuda, on each rank's GPU with NCCL) and writes the same per-rank
report JSON the C++ driver writes.

  torchrun --standalone --nproc-per-node N bench/peers/peer_train.py --mode ddp|fsdp2 [options]
  python bench/peers/peer_train.py --save-init FILE [model options]   (single process)

--save-init writes a freshly seeded model's full state dict as safetensors
(head.weight stored as its own copy of tok_emb.weight) and exits; run_peers.py
uses it when the C++ binary is not there (--python-only)."""
import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gpt_model import GPT, add_run_args, batch_tokens, count_params, lm_loss  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["ddp", "fsdp2"])
    add_run_args(p)
    p.add_argument("--bf16", action="store_true",
                   help="FSDP2: MixedPrecisionPolicy(param and reduce bf16, output fp32); refused for DDP")
    p.add_argument("--init", metavar="FILE", help="initial weights (safetensors full state dict), loaded strictly")
    p.add_argument("--report", metavar="PREFIX", help="rank r writes PREFIX.rank{r}.json")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--save-init", metavar="FILE", help="write a seeded model's weights and exit (no torchrun)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: GPU LOCAL_RANK over NCCL; AdamW then takes PyTorch's CUDA default (foreach)")
    p.add_argument("--seed", type=int, default=0, help="seed for the model when no --init is given / for --save-init")
    a = p.parse_args(argv)
    if a.save_init is None and a.mode is None:
        p.error("--mode ddp|fsdp2 is required (or --save-init FILE)")
    if a.d_model % a.heads != 0:
        p.error(f"--d-model {a.d_model} is not a multiple of --heads {a.heads}")
    if a.seq < 2:
        p.error("--seq must be at least 2 (next-token loss)")
    return a


def build_model(a):
    torch.manual_seed(a.seed)
    return GPT(vocab=a.vocab, seq_len=a.seq, d_model=a.d_model, n_head=a.heads, n_layer=a.layers)


def save_init(a):
    from safetensors.torch import save_file

    model = build_model(a)
    # safetensors refuses tensors that share memory; the head gets its own copy
    # (the C++ driver's full state dict has the same two keys).
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    assert "head.weight" in state and "tok_emb.weight" in state
    os.makedirs(os.path.dirname(os.path.abspath(a.save_init)), exist_ok=True)
    save_file(state, a.save_init)
    print(f"peer_train: wrote {len(state)} tensors, {count_params(model)} parameters to {a.save_init}")


def load_init(model, path):
    from safetensors.torch import load_file

    state = load_file(path)
    # strict: every key of the model (tok_emb.weight and head.weight both) must be there, nothing else
    model.load_state_dict(state, strict=True)
    if not torch.equal(state["head.weight"], state["tok_emb.weight"]):
        raise SystemExit(f"peer_train: {path}: head.weight differs from tok_emb.weight, but they are tied")


def local(t):
    """The rank-local tensor behind a DTensor (FSDP2 shards), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class StateBytes:
    """Bytes held by tensors, each underlying storage counted once (so a tied
    weight, or gradients that are views into one reduce-scatter output, count
    once, and shard padding counts), plus the plain sum of tensor sizes."""

    def __init__(self):
        self.storages = set()
        self.tensors = set()
        self.storage = 0
        self.tensor = 0

    def add(self, t):
        if t is None or not isinstance(t, torch.Tensor):
            return
        t = local(t)
        tkey = (t.data_ptr(), t.numel(), t.dtype)
        if tkey not in self.tensors:
            self.tensors.add(tkey)
            self.tensor += t.numel() * t.element_size()
        s = t.untyped_storage()
        skey = (s.data_ptr(), s.nbytes())
        if skey not in self.storages:
            self.storages.add(skey)
            self.storage += s.nbytes()


def model_state_bytes(model, optimizer):
    acc = StateBytes()
    parts = {}
    params = list(model.parameters())  # deduplicated: the tied weight once
    for name, tensors in (
        ("param", params),
        ("grad", [p.grad for p in params]),
        ("optim", [v for st in optimizer.state.values() for v in st.values()]),
    ):
        before = acc.storage
        for t in tensors:
            acc.add(t)
        parts[name] = acc.storage - before
    return acc.storage, acc.tensor, parts


def comm_buffer_bytes(model, mode):
    """DDP keeps its gradient buckets (flat copies of the gradients, since
    gradient_as_bucket_view is False by default) for the life of the model;
    they are not gradients, so they sit outside model_state_bytes. FSDP2
    frees its reduce-scatter buffers after each backward: 0."""
    if mode != "ddp":
        return 0
    try:
        sizes = model._get_ddp_logging_data().get("bucket_sizes", "")
        return sum(int(x) for x in str(sizes).replace(",", " ").split())
    except Exception:  # private API; the report just lacks the figure
        return None


def current_rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def percentile(xs, q):
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def run_report(impl, a, world, rank, n_params, losses, step_ms, phases, replicas, baseline_rss,
               dtype="float32", config=None):
    """The keys every PyTorch peer's report shares with gpt_bench's: the run,
    its config (plus `config`), the losses, step times and phases, tokens per
    second over the `replicas` that each read a.batch rows a step, memory."""
    mean_s = statistics.fmean(step_ms) / 1e3 if step_ms else float("nan")
    return {
        "impl": impl,
        "world": world,
        "rank": rank,
        "config": {
            "vocab": a.vocab, "seq_len": a.seq, "d_model": a.d_model, "n_head": a.heads,
            "n_layer": a.layers, "batch": a.batch, "dtype": dtype, **(config or {}),
        },
        "params": n_params,
        "warmup": a.warmup,
        "steps": a.steps,
        "losses": losses,
        "step_ms": step_ms,
        "p50_ms": percentile(step_ms, 50),
        "p95_ms": percentile(step_ms, 95),
        "phase_p50_ms": {k: percentile(v, 50) for k, v in phases.items()},
        "tokens_per_s": replicas * a.batch * a.seq / mean_s,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "baseline_rss_bytes": baseline_rss,
        "threads": a.threads,
        "fused_adam": a.fused_adam,
        "torch": torch.__version__,
    }


def write_report(prefix, rank, report):
    """PREFIX.rank{rank}.json, as gpt_bench --report writes it; nothing without a prefix."""
    if not prefix:
        return
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(f"{prefix}.rank{rank}.json", "w") as f:
        json.dump(report, f, indent=1)


def wrap(model, a, world, device):
    if a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        if device.type == "cuda":
            return DDP(model, device_ids=[device.index])
        return DDP(model)  # CPU module: no device_ids; default 25 MiB buckets
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    kw = dict(mesh=mesh, reshard_after_forward=True)
    root_kw = dict(kw)
    if a.bf16:
        # Blocks pass bf16 on; only the root returns fp32 logits, as gpt_bench
        # --bf16 (MixedPrecision output_dtype kFloat applies to the root). An
        # fp32 output of the last block would reach ln_f's bf16 weight, which
        # CPU layer_norm refuses ("mixed dtype").
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        root_kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                                    output_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **root_kw)  # root group: embeddings, ln_f and the tied head
    return model


def train(a):
    if a.mode == "ddp" and a.bf16:
        print("peer_train: --bf16 is not supported with --mode ddp (DDP has no mixed-precision "
              "policy; use --mode fsdp2)", file=sys.stderr)
        return 2
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("peer_train: launch with torchrun (RANK/WORLD_SIZE not set)", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    cuda = a.device == "cuda"
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    baseline_rss = current_rss_bytes()

    model = build_model(a)
    if a.init:
        load_init(model, a.init)
    n_params = count_params(model)
    model = wrap(model.to(device), a, world, device)
    # Without --fused-adam: PyTorch's default on CPU (foreach and fused are
    # off there), spelled out so a future default cannot change the run; on
    # CUDA, PyTorch's own default (foreach).
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            foreach=None if cuda else False, fused=a.fused_adam or None)

    losses, step_ms, phases = [], [], {"forward": [], "backward": [], "optimizer": []}
    for s in range(a.warmup + a.steps):
        if cuda and s == a.warmup:
            torch.cuda.reset_peak_memory_stats(device)
        tokens = batch_tokens(s, rank, world, a.batch, a.seq, a.vocab).to(device)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(tokens), tokens)
        t_fwd = time.perf_counter()
        loss.backward()
        t_bwd = time.perf_counter()
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)  # the step, not its launch
        t1 = time.perf_counter()
        if s >= a.warmup:
            step_ms.append((t1 - t0) * 1e3)
            phases["forward"].append((t_fwd - t0) * 1e3)
            phases["backward"].append((t_bwd - t_fwd) * 1e3)
            phases["optimizer"].append((t1 - t_bwd) * 1e3)
        mean = loss.detach().float().reshape(1).clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)

    state_bytes, state_tensor_bytes, parts = model_state_bytes(model, opt)
    report = run_report(a.mode, a, world, rank, n_params, losses, step_ms, phases, world, baseline_rss,
                        dtype="bfloat16" if a.bf16 else "float32")
    report.update({
        "model_state_bytes": state_bytes,
        # extras (not in the C++ report): the breakdown, tensor sizes without
        # shard padding / shared storage
        "model_state_tensor_bytes": state_tensor_bytes,
        "model_state_parts": parts,
        "comm_buffer_bytes": comm_buffer_bytes(model, a.mode),
        "device": str(device),
        "device_peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else 0,
        "device_peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else 0,
    })
    write_report(a.report, rank, report)
    if rank == 0:
        print(f"peer_train {a.mode} world={world} params={n_params} p50={report['p50_ms']:.2f} ms "
              f"tokens/s={report['tokens_per_s']:.0f} loss[0]={losses[0]:.6f} loss[-1]={losses[-1]:.6f} "
              f"model_state={state_bytes} B device_peak={report['device_peak_allocated_bytes']} B")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main():
    a = parse_args()
    if a.save_init:
        save_init(a)
        return 0
    return train(a)


if __name__ == "__main__":
    rc = main()
    # The report is written and the process group destroyed. torch 2.13's
    # Gloo can still abort in the interpreter's teardown, about one run in
    # ten here ("terminate called without an active exception": a worker
    # thread destroyed while joinable; pytorch/pytorch#179291 discusses the
    # teardown race), which fails a run that did everything: skip the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
