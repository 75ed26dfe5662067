#!/bin/bash
# The two runs of docs/scale.md and their eager comparisons, one after the
# other (each needs most of the machine's memory). Usage:
#   bench/scale/run_all.sh OUTDIR [SCRATCH]
# OUTDIR receives one JSON summary and one log per run; SCRATCH (default
# OUTDIR) holds the checkpoints, which are deleted after use.
set -u
out=$1; scratch=${2:-$1}
mkdir -p "$out" "$scratch"
py=.venv/bin/python3
run() { name=$1; shift; timeout "$T" $py bench/scale/run_scale.py --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1; echo "$name: exit $?"; }
FT="--mode finetune --layers 26 --d-model 3072 --heads 24 --vocab 32000 --seq 64 --tokens 16 --batch 1 --steps 2"
PT="--mode pretrain --layers 19 --d-model 2048 --heads 16 --vocab 32000 --seq 64 --tokens 16 --batch 1 --steps 2 --bf16"
df -h "$scratch"
# (a) fine-tuning, 3B, world 4
$py bench/scale/write_checkpoint.py --out "$scratch/base" --layers 26 --d-model 3072 --vocab 32000 --seq 64 > "$out/write_checkpoint.log" 2>&1
echo "checkpoint: exit $? $(du -sh "$scratch/base" | cut -f1)"
T=900 run finetune_deferred --world 4 -- $FT --checkpoint "$scratch/base" --save "$scratch/adapters"
ls -la "$scratch/adapters" >> "$out/finetune_deferred.log" 2>&1
T=300 run finetune_eager --world 4 -- $FT --init eager --checkpoint "$scratch/base" --stop-after load
rm -rf "$scratch/base" "$scratch/adapters"
# (b) pretraining, 1.09B, world 8 (its steps leave ~1.4 GiB of the 24: the guard at 0.5 GiB)
T=900 run pretrain_deferred --world 8 --guard-gib 0.5 -- $PT --save "$scratch/pretrain"
du -sh "$scratch/pretrain" >> "$out/pretrain_deferred.log" 2>&1
rm -rf "$scratch/pretrain"
T=300 run pretrain_eager --world 8 -- $PT --init eager --stop-after shard
