# shardtorch: `make test` builds and runs the whole suite, `make demo` runs the
# main job. Both install what is missing first (scripts/setup.sh, idempotent).
# Use your own LibTorch with `make test Torch_DIR=/path/to/libtorch/share/cmake/Torch`.
SHELL := /bin/bash
VENV ?= .venv
BUILD ?= build
JOBS ?= 2
PY := $(VENV)/bin/python3
Torch_DIR ?=

.PHONY: all setup configure build test demo pipeline-demo pipeline-bubble tp-demo ft-demo ft-bench bench dcp-bench sweep peers install clean

all: build

setup:
	@bash scripts/setup.sh

configure: setup
	@if [ -n "$(Torch_DIR)" ]; then torch_arg="-DTorch_DIR=$(Torch_DIR)"; \
	 else torch_arg="-DCMAKE_PREFIX_PATH=$$($(PY) -c 'import torch; print(torch.utils.cmake_prefix_path)')"; fi; \
	 cmake -S . -B $(BUILD) $$torch_arg -DSHARDTORCH_PYTHON=$(abspath $(PY)) > $(BUILD).configure.log 2>&1 \
	   || { cat $(BUILD).configure.log; exit 1; }

build: configure
	cmake --build $(BUILD) -j$(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS)

# Builds the library and the example only (not the test suite).
demo: configure
	cmake --build $(BUILD) -j$(JOBS) --target train_gpt
	$(VENV)/bin/torchrun --no-python --standalone --nproc-per-node 2 $(BUILD)/examples/train_gpt --steps 40

# Pipeline parallelism (docs/parallelism.md): the example GPT in 2 stages x 2 data-parallel
# ranks, 1F1B; writes the last step's timeline (JSON) and its picture (PNG) in $(BUILD).
pipeline-demo: configure
	cmake --build $(BUILD) -j$(JOBS) --target pipeline_gpt
	$(VENV)/bin/torchrun --no-python --standalone --nproc-per-node 4 $(BUILD)/examples/pipeline_gpt --pp 2 --steps 20 \
	  --microbatches 4 --timeline $(BUILD)/pipeline-timeline.json --plot $(BUILD)/pipeline-timeline.png --python $(PY)

# Tensor parallelism (docs/parallelism.md): the example GPT over 4 ranks, tensor-parallel 2 x
# data-parallel 2, with sequence parallelism.
tp-demo: configure
	cmake --build $(BUILD) -j$(JOBS) --target tp_gpt
	$(VENV)/bin/torchrun --no-python --standalone --nproc-per-node 4 $(BUILD)/examples/tp_gpt --tp 2 --steps 20 --sequence-parallel

# Fault tolerance (docs/fault_tolerance.md): torchft's lighthouse, three replica
# groups of the example GPT, one killed twice and healed; prints the timeline and checks the result.
ft-demo: configure
	cmake --build $(BUILD) -j$(JOBS) --target ft_train
	$(PY) tests/ft/kill_and_heal.py --lighthouse $(VENV)/bin/torchft_lighthouse --torchrun $(VENV)/bin/torchrun \
	  --trainer $(BUILD)/examples/ft_train --workdir $(BUILD)/ft-demo --groups 3 --steps 60 --kills 2 --step-ms 100 --model gpt --oracle exact

# Fault tolerance's cost against torchft's own DDP (docs/fault_tolerance.md, "Measurements"):
# steady-state overhead and one failure, side by side. A benchmark, not a test: figures vary by run.
ft-bench: configure
	cmake --build $(BUILD) -j$(JOBS) --target ft_train
	$(PY) bench/ft/run_overhead.py --build $(BUILD) --venv $(VENV) --out $(BUILD)/ft-bench.json

# Google Benchmark results as JSON in $(BUILD)/bench-results/ (not a test: figures vary by machine).
bench: build
	mkdir -p $(BUILD)/bench-results
	$(BUILD)/bench/bench_cpu_adam --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
	  --benchmark_out=$(BUILD)/bench-results/cpu_adam.json --benchmark_out_format=json
	$(BUILD)/bench/bench_comm --benchmark_min_time=0.2 \
	  --benchmark_out=$(BUILD)/bench-results/comm.json --benchmark_out_format=json
	$(BUILD)/bench/bench_checksum --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
	  --benchmark_out=$(BUILD)/bench-results/checksum.json --benchmark_out_format=json

# Each pipeline schedule's measured idle share (bubble) against its theory, with a stand-in
# compute per layer so that the stages' times do not depend on the cores (docs/parallelism.md).
pipeline-bubble: configure
	cmake --build $(BUILD) -j$(JOBS) --target gpt_bench
	$(PY) bench/pipeline/run_bubble.py --build $(BUILD) --venv $(VENV)

# A PyTorch distributed checkpoint of 1.07 B parameters written by FSDP2 at 2 ranks, loaded at 4 by
# shardtorch and by torch's dcp.load: time and memory per rank (docs/checkpoints.md). Needs ~10 GiB of
# memory and of disk (DCP_BENCH_DIR); DCP_BENCH_ARGS="--layers 4" makes it smaller.
DCP_BENCH_DIR ?= /tmp/shardtorch-dcp-bench
dcp-bench: configure
	cmake --build $(BUILD) -j$(JOBS) --target dcp_load_bench
	$(PY) bench/dcp/run_dcp_bench.py --build $(BUILD) --venv $(VENV) --dir $(DCP_BENCH_DIR) \
	  --out $(BUILD)/dcp-bench.json $(DCP_BENCH_ARGS)

# Memory against throughput of the example GPT (docs/benchmarks.md): CSV, JSON and PNG in $(BUILD)/sweep.
sweep: build
	$(BUILD)/tools/shardtorch-sweep --out $(BUILD)/sweep --gpt-bench $(BUILD)/bench/gpt_bench \
	  --torchrun $(VENV)/bin/torchrun --python $(PY)

# shardtorch against PyTorch's DDP and FSDP2 on the same GPT (docs/benchmarks.md).
peers: build
	$(PY) bench/peers/run_peers.py --gpt-bench $(BUILD)/bench/gpt_bench --torchrun $(VENV)/bin/torchrun \
	  --workdir $(BUILD)/peers --out $(BUILD)/peers/summary.json

install: build
	cmake --install $(BUILD) --prefix $(or $(PREFIX),/usr/local)

clean:
	rm -rf $(BUILD) $(BUILD).configure.log
