"""Checks that DCP checkpoints written at different layouts are one checkpoint
to PyTorch (ctest interop.tp_dcp_read_by_torch): each converts with
torch.distributed.checkpoint's own dcp_to_torch_save, and every key (the
model's tensors, the optimizer's state and param_groups) is in each, tensors
bitwise equal, with their dtypes and shapes, and values equal.
usage: compare_dcp.py DCP_DIR DCP_DIR..."""
import os
import sys
import tempfile
import warnings

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

warnings.filterwarnings("ignore")


def flat(tree, prefix=""):
    """The leaves of nested dicts and lists, by their dotted path."""
    out = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else None
    if items is None:
        return {prefix: tree}
    for k, v in items:
        out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def converted(path, work):
    out = os.path.join(work, os.path.basename(path.rstrip("/")) + ".pt")
    dcp_to_torch_save(path, out)
    return flat(torch.load(out, weights_only=False))


dirs = sys.argv[1:]
assert len(dirs) >= 2, __doc__
with tempfile.TemporaryDirectory() as work:
    first = converted(dirs[0], work)
    tensors = sum(isinstance(v, torch.Tensor) for v in first.values())
    assert tensors > 0 and any(k.startswith("model.") for k in first), sorted(first)[:10]
    assert any(".exp_avg_sq" in k for k in first) and any("param_groups" in k for k in first), sorted(first)[:10]
    for d in dirs[1:]:
        other = converted(d, work)
        assert other.keys() == first.keys(), (d, sorted(set(other) ^ set(first))[:10])
        for k, v in first.items():
            w = other[k]
            if isinstance(v, torch.Tensor):
                assert isinstance(w, torch.Tensor) and w.dtype == v.dtype and w.shape == v.shape, (d, k)
                assert torch.equal(w, v), (d, k)
            else:
                assert w == v, (d, k, w, v)
print(f"{len(dirs)} DCP checkpoints hold the same {len(first)} keys ({tensors} tensors), as PyTorch reads them")
