"""PyTorch's side of the DCP round trips (ctest interop.dcp_round_trip_with_torch).

usage: torchrun --standalone --nproc-per-node 2 fsdp2_run.py save DIR
       torchrun --standalone --nproc-per-node 2 fsdp2_run.py load DIR

The model is tests/dcp_helpers.h's DcpMlp: l0 Linear(4, 5) (fully_shard'ed on
its own), norm LayerNorm(5), l1 Linear(5, 1), buffer scale = [2, 3], under
FSDP2 on a CPU mesh (Gloo), with AdamW(lr=1e-2, weight_decay=0.1); fp32 and
the same in bf16 (model.to(torch.bfloat16)).

save: for each dtype, one AdamW step on batch 1, then dcp.save of
  {"model": ..., "optim": ...} from get_state_dict into DIR/py_<dtype>, the
  saved values whole in DIR/py_<dtype>.saved.safetensors, then the next step
  on batch 2 (DIR/batch.safetensors, for the C++ side to take the same) and
  its parameters in DIR/py_<dtype>.next.safetensors.
load: for each dtype, a fresh model and optimizer load DIR/cpp_<dtype>
  (written by the C++ side at 3 ranks) with a strict dcp.load and
  set_state_dict, and must equal DIR/cpp_<dtype>.expected.safetensors
  bitwise; format_utils.dcp_to_torch_save converts it, nested, equal too.
Exits non-zero (an assertion) on any difference.
"""
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from interop_common import flat_values, require_equal, run

warnings.filterwarnings("ignore")
BATCH = 12
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(4, 5)
        self.norm = nn.LayerNorm(5)
        self.l1 = nn.Linear(5, 1)
        self.register_buffer("scale", torch.tensor([2.0, 3.0]))

    def forward(self, x):
        return self.l1(torch.relu(self.norm(self.l0(x)))) * self.scale.sum()


def build(dtype, world, seed):
    torch.manual_seed(seed)
    model = MLP().to(dtype)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.l0, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def step(model, opt, x, rank, world):
    rows = BATCH // world
    opt.zero_grad()
    model(x[rank * rows:(rank + 1) * rows]).pow(2).mean().backward()
    opt.step()


def save(out, rank, world):
    g = torch.Generator().manual_seed(1)
    x1 = torch.randn(BATCH, 4, generator=g)
    x2 = torch.randn(BATCH, 4, generator=g)
    if rank == 0:
        save_file({"x1": x1, "x2": x2}, os.path.join(out, "batch.safetensors"))
    for name, dtype in DTYPES.items():
        model, opt = build(dtype, world, seed=0)
        step(model, opt, x1.to(dtype), rank, world)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "py_" + name))
        saved = flat_values(model, opt)
        step(model, opt, x2.to(dtype), rank, world)
        after = {k: v for k, v in flat_values(model, opt).items() if k.startswith("model.")}
        if rank == 0:
            save_file(saved, os.path.join(out, f"py_{name}.saved.safetensors"))
            save_file(after, os.path.join(out, f"py_{name}.next.safetensors"))
        dist.barrier()


def load(out, rank, world):
    for name, dtype in DTYPES.items():
        ck = os.path.join(out, "cpp_" + name)
        want = load_file(os.path.join(out, f"cpp_{name}.expected.safetensors"))
        model, opt = build(dtype, world, seed=1)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ck)  # strict: every key the model and its AdamW have
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        require_equal(flat_values(model, opt), want, f"rank {rank}, {name}: dcp.load")
        groups = opt.state_dict()["param_groups"]
        assert groups[0]["lr"] == 1e-2 and groups[0]["weight_decay"] == 0.1, groups
        if rank == 0:
            converted = os.path.join(out, f"cpp_{name}.pt")
            dcp_to_torch_save(ck, converted)
            nested = torch.load(converted, weights_only=False)
            got = {"model." + k: v for k, v in nested["model"].items()}
            for p, st in nested["optim"]["state"].items():
                for kind, v in st.items():
                    got[f"optim.state.{p}.{kind}"] = v
            require_equal(got, want, f"{name}: dcp_to_torch_save")
            assert nested["optim"]["param_groups"][0]["params"] == [
                "l0.weight", "l0.bias", "norm.weight", "norm.bias", "l1.weight", "l1.bias"], nested["optim"]["param_groups"]
        dist.barrier()
        if rank == 0:
            print(f"{name}: Python FSDP2 at {world} ranks loaded the C++ checkpoint strictly, bitwise; "
                  "dcp_to_torch_save converted it")


if __name__ == "__main__":
    run(save, load)
