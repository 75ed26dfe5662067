#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine with python3:
#  - Debian packages: build tools, GoogleTest, Google Benchmark, Boost 1.81 JSON and
#    program_options, xxHash, ccache, gRPC.
#  - A virtual environment owned by the Makefile (.venv) holding torch==2.13.0
#    and torchft's lighthouse.
# Each step is skipped when what it installs is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

# libgloo-dev: the torch wheel ships Gloo compiled in but not its headers,
# which c10d's ProcessGroupGloo.hpp includes (only src/comm/gloo_backend.cpp).
# clang-14 and libclang-rt-14-dev: libFuzzer with ASan/UBSan for the safetensors parser.
# clang-format-14: the C++ style (.clang-format), checked by the ctest build.format.
# libxxhash-dev: XXH3 checksums of checkpoint files (header only).
# g++-aarch64-linux-gnu: the ctest that compiles the CPU Adam for aarch64.
# gRPC and protobuf: the fault-tolerance manager's client of torchft's lighthouse.
# gdb: the stacks of a test's process that hung (tests/stacks_on_timeout.sh).
PKGS=(cmake g++ make ccache libgtest-dev libgmock-dev libbenchmark-dev
      libboost-json1.81-dev libboost-program-options1.81-dev libgloo-dev python3-venv
      clang-14 libclang-rt-14-dev clang-format-14 libxxhash-dev g++-aarch64-linux-gnu
      libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc gdb)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The venv is needed even with Torch_DIR (a LibTorch zip): torchrun comes from it.
VENV=${SHARDTORCH_VENV:-.venv}
if [ ! -x "$VENV/bin/python3" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python3" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  echo "setup: installing torch==2.13.0 into $VENV"
  "$VENV/bin/python3" -m pip install -q torch==2.13.0
fi
# safetensors: the test that loads our checkpoints from Python.
if ! "$VENV/bin/python3" -c 'import safetensors' 2>/dev/null; then
  echo "setup: installing safetensors into $VENV"
  "$VENV/bin/python3" -m pip install -q safetensors
fi
# transformers: the test that loads a Llama it saved (save_pretrained); pinned.
TRANSFORMERS_VERSION=5.24.0
if ! "$VENV/bin/python3" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('transformers') == '$TRANSFORMERS_VERSION' else 1)" 2>/dev/null; then
  echo "setup: installing transformers==$TRANSFORMERS_VERSION into $VENV"
  "$VENV/bin/python3" -m pip install -q "transformers==$TRANSFORMERS_VERSION"
fi
# torchft's lighthouse (torchft_lighthouse), the coordinator of fault-tolerant
# training (docs/fault_tolerance.md); pinned: proto/lighthouse.proto follows its protocol.
TORCHFT_VERSION=2026.10.26
if ! "$VENV/bin/python3" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('torchft-nightly') == '$TORCHFT_VERSION' else 1)" 2>/dev/null; then
  echo "setup: installing torchft-nightly==$TORCHFT_VERSION into $VENV"
  "$VENV/bin/python3" -m pip install -q "torchft-nightly==$TORCHFT_VERSION"
fi
# matplotlib: the sweep tool's PNG plot (bench/plot_sweep.py).
if ! "$VENV/bin/python3" -c 'import matplotlib' 2>/dev/null; then
  echo "setup: installing matplotlib into $VENV"
  "$VENV/bin/python3" -m pip install -q matplotlib
fi
