#!/usr/bin/env bash
# The whole GPU session in one command (docs/gpu.md), each stage under its
# own time limit, results in $OUT (the device tool's folder) or
# build-gpu/logs. With the device tool, from this machine:
#   scripts/gpu/fetch_debs.sh
#   run(command="scripts/gpu/measure.sh", carry=[".gpu"], timeout_s=590)
# Stages (SHARDTORCH_GPU_STAGES, default all, in this order):
#   build    configure and build (build_and_test.sh's build step)
#   adam     bench_cuda_adam: the fused CUDA AdamW against at::_fused_adamw_ and a copy roofline
#   cuda     the CUDA tests (ctest -L cuda)
#   overhead gpt_bench at world size 1: plain LibTorch, FullShard, NoShard; PyTorch FSDP2 and DDP
#   offload  FullShard bf16 with and without CPU offload, profiled; pinned bandwidth
#   overlap  offload with the optimizer step overlapping backward (--overlap-step) against
#            offload without it and the resident step, profiled; pinned bandwidth
#   overlap_threads  the same, unprofiled, with the host thread's team at 16, 14, 12 and 8 threads
#   largest  the largest GPT that trains with offload, from a list of sizes
#   waits    FullShard fp32 and bf16 against plain LibTorch, with the collectives'
#            stream-ordered waits (the default) and with SHARDTORCH_BLOCKING_WAIT=1
#   install  the installed-package consumer test (ctest -R install)
#   peers    PyTorch FSDP2 (bf16, fp32) and DDP (fp32) beside FullShard bf16 and fp32
#   ctest    the CPU suite with the GPU hidden, in the background on cores 8-15 from
#            the build to the deadline (the measurements run on cores 0-7)
# SHARDTORCH_GPU_LARGEST: the sizes LxDxH for `largest`; SHARDTORCH_GPU_LARGEST_ARGS:
#   gpt_bench arguments added there (--deferred).
# SHARDTORCH_GPU_DEADLINE_S: seconds from the start after which no new stage starts (default 540).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
LOGS=${OUT:-$ROOT/build-gpu/logs}
BUILD=$ROOT/build-gpu
STAGES=${SHARDTORCH_GPU_STAGES:-build adam cuda overhead offload largest ctest}
DEADLINE=$((SECONDS + ${SHARDTORCH_GPU_DEADLINE_S:-540}))
mkdir -p "$LOGS"
say() { echo "[gpu $(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$LOGS/stages.txt"; }
left() { echo $((DEADLINE - SECONDS)); }
want() { [[ " $STAGES " == *" $1 "* ]] && [ "$(left)" -gt 10 ]; }
# limit SECONDS CMD...: runs CMD under a time limit no later than the deadline.
limit() { local t=$1; shift; local l; l=$(left); [ "$l" -lt "$t" ] && t=$l; timeout -k 5 "$t" "$@"; }
export PATH=/usr/local/cuda/bin:$PATH
PY=$(command -v python3)
TORCHRUN=$(command -v torchrun || echo "$PY -m torch.distributed.run")

