"""Writes the benchmark's DCP checkpoint with torch (FSDP2, dcp.save).
usage: torchrun --standalone --nproc-per-node 2 save_large.py DIR LAYERS WIDTH DTYPE"""
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from large_model import DTYPES, build, fill

warnings.filterwarnings("ignore")
out, layers, width, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), DTYPES[sys.argv[4]]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = build(layers, width, dtype, world)
with torch.no_grad():
    fill(model, width)
t0 = time.perf_counter()
dcp.save(model.state_dict(), checkpoint_id=out)
dist.barrier()
if rank == 0:
    rows = -(-width // world)
    json.dump({"layers": layers, "width": width, "dtype": sys.argv[4], "saved_at_world": world,
               "parameters": layers * width * width, "save_seconds": time.perf_counter() - t0,
               "largest_chunk_bytes": rows * width * torch.tensor([], dtype=dtype).element_size()},
              open(os.path.join(out, "bench.json"), "w"))
dist.destroy_process_group()
# End without finalizing the interpreter: a Gloo worker thread that outlives the group can
# abort Py_FinalizeEx (std::terminate; see bench/ft/torchft_ddp.py).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
