"""Writes a tiny transformers LlamaForCausalLM (the shape of llama::Config{} in
examples/llama.h: grouped-query attention, RoPE, RMSNorm, SwiGLU, an untied
head) with save_pretrained in several safetensors files, and beside it
reference.safetensors: a batch of tokens and the logits transformers computes
for them, for the C++ side to load the checkpoint into llama::Llama (split
over tensor-parallel ranks or not) and compare.
usage: write_hf_llama.py DIR"""
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    out = sys.argv[1]
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # norms away from ones, so that a norm read wrongly shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
    model.save_pretrained(out, max_shard_size="24KB", safe_serialization=True)
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(tokens).logits
    save_file({"tokens": tokens.contiguous(), "logits": logits.contiguous()}, os.path.join(out, "reference.safetensors"))
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors") and f != "reference.safetensors")
    print(f"write_hf_llama: {len(files)} data files in {out}")


if __name__ == "__main__":
    main()
