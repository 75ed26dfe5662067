"""Writes the PyTorch twin of examples/gpt.h (gpt::Config{}) as a Hugging
Face checkpoint in several files, the way transformers' save_pretrained does
(safetensors.torch.save_file per file, each tensor whole in one file, a tied
weight saved once, and model.safetensors.index.json with metadata.total_size
and the weight_map), in fp32 and in bf16, and beside each a reference file
holding every name for the C++ side to load as a full state dict.
usage: write_hf_checkpoint.py DIR"""
import json
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "peers"))
from gpt_model import GPT  # noqa: E402

MAX_SHARD_BYTES = 24 * 1024  # small, so that the 2-block GPT spans several files


def split_into_shards(state, max_bytes):
    """Greedy, in the state dict's order, as huggingface_hub's
    split_torch_state_dict_into_shards (which transformers calls) does: a
    tensor that would overflow the current file starts the next one."""
    shards, current, size = [], {}, 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if current and size + n > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += n
    if current:
        shards.append(current)
    return shards


def write(state, d):
    os.makedirs(d, exist_ok=True)
    shards = split_into_shards(state, MAX_SHARD_BYTES)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, os.path.join(d, fname), metadata={"format": "pt"})
        for k, v in shard.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(d, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return len(shards)


def main(d):
    torch.manual_seed(7)
    model = GPT(vocab=64, seq_len=16, d_model=32, n_head=4, n_layer=2)  # gpt::Config{}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # LayerNorms unlike each other
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for dtype, sub in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        state = {k: v.to(dtype) for k, v in model.state_dict().items()}
        # transformers saves a tied weight once (safetensors refuses shared storage).
        del state["head.weight"]
        n = write(state, os.path.join(d, sub))
        # The reference: every name, in fp32 (bf16 values widened exactly).
        ref = {k: v.to(dtype).to(torch.float32).contiguous() for k, v in full.items()}
        save_file(ref, os.path.join(d, f"{sub}-reference.safetensors"), metadata={"format": "pt"})
        print(f"write_hf_checkpoint: {sub}: {len(state)} tensors in {n} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
