"""The benchmark's model and values (bench/dcp_load_bench.cpp builds the same):
`layers` square bias-free linear layers of `width`, each fully_shard'ed, on a
CPU mesh. Element k of layer i's weight is ((k % 1000) - 500) / 1000 * (i + 1),
computed in float64 and rounded to the dtype."""
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Stack(nn.Module):
    def __init__(self, layers, width, dtype):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width, bias=False, dtype=dtype) for _ in range(layers)])


def build(layers, width, dtype, world):
    """FSDP2 over `world` ranks, made on the meta device (nothing allocated
    but this rank's shards)."""
    with torch.device("meta"):
        model = Stack(layers, width, dtype)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model


def fill(model, width):
    """Each rank's rows of each weight, with the values above."""
    for i, layer in enumerate(model.layers):
        local = layer.weight.to_local()
        row0 = _first_row(layer.weight)
        rows = local.shape[0]
        for r in range(0, rows, 256):  # a few MiB of float64 at a time
            n = min(256, rows - r)
            k = torch.arange((row0 + r) * width, (row0 + r + n) * width, dtype=torch.int64)
            local[r:r + n] = (((k % 1000) - 500).double() / 1000.0 * (i + 1)).to(local.dtype).view(n, width)


def _first_row(dt):
    """The global row of this rank's first local row (Shard(0), torch's
    chunking: ceil(rows / world) per rank)."""
    world = dt.device_mesh.size()
    rank = dt.device_mesh.get_local_rank()
    per = -(-dt.shape[0] // world)
    return min(rank * per, dt.shape[0])


def rss_peak_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
