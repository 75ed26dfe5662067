"""PyTorch's tensor-parallel peer of gpt_bench --tp: trains the GPT of
examples/gpt.h (bench/peers/gpt_model.py) with DTensor's parallelize_module
and the plan of gpt::tp_plan, on CPU with Gloo, and writes the per-rank report
JSON of bench/peers/peer_train.py.

  torchrun --standalone --nproc-per-node N bench/tp/torch_tp.py --tp T [--sequence-parallel] \
      [--init FILE] [--report PREFIX] [model and run options of peer_train.py]

The ranks form a mesh (dp, tp) = (N/T, T), row-major (init_device_mesh), as
shardtorch's DeviceMesh {dp, tp}. The model is split over tp by
parallelize_module; with dp > 1 it is then sharded over dp by FSDP2
(fully_shard per block and at the root, over mesh["dp"]: FSDP2 x TP, 2-D).
Data-parallel replica d reads batch_tokens(step, d, dp): --batch rows per
replica, the same on every rank of its tensor-parallel group.

The plan, as gpt::tp_plan (the layouts as torchtitan writes them):
  tok_emb       RowwiseParallel (vocabulary-split embedding; output Replicate, or Shard(1) under SP)
  blocks.*.qkv  ColwiseParallel (see the fused qkv below)
  blocks.*.proj RowwiseParallel (output Replicate, or Shard(1) under SP)
  blocks.*.fc1  ColwiseParallel
  blocks.*.fc2  RowwiseParallel
  head          ColwiseParallel(output Shard(-1), use_local_output=False): the logits stay split by
                vocabulary and the loss runs under loss_parallel()
with --sequence-parallel also SequenceParallel on blocks.*.ln1, blocks.*.ln2
and ln_f, and the position embedding's output [T, d] split along the sequence
(PrepareModuleOutput Replicate -> Shard(0)), as shardtorch's shard_output(0).

The fused qkv: shardtorch splits each of Q, K and V across the group
(TpStyle::colwise().parts(3)), while ColwiseParallel gives rank r the
contiguous rows [r 3d/T, (r+1) 3d/T) of the weight. So the rows of the loaded
weight are permuted before parallelizing, [Q; K; V] -> [Q_0; K_0; V_0; Q_1;
K_1; V_1; ...] (Q_r: rank r's d/T rows of Q), and each rank's contiguous rows
are its Q, K and V slices; the block's forward then chunks the local output
in 3 and takes the number of heads from it, as gpt.h's does. The permutation
changes no arithmetic: each output feature is the same dot product.

The tied LM head: gpt_model's TiedHead is replaced by an nn.Linear without
bias on the same weight (ColwiseParallel takes nn.Linear and nn.Embedding
only). tok_emb (RowwiseParallel on an Embedding) and head (ColwiseParallel on
a Linear) both shard the [vocab, d] weight as Shard(0) over
tp, so after parallelize_module the head's own DTensor is dropped and
head.weight set to tok_emb's DTensor parameter again: one parameter, split
once by vocabulary, as shardtorch's TiedLinear. FSDP2 then shards it once, in
the root's group.

Report (rank r writes PREFIX.rank{r}.json): peer_train.py's keys (impl
"torch_tp", losses: the mean over dp replicas of each step's loss, step_ms,
p50/p95, phases) plus the mesh's shape."""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "peers"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpt_model import GPT, Block, add_run_args, batch_tokens, count_params  # noqa: E402
from peer_train import current_rss_bytes, load_init, percentile, run_report, write_report  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel ranks (must divide the world size)")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron-LM's sequence parallelism")
    add_run_args(p)
    p.add_argument("--init", metavar="FILE", help="initial weights (safetensors full state dict), loaded strictly")
    p.add_argument("--report", metavar="PREFIX", help="rank r writes PREFIX.rank{r}.json")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    a = p.parse_args(argv)
    if a.d_model % a.heads != 0:
        p.error(f"--d-model {a.d_model} is not a multiple of --heads {a.heads}")
    return a


