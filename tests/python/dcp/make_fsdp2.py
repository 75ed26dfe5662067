# Usage: torchrun --standalone --nproc_per_node=2 make_fsdp2.py <fp32|bf16> <outdir> [nocoll]
# (optional 3rd arg "nocoll": dcp.save(..., use_collectives=False) -> per-rank __<r>.metadata files)
# Builds a tiny MLP, shards it with FSDP2 (fully_shard) on a 1-D CPU mesh (gloo),
# runs one AdamW step, and saves {"model": ..., "optim": ...} from
# torch.distributed.checkpoint.state_dict.get_state_dict with dcp.save.
# Also writes <outdir>.expected.pt (rank 0, full unsharded tensors, for verification).
import os, sys, warnings
import torch, torch.nn as nn
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

warnings.filterwarnings("ignore")
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
out = sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(4, 5)      # weight [5,4]: uneven shard 3/2 rows
        self.norm = nn.LayerNorm(5)    # weight/bias [5]
        self.l1 = nn.Linear(5, 1)      # weight [1,5], bias [1]: rank 1 gets EMPTY shards
        self.register_buffer("scale", torch.tensor([2.0, 3.0]))  # persistent buffer, not sharded
    def forward(self, x):
        return self.l1(torch.relu(self.norm(self.l0(x)))) * self.scale.sum()

model = MLP().to(dtype)
mesh = init_device_mesh("cpu", (world,))
fully_shard(model.l0, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
x = torch.randn(3, 4, dtype=dtype)
model(x).sum().backward()
opt.step()
opt.zero_grad()

model_sd, optim_sd = get_state_dict(model, opt)
if rank == 0:
    def desc(v):
        if isinstance(v, DTensor):
            return f"DTensor{tuple(v.shape)} {v.dtype} placements={v.placements} local={tuple(v.to_local().shape)}"
        if isinstance(v, torch.Tensor):
            return f"Tensor{tuple(v.shape)} {v.dtype}"
        return repr(v)
    print("model_sd:")
    for k, v in model_sd.items(): print("  ", k, desc(v))
    print("optim_sd['state']:")
    for k, st in optim_sd["state"].items():
        for k2, v in st.items(): print("  ", k, k2, desc(v))
    print("optim_sd['param_groups']:", optim_sd["param_groups"])

use_coll = not (len(sys.argv) > 3 and sys.argv[3] == "nocoll")
dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out, use_collectives=use_coll)

# Reference values: full tensors gathered on every rank, saved by rank 0.
def full(v):
    if isinstance(v, DTensor): return v.full_tensor()
    return v
ref = {"model": {k: full(v) for k, v in model_sd.items()},
       "optim": {"state": {k: {k2: full(v) for k2, v in st.items()} for k, st in optim_sd["state"].items()},
                 "param_groups": optim_sd["param_groups"]}}
if rank == 0:
    torch.save(ref, out.rstrip("/") + ".expected.pt")
dist.barrier()
dist.destroy_process_group()
# End without finalizing the interpreter: a Gloo worker thread that outlives the group can
# abort Py_FinalizeEx (std::terminate; see bench/ft/torchft_ddp.py).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
