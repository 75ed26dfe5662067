"""PyTorch's pipelining peer of shardtorch::Pipeline: trains the GPT of
examples/gpt.h (bench/peers/gpt_model.py) cut into the same pipeline stages
with torch.distributed.pipelining (PipelineStage + ScheduleGPipe /
Schedule1F1B / ScheduleInterleaved1F1B) on CPU with Gloo, and writes the
per-rank report JSON of bench/peers/peer_train.py.

  torchrun --standalone --nproc-per-node N bench/pipeline/torch_pipeline.py \
      --pp P --schedule gpipe|1f1b|interleaved_1f1b --microbatches M [--chunks V] \
      [--split-at blocks.2,blocks.5] [--dp-mode ddp|fsdp2] [--init FILE] [--report PREFIX] \
      [model and run options of peer_train.py]

The ranks form a mesh (pp, dp) = (P, N/P), row-major: ranks 0..dp-1 are
pipeline rank 0. Each data-parallel coordinate d runs one pipeline; with
dp > 1 each stage module is wrapped over its dp group by DDP (default) or
FSDP2 (--dp-mode fsdp2), which the pipelining stage drives (no_sync /
set_requires_gradient_sync until the last micro-batch).

Layers and stages, as shardtorch's gpt::pipeline_layers and Pipeline:
  layers: embed (tok_emb + pos_emb), blocks.0 .. blocks.{L-1}, head (ln_f + head)
  P x V stages (V = --chunks), stage s on pipeline rank s % P (PyTorch's
  "loop" placement is the same); the layers are cut into contiguous stages
  whose largest parameter count is as small as possible (the same dynamic
  program and tie-breaking as shardtorch's balanced_split; the tied weight
  counts in the embed layer only), or at --split-at (the first layer of each
  stage after the first). Each stage module holds its modules under their
  names in the unsplit GPT (blocks.3.fc1.weight ...), so --init loads by name.

Loss and gradients: the last stage computes the mean next-token cross entropy
of each micro-batch and weights it by the micro-batch's share of the rows
(rows_i / batch, 1/M since PyTorch needs equal micro-batches), with the
schedule's scale_grads=False: the gradients are those of the mean loss over
the pipeline's whole batch, as shardtorch's step and single-process training
compute them (scale_grads=True, PyTorch's default, divides by M after the
backwards instead: the same for equal micro-batches, but it would divide a
weight shared by two stages of one rank twice). The step's loss is the sum of
the weighted micro-batch losses; the report holds its mean over the dp
pipelines on every rank.

The tied weight (tok_emb.weight = head.weight): torch.distributed.pipelining
has no support for a parameter shared by stages on different ranks, so the
tie is done by hand as Megatron-LM does for its word embeddings: the rank
holding the embed stage and the rank holding the head stage each keep a copy
(loaded from the same values; checked equal at start), and after each step's
backwards (after the dp reduction) the two copies' gradients are summed by an
all-reduce over a group of those two ranks (one group per dp coordinate),
before the optimizer step, so both copies take the same update and stay
equal. Stages of one rank holding both ends (P = 1) share the tensor itself.

Report (rank r writes PREFIX.rank{r}.json): peer_train.py's keys (impl
"torch_pipeline", losses, step_ms, p50/p95, tokens_per_s over the whole job,
peak RSS, model state bytes ...) plus the pipeline's shape, the stages, and
per-step phases: "pipeline" (the schedule's step), "tied" (the tie's
all-reduce), "optimizer", and this rank's compute inside the schedule:
"forward" (stage forwards and the loss) and "backward" (stage backwards), so
"idle" = pipeline - forward - backward (the bubble plus transfers)."""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "peers"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from gpt_model import GPT, TiedHead, add_run_args, batch_tokens, lm_loss  # noqa: E402
from peer_train import StateBytes, current_rss_bytes, percentile, run_report, write_report  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks (must divide the world size)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (must divide --batch)")
    p.add_argument("--chunks", type=int, default=1, help="stages per pipeline rank (interleaved_1f1b: 2 or more)")
    p.add_argument("--split-at", default="", metavar="NAME,NAME",
                   help="first layer of each stage after the first (layers: embed, blocks.i, head); "
                        "default: balanced by parameter count, as shardtorch")
    p.add_argument("--dp-mode", choices=["ddp", "fsdp2"], default="ddp",
                   help="how a stage is replicated over its dp group when world > pp")
    add_run_args(p)
    p.add_argument("--init", metavar="FILE", help="initial weights (safetensors full state dict, peer_train.py "
                                                  "--save-init or gpt_bench --save-init)")
    p.add_argument("--report", metavar="PREFIX", help="rank r writes PREFIX.rank{r}.json")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0, help="seed for the model when no --init is given")
    p.add_argument("--print-losses", action="store_true", help="rank 0 prints every step's loss")
    p.add_argument("--check-grads", action="store_true",
                   help="at step 0 compare every gradient (after the tie's all-reduce) with a single-process "
                        "GPT's on the whole step's batch (every pipeline's rows); reported as grad_check")
    a = p.parse_args(argv)
    if a.d_model % a.heads != 0:
        p.error(f"--d-model {a.d_model} is not a multiple of --heads {a.heads}")
    if a.seq < 2:
        p.error("--seq must be at least 2 (next-token loss)")
    if a.pp < 1 or a.chunks < 1 or a.microbatches < 1:
        p.error("--pp, --chunks and --microbatches must be positive")
    if a.schedule == "interleaved_1f1b":
        if a.chunks < 2:
            p.error("interleaved_1f1b needs --chunks 2 or more")
        if a.microbatches % a.pp != 0:
            p.error(f"interleaved_1f1b needs --microbatches a multiple of --pp ({a.microbatches} % {a.pp} != 0)")
    elif a.chunks != 1:
        p.error(f"--schedule {a.schedule} runs one stage per rank: --chunks must be 1")
    if a.batch % a.microbatches != 0:
        # PyTorch's stages receive into buffers of one fixed shape (the first
        # micro-batch's): unequal micro-batches fail in the transfers.
        p.error(f"--batch {a.batch} is not a multiple of --microbatches {a.microbatches} "
                "(torch.distributed.pipelining needs equal micro-batches)")
    a.split_at = [s for s in a.split_at.split(",") if s] if a.split_at else []
    return a


