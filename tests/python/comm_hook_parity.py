"""PyTorch DDP with its own comm hooks against shardtorch NoShard with the
same hook, at 2 ranks on Gloo: same initial weights, same data, SGD.

    comm_hook_parity.py --torchrun T --cpp BIN --hook allreduce,fp16,bf16 --workdir D

runs DDP (this file, as a torchrun worker) and the C++ program
(tests/comm_hook_parity.cpp) under torchrun, each once for all the hooks (a
fresh model per hook), then compares, per hook, every rank's loss
at every step and the reduced gradients after the first backward (SGD keeps
the gradients' scale visible in the parameters; the gradients are compared
as well). Both sides build the weights and the batches from the same integer
formulas, so they start from the same values without a file in between.
"""
import argparse
import json
import os
import subprocess
import sys

STEPS = 6
IN, HIDDEN, OUT, BATCH = 16, 32, 4, 8
LR = 0.1
TOL = 1e-6


def weight_values(numel, salt):
    return [((i * 37 + salt * 11) % 101 - 50) / 512.0 for i in range(numel)]


def batch(step, rank, rows, cols, mod, scale):
    return [[(((step * 131 + rank * 71 + b * 17 + j * 7) % mod) - mod // 2) / scale for j in range(cols)]
            for b in range(rows)]


def ddp_worker(hooks, out_dir):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for hook_name in hooks:
        ddp_train(hook_name, out_dir)
    dist.destroy_process_group()
    # End without finalizing the interpreter: a Gloo worker thread that outlives the group can
    # abort Py_FinalizeEx (std::terminate; see bench/ft/torchft_ddp.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def ddp_train(hook_name, out_dir):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(IN, HIDDEN)
            self.fc2 = torch.nn.Linear(HIDDEN, OUT)

        def forward(self, x):
            return self.fc2(torch.tanh(self.fc1(x)))

    net = Net()
    with torch.no_grad():
        for salt, (name, p) in enumerate(net.named_parameters()):
            p.copy_(torch.tensor(weight_values(p.numel(), salt), dtype=torch.float32).view(p.shape))
    model = DDP(net)
    def bf16_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # PyTorch's own bf16_compress_hook, called under another name: DDP
        # refuses that name unless NCCL is there (a check by name), while
        # Gloo all-reduces bf16 on the CPU.
        return default_hooks.bf16_compress_hook(state, bucket)

    hook = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
            "bf16": bf16_hook}[hook_name]
    model.register_comm_hook(dist.group.WORLD, hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        x = torch.tensor(batch(step, rank, BATCH, IN, 97, 64.0), dtype=torch.float32)
        y = torch.tensor(batch(step + 1000, rank, BATCH, OUT, 89, 128.0), dtype=torch.float32)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.reshape(-1).tolist() for n, p in net.named_parameters()}
        opt.step()
    with open(os.path.join(out_dir, f"ddp_{hook_name}_rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "grads": grads}, f)


def compare(workdir, hook):
    worst_loss = worst_grad = 0.0
    for rank in range(2):
        with open(os.path.join(workdir, f"ddp_{hook}_rank{rank}.json")) as f:
            ddp = json.load(f)
        with open(os.path.join(workdir, f"cpp_{hook}_rank{rank}.json")) as f:
            cpp = json.load(f)
        assert len(ddp["losses"]) == len(cpp["losses"]) == STEPS, (len(ddp["losses"]), len(cpp["losses"]))
        for step, (a, b) in enumerate(zip(ddp["losses"], cpp["losses"])):
            print(f"{hook} rank {rank} step {step}: DDP loss {a:.9g}, shardtorch {b:.9g}")
            worst_loss = max(worst_loss, abs(a - b))
        assert sorted(ddp["grads"]) == sorted(cpp["grads"]), (sorted(ddp["grads"]), sorted(cpp["grads"]))
        for name in ddp["grads"]:
            a, b = ddp["grads"][name], cpp["grads"][name]
            assert len(a) == len(b), name
            worst_grad = max(worst_grad, max(abs(u - v) for u, v in zip(a, b)))
    print(f"{hook}: largest loss difference {worst_loss:.3g}, largest first-step gradient difference {worst_grad:.3g}"
          f" (tolerance {TOL})")
    return worst_loss <= TOL and worst_grad <= TOL


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hook", required=True, help="comma-separated: allreduce, fp16, bf16")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--worker", action="store_true", help="run as a DDP rank (under torchrun)")
    ap.add_argument("--torchrun")
    ap.add_argument("--cpp")
    args = ap.parse_args()
    hooks = args.hook.split(",")
    unknown = [h for h in hooks if h not in ("allreduce", "fp16", "bf16")]
    if unknown:
        ap.error(f"unknown hook(s) {unknown}: allreduce, fp16, bf16")
    if args.worker:
        ddp_worker(hooks, args.workdir)
        return 0
    os.makedirs(args.workdir, exist_ok=True)
    for f in os.listdir(args.workdir):
        if f.endswith(".json"):
            os.remove(os.path.join(args.workdir, f))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = [args.torchrun, "--standalone", "--nproc-per-node", "2"]
    subprocess.run(common + [os.path.abspath(__file__), "--worker", "--hook", args.hook,
                             "--workdir", args.workdir], check=True, env=env)
    subprocess.run(common + ["--no-python", args.cpp, args.hook, args.workdir], check=True, env=env)
    results = [compare(args.workdir, hook) for hook in hooks]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