DEPS=/opt/shardtorch-deps
mkdir -p "$DEPS"
for f in .gpu/debs/*.deb; do  # each once per machine (a warm machine keeps them)
  [ -e "$DEPS/.done-$(basename "$f")" ] || { dpkg -x "$f" "$DEPS" && touch "$DEPS/.done-$(basename "$f")"; }
done
export LD_LIBRARY_PATH=$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if want build; then
  say "build"
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
    nproc; free -g | head -2
  } >"$LOGS/machine.txt" 2>&1
  cat "$LOGS/machine.txt"
  configure() {
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)');$DEPS/usr" \
      -DGLOO_INCLUDE_DIR="$DEPS/usr/include" -DSHARDTORCH_FT=OFF -DSHARDTORCH_PYTHON="$PY" "$@" >"$LOGS/configure.log" 2>&1
  }
  configure || { tail -30 "$LOGS/configure.log"; say "configure failed"; exit 1; }
  # -k 0: a target that fails to compile does not stop the others.
  limit 300 cmake --build "$BUILD" -j"$(nproc)" -- -k 0 >"$LOGS/build.log" 2>&1 || {
    say "build had errors"; grep -E "error" -A3 "$LOGS/build.log" | head -40; }
  if [ ! -x "$BUILD/bench/gpt_bench" ]; then  # the library itself failed: again without the CUDA kernels
    say "rebuilding without the CUDA kernels"
    configure -DSHARDTORCH_CUDA_KERNELS_ENABLE=OFF && limit 200 cmake --build "$BUILD" -j"$(nproc)" -- -k 0 \
      >"$LOGS/build_nokernels.log" 2>&1
  fi
  say "built"
fi
grep -i "fused CUDA Adam\|NCCL backend" "$LOGS/configure.log" | tee -a "$LOGS/stages.txt"
# The CPU suite (GPU hidden) runs in the background on cores 8-15 from here
# to the deadline; every measurement below runs on cores 0-7.
SUITE_PID=""
CORES=$(nproc)
if want ctest && [ "$CORES" -ge 16 ]; then
  say "CPU suite in the background (cores 8-$((CORES - 1)))"
  ( cd "$BUILD" && CUDA_VISIBLE_DEVICES= exec taskset -c 8-$((CORES - 1)) ctest -LE cuda \
      -E "^(tools|integration|bench)\." -j8 --timeout 120 --output-on-failure ) >"$LOGS/ctest.log" 2>&1 &
  SUITE_PID=$!
  PIN=(taskset -c 0-7)
else
  PIN=()
fi

if want adam; then
  say "adam"
  limit 90 "${PIN[@]}" "$BUILD/bench/bench_cuda_adam" --out "$LOGS/adam.jsonl" >"$LOGS/adam.log" 2>&1; echo "rc=$?" >>"$LOGS/adam.log"
  cat "$LOGS/adam.log"
fi

if want cuda; then
  say "CUDA tests"
  (cd "$BUILD" && limit 200 "${PIN[@]}" ctest -L cuda --timeout 180 --output-on-failure) >"$LOGS/cuda_tests.log" 2>&1
  echo "rc=$?" >>"$LOGS/cuda_tests.log"
  grep -E "Test +#|tests passed|rank [0-9]+:|rc=" "$LOGS/cuda_tests.log" | cut -c1-300 | head -20
fi

# One GPT for the overhead and offload stages: 12 x 1024, 8 x 1024 tokens a step.
GPT=(--layers 12 --d-model 1024 --heads 16 --vocab 32768 --seq 1024 --batch 8 --steps 15 --warmup 3 --quiet)
PEER=(--layers 12 --d-model 1024 --heads 16 --vocab 32768 --seq 1024 --batch 8 --steps 15 --warmup 3)
bench() {  # bench NAME SECONDS gpt_bench-args...
  local name=$1 t=$2; shift 2
  [ "$(left)" -gt 20 ] || { say "skip $name (time)"; return; }
  say "gpt_bench $name"
  limit "$t" "${PIN[@]}" $TORCHRUN --no-python --standalone --nproc-per-node 1 "$BUILD/bench/gpt_bench" "${GPT[@]}" \
    --report "$LOGS/gpt_$name" "$@" >"$LOGS/gpt_$name.log" 2>&1
  echo "rc=$?" >>"$LOGS/gpt_$name.log"; tail -2 "$LOGS/gpt_$name.log" | cut -c1-400
}
peer() {  # peer NAME SECONDS peer_train-args...
  local name=$1 t=$2; shift 2
  [ "$(left)" -gt 20 ] || { say "skip $name (time)"; return; }
  say "peer $name"
  limit "$t" "${PIN[@]}" $TORCHRUN --standalone --nproc-per-node 1 bench/peers/peer_train.py --device cuda "${PEER[@]}" \
    --report "$LOGS/peer_$name" "$@" >"$LOGS/peer_$name.log" 2>&1
  echo "rc=$?" >>"$LOGS/peer_$name.log"; tail -2 "$LOGS/peer_$name.log" | cut -c1-400
}

if want waits; then
  bench plain_fp32 60 --strategy plain
  bench full_shard_fp32 60 --strategy full_shard
  SHARDTORCH_BLOCKING_WAIT=1 bench full_shard_fp32_blocking 60 --strategy full_shard
  bench plain_bf16 60 --strategy plain --bf16
  bench full_shard_bf16_prefetch 60 --strategy full_shard --bf16 --prefetch
  SHARDTORCH_BLOCKING_WAIT=1 bench full_shard_bf16_prefetch_blocking 60 --strategy full_shard --bf16 --prefetch
  bench full_shard_fp32_prefetch 60 --strategy full_shard --prefetch
  bench offload_bf16 90 --strategy full_shard --bf16 --prefetch --offload
fi

if want peers; then
  peer fsdp2_bf16 90 --mode fsdp2 --bf16
  bench full_shard_bf16_prefetch 60 --strategy full_shard --bf16 --prefetch
  peer fsdp2_fp32 90 --mode fsdp2
  bench full_shard_fp32 60 --strategy full_shard
  peer ddp_fp32 90 --mode ddp
fi

if want install; then
  say "install"
  (cd "$BUILD" && limit 120 ctest -R install --timeout 110 --output-on-failure) >"$LOGS/install.log" 2>&1
  echo "rc=$?" >>"$LOGS/install.log"; tail -15 "$LOGS/install.log"
fi

if want overhead; then
  bench plain_bf16 60 --strategy plain --bf16
  bench full_shard_bf16_prefetch 60 --strategy full_shard --bf16 --prefetch
  bench no_shard_bf16 60 --strategy no_shard --bf16
  peer fsdp2_bf16 90 --mode fsdp2 --bf16
  bench plain_fp32 60 --strategy plain
  bench full_shard_fp32 60 --strategy full_shard
  bench no_shard_fp32 60 --strategy no_shard
  bench full_shard_bf16_fused 60 --strategy full_shard --bf16 --fused-adam
  if [ "$(left)" -gt "${SHARDTORCH_GPU_PEERS_FP32_MIN_LEFT:-0}" ]; then
    peer fsdp2_fp32 90 --mode fsdp2
    peer ddp_fp32 90 --mode ddp
  fi
fi

pinned_bandwidth() {
  say "pinned bandwidth"
  limit 60 "${PIN[@]}" "$PY" - >"$LOGS/pinned_bandwidth.json" 2>"$LOGS/pinned_bandwidth.err" <<'PYEOF'
import json, time, torch
n = 256 << 20
h = torch.empty(n, dtype=torch.uint8).pin_memory(); d = torch.empty(n, dtype=torch.uint8, device="cuda")
out = {}
for name, f in (("h2d", lambda: d.copy_(h, non_blocking=True)), ("d2h", lambda: h.copy_(d, non_blocking=True))):
    for _ in range(3): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10): f()
    torch.cuda.synchronize(); out[name + "_GBps"] = 10 * n / (time.perf_counter() - t) / 1e9
print(json.dumps(out))
PYEOF
  cat "$LOGS/pinned_bandwidth.json"
}

if want offload; then
  pinned_bandwidth
  bench offload_bf16 90 --strategy full_shard --bf16 --prefetch --offload
  bench offload_bf16_1thread 90 --strategy full_shard --bf16 --prefetch --offload --threads 1
  # Profiles: a short run each, the first measured step traced.
  SAVED=("${GPT[@]}")
  GPT=(--layers 12 --d-model 1024 --heads 16 --vocab 32768 --seq 1024 --batch 8 --steps 2 --warmup 2 --quiet)
  bench offload_profiled 60 --strategy full_shard --bf16 --prefetch --offload --profile "$LOGS/trace_offload"
  bench resident_profiled 60 --strategy full_shard --bf16 --prefetch --profile "$LOGS/trace_resident"
  GPT=("${SAVED[@]}")
  for t in offload resident; do
    [ -f "$LOGS/trace_$t.rank0.json" ] || continue
    "$PY" scripts/gpu/trace_summary.py "$LOGS/trace_$t.rank0.json" >"$LOGS/trace_${t}_summary.txt" 2>&1
    gzip -f "$LOGS/trace_$t.rank0.json"
  done
fi

# profiled NAME gpt_bench-args...: one short run, its first measured step traced and summarized.
profiled() {
  local name=$1; shift
  local saved=("${GPT[@]}")
  GPT=(--layers 12 --d-model 1024 --heads 16 --vocab 32768 --seq 1024 --batch 8 --steps 2 --warmup 2 --quiet)
  bench "${name}_profiled" 60 "$@" --profile "$LOGS/trace_$name"
  GPT=("${saved[@]}")
  if [ -f "$LOGS/trace_$name.rank0.json" ]; then
    "$PY" scripts/gpu/trace_summary.py "$LOGS/trace_$name.rank0.json" >"$LOGS/trace_${name}_summary.txt" 2>&1
    gzip -f "$LOGS/trace_$name.rank0.json"
  fi
}

if want overlap; then
  pinned_bandwidth
  bench resident_bf16 60 --strategy full_shard --bf16 --prefetch
  bench offload_bf16 90 --strategy full_shard --bf16 --prefetch --offload
  bench offload_bf16_overlap 90 --strategy full_shard --bf16 --prefetch --offload --overlap-step
  profiled overlap --strategy full_shard --bf16 --prefetch --offload --overlap-step
  profiled offload --strategy full_shard --bf16 --prefetch --offload
  bench resident_bf16_again 60 --strategy full_shard --bf16 --prefetch
  bench offload_bf16_overlap_again 90 --strategy full_shard --bf16 --prefetch --offload --overlap-step
fi

if want overlap_threads; then  # the host thread's OpenMP team against the launching threads
  bench resident_bf16 60 --strategy full_shard --bf16 --prefetch
  bench offload_bf16 90 --strategy full_shard --bf16 --prefetch --offload
  bench offload_bf16_overlap 90 --strategy full_shard --bf16 --prefetch --offload --overlap-step
  for t in 14 12 8; do
    SHARDTORCH_OFFLOAD_THREADS=$t bench "offload_bf16_overlap_t$t" 90 --strategy full_shard --bf16 --prefetch --offload --overlap-step
  done
fi

if want largest; then
  # Sizes up: the last that finishes is the largest that trains here.
  for size in ${SHARDTORCH_GPU_LARGEST:-"24x2048x16" "32x2560x20" "40x3072x24"}; do
    size=${size//x/ }
    read -r L D H <<<"$size"
    [ "$(left)" -gt 60 ] || break
    GPT=(--layers "$L" --d-model "$D" --heads "$H" --vocab 32768 --seq 1024 --batch 4 --steps 3 --warmup 1 --quiet)
    # shellcheck disable=SC2086
    bench "largest_${L}x${D}" "${SHARDTORCH_GPU_LARGEST_LIMIT_S:-150}" --strategy full_shard --bf16 --prefetch --offload \
      ${SHARDTORCH_GPU_LARGEST_ARGS:-}
  done
fi

if [ -n "$SUITE_PID" ]; then
  while kill -0 "$SUITE_PID" 2>/dev/null && [ "$(left)" -gt 5 ]; do sleep 2; done
  pkill -f "ctest -LE cuda" 2>/dev/null; pkill -f shardtorch_tests 2>/dev/null
  sleep 1
  echo "ended at +${SECONDS}s" >>"$LOGS/ctest.log"
  say "CPU suite: $(grep -c " Passed " "$LOGS/ctest.log") passed, $(grep -cE "\*\*\*(Failed|Exception|Timeout)" "$LOGS/ctest.log") failed so far"
  grep -E "tests passed|\*\*\*(Failed|Exception|Timeout)" "$LOGS/ctest.log" | head -40
fi
say "done"
# The device tool brings back a few files: everything else goes in one archive.
tar czf /tmp/results.tar.gz -C "$LOGS" . 2>/dev/null && mv /tmp/results.tar.gz "$LOGS/results.tar.gz" &&
  find "$LOGS" -type f ! -name results.tar.gz ! -name stages.txt -delete
