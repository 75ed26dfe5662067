#!/usr/bin/env bash
# Run here (a Debian machine with network): downloads what the GPU machine
# lacks into .gpu/, which the device tool carries (`carry: [".gpu"]`):
#   .gpu/debs    Debian packages: GoogleTest, Google Benchmark, Boost 1.81 JSON
#                and program_options, Gloo's headers, xxHash, and gRPC with
#                protobuf and their libraries (fault tolerance);
#   .gpu/wheels  the pinned torchft wheel (its lighthouse) for CPython 3.10
#                to 3.13, since that machine's Python version is not known here.
# Idempotent: what is already downloaded is kept. The GPU machine unpacks the
# packages with dpkg -x (scripts/gpu/build_and_test.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
PKGS=(libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian
      libboost1.81-dev libboost-json1.81-dev libboost-json1.81.0
      libboost-container1.81-dev libboost-container1.81.0 libboost-system1.81-dev libboost-system1.81.0
      libboost-program-options1.81-dev libboost-program-options1.81.0 libgloo-dev
      libxxhash-dev libxxhash0
      # gRPC and protobuf (-DSHARDTORCH_FT=ON), and the libraries they need
      # beyond the C runtime, zlib and OpenSSL's runtime, which any machine
      # that runs Python has.
      libgrpc++-dev libgrpc++1.51 libgrpc-dev libgrpc29 libprotobuf-dev libprotobuf32 libprotobuf-lite32
      libprotoc32 protobuf-compiler protobuf-compiler-grpc libabsl-dev libabsl20220623 libc-ares-dev
      libc-ares2 libre2-dev libre2-9 libssl-dev zlib1g-dev)
TORCHFT=torchft-nightly==2026.10.26  # as scripts/setup.sh pins it
mkdir -p .gpu/debs .gpu/wheels
(
  cd .gpu/debs
  for p in "${PKGS[@]}"; do
    ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download -q "$p"
  done
)
PIP=${PIP:-.venv/bin/pip}
for v in 3.10 3.11 3.12 3.13; do
  tag=cp${v/./}
  ls .gpu/wheels/torchft_nightly-*-"$tag"-*.whl >/dev/null 2>&1 ||
    "$PIP" download -q "$TORCHFT" --no-deps --only-binary=:all: --python-version "$v" -d .gpu/wheels
done
ls -1 .gpu/debs | wc -l | xargs echo "fetch_debs: .deb files in .gpu/debs:"
ls -1 .gpu/wheels | wc -l | xargs echo "fetch_debs: wheels in .gpu/wheels:"
du -sh .gpu | cut -f1 | xargs echo "fetch_debs: size"
