#!/usr/bin/env bash
# Run here (a Debian machine with network): downloads the Debian packages the
# GPU machine lacks (GoogleTest, Google Benchmark, Boost 1.81 JSON and
# program_options, Gloo's headers) into .gpu/debs, which the device tool
# carries (`carry: [".gpu"]`). Idempotent: a package already downloaded is
# kept. The GPU machine unpacks them with dpkg -x (scripts/gpu/build_and_test.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
PKGS=(libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian
      libboost1.81-dev libboost-json1.81-dev libboost-json1.81.0
      libboost-container1.81-dev libboost-container1.81.0 libboost-system1.81-dev libboost-system1.81.0
      libboost-program-options1.81-dev libboost-program-options1.81.0 libgloo-dev
      libxxhash-dev libxxhash0)
mkdir -p .gpu/debs
cd .gpu/debs
for p in "${PKGS[@]}"; do
  ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download -q "$p"
done
ls -1 | wc -l | xargs echo "fetch_debs: .deb files in .gpu/debs:"
du -sh . | cut -f1 | xargs echo "fetch_debs: size"
