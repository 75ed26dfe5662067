#!/usr/bin/env bash
# In-memory snapshots against the disk, side by side in one run, on the
# example GPT under torchrun (docs/fault_tolerance.md, "In-memory snapshots",
# records the figures):
#  - steady state: the median step time without snapshots and with a
#    snapshot (and the buddy's copy) after every step, REPEATS runs each,
#    interleaved; and the bytes each rank keeps;
#  - recovery: a rank killed at step KILL; the time from the kill to the end
#    of the first step after torchrun's restart, restored from the snapshots,
#    against the same job restarted from its disk checkpoint (saved every
#    SAVE_EVERY steps to a directory of the local disk), and the time until
#    the step being done when the rank died is done again (the disk restart
#    redoes the steps since its checkpoint); then the same kill without
#    torchrun, the other ranks staying alive and rejoining a replacement
#    (Snapshots::rejoin).
# usage: [BATCH=8] [RECOVERY=1] bench/snapshots/run.sh BUILD_DIR [ranks] [d_model] [layers] [steps] [repeats]
#        [save_every] [kill_at]
# (BATCH: sequences of 64 tokens per rank and step; RECOVERY=0: the steady
# state only; save_every: the disk checkpoint's interval, 10; kill_at: the
# step a rank dies in, steps - 5; repeats 0: the recovery only). The steady
# state also reports the CPU time (user and system, every process of the
# run) that the snapshots add per step and rank.
set -euo pipefail
build=$1 ranks=${2:-2} d_model=${3:-256} layers=${4:-4} steps=${5:-30} repeats=${6:-3}
save_every=${7:-10} kill_at=${8:-$((${5:-30} - 5))} batch=${BATCH:-8}
torchrun=$(dirname "$0")/../../.venv/bin/torchrun
bin=$build/tests/snapshot_train
tmp=$(mktemp -d)
shm=$(mktemp -d /dev/shm/shardtorch-snapshot-bench.XXXXXX)  # the snapshots: node-local memory, as by default
ck=$(mktemp -d /var/tmp/shardtorch-snapshot-bench.XXXXXX)
trap 'rm -rf "$tmp" "$shm" "$ck"' EXIT
run() {  # LOG [snapshot_train options]
  local log=$1
  shift
  "$torchrun" --no-python --standalone --nproc-per-node "$ranks" --max-restarts 1 --monitor-interval 0.1 \
    "$bin" --model gpt --d-model "$d_model" --layers "$layers" --batch "$batch" --steps "$steps" "$@" > "$log" 2>&1 ||
    { cat "$log"; exit 1; }
}
median() { sed -n 's/^median step ms \([0-9.]*\).*/\1/p' "$1" | tail -1; }
mark() { times > "$tmp/times.$1"; }  # in this shell: the CPU time of every process it has waited for
cpu() {                              # that time at mark $1, in seconds
  tail -1 "$tmp/times.$1" |
    awk '{ for (i = 1; i <= 2; ++i) { gsub(",", ".", $i); split($i, a, /[ms]/); t += a[1] * 60 + a[2] } printf "%.3f", t }'
}
for i in $(seq "$repeats"); do
  mark 0
  run "$tmp/plain$i.log"
  mark 1
  run "$tmp/snap$i.log" --every 1 --dir "$shm/$i"
  mark 2
  c0=$(cpu 0) c1=$(cpu 1) c2=$(cpu 2)
  echo "repeat $i: median step ms without $(median "$tmp/plain$i.log"), with snapshots (K=1) $(median "$tmp/snap$i.log");" \
    "CPU ms added per step and rank $(awk -v a="$c0" -v b="$c1" -v c="$c2" -v n="$steps" -v r="$ranks" \
      'BEGIN { printf "%.1f", ((c - b) - (b - a)) * 1000 / n / r }')"
