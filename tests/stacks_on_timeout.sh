#!/usr/bin/env bash
# usage: stacks_on_timeout.sh SECONDS COMMAND [ARGS...]
# Runs COMMAND as timeout(1) does (its status; 124 once SECONDS have passed,
# after a SIGKILL), but a command still running then first has the stacks of
# all its threads printed to this script's stderr (gdb), so that a hang seen
# once in a test's log can be read.
set -uo pipefail
secs=$1
shift
"$@" &
pid=$!
hung=$(mktemp)
(
  trap 'kill "$s" 2> /dev/null; exit 0' TERM
  sleep "$secs" < /dev/null > /dev/null 2>&1 &
  s=$!
  wait "$s"
  kill -0 "$pid" 2> /dev/null || exit 0
  echo hung > "$hung"
  echo "stacks_on_timeout: pid $pid ($1) still running after $secs s; its threads:" >&2
  if command -v gdb > /dev/null; then
    timeout 60 gdb -p "$pid" -batch -ex "thread apply all bt" < /dev/null 2>&1 | grep -v '^\[New LWP' >&2
  else
    echo "(gdb is not installed: no stacks)" >&2
  fi
  kill -9 "$pid" 2> /dev/null
) &
watch=$!
code=0
wait "$pid" || code=$?
kill "$watch" 2> /dev/null
wait "$watch" 2> /dev/null
[ -s "$hung" ] && code=124
rm -f "$hung"
exit $code
