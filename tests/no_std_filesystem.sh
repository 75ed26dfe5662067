#!/usr/bin/env bash
# No binary built here may import or define a std::filesystem symbol: some
# LibTorch builds (the torch 2.11 CUDA wheel's libtorch.so) export their own,
# which then bind in place of libstdc++'s and crash (src/base/files.h says more).
# Usage: no_std_filesystem.sh BINARY...
set -uo pipefail
[ $# -gt 0 ] || { echo "no binaries given"; exit 2; }
command -v nm > /dev/null || { echo "no nm: install binutils"; exit 2; }
bad=0
for f in "$@"; do
  if [ ! -f "$f" ]; then
    echo "missing: $f"
    bad=1
    continue
  fi
  if ! table=$(nm -D "$f"); then
    echo "nm could not read the dynamic symbols of $f"
    bad=1
    continue
  fi
  syms=$(grep 'St10filesystem' <<< "$table" || true)
  if [ -n "$syms" ]; then
    echo "$f uses std::filesystem:"
    echo "$syms" | c++filt | sed 's/^/  /' | head -20
    bad=1
  else
    echo "ok: $(basename "$f")"
  fi
done
exit $bad
