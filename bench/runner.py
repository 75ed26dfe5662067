"""What the benchmark runners share (bench/peers/run_peers.py,
bench/pipeline/run_pipeline_peers.py, bench/pipeline/run_bubble.py): a
command run with its output in a log file, and each rank's JSON report
(PREFIX.rankR.json) read back."""
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def die(prog, msg):
    """Exits with status 2 (a run failed), `msg` on stderr prefixed by `prog`."""
    print(f"{prog}: {msg}", file=sys.stderr)
    sys.exit(2)


def run_logged(prog, cmd, log_path, env=None, timeout=1800):
    """Runs `cmd` from the repository root with its output in `log_path`; on
    failure prints the log's tail and exits."""
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    t0 = time.time()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        with open(log_path) as f:
            print(f.read()[-4000:], file=sys.stderr)
        die(prog, f"command failed ({rc}); full log in {log_path}")
    print(f"  ok in {time.time() - t0:.1f} s (log {os.path.relpath(log_path, ROOT)})", flush=True)


def rank_reports(prog, prefix, nproc, who):
    """The reports PREFIX.rank0.json .. PREFIX.rank{nproc-1}.json, in rank order."""
    reps = []
    for r in range(nproc):
        path = f"{prefix}.rank{r}.json"
        if not os.path.exists(path):
            die(prog, f"{who} wrote no report {path}")
        with open(path) as f:
            reps.append(json.load(f))
    return reps