# ---- layers and the split -------------------------------------------------

def layer_names(n_layer):
    return ["embed"] + [f"blocks.{i}" for i in range(n_layer)] + ["head"]


def layer_weights(a):
    """Parameters per layer, each tensor counted in the first layer holding it
    (the tied weight in embed), as shardtorch's Pipeline counts them."""
    d, v, t = a.d_model, a.vocab, a.seq
    block = 3 * d * d + (d * d + d) + 2 * d + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
    return [v * d + t * d] + [block] * a.layers + [2 * d]


def balanced_split(weight, stages):
    """First layer of each of `stages` contiguous parts minimising the largest
    part's sum: shardtorch's detail::balanced_split, the same tie-breaking
    (the smallest last-part start among equal optima, strict <)."""
    n = len(weight)
    prefix = [0]
    for w in weight:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == inf:
                    continue
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i]:
                    best[s][i] = v
                    cut[s][i] = j
    starts = [0] * stages
    i = n
    for s in range(stages, 0, -1):
        starts[s - 1] = cut[s][i]
        i = cut[s][i]
    return starts


def stage_layers(a):
    names = layer_names(a.layers)
    n, stages = len(names), a.pp * a.chunks
    if n < stages:
        raise SystemExit(f"torch_pipeline: {n} layers cannot fill {stages} stages ({a.pp} pipeline ranks x "
                         f"{a.chunks} chunks)")
    if not a.split_at:
        starts = balanced_split(layer_weights(a), stages)
    else:
        if len(a.split_at) != stages - 1:
            raise SystemExit(f"torch_pipeline: --split-at names {len(a.split_at)} layers; {stages} stages need "
                             f"{stages - 1}")
        starts = [0]
        for name in a.split_at:
            if name not in names:
                raise SystemExit(f"torch_pipeline: --split-at names layer '{name}', which is not one of the "
                                 f"layers ({', '.join(names)})")
            at = names.index(name)
            if at <= starts[-1]:
                raise SystemExit(f"torch_pipeline: --split-at: layer '{name}' does not come after the previous "
                                 "split point")
            starts.append(at)
    bounds = starts + [n]
    return [names[bounds[s]:bounds[s + 1]] for s in range(stages)]


