"""torch's own dcp.load of the benchmark's checkpoint into FSDP2 at this world
size: one JSON line per rank (time, peak resident memory during the load).
usage: torchrun --standalone --nproc-per-node 4 load_large.py DIR LAYERS WIDTH DTYPE"""
import os
import json
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from large_model import DTYPES, build, reset_peak, rss_bytes, rss_peak_bytes

warnings.filterwarnings("ignore")
ck, layers, width, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), DTYPES[sys.argv[4]]
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
before_model = rss_bytes()
model = build(layers, width, dtype, world)
with torch.no_grad():
    for p in model.parameters():
        p.to_local().zero_()
sd = model.state_dict()
dist.barrier()
reset_peak()
before_load = rss_bytes()
t0 = time.perf_counter()
dcp.load(sd, checkpoint_id=ck)
seconds = time.perf_counter() - t0
peak = rss_peak_bytes()
dist.barrier()
shard = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
# One write per record: torchrun's workers run unbuffered, where print() writes
# the text and its newline apart and another rank's record can come between.
sys.stdout.write(json.dumps({"rank": rank, "world": world, "seconds": seconds, "shard_bytes": shard,
                             "rss_before_model": before_model, "rss_before_load": before_load,
                             "peak_rss_during_load": peak}) + "\n")
sys.stdout.flush()
dist.destroy_process_group()
# End without finalizing the interpreter: a Gloo worker thread that outlives the group can
# abort Py_FinalizeEx (std::terminate; see bench/ft/torchft_ddp.py).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
