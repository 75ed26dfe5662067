#!/usr/bin/env python3
"""Fault tolerance's cost, shardtorch against torchft, in one run (a benchmark).

docs/fault_tolerance.md, "Measurements". On this machine, side by side, with
the same model (ft_train's MLP, --hidden H), replica count R and steps:

  steady state, for each H:
    a. shardtorch FT: torchft_lighthouse + R groups of `ft_train`, each under
       its own torchrun (1 rank);
    b. shardtorch without FT: `ft_train --no-ft`, R ranks in one torchrun;
    c. torchft FT: R groups of bench/ft/torchft_ddp.py --mode ft (torchft's
       Manager + DistributedDataParallel + ProcessGroupGloo + OptimizerWrapper);
    d. torch DDP: torchft_ddp.py --mode ddp, R ranks in one torchrun;
  and each FT's overhead against its own baseline, (a-b)/b and (c-d)/d.
  Every process runs with OMP_NUM_THREADS=1 (torchrun sets that only when it
  starts several processes, which would favour the baselines).

  one failure, the same schedule for both libraries: the last group SIGKILLs
  itself before step K; its torchrun (--max-restarts 1) restarts it and it
  heals. Measured from the logs: kill -> the survivors' next committed step,
  the survivors' steps not committed, kill -> restarted process up -> healed,
  the heal's transfer (bytes, time) against the loopback bandwidth measured
  here (a TCP transfer over 127.0.0.1, 256 MB by default), and the steps the restarted
  group missed or had to redo.

--groups 1 runs the steady state only, one group against one plain process:
the FT machinery's own cost, without a peer or a cross-replica all-reduce.

Prints a table and writes everything to --out (JSON). Timings vary by run and
by machine load: run it on an otherwise idle machine.
"""
import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLOCK = r"(\d\d):(\d\d):(\d\d)\.(\d\d\d)"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sod(hms):
    """HH:MM:SS.mmm groups -> seconds of the (local) day."""
    h, m, s, ms = (int(x) for x in hms)
    return h * 3600 + m * 60 + s + ms / 1000


def epoch_ms_to_sod(ms):
    t = time.localtime(ms / 1000)
    return t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec + (ms % 1000) / 1000


def since(later, earlier):
    """later - earlier in seconds of the day, across midnight."""
    return (later - earlier + 43200) % 86400 - 43200


def loopback_bandwidth(total=256 << 20, chunk=4 << 20):
    """Bytes per second of one TCP stream over 127.0.0.1 (sender and receiver
    threads in this process; the socket calls release the GIL)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    got = [0]

    def receive():
        conn, _ = server.accept()
        buf = bytearray(chunk)
        view = memoryview(buf)
        while got[0] < total:
            n = conn.recv_into(view)
            if n == 0:
                break
            got[0] += n
        conn.close()

    reader = threading.Thread(target=receive)
    reader.start()
    payload = memoryview(bytes(chunk))
    with socket.create_connection(server.getsockname()) as out:
        t0 = time.perf_counter()
        sent = 0
        while sent < total:  # exactly `total`: the receiver stops there
            n = min(chunk, total - sent)
            out.sendall(payload[:n])
            sent += n
        reader.join()
        elapsed = time.perf_counter() - t0
    server.close()
    return {"bytes": got[0], "seconds": elapsed, "bytes_per_s": got[0] / elapsed}


def _quorum_probe(addr, g, rounds, out):
    from datetime import timedelta

    os.environ["RUST_LOG"] = "warn"
    from torchft._torchft import LighthouseClient

    client = LighthouseClient(addr, connect_timeout=timedelta(seconds=10))
    times = []
    for i in range(rounds):
        t0 = time.perf_counter()
        client.quorum(replica_id=f"probe{g}", timeout=timedelta(seconds=10), address="", store_address="",
                      step=i, world_size=1, shrink_only=False)
        times.append(time.perf_counter() - t0)
    out.put(times[5:])


def lighthouse_round_trip(lighthouse_cmd, groups, rounds=200):
    """The lighthouse's quorum as a per-step barrier: R client processes (the
    Rust client torchft ships) ask for a quorum in lockstep, nothing else
    running; the median of the calls' times (the first 5 left out), in ms."""
    import multiprocessing as mp

    port = free_port()
    lh = subprocess.Popen([*lighthouse_cmd, "--bind", f"127.0.0.1:{port}", "--min_replicas", str(groups),
                           "--join_timeout_ms", "1000", "--quorum_tick_ms", "20"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        time.sleep(0.3)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_quorum_probe, args=(f"http://127.0.0.1:{port}", g, rounds, q))
                 for g in range(groups)]
        for p in procs:
            p.start()
        times = [t for _ in procs for t in q.get(timeout=120)]
        for p in procs:
            p.join()
    finally:
        lh.terminate()
        lh.wait()
    return {"clients": groups, "rounds": rounds, "median_ms": statistics.median(times) * 1000}