class StageModule(nn.Module):
    """The layers of one stage, each module under its name in the unsplit GPT."""

    def __init__(self, layers, gpt, head_weight):
        super().__init__()
        self.layers = list(layers)
        self.has_embed = "embed" in layers
        self.has_head = "head" in layers
        if self.has_embed:
            self.tok_emb = gpt.tok_emb
            self.pos_emb = gpt.pos_emb
        ids = [int(n.split(".")[1]) for n in layers if n.startswith("blocks.")]
        if ids:
            self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in ids})
        if self.has_head:
            self.ln_f = gpt.ln_f
            self.head = TiedHead(head_weight)

    def forward(self, x):
        if self.has_embed:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos).unsqueeze(0)
        if hasattr(self, "blocks"):
            for block in self.blocks.values():  # insertion order = layer order
                x = block(x)
        if self.has_head:
            x = self.head(self.ln_f(x))
        return x


def materialize(modules, source):
    """Replace the meta parameters of `modules` by CPU parameters holding
    source(name); a parameter shared by several modules stays one tensor."""
    made = {}
    for m in modules:
        for prefix, sub in m.named_modules():
            for key, p in list(sub._parameters.items()):
                if p is None:
                    continue
                if id(p) not in made:
                    name = f"{prefix}.{key}" if prefix else key
                    value = source(name)
                    if tuple(value.shape) != tuple(p.shape):
                        raise SystemExit(f"torch_pipeline: {name}: shape {tuple(value.shape)} in the initial "
                                         f"weights, {tuple(p.shape)} in the model")
                    made[id(p)] = nn.Parameter(value.detach().to(torch.float32).clone().contiguous())
                sub._parameters[key] = made[id(p)]


