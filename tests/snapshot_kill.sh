#!/usr/bin/env bash
# In-memory snapshots under torchrun --max-restarts, 4 ranks (one per
# "node": the default buddy map puts rank r's copy on rank r+1): runs killed
# on purpose (tests/snapshot_train.cpp's --kill) restore and end with final
# parameters equal, bitwise, to a run of the same strategy that never died.
# usage: snapshot_kill.sh TORCHRUN SNAPSHOT_TRAIN full_shard|strategies|rejoin
set -euo pipefail
torchrun=$1 bin=$2 set=$3
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

run() {  # NAME [snapshot_train options]
  local name=$1
  shift
  "$torchrun" --no-python --standalone --nproc-per-node 4 --max-restarts 3 --monitor-interval 0.1 \
    "$bin" --out "$tmp/$name.safetensors" "$@" > "$tmp/$name.log" 2>&1 ||
    { echo "FAIL: $name exited with an error"; cat "$tmp/$name.log"; exit 1; }
}
# free_port: a port nothing listens on now.
free_port() {
  "$(dirname "$torchrun")/python3" -c \
    'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
# Starts 4 ranks of the trainer by hand (no torchrun) on a fresh port, each
# under stacks_on_timeout.sh SECS, rank r's output in LOG$r.log; their pids
# go to `pids`.
start_four() {  # SECS LOG [snapshot_train options]
  local secs=$1 log=$2 r port
  shift 2
  port=$(free_port)
  pids=()
  for r in 0 1 2 3; do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=4 LOCAL_WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$here/stacks_on_timeout.sh" "$secs" "$bin" "$@" > "$log$r.log" 2>&1 &
    pids+=($!)
  done
}
# The uninterrupted run of STRATEGY for STEPS, as oracle-STRATEGY: 4 ranks
# launched by hand (nothing restarts them). Kept beside the trainer and made
# again only when the trainer is newer (it is relinked whenever the library
# changes), so the three sets share it.
oracle() {  # STRATEGY STEPS
  local s=$1 steps=$2 dir kept r code
  dir=$(dirname "$bin")/snapshot-oracles
  kept=$dir/$s-$steps.safetensors
  if [ ! "$kept" -nt "$bin" ]; then
    mkdir -p "$dir"
    start_four 120 "$tmp/oracle-$s.r" --strategy $s --steps $steps --out "$dir/part-$s-$steps.safetensors"
    for r in 0 1 2 3; do
      code=0
      wait "${pids[$r]}" || code=$?
      [ $code = 0 ] || { echo "FAIL: oracle-$s: rank $r exited with $code"; cat "$tmp/oracle-$s".r*.log; exit 1; }
    done
    mv "$dir/part-$s-$steps.safetensors" "$kept"
  fi
  cp "$kept" "$tmp/oracle-$s.safetensors"
}
# The run NAME ends equal to the uninterrupted run of STRATEGY.
same() {  # STRATEGY NAME
  cmp -s "$tmp/oracle-$1.safetensors" "$tmp/$2.safetensors" ||
    { echo "FAIL: $2 ends with other parameters than the uninterrupted run"; cat "$tmp/$2.log"; exit 1; }
  echo "ok: $2"
}
says() {  # NAME TEXT: the run's log has a line with TEXT
  grep -qF -- "$2" "$tmp/$1.log" || { echo "FAIL: $1 never says '$2'"; cat "$tmp/$1.log"; exit 1; }
}

if [ "$set" = full_shard ]; then
  s=full_shard
  oracle $s 10
  # K = 1: killed in the forward of step 4, then in the backward of step 7,
  # inside a reduce-scatter (the step's second, posted, not yet complete on
  # the other ranks): each time the step before.
  run k1 --strategy $s --steps 10 --every 1 --dir "$tmp/k1" --kill "0:1@4:forward,1:2@7:reduce-scatter"
  says k1 "killed at step 7 (reduce-scatter)"
  says k1 "restored step 3 from memory"
  says k1 "restored step 6 from memory"
  same $s k1
  # The same kill without torchrun (which stops the other workers at once):
  # the others fail at once with the collective's error, naming the rank
  # that died, instead of waiting for their collectives' timeout (300 s).
  start_four 60 "$tmp/alone" --strategy $s --steps 10 --every 1 --dir "$tmp/alone" --kill "0:2@4:reduce-scatter"
  for r in 0 1 2 3; do
    code=0
    wait "${pids[$r]}" || code=$?
    want=1 text="rank $r failed: shardtorch: rank $r/4: "
    [ $r = 2 ] && want=137 text="killed at step 4 (reduce-scatter)"
    { [ $code = $want ] && grep -qF -- "$text" "$tmp/alone$r.log" &&
      { [ $r = 2 ] || grep -qF "Peer at fault: rank 2 is no longer running" "$tmp/alone$r.log"; }; } ||
      { echo "FAIL: alone: rank $r exited with $code (want $want, and '$text' said)"; cat "$tmp/alone$r.log"; exit 1; }
  done
  echo "ok: alone"
  # K = 4: killed before the optimizer step of step 7, then while writing
  # the snapshot of step 8: both times step 4.
  run k4 --strategy $s --steps 10 --every 4 --dir "$tmp/k4" --kill "0:3@7:optimizer,1:0@8:snapshot"
  test "$(grep -c "restored step 4 from memory" "$tmp/k4.log")" = 2 ||
    { echo "FAIL: k4 did not restore step 4 twice"; cat "$tmp/k4.log"; exit 1; }
  same $s k4
  # A node lost: rank 2's own snapshots are gone; its buddy's copy serves.
  run node --strategy $s --steps 10 --every 1 --dir "$tmp/node" --kill "0:2@6:forward:node"
  says node "restored step 5 from memory; from their buddies' copies: ranks 2"
  same $s node
  # Rank 3's newest snapshot damaged: refused by its checksum, its buddy's copy serves.
  run damage --strategy $s --steps 10 --every 1 --dir "$tmp/damage" --kill "0:3@6:forward:damage"
  says damage "does not match its checksum"
  says damage "restored step 5 from memory; from their buddies' copies: ranks 3"
  same $s damage
  # Rank 1 and its buddy lost together: the disk checkpoint of step 6.
  run pair --strategy $s --steps 10 --every 1 --dir "$tmp/pair" --checkpoint "$tmp/ck" --save-every 3 \
    --kill "0:1@8:forward:pair"
  says pair "loaded the sharded checkpoint '$tmp/ck' at step 6 instead"
  same $s pair
elif [ "$set" = rejoin ]; then
  # A hand launch whose other ranks stay alive: each survivor of a lost rank
  # calls Snapshots::rejoin(), and this script starts a replacement with
  # SHARDTORCH_REJOIN=1 as soon as the lost one has exited.
  hand() {  # NAME KILLS [snapshot_train options]: 4 ranks, each killed one replaced; each other exits with $want
    local name=$1 kills=$2 replaced=0 left=4 r p code port
    shift 2
    # A port of its own per launch: one held across launches could be taken meanwhile.
    port=$(free_port)
    declare -A pid inc
    start() {  # RANK INCARNATION [snapshot_train options]
      local rk=$1 in=$2
      shift 2
      RANK=$rk LOCAL_RANK=$rk WORLD_SIZE=4 LOCAL_WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        TORCHELASTIC_RESTART_COUNT=$in SHARDTORCH_REJOIN=$([ "$in" = 0 ] && echo 0 || echo 1) \
        "$here/stacks_on_timeout.sh" "${REJOIN_TIMEOUT:-120}" "$bin" --dir "$tmp/$name" --rejoin --kill "$kills" \
        --out "$tmp/$name.safetensors" "$@" > "$tmp/$name.r$rk.i$in.log" 2>&1 &
      pid[$rk]=$!
      inc[$rk]=$in
    }
    for r in 0 1 2 3; do start $r 0 "$@"; done
    while [ $left -gt 0 ]; do
      for r in 0 1 2 3; do
        p=${pid[$r]}
        [ "$p" = done ] && continue
        kill -0 "$p" 2> /dev/null && continue
        code=0
        wait "$p" || code=$?
        if [ $code = 137 ]; then  # killed on purpose: replaced
          replaced=$((replaced + 1))
          start $r $replaced "$@"
        else
          [ $code = "${want:-0}" ] || { echo "FAIL: $name: rank $r (incarnation ${inc[$r]}) exited with $code";
                             tail -n 30 "$tmp/$name".*.log; exit 1; }
          pid[$r]=done
          left=$((left - 1))
        fi
      done
      sleep 0.05
    done
    cat "$tmp/$name".*.log > "$tmp/$name.log"
  }
  # Rank 2 killed inside a reduce-scatter of step 4, then rank 1 before the
  # forward of step 7 (the second rejoin includes the first replacement):
  # the survivors keep their state in place. Then rank 3 before its
  # optimizer step of step 9: the others have made that update, so they
  # load their own step 8.
  s=full_shard
  oracle $s 10
  hand rejoin "0:2@4:reduce-scatter,0:1@7:forward,0:3@9:optimizer" --strategy $s --steps 10 --every 1
  says rejoin "rank 2: killed at step 4 (reduce-scatter)"
  says rejoin "rank 1: killed at step 7 (forward)"
  says rejoin "rank 0: rejoined at step 3"
  says rejoin "rank 3: rejoined at step 6"
  says rejoin "restored step 3 from memory; kept in place (as training left it) on ranks 0 1 3"
  says rejoin "restored step 6 from memory; kept in place (as training left it) on ranks 0 2 3"
  says rejoin "rank 3: killed at step 9 (optimizer)"
  says rejoin "rank 2: rejoined at step 8"
  grep -qF "restored step 8 from memory" "$tmp/rejoin.log" && ! grep -q "restored step 8 .*kept in place" "$tmp/rejoin.log" ||
    { echo "FAIL: rejoin: step 8 was not restored from every rank's own snapshot"; cat "$tmp/rejoin.log"; exit 1; }
  same $s rejoin
  # Rank 2 lost in step 3, before the first snapshot (K = 4), with no disk
  # checkpoint: the survivors have trained and its replacement has not, so
  # every rank fails saying so rather than going on apart.
  want=1 hand early "0:2@3:forward" --strategy $s --steps 10 --every 4
  test "$(grep -c "no step is in memory on every rank to rejoin at" "$tmp/early.log")" = 4 ||
    { echo "FAIL: early: not every rank refused to go on"; cat "$tmp/early.log"; exit 1; }
  echo "ok: early"
  # The other strategies (HybridShard's groups connected again too), K = 2,
  # rank 1's node lost in step 5: its replacement takes its buddy's copy of
  # step 4, which the survivors keep in place.
  for s in shard_grad_op optimizer_only hybrid_shard; do
    phase=reduce-scatter
    [ $s = optimizer_only ] && phase=backward
    oracle $s 8
    hand "rejoin-$s" "0:1@5:$phase:node" --strategy $s --steps 8 --every 2
    says "rejoin-$s" "restored step 4 from memory; from their buddies' copies: ranks 1; kept in place (as training left it) on ranks 0 2 3"
    same $s "rejoin-$s"
  done
else
  # Killed inside a reduce-scatter where the strategy reduce-scatters;
  # OptimizerOnly all-reduces its gradients: killed between the units' reductions.
  for s in shard_grad_op optimizer_only hybrid_shard; do
    phase=reduce-scatter
    [ $s = optimizer_only ] && phase=backward
    oracle $s 8
    run "$s" --strategy $s --steps 8 --every 2 --dir "$tmp/$s" --kill "0:1@5:$phase:node"
    says "$s" "killed at step 5 ($phase, node)"
    says "$s" "restored step 4 from memory; from their buddies' copies: ranks 1"
    same $s "$s"
  done
fi
echo "PASS: snapshots ($set)"