class Runner:
    def __init__(self, a):
        self.a = a
        self.torchrun = a.torchrun or os.path.join(a.venv, "bin", "torchrun")
        # The wheel's lighthouse; a .py file (tests/ft/lighthouse.py) runs under this Python.
        lighthouse = a.lighthouse or os.path.join(a.venv, "bin", "torchft_lighthouse")
        self.lighthouse_cmd = [sys.executable, lighthouse] if lighthouse.endswith(".py") else [lighthouse]
        self.trainer = os.path.join(a.build, "examples", "ft_train")
        self.script = os.path.join(ROOT, "bench", "ft", "torchft_ddp.py")
        self.env = dict(os.environ, OMP_NUM_THREADS="1")
        if a.quiet_torchft:
            self.env["RUST_LOG"] = "warn"  # torchft's manager logs every quorum at INFO otherwise

    def spawn(self, cmd, log_path, env):
        log = open(log_path, "w")
        # Own session: on a timeout the whole torchrun tree is ended by its id.
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        p.log = log
        return p

    def wait_all(self, procs, what):
        deadline = time.time() + self.a.run_timeout
        try:
            for p in procs:
                p.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            raise RuntimeError(f"{what}: did not finish within {self.a.run_timeout} s")
        finally:
            for p in procs:
                p.log.close()
        bad = [p.returncode for p in procs if p.returncode != 0]
        if bad:
            raise RuntimeError(f"{what}: exit status {bad}")

    def start_lighthouse(self, workdir, min_replicas):
        port = free_port()
        lh = self.spawn([*self.lighthouse_cmd, "--bind", f"127.0.0.1:{port}", "--min_replicas", str(min_replicas),
                         "--join_timeout_ms", "1000", "--quorum_tick_ms", "20", "--heartbeat_timeout_ms",
                         str(self.a.heartbeat_timeout_ms)],
                        os.path.join(workdir, "lighthouse.log"), dict(self.env, RUST_LOG="info"))
        time.sleep(0.3)
        return lh, port

    def stop(self, p):
        if p.poll() is None:
            p.terminate()
            p.wait()
        p.log.close()

    def ft_groups(self, lib, workdir, hidden, steps, min_replicas, kill=None, step_ms=0, groups=None):
        """R groups of `lib` (shardtorch or torchft) against a fresh lighthouse;
        returns the groups' log texts."""
        shutil.rmtree(workdir, ignore_errors=True)
        os.makedirs(workdir)
        a = self.a
        groups = groups or a.groups
        lh, port = self.start_lighthouse(workdir, min_replicas)
        procs = []
        try:
            for g in range(groups):
                restarts = ["--max-restarts", "1", "--monitor-interval", "0.2"] if kill else []
                common = ["--steps", str(steps), "--groups", str(groups), "--hidden", str(hidden), "--dir", workdir,
                          "--timeout-ms", str(a.timeout_ms)]
                if step_ms:
                    common += ["--step-ms", str(step_ms)]
                if kill and g == groups - 1:
                    common += ["--kill", f"0@{kill}"]
                if lib == "shardtorch" and a.prefetch_quorum:
                    common += ["--prefetch-quorum"]
                if lib == "shardtorch":
                    env = dict(self.env, SHARDTORCH_FT_LIGHTHOUSE=f"127.0.0.1:{port}",
                               SHARDTORCH_FT_REPLICA_GROUP=str(g))
                    cmd = [self.torchrun, "--no-python", "--standalone", "--nproc-per-node", "1", *restarts,
                           self.trainer, *common]
                else:
                    env = dict(self.env, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", REPLICA_GROUP_ID=str(g))
                    cmd = [self.torchrun, "--standalone", "--nproc-per-node", "1", *restarts, self.script,
                           "--mode", "ft", *common]
                procs.append(self.spawn(cmd, os.path.join(workdir, f"group-{g}.log"), env))
            self.wait_all(procs, f"{lib} FT in {workdir}")
        finally:
            self.stop(lh)
        return [open(os.path.join(workdir, f"group-{g}.log")).read() for g in range(groups)]

    def baseline(self, lib, workdir, hidden, steps, groups=None):
        shutil.rmtree(workdir, ignore_errors=True)
        os.makedirs(workdir)
        groups = groups or self.a.groups
        common = ["--steps", str(steps), "--groups", str(groups), "--hidden", str(hidden)]
        if lib == "shardtorch":
            cmd = [self.torchrun, "--no-python", "--standalone", "--nproc-per-node", str(groups), self.trainer,
                   "--no-ft", *common]
        else:
            cmd = [self.torchrun, "--standalone", "--nproc-per-node", str(groups), self.script, "--mode", "ddp",
                   *common]
        p = self.spawn(cmd, os.path.join(workdir, "run.log"), self.env)
        self.wait_all([p], f"{lib} without FT in {workdir}")
        text = open(os.path.join(workdir, "run.log")).read()
        m = re.search(r"without fault tolerance: (\d+) ranks, step time: median ([\d.]+) ms", text)
        if not m:
            raise RuntimeError(f"no step time in {workdir}/run.log")
        return float(m.group(2))


def group_medians(texts):
    out = []
    for g, text in enumerate(texts):
        m = re.search(rf"group {g}: step time: median ([\d.]+) ms over (\d+) steady steps", text)
        if not m:
            raise RuntimeError(f"group {g} printed no step time")
        out.append(float(m.group(1)))
    return out


def commits(workdir, g):
    """[(step, seconds of the day)] of the group's committed steps, in order."""
    out = []
    path = os.path.join(workdir, f"steps-{g}.txt")
    if os.path.exists(path):
        for line in open(path):
            w = line.split()
            out.append((int(w[0]), epoch_ms_to_sod(int(w[4]))))
    return out


def failure_figures(lib, workdir, texts, groups, steady_ms):
    victim = groups - 1
    vt = texts[victim]
    kill = re.search(rf"killing itself at step (\d+) at {CLOCK}", vt)
    if not kill:
        raise RuntimeError(f"{lib}: the victim did not die")
    k_step, t_kill = int(kill.group(1)), sod(kill.groups()[1:])
    after_kill = vt[kill.end():]
    f = {"killed_group": victim, "killed_before_step": k_step}

    # The survivors: their next committed step, their steps not committed.
    resume, stalls, failed = {}, {}, {}
    for g in range(groups):
        if g == victim:
            continue
        cs = commits(workdir, g)
        nxt = next(((s, t) for s, t in cs if since(t, t_kill) > 0), None)
        prev = max((t for s, t in cs if since(t, t_kill) <= 0), default=None)
        if nxt:
            resume[g] = {"step": nxt[0], "ms": round(since(nxt[1], t_kill) * 1000)}
            if prev is not None:
                stalls[g] = round(since(nxt[1], prev) * 1000)
        if lib == "shardtorch":
            lost = re.findall(rf"\[shardtorch-ft {CLOCK}\] group {g}: step (\d+) not committed", texts[g])
            failed[g] = [int(x[4]) for x in lost]
        else:
            failed[g] = [int(x) for x in re.findall(rf"group {g}: step (\d+) not committed at", texts[g])]
    f["survivors_next_commit_after_kill_ms"] = resume
    f["kill_to_survivors_resumed_ms"] = max((r["ms"] for r in resume.values()), default=None)
    f["survivors_commit_gap_across_kill_ms"] = stalls
    f["survivors_steps_not_committed"] = failed
    f["survivor_steady_step_ms"] = steady_ms

    # The restarted group: up, healed (the transfer's time and bytes).
    if lib == "shardtorch":
        up = re.search(rf"\[shardtorch-ft {CLOCK}\] group {victim}: replica .*restarted", after_kill)
        heal = re.search(rf"\[shardtorch-ft {CLOCK}\] group {victim}: healed from '([^']+)': step (\d+) -> (\d+) "
                         rf"in (\d+) ms", after_kill)
        sent = None
        if heal:
            for g in range(groups):
                for m in re.finditer(rf"\[shardtorch-ft {CLOCK}\] group {g}: step (\d+): sent this (?:rank|group)'s "
                                     rf"state(?: \((\d+) bytes\))? to '{victim}' in (\d+) ms", texts[g]):
                    if since(sod(m.groups()[:4]), t_kill) > 0:
                        sent = m
        if heal:
            f["healed_from"] = heal.group(5)
            f["healed_step"] = (int(heal.group(6)), int(heal.group(7)))
            f["kill_to_healed_ms"] = round(since(sod(heal.groups()[:4]), t_kill) * 1000)
            f["heal_transfer_ms"] = int(heal.group(8))
            f["heal_transfer_what"] = "the healed group's own figure: the heal in should_commit(), receive and load"
        if sent:
            f["heal_source_send_ms"] = int(sent.group(7))
        if sent and sent.group(6):
            f["heal_bytes"] = int(sent.group(6))
            f["heal_bytes_what"] = "the source's log: this rank's state as sent over Gloo"
        else:
            # Older ft_train logs no byte count: parameters + AdamW's two moments, float32.
            m = re.search(r"parameters of (\d+) elements", vt)
            if m:
                f["heal_bytes"] = 3 * 4 * int(m.group(1))
                f["heal_bytes_what"] = "estimated: 3 x 4 bytes per parameter element (the source logged no bytes)"
    else:
        up = re.search(rf"group {victim}: incarnation 1, manager up at {CLOCK}", after_kill)
        heal = re.search(rf"group {victim}: healed: step (\d+) -> (\d+) at {CLOCK}, state (\d+) bytes", after_kill)
        fetch = None
        for m in re.finditer(rf"\[torchft {CLOCK}\] fetching checkpoint from (\S+) took ([\d.e-]+)s", after_kill):
            fetch = m
        if heal:
            f["healed_step"] = (int(heal.group(1)), int(heal.group(2)))
            f["kill_to_healed_ms"] = round(since(sod(heal.groups()[2:6]), t_kill) * 1000)
            f["heal_bytes"] = int(heal.group(7))
            f["heal_bytes_what"] = ("torch.save's size of the state dict received (torchft does not log the bytes "
                                    "its HTTP transport moved)")
        if fetch:
            f["heal_transfer_ms"] = round(float(fetch.group(6)) * 1000, 1)
            f["heal_transfer_what"] = "torchft's HTTP transport: fetching the checkpoint (GET and torch.load)"
    if up:
        f["kill_to_restarted_up_ms"] = round(since(sod(up.groups()[:4]), t_kill) * 1000)
    if "healed_step" in f:
        healed_to = f["healed_step"][1]
        f["steps_without_killed_group"] = healed_to - k_step
        f["steps_redone_by_killed_group"] = max(0, k_step - healed_to)
        # The survivors while it healed: their longest gap between commits
        # from the restarted process's start to 2 s after its heal.
        if up:
            t0 = sod(up.groups()[:4])
            t1 = t0 + f["kill_to_healed_ms"] / 1000 - f["kill_to_restarted_up_ms"] / 1000 + 2
            gaps = []
            for g in range(groups):
                if g == victim:
                    continue
                cs = [t for s, t in commits(workdir, g) if since(t, t0) >= 0 and since(t, t1) <= 0]
                gaps += [round(since(b, a_) * 1000) for a_, b in zip(cs, cs[1:])]
            f["survivors_longest_commit_gap_while_healing_ms"] = max(gaps, default=None)
    return f


def fmt(v, unit=""):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.2f}{unit}"
    return f"{v}{unit}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--venv", default=os.path.join(ROOT, ".venv"))
    ap.add_argument("--workdir", default=None, help="logs (default BUILD/ft-bench)")
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--hidden", default="256,1024", help="model widths, comma-separated")
    ap.add_argument("--groups", type=int, default=3,
                    help="replica count R (1: the FT machinery alone, without a peer or a cross-replica all-reduce)")
    ap.add_argument("--steps", type=int, default=200, help="steps of each steady-state run")
    ap.add_argument("--repeats", type=int, default=3, help="steady-state runs of each kind (the median is reported)")
    ap.add_argument("--timeout-ms", type=int, default=5000, help="both managers' collective timeout")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=1000, help="the lighthouse's")
    ap.add_argument("--fail-hidden", type=int, default=256)
    ap.add_argument("--fail-steps", type=int, default=200)
    ap.add_argument("--kill-step", type=int, default=30, help="the last group dies before this step")
    ap.add_argument("--fail-step-ms", type=int, default=50,
                    help="sleep after each step in the failure runs, so that the survivors are still training "
                         "when the killed group comes back")
    ap.add_argument("--no-failure", action="store_true")
    ap.add_argument("--prefetch-quorum", action="store_true",
                    help="shardtorch's groups run with ManagerOptions::prefetch_quorum (ft_train --prefetch-quorum)")
    ap.add_argument("--quiet-torchft", type=int, default=1,
                    help="1: RUST_LOG=warn for torchft's groups (its manager logs every quorum at INFO otherwise)")
    ap.add_argument("--run-timeout", type=float, default=240, help="seconds per run")
    ap.add_argument("--libs", default="shardtorch,torchft", help="which sides to run (both for the comparison)")
    ap.add_argument("--torchrun", default=None, help="default VENV/bin/torchrun")
    ap.add_argument("--lighthouse", default=None,
                    help="the lighthouse to start (default VENV/bin/torchft_lighthouse; a .py file runs under this "
                         "Python: tests/ft/lighthouse.py starts the same server without importing torch)")
    ap.add_argument("--loopback-mb", type=int, default=256, help="size of the loopback bandwidth measurement")
    ap.add_argument("--quorum-rounds", type=int, default=200,
                    help="quorum calls per client in the lighthouse measurement (the first 5 are left out)")
    a = ap.parse_args()
    if a.loopback_mb < 1:
        ap.error("--loopback-mb must be 1 or more")
    if a.quorum_rounds <= 5:
        ap.error("--quorum-rounds must be over 5 (the first 5 calls are left out)")
    if a.steps <= 5:
        ap.error("--steps must be over 5 (the step-time medians leave out the first 5 steps)")
    libs = a.libs.split(",")
    a.workdir = a.workdir or os.path.join(a.build, "ft-bench")
    os.makedirs(a.workdir, exist_ok=True)
    r = Runner(a)
    hiddens = [int(h) for h in a.hidden.split(",")]
    results = {
        "command": " ".join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT) else
                             sys.executable] + [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "settings": {k: v for k, v in vars(a).items() if k not in ("build", "venv", "workdir", "out")},
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    results["ft_train"] = {"path": r.trainer,
                           "built": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(r.trainer)))}
    try:
        from importlib.metadata import version
        results["machine"]["torchft"] = version("torchft-nightly")
    except Exception:
        pass
    try:
        import torch  # noqa: F401  (versions only)
        results["machine"]["torch"] = torch.__version__
    except Exception:
        pass

    bw = loopback_bandwidth(total=a.loopback_mb << 20)
    results["loopback"] = bw
    print(f"loopback (one TCP stream, 127.0.0.1): {bw['bytes'] >> 20} MiB in {bw['seconds']:.3f} s = "
          f"{bw['bytes_per_s'] / 1e6:.0f} MB/s", flush=True)

    rt = lighthouse_round_trip(r.lighthouse_cmd, a.groups, a.quorum_rounds)
    results["lighthouse_quorum"] = rt
    print(f"lighthouse quorum, {a.groups} clients in lockstep (a barrier per step): median "
          f"{rt['median_ms']:.3f} ms per call", flush=True)

    steady = []
    for h in hiddens:
        row = {"hidden": h, "runs": {"shardtorch_ft": [], "shardtorch": [], "torchft_ft": [], "torch_ddp": []}}
        for rep in range(a.repeats):
            d = os.path.join(a.workdir, f"h{h}-r{rep}")
            if "shardtorch" in libs:
                texts = r.ft_groups("shardtorch", d + "-shardtorch-ft", h, a.steps, a.groups)
                row["runs"]["shardtorch_ft"].append(group_medians(texts))
                row["runs"]["shardtorch"].append(r.baseline("shardtorch", d + "-shardtorch", h, a.steps))
            if "torchft" in libs:
                texts = r.ft_groups("torchft", d + "-torchft-ft", h, a.steps, a.groups)
                row["runs"]["torchft_ft"].append(group_medians(texts))
                row["runs"]["torch_ddp"].append(r.baseline("torchft", d + "-torch-ddp", h, a.steps))
            print(f"hidden {h} run {rep}: " + ", ".join(f"{k} {v[-1]}" for k, v in row["runs"].items() if v),
                  flush=True)
        # A FT run's figure: the median of its groups' medians; then the median over the repeats.
        for k, v in row["runs"].items():
            row[k + "_ms"] = (statistics.median(statistics.median(x) if isinstance(x, list) else x for x in v)
                              if v else float("nan"))
        row["shardtorch_overhead"] = row["shardtorch_ft_ms"] / row["shardtorch_ms"] - 1
        row["torchft_overhead"] = row["torchft_ft_ms"] / row["torch_ddp_ms"] - 1
        # Each repeat's FT run against the baseline run right after it: the spread shows the noise.
        for ft, base in (("shardtorch_ft", "shardtorch"), ("torchft_ft", "torch_ddp")):
            row[ft.split("_")[0] + "_overhead_per_repeat"] = [
                statistics.median(x) / y - 1 for x, y in zip(row["runs"][ft], row["runs"][base])]
        steady.append(row)
    results["steady"] = steady

    print()
    print(f"steady state: R={a.groups} replicas, {a.steps} steps, median step time (first 5 steps skipped), "
          f"median of {a.repeats} runs")
    print(f"{'hidden':>6} | {'shardtorch FT':>13} | {'shardtorch':>10} | {'overhead':>8} | {'torchft FT':>10} | "
          f"{'torch DDP':>9} | {'overhead':>8}")
    for row in steady:
        print(f"{row['hidden']:>6} | {row['shardtorch_ft_ms']:>10.3f} ms | {row['shardtorch_ms']:>7.3f} ms | "
              f"{row['shardtorch_overhead'] * 100:>7.1f}% | {row['torchft_ft_ms']:>7.3f} ms | "
              f"{row['torch_ddp_ms']:>6.3f} ms | {row['torchft_overhead'] * 100:>7.1f}%", flush=True)
    for row in steady:
        print(f"hidden {row['hidden']}: overhead of each repeat (FT run against the baseline run after it): "
              f"shardtorch {', '.join(f'{x * 100:.1f}%' for x in row['shardtorch_overhead_per_repeat'])}; "
              f"torchft {', '.join(f'{x * 100:.1f}%' for x in row['torchft_overhead_per_repeat'])}")
    if not a.no_failure and a.groups >= 2:
        fail = {}
        for lib in libs:
            d = os.path.join(a.workdir, f"failure-{lib}")
            texts = r.ft_groups(lib, d, a.fail_hidden, a.fail_steps, max(1, a.groups - 1), kill=a.kill_step,
                                step_ms=a.fail_step_ms)
            meds = group_medians(texts)
            fail[lib] = failure_figures(lib, d, texts, a.groups, statistics.median(meds[:-1]))
        results["failure"] = fail
        rows = [
            ("killed before step", "killed_before_step", ""),
            ("kill -> survivors' next commit", "kill_to_survivors_resumed_ms", " ms"),
            ("survivors' steps not committed", "survivors_steps_not_committed", ""),
            ("kill -> restarted process up", "kill_to_restarted_up_ms", " ms"),
            ("kill -> healed", "kill_to_healed_ms", " ms"),
            ("healed to step", "healed_step", ""),
            ("heal transfer", "heal_transfer_ms", " ms"),
            ("state moved", "heal_bytes", " B"),
            ("survivors' longest gap while healing", "survivors_longest_commit_gap_while_healing_ms", " ms"),
            ("steps without the killed group", "steps_without_killed_group", ""),
            ("steps redone by the killed group", "steps_redone_by_killed_group", ""),
        ]
        print()
        print(f"one failure: hidden {a.fail_hidden}, {a.fail_steps} steps, {a.fail_step_ms} ms sleep per step, "
              f"group {a.groups - 1} SIGKILLed before step {a.kill_step}, lighthouse heartbeat timeout "
              f"{a.heartbeat_timeout_ms} ms; loopback {bw['bytes_per_s'] / 1e6:.0f} MB/s")
        print(f"{'':>38} | {'shardtorch':>16} | {'torchft':>16}")
        for label, key, unit in rows:
            vals = []
            for lib in ("shardtorch", "torchft"):
                v = fail.get(lib, {}).get(key)
                if isinstance(v, dict):
                    v = sum(len(x) for x in v.values())
                elif isinstance(v, (tuple, list)):
                    v = f"{v[0]} -> {v[1]}"
                vals.append(fmt(v, unit))
            print(f"{label:>38} | {vals[0]:>16} | {vals[1]:>16}")
        for lib in libs:
            f = fail[lib]
            if f.get("heal_bytes") and f.get("heal_transfer_ms"):
                rate = f["heal_bytes"] / (f["heal_transfer_ms"] / 1000) if f["heal_transfer_ms"] else float("inf")
                f["heal_effective_bytes_per_s"] = rate
                f["heal_share_of_loopback"] = rate / bw["bytes_per_s"]
                print(f"{lib}: heal moved {f['heal_bytes']} B in {f['heal_transfer_ms']} ms = {rate / 1e6:.1f} MB/s "
                      f"({rate / bw['bytes_per_s'] * 100:.2f}% of loopback; at loopback speed it would take "
                      f"{f['heal_bytes'] / bw['bytes_per_s'] * 1000:.2f} ms)")
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    if a.out:
        with open(a.out, "w") as out:
            json.dump(results, out, indent=2)
        print(f"\nresults: {a.out}; logs: {a.workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
