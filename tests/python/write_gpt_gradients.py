"""Writes DIR/reference.safetensors for TpLayersPython.*: the example GPT of
examples/gpt.h written with torch.nn (bench/peers/gpt_model.py) at d_model 128
(an MLP 512 wide, whose products are accumulated in blocks), its parameters
(param.NAME), a batch of tokens, the mean next-token loss and every
parameter's gradient of it (grad.NAME), computed with one thread.
usage: write_gpt_gradients.py DIR"""
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "peers"))
from gpt_model import GPT, batch_tokens, lm_loss  # noqa: E402

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, BATCH = 64, 64, 128, 4, 2, 16


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    torch.manual_seed(3)
    model = GPT(vocab=VOCAB, seq_len=SEQ, d_model=D_MODEL, n_head=HEADS, n_layer=LAYERS)
    with torch.no_grad():  # biases and norms away from their initial constants
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    tokens = batch_tokens(0, 0, 1, BATCH, SEQ, VOCAB)
    loss = lm_loss(model(tokens), tokens)
    loss.backward()
    tensors = {"tokens": tokens, "loss": loss.detach().reshape(1)}
    for name, p in model.named_parameters():  # head.weight is tok_emb.weight: named once
        tensors["param." + name] = p.detach().clone()
        tensors["grad." + name] = p.grad.clone()
    save_file(tensors, os.path.join(out, "reference.safetensors"))


if __name__ == "__main__":
    main()
