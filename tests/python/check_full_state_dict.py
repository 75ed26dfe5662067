"""Loads a shardtorch full state dict with Python's safetensors into the
PyTorch equivalent of examples/gpt.h and checks that it computes the logits
the sharded C++ model computed. usage: check_full_state_dict.py DIR"""
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

# The PyTorch twin of examples/gpt.h lives with the peers benchmark.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "peers"))
from gpt_model import GPT  # noqa: E402


def main(d):
    state = load_file(f"{d}/model.safetensors")
    with safe_open(f"{d}/model.safetensors", framework="pt") as f:
        meta = f.metadata()
    # Hugging Face's loaders refuse a state dict whose "format" is not one of theirs.
    if meta.get("format") != "pt" or meta.get("shardtorch_format") != "full state dict v1":
        print(f"check_full_state_dict: metadata {meta}: want format=pt and shardtorch_format", file=sys.stderr)
        return 1
    io = load_file(f"{d}/io.safetensors")
    model = GPT(vocab=64, seq_len=16, d_model=32, n_head=4, n_layer=2)  # gpt::Config{}
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model(io["tokens"])
    err = (logits - io["logits"]).abs().max().item()
    print(f"check_full_state_dict: {len(state)} tensors loaded strictly; max |logits difference| {err:.3g}")
    if not err < 1e-4:
        print("check_full_state_dict: logits differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
