#!/usr/bin/env python3
"""Fault-tolerant training under failures, end to end (docs/fault_tolerance.md).

Starts torchft's lighthouse and R replica groups of examples/ft_train, each
under its own torchrun (which restarts it), kills one group with SIGKILL at
random steps (the seed is printed; --seed repeats a run), waits for every
group to finish, then checks:
  - the groups that were not killed never restarted;
  - the killed group restarted once per kill, healed and finished;
  - every group ends with bitwise the same parameters and optimizer state;
  - each committed step equals single-process training on the batches of the
    groups it counted (ft_train --reference, within 1e-6).
Prints a timeline of the lighthouse's quorums and the groups' heals.
"""
import argparse
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True, help="torchft_lighthouse executable")
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--trainer", required=True, help="examples/ft_train")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=1, help="ranks per group")
    ap.add_argument("--strategy", default="no_shard")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kills", type=int, default=2, help="how many times the victim group dies")
    ap.add_argument("--kill-rank", type=int, default=0)
    ap.add_argument("--step-ms", type=int, default=200)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=240)
    a = ap.parse_args()

    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    victim = rng.randrange(a.groups)
    # Incarnation i dies at its step kill_steps[i] (or the first step after it
    # healed past it): a restarted one heals first, so each kill comes after
    # the previous one rejoined. Early in the run, so that the last restart
    # (a few seconds) still finds the others training.
    kill_steps = sorted(rng.sample(range(3, max(4 + a.kills, a.steps // 3)), a.kills))
    kill_arg = ",".join(f"{i}@{s}" for i, s in enumerate(kill_steps))
    print(f"seed {seed}: group {victim} rank {a.kill_rank} dies at steps {kill_steps}", flush=True)

    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    port = free_port()
    lh_log = open(os.path.join(a.workdir, "lighthouse.log"), "w")
    lighthouse = subprocess.Popen(
        [a.lighthouse, "--bind", f"127.0.0.1:{port}", "--min_replicas", str(max(1, a.groups - 1)),
         "--join_timeout_ms", "1000", "--quorum_tick_ms", "20", "--heartbeat_timeout_ms", "1000"],
        stdout=lh_log, stderr=subprocess.STDOUT, env=dict(os.environ, RUST_LOG="info"))
    procs, logs = [], []
    t0 = time.time()
    try:
        for g in range(a.groups):
            env = dict(os.environ, SHARDTORCH_FT_LIGHTHOUSE=f"127.0.0.1:{port}", SHARDTORCH_FT_REPLICA_GROUP=str(g))
            cmd = [a.torchrun, "--no-python", "--standalone", "--nproc-per-node", str(a.ranks),
                   "--max-restarts", str(a.kills + 1), "--monitor-interval", "0.2", a.trainer,
                   "--steps", str(a.steps), "--groups", str(a.groups), "--dir", a.workdir,
                   "--strategy", a.strategy, "--step-ms", str(a.step_ms)]
            if g == victim:
                cmd += ["--kill", kill_arg, "--kill-rank", str(a.kill_rank)]
            log = open(os.path.join(a.workdir, f"group-{g}.log"), "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.time() + a.timeout
        for p in procs:
            p.wait(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        print(f"FAIL: the groups did not finish within {a.timeout} s", flush=True)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        dump(a)
        return 1
    finally:
        lighthouse.terminate()
        lighthouse.wait()
    elapsed = time.time() - t0
    failures = []
    for g, p in enumerate(procs):
        if p.returncode != 0:
            failures.append(f"group {g}'s torchrun exited with {p.returncode}")
        text = open(os.path.join(a.workdir, f"group-{g}.log")).read()
        incarnations = [int(x) for x in re.findall(r"group \d+: incarnation (\d+)", text)]
        want = list(range(a.kills + 1)) if g == victim else [0]
        if incarnations != want:
            failures.append(f"group {g} ran incarnations {incarnations}, expected {want}")
        if g == victim and len(re.findall(r"healed from", text)) < a.kills:
            failures.append(f"group {g} healed {len(re.findall(r'healed from', text))} times, expected {a.kills}")
        if f"group {g}: done at step {a.steps}" not in text:
            failures.append(f"group {g} did not finish at step {a.steps}")
    print(f"groups finished in {elapsed:.1f} s", flush=True)
    timeline(a)
    ref = subprocess.run([a.trainer, "--reference", "--dir", a.workdir, "--groups", str(a.groups),
                          "--ranks", str(a.ranks)], capture_output=True, text=True)
    print(ref.stdout + ref.stderr, end="", flush=True)
    if ref.returncode != 0:
        failures.append("the final states differ from each other or from the reference")
    if failures:
        dump(a)
        for f in failures:
            print("FAIL: " + f, flush=True)
        return 1
    print("PASS: survivors never restarted; the killed group healed and rejoined; every group bitwise equal and "
          "equal to the single-process replay", flush=True)
    return 0


def timeline(a):
    for g in range(a.groups):
        for line in open(os.path.join(a.workdir, f"group-{g}.log")):
            if "[shardtorch-ft" in line or "killing itself" in line or "incarnation" in line:
                print("  " + line.rstrip(), flush=True)


def dump(a):
    for name in sorted(os.listdir(a.workdir)):
        if name.endswith(".log"):
            print(f"---- {name} (last 40 lines)")
            print("".join(open(os.path.join(a.workdir, name)).readlines()[-40:]), flush=True)


if __name__ == "__main__":
    sys.exit(main())
