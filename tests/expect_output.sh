#!/usr/bin/env bash
# Runs COMMAND, shows its output (stdout and stderr), and passes only if it
# exits with STATUS and a line of its output matches the extended regular
# expression REGEX: ctest's PASS_REGULAR_EXPRESSION alone ignores the exit
# status, so an entry judged by its output alone passes a command that
# printed the line and then failed.
# usage: expect_output.sh STATUS REGEX COMMAND [ARG...]
set -uo pipefail
[ $# -ge 3 ] || { echo "usage: expect_output.sh STATUS REGEX COMMAND [ARG...]"; exit 2; }
want=$1 regex=$2
shift 2
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$@" 2>&1 | tee "$out"
status=${PIPESTATUS[0]}
ok=1
if [ "$status" != "$want" ]; then
  echo "expect_output: exited with status $status, expected $want"
  ok=0
fi
if ! grep -Eq -e "$regex" "$out"; then
  echo "expect_output: no line of the output matches '$regex'"
  ok=0
fi
[ $ok = 1 ]
