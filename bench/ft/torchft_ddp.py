#!/usr/bin/env python3
"""torchft's fault-tolerant DDP and plain torch DDP on ft_train's model (a benchmark).

The comparison point of docs/fault_tolerance.md's "Measurements": the same
model, optimizer, batch and data split as examples/ft_train, trained

  --mode ft   with torchft (Manager, torchft.ddp.DistributedDataParallel,
              ProcessGroupGloo, OptimizerWrapper): one process per replica
              group, each under its own torchrun, against a torchft_lighthouse
              (TORCHFT_LIGHTHOUSE=http://host:port, REPLICA_GROUP_ID=G);
  --mode ddp  with torch's own DistributedDataParallel over Gloo: R ranks in
              one torchrun (torchft's baseline), rank r reading group r's data.

Model: Linear(16,H), tanh, Linear(H,H), tanh, Linear(H,1); AdamW lr 1e-2; 8
samples per replica and step; MSE against tanh(0.5 x.w) on random x.

Prints what bench/ft/run_overhead.py parses, in the same words as ft_train:
  ft:  "group G: step time: median X ms over K steady steps" (committed steps
       from the 6th on that neither healed nor changed the quorum), and appends
       "<step> quorum <id> at <epoch ms> participants <n>" per committed step to
       DIR/steps-G.txt; "killing itself at step S at HH:MM:SS.mmm" (--kill),
       "healed: step A -> B at HH:MM:SS.mmm, state N bytes" (N: torch.save's
       size of the state received), "step S not committed at HH:MM:SS.mmm",
       "incarnation I, manager up at HH:MM:SS.mmm". torchft's HTTP checkpoint transport logs
       how long fetching the state took ("... took Xs").
  ddp: "without fault tolerance: R ranks, step time: median X ms over K steps".

  REPLICA_GROUP_ID=0 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 \
    .venv/bin/torchrun --standalone --nproc-per-node 1 bench/ft/torchft_ddp.py --mode ft --groups 3
  .venv/bin/torchrun --standalone --nproc-per-node 3 bench/ft/torchft_ddp.py --mode ddp --groups 3
"""
import argparse
import datetime
import io
import logging
import os
import signal
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, PER_RANK, BATCH = 16, 64, 8
WARMUP = 5


def wall_clock():
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"


def build_model(hidden):
    torch.manual_seed(0)  # every replica, every incarnation: the same start
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, 1))


def synthetic_data(size):
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(size, FEATURES, generator=gen)
    w = torch.randn(FEATURES, 1, generator=gen)
    return x, torch.tanh(x @ w * 0.5)


def batch_of(step, part_index, parts, size):
    """Replica part_index's batch at `step` (ft_train's ReplicaSampler: a fixed
    slice per replica, read round-robin, a function of the step only)."""
    length = size // parts
    begin = part_index * length
    return torch.tensor([begin + (step * BATCH + i) % length for i in range(BATCH)])


def parse_kill(spec):
    """"0@40,1@90" -> {incarnation: step} (ft_train's --kill, before the step)."""
    out = {}
    for item in filter(None, spec.split(",")):
        inc, _, step = item.partition("@")
        out[int(inc)] = int(step)
    return out


def median_ms(times):
    return statistics.median(times) * 1000 if times else 0.0


