"""Wall and CPU time of one Gloo all_reduce of NoShard's gradient bucket.

    torchrun --standalone --nproc-per-node 2 bench/peers/allreduce_cost.py [--mb 12.76]

The CPU time (every thread of the process) is what a rank with one core
cannot overlap with its backward: docs/benchmarks.md uses it to bound
NoShard's step time from below.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=12.756992, help="megabytes of fp32 (default: the medium GPT's gradients)")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    t = torch.randn(int(a.mb * 1e6) // 4)
    for _ in range(3):
        dist.all_reduce(t)
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(a.iters):
        dist.all_reduce(t)
    wall = (time.perf_counter() - w0) / a.iters * 1e3
    cpu = (time.process_time() - c0) / a.iters * 1e3
    print(f"rank {dist.get_rank()}: all_reduce of {t.numel() * 4 / 1e6:.2f} MB: wall {wall:.1f} ms, cpu {cpu:.1f} ms",
          flush=True)
    dist.destroy_process_group()
    os._exit(0)  # skip the interpreter teardown Gloo can abort in (see peer_train.py)


if __name__ == "__main__":
    main()