def full(t):
    """The whole tensor behind an FSDP2 DTensor (a collective over its dp
    group), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def check_grads(a, stage_mods, step, dp):
    """The largest difference between this rank's gradients and those of the
    unsplit GPT on every pipeline's rows of the step (the mean loss over them,
    the gradient a dp x pipeline run must reproduce), by parameter name."""
    torch.manual_seed(a.seed)
    ref = GPT(vocab=a.vocab, seq_len=a.seq, d_model=a.d_model, n_head=a.heads, n_layer=a.layers)
    if a.init:
        from safetensors.torch import load_file

        ref.load_state_dict(load_file(a.init), strict=True)
    tokens = torch.cat([batch_tokens(step, d, dp, a.batch, a.seq, a.vocab) for d in range(dp)])
    lm_loss(ref(tokens), tokens).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    worst_abs, worst_rel, worst_name, n = 0.0, 0.0, None, 0
    for m in stage_mods:
        for name, p in m.named_parameters(remove_duplicate=False):
            g = full(p.grad) if p.grad is not None else torch.zeros_like(full(p.detach()))
            r = ref_grads[name]
            d = (g - r).abs().max().item()
            rel = d / max(r.abs().max().item(), 1e-30)
            n += 1
            if d > worst_abs:
                worst_abs, worst_name = d, name
            worst_rel = max(worst_rel, rel)
    return {"tensors": n, "max_abs_diff": worst_abs, "max_rel_diff": worst_rel, "worst": worst_name}


def tied_diff(tied, group):
    """Largest difference between the tied weight's copies across the tie's
    ranks (0 when they stayed equal, as they must)."""
    if group is None:
        return None
    with torch.no_grad():
        w = full(tied[0].detach()).clone()
        hi, lo = w.clone(), w.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        return (hi - lo).abs().max().item()


# ---- the run --------------------------------------------------------------

def main():
    a = parse_args()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("torch_pipeline: launch with torchrun (RANK/WORLD_SIZE not set)", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % a.pp != 0:
        if rank == 0:
            print(f"torch_pipeline: --pp {a.pp} does not divide the world's {world} ranks", file=sys.stderr)
        return 2
    dp = world // a.pp
    baseline_rss = current_rss_bytes()
    device = torch.device("cpu")

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    mesh = init_device_mesh("cpu", (a.pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    pp_group = mesh.get_group("pp")

    layers = stage_layers(a)
    S = len(layers)
    mine = [s for s in range(S) if s % a.pp == pp_rank]
    first_rank, last_rank = 0, (S - 1) % a.pp  # pipeline ranks holding embed and head
    if rank == 0:
        print(f"torch_pipeline: {a.schedule}, pp={a.pp} dp={dp} ({a.dp_mode if dp > 1 else 'no dp'}), "
              f"{a.microbatches} micro-batches of {a.batch // a.microbatches} rows, {a.chunks} chunk(s)/rank")
        w = layer_weights(a)
        names = layer_names(a.layers)
        for s, ls in enumerate(layers):
            print(f"  stage {s} (pipeline rank {s % a.pp}): {' '.join(ls)}  "
                  f"[{sum(w[names.index(n)] for n in ls)} params]")
        if first_rank != last_rank:
            print(f"  tied across stages: tok_emb.weight = head.weight (pipeline ranks {first_rank} and "
                  f"{last_rank}; gradients summed after each step)")
    if first_rank == last_rank and S > 1 and dp > 1:  # the same on every rank: all stop
        if rank == 0:
            print("torch_pipeline: embed and head in two stages of one rank would share the tied weight between "
                  "two dp-wrapped stage modules; unsupported (use --pp 2 or more, or dp = 1)", file=sys.stderr)
        return 2

    # The GPT on the meta device (nothing allocated), this rank's stage modules
    # over its modules, then only their parameters materialised.
    with torch.device("meta"):
        gpt = GPT(vocab=a.vocab, seq_len=a.seq, d_model=a.d_model, n_head=a.heads, n_layer=a.layers)
    n_params = sum(p.numel() for p in gpt.parameters())
    holds_embed = any("embed" in layers[s] for s in mine)
    # The head's weight: the embedding's own tensor when this rank holds both
    # ends, else a copy (Megatron-LM's tied word embeddings).
    head_weight = gpt.tok_emb.weight if holds_embed else nn.Parameter(torch.empty_like(gpt.tok_emb.weight))
    stage_mods = [StageModule(layers[s], gpt, head_weight) for s in mine]

    if a.init:
        from safetensors import safe_open

        with safe_open(a.init, framework="pt") as f:
            keys = set(f.keys())
            needed = {n for m in stage_mods for n in m.state_dict().keys()}
            missing = sorted(needed - keys)
            if missing:
                raise SystemExit(f"torch_pipeline: {a.init} lacks {missing}")
            if any(m.has_head for m in stage_mods) and not torch.equal(f.get_tensor("head.weight"),
                                                                       f.get_tensor("tok_emb.weight")):
                raise SystemExit(f"torch_pipeline: {a.init}: head.weight differs from tok_emb.weight, but they are "
                                 "tied")
            materialize(stage_mods, f.get_tensor)
    else:
        torch.manual_seed(a.seed)  # the whole model, as peer_train.py builds it, then this rank's part
        full = GPT(vocab=a.vocab, seq_len=a.seq, d_model=a.d_model, n_head=a.heads, n_layer=a.layers)
        state = full.state_dict()
        materialize(stage_mods, lambda name: state[name])
        del full, state
    del gpt

    # The tie's groups: for each dp coordinate, the ranks holding embed and head.
    tie_group = None
    if first_rank != last_rank:
        for d in range(dp):
            g = dist.new_group([first_rank * dp + d, last_rank * dp + d])
            if d == dp_rank and pp_rank in (first_rank, last_rank):
                tie_group = g
    tied = []  # this rank's copies of the tied weight
    if tie_group is not None:
        for m in stage_mods:
            if m.has_embed:
                tied.append(m.tok_emb.weight)
            if m.has_head:
                tied.append(m.head.weight)
        with torch.no_grad():  # the copies start equal (shardtorch checks the same)
            hi, lo = tied[0].detach().clone(), tied[0].detach().clone()
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=tie_group)
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=tie_group)
            if not torch.equal(hi, lo):
                raise SystemExit("torch_pipeline: the tied weight's copies differ across ranks")

    # Data parallelism over the dp group, one wrapper per stage module.
    submods = list(stage_mods)
    if dp > 1:
        dp_group = mesh.get_group("dp")
        if a.dp_mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            submods = [DDP(m, process_group=dp_group) for m in stage_mods]
        else:
            from torch.distributed.fsdp import fully_shard

            dp_mesh = mesh["dp"]
            for m in stage_mods:
                if hasattr(m, "blocks"):
                    for b in m.blocks.values():
                        fully_shard(b, mesh=dp_mesh, reshard_after_forward=True)
                fully_shard(m, mesh=dp_mesh, reshard_after_forward=True)
        if tie_group is not None:  # the wrappers may have replaced the parameters (FSDP2: DTensors)
            tied = [m.tok_emb.weight for m in stage_mods if m.has_embed] + \
                   [m.head.weight for m in stage_mods if m.has_head]

    # Stages with static shapes (no metadata inference pass): each micro-batch
    # is [rows, seq] tokens into the first stage, [rows, seq, d_model]
    # activations between stages, [rows, seq, vocab] logits out of the last.
    mb = a.batch // a.microbatches

    def act(width):
        return torch.empty(mb, a.seq, width, requires_grad=True)

    stages = []
    for s, m in zip(mine, submods):
        inp = torch.zeros(mb, a.seq, dtype=torch.int64) if s == 0 else act(a.d_model)
        out = act(a.vocab) if s == S - 1 else act(a.d_model)
        stages.append(PipelineStage(m, s, S, device, input_args=inp, output_args=out, group=pp_group))

    timers = {"forward": 0.0, "backward": 0.0}

    def timed(fn, key):
        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                timers[key] += time.perf_counter() - t
        return wrapper

    for st in stages:  # this rank's compute inside the schedule
        st.forward_one_chunk = timed(st.forward_one_chunk, "forward")
        st.backward_one_chunk = timed(st.backward_one_chunk, "backward")

    def loss_fn(logits, target):
        # shardtorch's weighting: the micro-batch's share of the pipeline's rows
        t = time.perf_counter()
        loss = lm_loss(logits, target) * (target.shape[0] / a.batch)
        timers["forward"] += time.perf_counter() - t
        return loss

    if a.schedule == "gpipe":
        sched = ScheduleGPipe(stages[0], a.microbatches, loss_fn=loss_fn, scale_grads=False)
    elif a.schedule == "1f1b":
        sched = Schedule1F1B(stages[0], a.microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        sched = ScheduleInterleaved1F1B(stages, a.microbatches, loss_fn=loss_fn, scale_grads=False)

    params = []
    seen = set()
    for m in submods:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    stage_params = sum(p.numel() for p in params)  # copies of the tied weight each counted where held
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            foreach=False, fused=a.fused_adam or None)

    grad_check = None
    is_first = 0 in mine
    is_last = (S - 1) in mine
    losses, step_ms = [], []
    phases = {k: [] for k in ("pipeline", "forward", "backward", "idle", "tied", "optimizer")}
    for step in range(a.warmup + a.steps):
        tokens = batch_tokens(step, dp_rank, dp, a.batch, a.seq, a.vocab) if (is_first or is_last) else None
        dist.barrier()
        timers["forward"] = timers["backward"] = 0.0
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        mb_losses = []
        args = (tokens,) if is_first else ()
        kwargs = {"target": tokens, "losses": mb_losses} if is_last else {}
        sched.step(*args, **kwargs, return_outputs=False)
        t1 = time.perf_counter()
        if tie_group is not None:
            with torch.no_grad():
                g = tied[0].grad
                g = g._local_tensor if hasattr(g, "_local_tensor") else g  # FSDP2: this rank's shard, in place
                dist.all_reduce(g, group=tie_group)  # the two copies' gradients summed
                for other in tied[1:]:  # a rank holding both ends (chunks) shares one tensor: nothing more
                    if other is not tied[0]:
                        o = other.grad
                        (o._local_tensor if hasattr(o, "_local_tensor") else o).copy_(g)
        t2 = time.perf_counter()
        if a.check_grads and step == 0:
            grad_check = check_grads(a, stage_mods, step, dp)
        opt.step()
        t3 = time.perf_counter()
        if step >= a.warmup:
            step_ms.append((t3 - t0) * 1e3)
            phases["pipeline"].append((t1 - t0) * 1e3)
            phases["forward"].append(timers["forward"] * 1e3)
            phases["backward"].append(timers["backward"] * 1e3)
            phases["idle"].append((t1 - t0 - timers["forward"] - timers["backward"]) * 1e3)
            phases["tied"].append((t2 - t1) * 1e3)
            phases["optimizer"].append((t3 - t2) * 1e3)
        # the pipeline's loss (sum of the weighted micro-batch losses), mean over the dp pipelines
        mine_loss = torch.zeros(1, dtype=torch.float64)
        if is_last:
            mine_loss[0] = float(sum(l.detach().float() for l in mb_losses).item())
        dist.all_reduce(mine_loss)
        losses.append(mine_loss.item() / dp)
        if a.print_losses and rank == 0:
            print(f"step {step} loss {losses[-1]:.9f}", flush=True)

    acc = StateBytes()
    parts = {}
    for name, tensors in (("param", params), ("grad", [p.grad for p in params]),
                          ("optim", [v for st in opt.state.values() for v in st.values()])):
        before = acc.storage
        for t in tensors:
            acc.add(t)
        parts[name] = acc.storage - before
    # every pipeline's batch: dp x batch rows per step
    report = run_report("torch_pipeline", a, world, rank, n_params, losses, step_ms, phases, dp, baseline_rss, config={
        "pp": a.pp, "dp": dp, "schedule": a.schedule, "microbatches": a.microbatches, "chunks": a.chunks,
        "dp_mode": a.dp_mode if dp > 1 else None, "split_at": a.split_at, "lr": a.lr,
    })
    report.update({
        "stages": [{"stage": s, "pipeline_rank": s % a.pp, "layers": ls} for s, ls in enumerate(layers)],
        "pipeline_rank": pp_rank,
        "dp_rank": dp_rank,
        "my_stages": mine,
        "stage_params": stage_params,
        "tied_copies_max_diff": tied_diff(tied, tie_group),
        "grad_check": grad_check,
        "idle_share_p50": percentile([i / p for i, p in zip(phases["idle"], phases["pipeline"]) if p > 0], 50),
        "model_state_bytes": acc.storage,
        "model_state_tensor_bytes": acc.tensor,
        "model_state_parts": parts,
        "device": str(device),
    })
    write_report(a.report, rank, report)
    if rank == 0:
        ph = report["phase_p50_ms"]
        print(f"torch_pipeline {a.schedule} world={world} pp={a.pp} dp={dp} params={n_params} "
              f"p50={report['p50_ms']:.2f} ms (rank 0: fwd {ph['forward']:.2f} bwd {ph['backward']:.2f} "
              f"idle {ph['idle']:.2f} tied {ph['tied']:.2f} opt {ph['optimizer']:.2f}) "
              f"tokens/s={report['tokens_per_s']:.0f} loss[0]={losses[0]:.9f} loss[-1]={losses[-1]:.9f}")
    if grad_check is not None:
        print(f"rank {rank} grad check (step 0, {grad_check['tensors']} tensors vs unsplit GPT): max abs diff "
              f"{grad_check['max_abs_diff']:.3g} ({grad_check['worst']}), max rel {grad_check['max_rel_diff']:.3g}; "
              f"tied copies differ by {report['tied_copies_max_diff']}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    rc = main()
    # As peer_train.py: skip the interpreter's teardown, where torch 2.13's
    # Gloo can abort after a run that did everything (pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
