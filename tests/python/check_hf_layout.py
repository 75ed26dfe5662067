"""Reads a Hugging Face multi-file safetensors checkpoint that shardtorch's
save_hf_checkpoint wrote, the way transformers' loaders do (the index's
weight_map, then each file), checks the layout, and checks that the PyTorch
twin of examples/gpt.h computes the logits the sharded C++ model computed.
usage: check_hf_layout.py DIR MAX_FILE_BYTES"""
import json
import os
import sys

import torch
from safetensors import safe_open

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "peers"))
from gpt_model import GPT  # noqa: E402


def fail(msg):
    print(f"check_hf_layout: {msg}", file=sys.stderr)
    return 1


def main(d, max_bytes):
    with open(f"{d}/model.safetensors.index.json") as f:
        index = json.load(f)
    weight_map = index["weight_map"]
    files = sorted(set(weight_map.values()))
    n = len(files)
    if n < 3 or files != [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]:
        return fail(f"files {files}")
    state, total = {}, 0
    for name in files:
        with safe_open(f"{d}/{name}", framework="pt") as f:
            if f.metadata().get("format") != "pt":
                return fail(f"{name}: metadata {f.metadata()}")
            keys = list(f.keys())
            nbytes = 0
            for k in keys:
                if weight_map.get(k) != name:
                    return fail(f"{k} is in {name} but the index says {weight_map.get(k)}")
                t = f.get_tensor(k)
                state[k] = t
                nbytes += t.numel() * t.element_size()
            if nbytes > max_bytes and len(keys) > 1:
                return fail(f"{name} holds {nbytes} bytes in {len(keys)} tensors, over {max_bytes}")
            total += nbytes
    if set(state) != set(weight_map):
        return fail(f"the index names tensors no file holds: {sorted(set(weight_map) - set(state))}")
    if index["metadata"]["total_size"] != total:
        return fail(f"total_size {index['metadata']['total_size']} but the files hold {total} bytes")
    model = GPT(vocab=64, seq_len=16, d_model=32, n_head=4, n_layer=2)  # gpt::Config{}
    # The tied head is saved once, under the embedding's name (as transformers saves it).
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or missing != ["head.weight"]:
        return fail(f"missing {missing}, unexpected {unexpected}")
    with safe_open(f"{d}/io.safetensors", framework="pt") as f:
        tokens, want = f.get_tensor("tokens"), f.get_tensor("logits")
    with torch.no_grad():
        err = (model(tokens) - want).abs().max().item()
    print(f"check_hf_layout: {len(state)} tensors in {n} files, {total} bytes; max |logits difference| {err:.3g}")
    return 0 if err < 1e-4 else fail("logits differ")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
