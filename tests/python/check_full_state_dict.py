"""Loads a shardtorch full state dict with Python's safetensors into the
PyTorch equivalent of examples/gpt.h and checks that it computes the logits
the sharded C++ model computed. usage: check_full_state_dict.py DIR"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        att = q @ k.transpose(-2, -1) / math.sqrt(c // self.h)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = torch.softmax(att.masked_fill(mask, float("-inf")), -1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=64, seq_len=16, d=32, h=4, layers=2):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Module()
        self.head.weight = self.tok_emb.weight  # tied

    def forward(self, tokens):
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1])).unsqueeze(0)
        for b in self.blocks:
            x = b(x)
        return F.linear(self.ln_f(x), self.head.weight)


def main(d):
    state = load_file(f"{d}/model.safetensors")
    io = load_file(f"{d}/io.safetensors")
    model = GPT()
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
