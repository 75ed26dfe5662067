#!/usr/bin/env bash
# Activation checkpointing changes nothing but memory and time: train_gpt run
# for 6 steps with --activation-checkpointing ends with the same parameter
# fingerprint as without it.
# usage: recompute_example.sh TORCHRUN TRAIN_GPT [train_gpt options for both runs]
set -euo pipefail
source "$(dirname "$0")/train_gpt_fingerprint.sh" "$@"
run() { "$torchrun" --no-python --standalone --nproc-per-node 2 "$train" --steps 6 --dataset 64 "${extra[@]}" "$@"; }

run > "$tmp/plain.log" 2>&1 || { cat "$tmp/plain.log"; exit 1; }
run --activation-checkpointing > "$tmp/ckpt.log" 2>&1 || { cat "$tmp/ckpt.log"; exit 1; }
grep -q "activation checkpointing" "$tmp/ckpt.log" || { echo "the run does not say it checkpoints"; cat "$tmp/ckpt.log"; exit 1; }
want=$(fingerprint "$tmp/plain.log") got=$(fingerprint "$tmp/ckpt.log")
echo "without checkpointing: step, fingerprint = $want"
echo "with checkpointing:    step, fingerprint = $got"
test -n "$want" && test "$want" = "$got" || { echo "training with activation checkpointing differs"; exit 1; }
