#!/usr/bin/env bash
# The example's resume is exact: train_gpt run for 8 steps uninterrupted, and
# run for 4 steps (checkpoints at 3 and 4), then resumed to 8 (2k for a stop
# at k) from the checkpoint, end with the same parameter fingerprint. The data
# set is 3 batches per epoch, so the stop falls inside the second epoch and
# resuming must restore both the epoch and the position in it. (8 steps: the
# example judges whether its loss fell from 10 steps on.)
# usage: resume_example.sh TORCHRUN TRAIN_GPT [train_gpt options for every run]
set -euo pipefail
source "$(dirname "$0")/train_gpt_fingerprint.sh" "$@"
run() { "$torchrun" --no-python --standalone --nproc-per-node 2 "$train" --dataset 48 "${extra[@]}" "$@"; }

run --steps 8 > "$tmp/straight.log" 2>&1 || { cat "$tmp/straight.log"; exit 1; }
run --steps 4 --checkpoint "$tmp/ck" --save-every 3 > "$tmp/first.log" 2>&1 || { cat "$tmp/first.log"; exit 1; }
run --steps 8 --checkpoint "$tmp/ck" --resume --export "$tmp/model.safetensors" > "$tmp/resumed.log" 2>&1 ||
  { cat "$tmp/resumed.log"; exit 1; }

grep -q "^saved .* at step 3$" "$tmp/first.log" || { echo "no checkpoint at step 3"; cat "$tmp/first.log"; exit 1; }
grep -q "^resumed from .* at step 4 (epoch 1, 1 batches into it)$" "$tmp/resumed.log" ||
  { echo "did not resume from step 4, epoch 1, batch 1"; cat "$tmp/resumed.log"; exit 1; }
test -s "$tmp/model.safetensors" || { echo "no exported state dict"; exit 1; }
want=$(fingerprint "$tmp/straight.log") got=$(fingerprint "$tmp/resumed.log")
echo "uninterrupted: step, fingerprint = $want"
echo "resumed:       step, fingerprint = $got"
test -n "$want" && test "$want" = "$got" || { echo "resumed training differs from uninterrupted training"; exit 1; }
