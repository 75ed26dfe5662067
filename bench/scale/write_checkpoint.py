"""Writes the base of scale_gpt's finetune model (examples/scale_gpt.cpp) as a
Hugging Face multi-file checkpoint: model.safetensors.index.json and
model-0000K-of-0000N.safetensors, bf16, names "model.<name>", the LM head tied
to model.tok_emb.weight (not written). Streaming: one data file's tensors
(at most --max-file-bytes) are in memory at a time, never the model.

    python bench/scale/write_checkpoint.py --out /tmp/base --layers 26 --d-model 3072
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file


def tensors(a):
    d = a.d_model
    yield "model.tok_emb.weight", (a.vocab, d), "normal"
    yield "model.pos_emb.weight", (a.seq, d), "normal"
    for i in range(a.layers):
        p = f"model.blocks.{i}."
        yield p + "ln1.weight", (d,), "ones"
        yield p + "ln1.bias", (d,), "zeros"
        yield p + "qkv.weight", (3 * d, d), "normal"
        yield p + "proj.weight", (d, d), "normal"
        yield p + "proj.bias", (d,), "zeros"
        yield p + "ln2.weight", (d,), "ones"
        yield p + "ln2.bias", (d,), "zeros"
        yield p + "fc1.weight", (4 * d, d), "normal"
        yield p + "fc1.bias", (4 * d,), "zeros"
        yield p + "fc2.weight", (d, 4 * d), "normal"
        yield p + "fc2.bias", (d,), "zeros"
    yield "model.ln_f.weight", (d,), "ones"
    yield "model.ln_f.bias", (d,), "zeros"


def make(shape, kind, gen):
    if kind == "ones":
        return torch.ones(shape, dtype=torch.bfloat16)
    if kind == "zeros":
        return torch.zeros(shape, dtype=torch.bfloat16)
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--d-model", type=int, required=True)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--max-file-bytes", type=int, default=2_000_000_000)
    a = ap.parse_args()
    specs = list(tensors(a))
    # Files in order, each filled until the next tensor would pass the limit (as save_pretrained).
    plan, size = [[]], 0
    for name, shape, kind in specs:
        nbytes = 2 * int(torch.Size(shape).numel())
        if plan[-1] and size + nbytes > a.max_file_bytes:
            plan.append([])
            size = 0
        plan[-1].append((name, shape, kind))
        size += nbytes
    os.makedirs(a.out, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for k, group in enumerate(plan):
        fname = f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors"
        part = {name: make(shape, kind, gen) for name, shape, kind in group}
        save_file(part, os.path.join(a.out, fname), metadata={"format": "pt"})
        for name, t in part.items():
            weight_map[name] = fname
            total += t.numel() * 2
        del part
        print(f"wrote {fname}", flush=True)
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    print(json.dumps({"files": len(plan), "bytes": total, "params": total // 2}))


if __name__ == "__main__":
    main()