done
[ "$repeats" -gt 0 ] && grep -h "^bytes kept" "$tmp/snap1.log"
[ "${RECOVERY:-1}" = 0 ] && exit 0
# Recovery: memory, then disk.
recovery() {  # LOG PATTERN: ms from the kill to the line PATTERN
  local killed first
  killed=$(sed -n 's/.*killed at step .* at epoch ms \([0-9]*\)$/\1/p' "$1" | head -1)
  first=$(sed -n "s/^$2 at epoch ms \([0-9]*\)\$/\1/p" "$1" | head -1)
  echo $((first - killed))
}
run "$tmp/mem.log" --every 1 --dir "$shm/kill" --checkpoint "$ck/mem" --save-every $save_every --kill "0:1@$kill_at:forward" --report-step $kill_at
run "$tmp/disk.log" --checkpoint "$ck/disk" --save-every $save_every --kill "0:1@$kill_at:forward" --report-step $kill_at
grep -h "restored step\|incarnation 1" "$tmp/mem.log" "$tmp/disk.log" || true
first="first step after the restart ended" again="step $kill_at ended again"
echo "kill to first step after the restart: from memory $(recovery "$tmp/mem.log" "$first") ms, from disk $(recovery "$tmp/disk.log" "$first") ms"
echo "kill to step $kill_at done again: from memory $(recovery "$tmp/mem.log" "$again") ms, from disk $(recovery "$tmp/disk.log" "$again") ms"
phases() {  # LOG: ms from the kill to the restarted rank 0's start, World, restore
  local killed
  killed=$(sed -n 's/.*killed at step .* at epoch ms \([0-9]*\)$/\1/p' "$1" | head -1)
  sed -n 's/^incarnation 1: .*epoch ms: process \([0-9]*\), world \([0-9]*\), restored \([0-9]*\).*/\1 \2 \3/p' "$1" |
    head -1 | { read -r p w r; echo "process started $((p - killed)), World built $((w - killed)), state loaded $((r - killed))"; }
}
echo "after the kill (ms), from memory: $(phases "$tmp/mem.log"); from disk: $(phases "$tmp/disk.log")"
# The same kill without torchrun: the other ranks stay alive and rejoin a
# replacement that this script starts as soon as the killed rank has exited.
port=$("$(dirname "$torchrun")/python3" -c \
  'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
hand() {  # RANK INCARNATION
  RANK=$1 LOCAL_RANK=$1 WORLD_SIZE=$ranks LOCAL_WORLD_SIZE=$ranks MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    TORCHELASTIC_RESTART_COUNT=$2 SHARDTORCH_REJOIN=$2 "$bin" --model gpt --d-model "$d_model" --layers "$layers" --batch "$batch" \
    --steps "$steps" --every 1 --dir "$shm/rejoin" --rejoin --kill "0:1@$kill_at:forward" --report-step $kill_at \
    >> "$tmp/rejoin.log" 2>&1
}
pids=()
for r in $(seq 0 $((ranks - 1))); do
  # The rank's output goes to the log; the shell's own "Killed" line for the
  # rank killed on purpose goes nowhere.
  hand "$r" 0 2>/dev/null &
  pids+=($!)
done
code=0
wait "${pids[1]}" || code=$?
[ $code = 137 ] || { cat "$tmp/rejoin.log"; exit 1; }
hand 1 1 &
pids[1]=$!
for p in "${pids[@]}"; do wait "$p" || { cat "$tmp/rejoin.log"; exit 1; }; done
echo "kill to first step after the rejoin (rank 0 stayed alive): $(recovery "$tmp/rejoin.log" "$first") ms;" \
  "to step $kill_at done again: $(recovery "$tmp/rejoin.log" "$again") ms"
killed=$(sed -n 's/.*killed at step .* at epoch ms \([0-9]*\)$/\1/p' "$tmp/rejoin.log" | head -1)
sed -n 's/^rank \([0-9]*\): rejoined at step \([0-9]*\) at epoch ms \([0-9]*\)$/\1 \2 \3/p' "$tmp/rejoin.log" |
  while read -r r s t; do echo "rank $r rejoined at step $s, $((t - killed)) ms after the kill"; done
grep -h "restored step" "$tmp/rejoin.log" || true
