#!/usr/bin/env bash
# GPU measurements (docs/gpu.md): gpt_bench at world size 1 over NCCL on the
# machine's GPU, one strategy after another in one invocation. Called by
# build_and_test.sh with SHARDTORCH_GPU_STEPS containing "bench".
# usage: bench.sh BUILD_DIR LOG_DIR
set -uo pipefail
BUILD=$1
LOGS=$2
GPT=(--layers 12 --d-model 1024 --heads 16 --vocab 32768 --seq 1024 --batch 8 --steps 20 --warmup 5 --quiet)
rc=0
run() {
  local name=$1; shift
  echo "== $name: gpt_bench ${GPT[*]} $*"
  "$BUILD/bench/gpt_bench" "${GPT[@]}" --report "$LOGS/gpu_$name" "$@" 2>&1 | tail -3 || rc=1
}
run no_shard --strategy no_shard
run full_shard --strategy full_shard
run full_shard_prefetch --strategy full_shard --prefetch
run full_shard_bf16_prefetch --strategy full_shard --prefetch --bf16
run full_shard_offload_bf16 --strategy full_shard --prefetch --bf16 --offload
exit $rc
