"""PyTorch's side of the tensor-parallel DCP round trip (ctest interop.tp_dcp_with_torch).

usage: torchrun --standalone --nproc-per-node 2 tp_run.py save DIR
       torchrun --standalone --nproc-per-node 2 tp_run.py load DIR

The model is tests/test_tp_checkpoint.cpp's TpMlp: l0 Linear(4, 6), ReLU,
l1 Linear(6, 2), split over 2 ranks with torch.distributed.tensor.parallel
(l0 ColwiseParallel, l1 RowwiseParallel: DTensors on a CPU mesh, Gloo), with
AdamW(lr=1e-2, weight_decay=0.1); the loss is the output's mean square.

save: one AdamW step on batch x1, then dcp.save of {"model": ..., "optim":
  ...} from get_state_dict into DIR/py_tp, the saved values whole in
  DIR/py_tp.saved.safetensors, then the next step on x2 (DIR/batch.safetensors,
  for the C++ side to take the same) and its parameters whole in
  DIR/py_tp.next.safetensors.
load: a fresh split model and AdamW load DIR/cpp_tp (written by the C++ side
  at tp 2 x dp 2) with a strict dcp.load and set_state_dict, and must equal
  DIR/cpp_tp.expected.safetensors bitwise, each parameter's step 2.
Exits non-zero (an assertion) on any difference.
"""
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from interop_common import flat_values, require_equal, run

warnings.filterwarnings("ignore")
BATCH = 8


class TpMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(4, 6)
        self.l1 = nn.Linear(6, 2)

    def forward(self, x):
        return self.l1(torch.relu(self.l0(x)))


def build(world, seed):
    torch.manual_seed(seed)
    model = TpMlp()
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"l0": ColwiseParallel(), "l1": RowwiseParallel()})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def step(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def save(out, rank, world):
    g = torch.Generator().manual_seed(1)
    x1 = torch.randn(BATCH, 4, generator=g)
    x2 = torch.randn(BATCH, 4, generator=g)
    if rank == 0:
        save_file({"x1": x1, "x2": x2}, os.path.join(out, "batch.safetensors"))
    model, opt = build(world, seed=0)
    step(model, opt, x1)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "py_tp"))
    saved = flat_values(model, opt)
    step(model, opt, x2)
    after = {k: v for k, v in flat_values(model, opt).items() if k.startswith("model.")}
    if rank == 0:
        save_file(saved, os.path.join(out, "py_tp.saved.safetensors"))
        save_file(after, os.path.join(out, "py_tp.next.safetensors"))
        print(f"Python saved the model split over {world} ranks (DTensor tensor parallelism)")


def load(out, rank, world):
    want = load_file(os.path.join(out, "cpp_tp.expected.safetensors"))
    model, opt = build(world, seed=1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(out, "cpp_tp"))  # strict: every key the model and its AdamW have
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = flat_values(model, opt)
    steps = {k: v for k, v in got.items() if k.endswith(".step")}
    assert len(steps) == 4 and all(v.item() == 2 for v in steps.values()), steps
    require_equal({k: v for k, v in got.items() if k not in steps}, want, f"rank {rank}: dcp.load")
    if rank == 0:
        print(f"Python's tensor parallelism at {world} ranks loaded the C++ tp 2 x dp 2 checkpoint strictly, bitwise")


if __name__ == "__main__":
    run(save, load)
