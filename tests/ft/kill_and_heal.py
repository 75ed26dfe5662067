#!/usr/bin/env python3
"""Fault-tolerant training under failures, end to end (docs/fault_tolerance.md).

Starts torchft's lighthouse and R replica groups of examples/ft_train, each
under its own torchrun (which restarts it), kills one group with SIGKILL at
random steps (the seed is printed; --seed repeats a run), waits for every
group to finish, then checks:
  - the groups that were not killed never restarted;
  - the killed group restarted once per kill, healed and finished;
  - with --snapshots K: the killed group restored the newest snapshot of its
    own from memory at each restart (the kill's step rounded down to a
    multiple of K), and was healed exactly when the others were past that
    step: always when they went on without it, else (--min-replicas equal to
    --groups: they waited for it) only when the kill came after a step that
    had no snapshot;
  - every group ends with bitwise the same parameters and optimizer state;
  - each committed step equals single-process training on the batches of the
    groups it counted (ft_train --reference, within --tolerance), or, with
    --oracle exact, every group is bitwise a replay with the groups' own
    reduction order (ft_train --reference --exact).
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
    ap.add_argument("--lighthouse", required=True, help="torchft_lighthouse executable, or a Python script "
                    "run by this script's interpreter (tests/ft/lighthouse.py)")
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--trainer", required=True, help="examples/ft_train")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=1, help="ranks per group")
    ap.add_argument("--strategy", default="no_shard")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kills", type=int, default=2, help="how many times the victim group dies (scenario twice)")
    ap.add_argument("--scenario", default="twice", choices=["twice", "backward", "heal", "lighthouse"],
                    help="twice: one group killed --kills times before a step; backward: killed in the backward, "
                         "between its gradient all-reduces; heal: a group killed, then its source killed while "
                         "sending it the state; lighthouse: the lighthouse dies, every group fails with a clear "
                         "error within the quorum timeout")
    ap.add_argument("--timeout-ms", type=int, default=5000, help="ManagerOptions::timeout of the groups")
    ap.add_argument("--quorum-timeout-ms", type=int, default=5000, help="ManagerOptions::quorum_timeout")
    ap.add_argument("--kill-rank", type=int, default=0)
    ap.add_argument("--step-ms", type=int, default=200)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--model", default="mlp", help="ft_train --model: mlp or gpt (the example GPT)")
    ap.add_argument("--tolerance", default="1e-6", help="largest difference from the single-process replay")
    ap.add_argument("--oracle", default="replay", choices=["replay", "exact", "both"],
                    help="replay: a single-process replay of the committed steps, within --tolerance; exact: a replay "
                         "with the groups' own reduction order (one process per group under torchrun; groups of one "
                         "rank, at most 3), every group bitwise equal to it; both")
    ap.add_argument("--prefetch-quorum", action="store_true", help="the groups run with ManagerOptions::prefetch_quorum")
    ap.add_argument("--cpu-offload", action="store_true", help="the groups run with ShardOptions::cpu_offload")
    ap.add_argument("--hybrid-shard-size", type=int, default=0, help="ft_train --hybrid-shard-size (--strategy hybrid_shard)")
    ap.add_argument("--snapshots", type=int, default=0, metavar="K",
                    help="scenario twice: the groups keep in-memory snapshots every K steps (ft_train --snapshots "
                         "--snapshot-every K) and restore them when restarted; with K > 1 the kills alternate "
                         "between a step with a snapshot (the last) and one without")
    ap.add_argument("--min-replicas", type=int, default=None,
                    help="the lighthouse's --min_replicas (default: groups - 1); equal to --groups, the others wait "
                         "for a killed group instead of going on without it")
    a = ap.parse_args()

    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    # Kill steps come early in the run, so that the last restart (a few
    # seconds) still finds the others training.
    late = max(6, a.steps // 3)
    kills = {}  # group -> --kill argument
    restarts = {g: 0 for g in range(a.groups)}
    if a.scenario == "twice":
        victim = rng.randrange(a.groups)
        # Incarnation i dies at its step kill_steps[i] (or the first step after
        # it healed past it): each kill comes after the previous one rejoined.
        if not a.snapshots:
            kill_steps = sorted(rng.sample(range(3, max(4 + a.kills, late)), a.kills))
        else:
            # Kill i comes 2 to 2 K + 2 steps after the previous one (the
            # restarted group first commits a step that counts every group),
            # at a multiple of K for odd i and the last, else (K > 1) between
            # two. The last restore is not healed when the others wait: the
            # data position at the end is the one the snapshot gave back.
            kill_steps, lo = [], 3
            for i in range(a.kills):
                with_snapshot = (a.kills - 1 - i) % 2 == 0 or a.snapshots == 1
                kill_steps.append(rng.choice([s for s in range(lo, lo + 2 * a.snapshots + 1)
                                              if (s % a.snapshots == 0) == with_snapshot]))
                lo = kill_steps[-1] + 2
            assert kill_steps[-1] + 3 <= a.steps, f"--steps {a.steps}: too few for kills at {kill_steps}"
        kills[victim] = ",".join(f"{i}@{s}" for i, s in enumerate(kill_steps))
        restarts[victim] = a.kills
        what = f"group {victim} rank {a.kill_rank} dies before steps {kill_steps}"
        if a.snapshots:
            what += f", snapshots every {a.snapshots} steps"
    elif a.scenario == "backward":
        victim = rng.randrange(a.groups)
        step = rng.randrange(3, late)
        kills[victim] = f"0@{step}b"
        restarts[victim] = 1
        what = f"group {victim} rank {a.kill_rank} dies in the backward of step {step}"
    elif a.scenario == "lighthouse":
        what = "the lighthouse dies"
    else:
        # The last group dies; restarted, it heals from the first counted group
        # (by name), which dies while sending it the state; the heal is
        # retried from another group.
        assert a.groups >= 3, "the heal scenario needs 3 groups"
        victim, source = a.groups - 1, 0
        step = rng.randrange(3, late)
        kills[victim] = f"0@{step}"
        kills[source] = f"0@{step}h"
        restarts[victim] = restarts[source] = 1
        what = f"group {victim} dies before step {step}; group {source} dies while sending it the state"
    print(f"seed {seed}: {what}", flush=True)

    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    # The snapshots' directory: node-local memory in production; here the
    # run's own directory, so that no run sees another's.
    snapdir = os.path.join(a.workdir, "snapshots")
    if a.snapshots:
        os.makedirs(snapdir)
    min_replicas = a.min_replicas if a.min_replicas is not None else max(1, a.groups - 1)
    port = free_port()
    lh_log = open(os.path.join(a.workdir, "lighthouse.log"), "w")
    launcher = [sys.executable, a.lighthouse] if a.lighthouse.endswith(".py") else [a.lighthouse]
    lighthouse = subprocess.Popen(
        launcher + ["--bind", f"127.0.0.1:{port}", "--min_replicas", str(min_replicas),
         "--join_timeout_ms", "1000", "--quorum_tick_ms", "20", "--heartbeat_timeout_ms", "1000"],
        stdout=lh_log, stderr=subprocess.STDOUT, env=dict(os.environ, RUST_LOG="info"))
    procs, logs = [], []
    t0 = time.time()
    try:
        for g in range(a.groups):
            env = dict(os.environ, SHARDTORCH_FT_LIGHTHOUSE=f"127.0.0.1:{port}", SHARDTORCH_FT_REPLICA_GROUP=str(g))
            if a.oracle != "replay":
                env["OMP_NUM_THREADS"] = "1"  # as the exact replay's processes have it
            cmd = [a.torchrun, "--no-python", "--standalone", "--nproc-per-node", str(a.ranks),
                   "--max-restarts", str(restarts[g] + 1), "--monitor-interval", "0.2", a.trainer,
                   "--steps", str(a.steps), "--groups", str(a.groups), "--dir", a.workdir,
                   "--strategy", a.strategy, "--step-ms", str(a.step_ms), "--timeout-ms", str(a.timeout_ms),
                   "--quorum-timeout-ms", str(a.quorum_timeout_ms), "--model", a.model]
            if g in kills:
                cmd += ["--kill", kills[g], "--kill-rank", str(a.kill_rank)]
            if a.prefetch_quorum:
                cmd += ["--prefetch-quorum"]
            if a.cpu_offload:
                cmd += ["--cpu-offload"]
            if a.hybrid_shard_size:
                cmd += ["--hybrid-shard-size", str(a.hybrid_shard_size)]
            if a.snapshots:
                cmd += ["--snapshots", snapdir, "--snapshot-every", str(a.snapshots)]
            log = open(os.path.join(a.workdir, f"group-{g}.log"), "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        if a.scenario == "lighthouse":
            return lighthouse_dies(a, lighthouse, procs, logs)
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
    texts = [open(os.path.join(a.workdir, f"group-{g}.log")).read() for g in range(a.groups)]
    samples = set()
    for g, p in enumerate(procs):
        text = texts[g]
        if p.returncode != 0:
            failures.append(f"group {g}'s torchrun exited with {p.returncode}")
        incarnations = [int(x) for x in re.findall(r"group \d+: incarnation (\d+)", text)]
        want = list(range(restarts[g] + 1))
        if incarnations != want:
            failures.append(f"group {g} ran incarnations {incarnations}, expected {want}")
        heals = len(re.findall(r"healed from", text))
        if a.snapshots and g in kills:
            failures += check_restores(a, g, text, min_replicas)
        elif heals < restarts[g]:
            failures.append(f"group {g} healed {heals} times, expected at least {restarts[g]}")
        done = re.search(rf"group {g}: done at step (\d+), (\d+) samples read", text)
        if not done or int(done.group(1)) != a.steps:
            failures.append(f"group {g} did not finish at step {a.steps}")
        else:
            samples.add(done.group(2))
    # Snapshots::finish() at the end of every group removes its snapshots.
    if a.snapshots and os.listdir(snapdir):
        failures.append(f"snapshots left after the end: {sorted(os.listdir(snapdir))}")
    # The data position travels with a heal (Manager::set_user_state) and
    # with a snapshot (Snapshots::register_state): every group read as much.
    if len(samples) > 1:
        failures.append(f"the groups end with different data positions: {sorted(samples)}")
    # A kill between the gradient all-reduces: the survivors drop that step
    # (no partly reduced gradient is applied) within the timeout.
    if a.scenario == "backward":
        kill = re.search(r"killing itself.* at (\d\d):(\d\d):(\d\d)\.(\d\d\d)", texts[victim])
        t_kill = clock(kill.groups()) if kill else None
        if t_kill is None:  # the wait could not be timed: say so rather than pass without timing it
            failures.append(f"group {victim} logged no 'killing itself ... at HH:MM:SS.mmm' line")
        dropped = 0
        for g in range(a.groups):
            if g == victim:
                continue
            # A group that joined only after the kill (its first committed step
            # is later) was not in that step's quorum: nothing for it to drop.
            first = open(os.path.join(a.workdir, f"steps-{g}.txt")).readline().split()
            joined = time.localtime(int(first[4]) / 1000) if len(first) > 4 else None
            if t_kill is not None and joined is not None and \
                    clock((joined.tm_hour, joined.tm_min, joined.tm_sec, int(first[4]) % 1000)) > t_kill:
                print(f"group {g} joined after the kill")
                continue
            m = re.search(r"\[shardtorch-ft (\d\d):(\d\d):(\d\d)\.(\d\d\d)\] group \d+: step \d+ not committed", texts[g])
            if m:
                dropped += 1
            if not m:
                failures.append(f"group {g} committed the step group {victim} died in")
            elif t_kill is not None:
                waited = (clock(m.groups()) - t_kill) % 86400
                print(f"group {g} dropped the step {waited:.2f} s after the kill (timeout {a.timeout_ms / 1000:.1f} s)")
                if waited > a.timeout_ms / 1000 + 1.0:
                    failures.append(f"group {g} waited {waited:.2f} s, past the timeout")
        if dropped == 0:
            failures.append(f"no group dropped the step group {victim} died in")
    print(f"groups finished in {elapsed:.1f} s", flush=True)
    timeline(a)
    if a.oracle in ("replay", "both"):
        ref = subprocess.run([a.trainer, "--reference", "--dir", a.workdir, "--groups", str(a.groups),
                              "--ranks", str(a.ranks), "--model", a.model, "--tolerance", a.tolerance],
                             capture_output=True, text=True)
        print(ref.stdout + ref.stderr, end="", flush=True)
        if ref.returncode != 0:
            failures.append("the final states differ from each other or from the reference")
    if a.oracle in ("exact", "both"):
        ref = subprocess.run([a.torchrun, "--no-python", "--standalone", "--nproc-per-node", str(a.groups),
                              a.trainer, "--reference", "--exact", "--dir", a.workdir, "--groups", str(a.groups),
                              "--model", a.model],
                             capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        print(ref.stdout + (ref.stderr if ref.returncode else ""), end="", flush=True)
        if ref.returncode != 0:
            failures.append("the final states differ from the exact replay")
    if failures:
        dump(a)
        for f in failures:
            print("FAIL: " + f, flush=True)
        return 1
    print("PASS: only the killed groups restarted; they healed and rejoined; every group bitwise equal and "
          "equal to the single-process replay", flush=True)
    return 0


def check_restores(a, g, text, min_replicas):
    """The killed group g under --snapshots K: after each kill (at the top of
    its loop, past step N's snapshot if N is a multiple of K) it restored
    step N rounded down to a multiple of K; its first step after that counted
    it at that step, or healed it to the others' later step. When the others
    waited for it (min_replicas = groups: no step commits without it) they
    were at N: it was healed exactly when it restored a step before N."""
    failures = []
    killed = [int(s) for s in re.findall(rf"group {g} rank \d+: killing itself at step (\d+)", text)]
    restores = re.findall(rf"group {g}: restored step (\d+) from memory, then (healed|counted without a heal) at "
                          rf"step (\d+)", text)
    if len(restores) != len(killed):
        return [f"group {g} was killed at steps {killed} and restored {len(restores)} times from memory"]
    waited = min_replicas == a.groups
    for n, (restored, outcome, at) in zip(killed, restores):
        restored, at, healed = int(restored), int(at), outcome == "healed"
        print(f"group {g}: killed at step {n}, restored step {restored} from memory, then {outcome} at step {at}",
              flush=True)
        if restored != n - n % a.snapshots:
            failures.append(f"group {g} killed at step {n} restored step {restored}, not {n - n % a.snapshots}")
        if healed != (at > restored) or (waited and at != n):
            failures.append(f"group {g} restored step {restored} and was {outcome} at step {at}, "
                            f"the others {'waiting at step ' + str(n) if waited else 'going on'}")
    return failures


def lighthouse_dies(a, lighthouse, procs, logs):
    """Kills the lighthouse once every group has committed a few steps; each
    group must then fail with an error naming the lighthouse within its
    quorum timeout, and exit (torchrun gives up after its restarts)."""
    deadline = time.time() + a.timeout
    while time.time() < deadline:
        if all(os.path.exists(os.path.join(a.workdir, f"steps-{g}.txt")) and
               len(open(os.path.join(a.workdir, f"steps-{g}.txt")).readlines()) >= 5 for g in range(a.groups)):
            break
        time.sleep(0.1)
    lighthouse.kill()
    t_kill = time.time()
    print("killed the lighthouse", flush=True)
    failures = []
    for g, p in enumerate(procs):
        try:
            p.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            failures.append(f"group {g} still runs {time.time() - t_kill:.1f} s after the lighthouse died")
            p.kill()
            continue
    waited = time.time() - t_kill
    # Each attempt waits at most the quorum timeout; torchrun restarts the group --max-restarts times.
    bound = (a.quorum_timeout_ms / 1000 + 10) * (2 + a.kills)
    print(f"every group exited {waited:.1f} s after the lighthouse died (bound {bound:.0f} s)", flush=True)
    if waited > bound:
        failures.append(f"the groups took {waited:.1f} s to give up")
    for g, p in enumerate(procs):
        text = open(os.path.join(a.workdir, f"group-{g}.log")).read()
        if p.returncode == 0:
            failures.append(f"group {g} exited 0 without a lighthouse")
        if "got no quorum from the lighthouse at 127.0.0.1:" not in text:
            failures.append(f"group {g}'s log does not name the lighthouse")
    if failures:
        dump(a)
        for f in failures:
            print("FAIL: " + f, flush=True)
        return 1
    print("PASS: every group failed with an error naming the lighthouse, within its quorum timeout", flush=True)
    return 0


def clock(hms):
    h, m, s, ms = (int(x) for x in hms)
    return h * 3600 + m * 60 + s + ms / 1000


def timeline(a):
    for g in range(a.groups):
        for line in open(os.path.join(a.workdir, f"group-{g}.log")):
            if ("[shardtorch-ft" in line or "killing itself" in line or "incarnation" in line or "done at" in line
                    or "from memory" in line):
                print("  " + line.rstrip(), flush=True)


def dump(a):
    for name in sorted(os.listdir(a.workdir)):
        if name.endswith(".log"):
            print(f"---- {name} (last 40 lines)")
            print("".join(open(os.path.join(a.workdir, name)).readlines()[-40:]), flush=True)


if __name__ == "__main__":
    sys.exit(main())
