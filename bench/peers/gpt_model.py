"""The GPT of examples/gpt.h written with torch.nn, plus the benchmark's
deterministic token stream and loss. Shared by peer_train.py and run_peers.py.

Module and parameter names follow the C++ model, so a full state dict saved by
shardtorch (safetensors, keys tok_emb.weight ... head.weight) loads strictly."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)  # no bias, as in gpt.h
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        H = self.n_head
        D = C // H
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)
        k = k.view(B, T, H, D).transpose(1, 2)
        v = v.view(B, T, H, D).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(D)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))  # exact (erf) GELU


class TiedHead(nn.Module):
    """LM head whose only parameter is the token embedding's weight (same object)."""

    def __init__(self, shared_weight):
        super().__init__()
        self.weight = shared_weight

    def forward(self, x):
        return F.linear(x, self.weight)


class GPT(nn.Module):
    def __init__(self, vocab=64, seq_len=16, d_model=32, n_head=4, n_layer=2):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = TiedHead(self.tok_emb.weight)
        with torch.no_grad():  # small embeddings, as gpt.h does
            self.tok_emb.weight.normal_(0.0, 0.02)
            self.pos_emb.weight.normal_(0.0, 0.02)

    def forward(self, tokens):
        T = tokens.shape[1]
        pos = torch.arange(T, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos).unsqueeze(0)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits, tokens):
    """Mean next-token cross entropy: logits[:, :-1] against tokens[:, 1:]."""
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))


def batch_tokens(step, rank, world, batch, seq, vocab):
    """The benchmark's token rows for (step, rank); the C++ driver makes the same.
    Row b: idx = (step*world + rank)*batch + b, start = idx*2654435761 mod vocab,
    stride = 1 + (idx // vocab) mod 3, token[t] = (start + stride*t) mod vocab."""
    rows = []
    for b in range(batch):
        idx = (step * world + rank) * batch + b
        start = (idx * 2654435761) % vocab
        stride = 1 + (idx // vocab) % 3
        rows.append([(start + stride * t) % vocab for t in range(seq)])
    return torch.tensor(rows, dtype=torch.int64)


def count_params(model):
    """Parameters counted once each (model.parameters() skips the tied head)."""
    return sum(p.numel() for p in model.parameters())


def add_run_args(p):
    """The options of one training run, the same names and defaults as
    gpt_bench's: the model's shape, the batch, the steps and the learning rate."""
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=30, help="measured steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--fused-adam", action="store_true",
                   help="fused AdamW on both sides: shardtorch::FusedAdamW / torch.optim.AdamW(fused=True); "
                        "default: shardtorch::AdamW (torch::optim) / torch.optim.AdamW() (a per-tensor loop on CPU)")
