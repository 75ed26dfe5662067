"""Gloo's reduce-scatter (reduce_scatter_single, which torch 2.13 names
reduce_scatter_tensor's successor) beside an all_reduce of the same input.

    torchrun --standalone --nproc-per-node 2 bench/peers/gloo_reduce_scatter_cost.py

c10d's Gloo reduce-scatter all-reduces a clone of its input; the
ReduceScatterBucketer all-reduces its own input in place instead
(docs/benchmarks.md, "Reduce-scatters on Gloo"). Rank 0 prints the mean wall
time of each per input size.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist


def timed(f, iters):
    for _ in range(2):
        f()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        f()
    return (time.perf_counter() - start) / iters * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kib", type=int, nargs="+", default=[256, 1024, 4096, 12458, 65536], help="input sizes")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    for kib in a.kib:
        n = kib * 256 // world * world  # fp32 elements, a multiple of the world size
        full, shard = torch.randn(n), torch.empty(n // world)
        rs = timed(lambda: reduce_scatter(shard, full), a.iters)
        ar = timed(lambda: dist.all_reduce(full), a.iters)
        if dist.get_rank() == 0:
            print(f"{world} ranks, {kib} KiB input: {reduce_scatter.__name__} {rs:.2f} ms, all_reduce {ar:.2f} ms",
                  flush=True)
    dist.destroy_process_group()
    os._exit(0)  # skip the interpreter teardown Gloo can abort in (see peer_train.py)


if __name__ == "__main__":
    main()