class TPBlock(Block):
    """gpt_model.Block whose forward takes the heads and the sequence length
    from qkv's output (this rank's heads; under sequence parallelism the whole
    sequence, while x holds a slice of it), as gpt.h's Block does."""

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        B, T = q.shape[0], q.shape[1]
        D = self.head_dim
        q = q.view(B, T, -1, D).transpose(1, 2)
        k = k.view(B, T, -1, D).transpose(1, 2)
        v = v.view(B, T, -1, D).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / (D ** 0.5)
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, -1)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def permute_qkv(weight, tp):
    """[Q; K; V] (each [d, d]) -> each rank's Q, K and V rows contiguous."""
    three_d, d = weight.shape
    return weight.reshape(3, tp, three_d // (3 * tp), d).transpose(0, 1).reshape(three_d, d).contiguous()


def tp_plan(n_layer, sp):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel)

    between = Shard(1) if sp else Replicate()  # the activations between blocks
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(n_layer):
        b = f"blocks.{i}."
        plan[b + "qkv"] = ColwiseParallel(input_layouts=between)
        plan[b + "proj"] = RowwiseParallel(output_layouts=between)
        plan[b + "fc1"] = ColwiseParallel(input_layouts=between)
        plan[b + "fc2"] = RowwiseParallel(output_layouts=between)
        if sp:
            plan[b + "ln1"] = SequenceParallel()
            plan[b + "ln2"] = SequenceParallel()
    if sp:
        plan["ln_f"] = SequenceParallel()
        plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    return plan


def build(a, mesh, dp):
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = GPT(vocab=a.vocab, seq_len=a.seq, d_model=a.d_model, n_head=a.heads, n_layer=a.layers)
    if a.init:
        load_init(model, a.init)
    n_params = count_params(model)
    for block in model.blocks:
        block.__class__ = TPBlock
        block.head_dim = a.d_model // a.heads
        with torch.no_grad():
            block.qkv.weight.copy_(permute_qkv(block.qkv.weight, a.tp))
    # ColwiseParallel takes an nn.Linear only: the head becomes one, on the same weight.
    model.head = torch.nn.Linear(a.d_model, a.vocab, bias=False)
    model.head.weight = model.tok_emb.weight
    parallelize_module(model, mesh["tp"], tp_plan(a.layers, a.sequence_parallel))
    model.head.weight = model.tok_emb.weight  # tie again: one DTensor, Shard(0) over tp for both
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=True)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=True)
    return model, n_params


def train(a):
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("torch_tp: launch with torchrun (RANK/WORLD_SIZE not set)", file=sys.stderr)
        return 2
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % a.tp:
        print(f"torch_tp: --tp {a.tp} does not divide the world's {world} ranks", file=sys.stderr)
        return 2
    dp = world // a.tp
    mesh = init_device_mesh("cpu", (dp, a.tp), mesh_dim_names=("dp", "tp"))
    d = mesh.get_local_rank("dp")
    baseline_rss = current_rss_bytes()
    model, n_params = build(a, mesh, dp)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            foreach=False, fused=a.fused_adam or None)
    dp_group = mesh.get_group("dp") if dp > 1 else None

    losses, step_ms, phases = [], [], {"forward": [], "backward": [], "optimizer": []}
    for s in range(a.warmup + a.steps):
        tokens = batch_tokens(s, d, dp, a.batch, a.seq, a.vocab)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with loss_parallel():
            logits = model(tokens)  # DTensor [B, T, V], Shard(-1): this rank's vocabulary
            V = logits.shape[-1]
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))
            t_fwd = time.perf_counter()
            loss.backward()
        t_bwd = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        if s >= a.warmup:
            step_ms.append((t1 - t0) * 1e3)
            phases["forward"].append((t_fwd - t0) * 1e3)
            phases["backward"].append((t_bwd - t_fwd) * 1e3)
            phases["optimizer"].append((t1 - t_bwd) * 1e3)
        mean = loss.detach()
        mean = (mean.full_tensor() if hasattr(mean, "full_tensor") else mean).double().reshape(1).clone()
        if dp_group is not None:
            dist.all_reduce(mean, group=dp_group)
        losses.append(mean.item() / dp)

    report = run_report("torch_tp", a, world, rank, n_params, losses, step_ms, phases, dp, baseline_rss)
    report.update({"tp": a.tp, "dp": dp, "sequence_parallel": a.sequence_parallel,
                   "dp_mode": "fsdp2" if dp > 1 else None})
    write_report(a.report, rank, report)
    if rank == 0:
        print(f"torch_tp dp {dp} x tp {a.tp}{' sp' if a.sequence_parallel else ''} params={n_params} "
              f"p50={report['p50_ms']:.2f} ms loss[0]={losses[0]:.6f} loss[-1]={losses[-1]:.6f}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    rc = train(parse_args())
    # As peer_train.py: torch 2.13's Gloo can abort in the interpreter's
    # teardown after everything is done; skip the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