def run_ft(a):
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    # Only the checkpoint transport's timing line, with the wall clock; the
    # manager's per-step INFO lines would slow torchft down (left at WARNING).
    http_log = logging.getLogger("torchft.checkpointing.http_transport")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[torchft %(asctime)s.%(msecs)03d] %(message)s", "%H:%M:%S"))
    http_log.addHandler(handler)
    http_log.setLevel(logging.INFO)

    group = os.environ["REPLICA_GROUP_ID"]
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_at = parse_kill(a.kill).get(incarnation) if int(os.environ.get("RANK", "0")) == a.kill_rank else None
    timeout = datetime.timedelta(milliseconds=a.timeout_ms)

    model = build_model(a.hidden)
    inner_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    heal = {}  # what the last load_state_dict received

    def save_state():
        return {"model": model.state_dict(), "optim": inner_opt.state_dict()}

    def load_state(state):
        buf = io.BytesIO()
        torch.save(state, buf)
        heal.update(bytes=buf.tell(), at=wall_clock(), pending=True)
        model.load_state_dict(state["model"])
        inner_opt.load_state_dict(state["optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=a.min_replicas,
                      load_state_dict=load_state, state_dict=save_state, replica_id=group,
                      timeout=timeout, quorum_timeout=datetime.timedelta(seconds=60))
    ddp = DistributedDataParallel(manager, model, bucket_cap_mb=a.bucket_mb)
    opt = Optimizer(manager, inner_opt)
    x, y = synthetic_data(a.groups * PER_RANK)
    print(f"group {group}: incarnation {incarnation}, manager up at {wall_clock()}", flush=True)

    os.makedirs(a.dir, exist_ok=True)
    steps_log = open(os.path.join(a.dir, f"steps-{group}.txt"), "a")
    times = []
    last_quorum = None
    while manager.current_step() < a.steps:
        before = manager.current_step()
        if kill_at is not None and before >= kill_at:
            print(f"group {group} rank {a.kill_rank}: killing itself at step {before} at {wall_clock()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.perf_counter()
        opt.zero_grad()  # starts the quorum in the background
        idx = batch_of(before, int(group), a.groups, x.size(0))
        loss = F.mse_loss(ddp(x[idx]), y[idx])
        loss.backward()  # the comm hook all-reduces each bucket through the manager
        manager.wait_quorum()  # done already (the hook waited); makes current_step() the quorum's
        step = manager.current_step()
        opt.step()  # should_commit(), then AdamW if committed
        committed = manager.current_step() == step + 1
        elapsed = time.perf_counter() - t0
        quorum = getattr(manager, "_quorum_id", None)  # no public accessor; read only, to skip reconfigured steps
        healed = heal.pop("pending", False) or step != before  # load_state ran (in should_commit)
        if healed:
            print(f"group {group}: healed: step {before} -> {step} at {heal.get('at', wall_clock())}, "
                  f"state {heal.get('bytes', 0)} bytes", flush=True)
        if committed:
            if step >= WARMUP and not healed and quorum == last_quorum:
                times.append(elapsed)
            steps_log.write(f"{step} quorum {quorum} at {int(time.time() * 1000)} participants "
                            f"{manager.num_participants()}\n")
            steps_log.flush()
            if step % 10 == 0:
                print(f"group {group} step {step} loss {loss.item():.5f}", flush=True)
        else:
            print(f"group {group}: step {step} not committed at {wall_clock()}", flush=True)
        last_quorum = quorum
        if a.step_ms > 0:
            time.sleep(a.step_ms / 1000)
    print(f"group {group}: done at step {manager.current_step()}", flush=True)
    print(f"group {group}: step time: median {median_ms(times):.3f} ms over {len(times)} steady steps", flush=True)
    steps_log.close()
    manager.shutdown(wait=False)
    sys.stdout.flush()
    os._exit(0)  # torchft's server threads need not be joined


def run_ddp(a):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(a.hidden)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = synthetic_data(a.groups * PER_RANK)
    times = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        idx = batch_of(step, rank, a.groups, x.size(0))
        F.mse_loss(ddp(x[idx]), y[idx]).backward()
        opt.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        print(f"without fault tolerance: {world} ranks, step time: median {median_ms(times):.3f} ms "
              f"over {len(times)} steps", flush=True)
    dist.destroy_process_group()
    # Not a normal interpreter exit: Gloo's worker threads outlive
    # destroy_process_group() (torch.distributed.nn.functional's defaults keep
    # the group alive), and one of them may still be freeing the last step's
    # all-reduce work, whose saved thread-local state holds a Python object.
    # Freeing it takes the GIL; once Py_FinalizeEx has begun, Python ends such
    # a thread with pthread_exit(), whose unwinding through the work's noexcept
    # destructor calls std::terminate ("terminate called without an active
    # exception", SIGABRT, now and then, on any rank). So, like run_ft(), end
    # the process here without finalizing the interpreter.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["ft", "ddp"], required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--groups", type=int, default=3, help="replica groups (ddp: the data is split as many ways)")
    ap.add_argument("--hidden", type=int, default=32, help="width of the hidden layers")
    ap.add_argument("--bucket-mb", type=float, default=0.002,
                    help="DDP bucket size; ft_train's shardtorch buckets are 0.002 MB")
    ap.add_argument("--dir", default=".", help="ft: where steps-G.txt goes")
    ap.add_argument("--kill", default="", help="ft: INCARNATION@STEP,...: SIGKILL itself before that step")
    ap.add_argument("--kill-rank", type=int, default=0)
    ap.add_argument("--step-ms", type=int, default=0, help="ft: sleep after each step")
    ap.add_argument("--timeout-ms", type=int, default=5000, help="ft: the manager's and Gloo's timeout")
    ap.add_argument("--min-replicas", type=int, default=None,
                    help="ft: the manager's min_replica_size (default: 2, or 1 with --groups 1)")
    a = ap.parse_args()
    if a.min_replicas is None:
        a.min_replicas = min(2, a.groups)
    if a.mode == "ft":
        run_ft(a)
    else:
        run_ddp(a)


if __name__ == "__main__":
    main()
