"""What fsdp2_run.py and tp_run.py share: a model's and its optimizer's state
whole by their DCP keys, an exact comparison, and the process group's run."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor


def full(v):
    return v.full_tensor() if isinstance(v, DTensor) else v


def flat_values(model, opt):
    """Parameters, buffers and optimizer state whole, by their DCP keys."""
    msd, osd = get_state_dict(model, opt)
    out = {"model." + k: full(v).detach().clone().contiguous() for k, v in msd.items()}
    for name, st in osd["state"].items():
        for kind, v in st.items():
            out[f"optim.state.{name}.{kind}"] = full(v).detach().clone().contiguous()
    return out


def require_equal(got, want, what):
    assert set(got) == set(want), f"{what}: keys {sorted(set(got) ^ set(want))} differ"
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: {k} is {g.dtype} {tuple(g.shape)}, expected {w.dtype} {tuple(w.shape)}"
        assert torch.equal(g, w), f"{what}: {k} differs by {(g.double() - w.double()).abs().max().item()}"


def run(save, load):
    """`save(DIR, rank, world)` or `load(...)` as argv says (MODE DIR), in a Gloo group."""
    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    (save if mode == "save" else load)(out, rank, world)
    dist.barrier()
    dist.destroy_process_group()
    # End without finalizing the interpreter: a Gloo worker thread that outlives the group can
    # abort Py_FinalizeEx (std::terminate; see bench/ft/torchft_ddp.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
