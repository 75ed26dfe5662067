#!/usr/bin/env python3
"""The layer rule of src/ (docs/design.md, "Where things live"): each folder of
src/ is a layer, and a file may include only headers of its own layer or of
layers below it. Public headers (include/shardtorch/) belong to the layer of
what they declare and obey the same rule. Reads the quoted #include lines;
prints every include that runs upward and exits 1 if there is one.

  python3 scripts/check_layers.py [source dir]
"""
import os
import re
import sys

# Bottom to top. A folder's files may include its own and earlier folders'.
LAYERS = [
    "base",        # checks, errors, files, storage access, memory accounting
    "deferred",    # deferred construction (meta tensors, replay)
    "comm",        # Comm and its backends, the collective check, peer records, World, DeviceMesh
    "buckets",     # the reduce-scatter and all-reduce bucketers
    "runtime",     # one sharded model's state: units, flat parameters, reduction, offload, recompute
    "shard",       # the front door: shard(), the model handle, summon_full_params
    "plan",        # the memory planner (arithmetic over unit shapes)
    "optim",       # optimizers over shards, fused kernels, grad scaler, clipping
    "checkpoint",  # safetensors, full and sharded state dicts, Hugging Face checkpoints
    "ft",          # fault tolerance across replica groups
    "parallel",    # model parallelism: pipeline stages and schedules, tensor parallelism
    "testing",     # the multi-rank test helper
]

# Public headers by layer (each must be listed: a new one is an error until placed).
PUBLIC = {
    "base": ["error.h", "export.h", "log.h", "memory.h", "checkpoint/safetensors_error.h"],
    "deferred": ["deferred.h"],
    "comm": ["collectives.h", "world.h", "comm_hooks.h", "mesh.h"],
    "runtime": ["flat_param_layout.h", "shard_options.h", "unit.h"],
    "shard": ["sharded_model.h", "sharded.h", "gather.h"],
    "plan": ["plan.h"],
    "optim": ["optim.h", "optim/cpu_adam.h", "grad_scaler.h", "clip.h"],
    "checkpoint": ["checkpoint.h", "checkpoint/safetensors.h", "hf_checkpoint.h", "dcp_checkpoint.h", "snapshot.h"],
    "ft": ["ft.h"],
    "parallel": ["schedule.h", "pipeline.h", "pipeline_checkpoint.h", "tensor_parallel.h"],
    "testing": ["testing.h", "parity.h"],
    None: ["shardtorch.h"],  # the umbrella header: includes everything, included by nothing here
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def main():
    top = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    src, inc = os.path.join(top, "src"), os.path.join(top, "include", "shardtorch")
    rank = {name: i for i, name in enumerate(LAYERS)}
    public = {h: layer for layer, hs in PUBLIC.items() for h in hs}
    problems = []

    def layer_of(path):
        """(layer, shown name) of a file of src/ or include/shardtorch/; layer None: the umbrella."""
        if path.startswith(src + os.sep):
            rel = os.path.relpath(path, src)
            folder = rel.split(os.sep)[0]
            if folder not in rank:
                problems.append(f"src/{rel}: folder '{folder}' is not a layer (scripts/check_layers.py, LAYERS)")
                return "?", "src/" + rel
            return folder, "src/" + rel
        rel = os.path.relpath(path, inc)
        if rel not in public:
            problems.append(f"include/shardtorch/{rel}: public header in no layer (scripts/check_layers.py, PUBLIC)")
            return "?", "shardtorch/" + rel
        return public[rel], "shardtorch/" + rel

    files = []
    for base in (src, inc):
        for d, _, names in os.walk(base):
            files += [os.path.join(d, n) for n in names if n.endswith((".h", ".cpp", ".hpp"))]
    if not files:
        print(f"check_layers: no sources under {src}", file=sys.stderr)
        return 1
    edges = 0
    for f in sorted(files):
        mine, shown = layer_of(f)
        if mine == "?":
            continue
        for name in INCLUDE.findall(open(f, encoding="utf-8").read()):
            if name.startswith("shardtorch/"):
                target = os.path.join(inc, name[len("shardtorch/"):])
            else:
                target = os.path.normpath(os.path.join(os.path.dirname(f), name))
                if not os.path.exists(target):
                    target = os.path.join(src, name)
            if not os.path.exists(target) or not target.startswith((src + os.sep, inc + os.sep)):
                continue  # generated or outside the library (cuda/, lighthouse.grpc.pb.h)
            theirs, their_name = layer_of(target)
            if theirs == "?":
                continue
            edges += 1
            if theirs is None:
                problems.append(f"{shown} includes the umbrella header {their_name}")
            elif mine is not None and rank[theirs] > rank[mine]:
                problems.append(f"{shown} ({mine}) includes {their_name} ({theirs}): an include up the layers")
    for p in problems:
        print(p)
    print(f"check_layers: {len(files)} files, {edges} includes within the library, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
