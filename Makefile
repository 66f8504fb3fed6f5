# gca-pretrain: every target installs what it needs first (a stamp keyed to the dependency files).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPS_HASH := $(shell cat requirements.lock pyproject.toml Makefile | sha1sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(DEPS_HASH)
PYTEST := $(PY) -m pytest -q
# The default CPU tier: everything not behind a heavier marker.
DEFAULT_MARKERS := not slow and not gpu and not dist and not slurm and not multinode

.PHONY: install lint format typecheck test test-slow test-dist test-gpu test-kernels test-reliability test-slurm test-multinode preflight demo demo-baseline demo-seeds demo-16m demo-multihop demo-smoke demo-lm demo-lm-smoke demo-cpt demo-cpt-smoke prep bench bench-train bench-kernels bench-cp bench-reader bench-prep test-eval bench-eval train-debug train-fsdp-cpu train-ds-cpu ds-warmup clean-shm clean-venv gpu-wheels gpu-check gpu-stamp gpu-publish demo-lm-gpu bench-gpu test-gpu-wheels test-gpu-check test-gpu-compile reference-curves

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml Makefile
	@echo "==> creating $(VENV) and installing pinned dependencies (first time: ~3 min)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --no-cache-dir --no-deps -r requirements.lock
	$(VENV)/bin/pip install --quiet --no-deps --no-build-isolation --config-settings editable_mode=compat -e .
	@# `import streaming` works in any script of this venv (no usable torchvision exists for the CPU torch):
	@# a startup hook prepares the import; data_prep/streaming_compat.py says why and what it does.
	$(PY) -c "from data_prep.streaming_compat import write_startup_hook; write_startup_hook()"
	@rm -f $(VENV)/.installed-*
	@touch $@
	@echo "==> environment ready ($(STAMP))"

# Lint (ruff, rules and line length in pyproject.toml; the formatter must leave every file unchanged) and type
# check (mypy on the library packages, settings in pyproject.toml) both run first in `make test`, so CI enforces them.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Rewrite the files the way `make lint` expects them (ruff's formatter and its safe fixes).
format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

typecheck: install
	$(VENV)/bin/mypy

test: install lint typecheck
	$(PYTEST) -m "$(DEFAULT_MARKERS)" tests

# Regenerate tests/assets/reference_curves.json (debug config, 20 steps, single / FSDP2 / ZeRO-2 on 2 ranks), only
# after a deliberate numerics change; the commit says why the curves moved (tests/reference_curves.py, docs/testing.md).
reference-curves: install ds-warmup
	work=$$(mktemp -d) && $(PY) tests/reference_curves.py --work $$work; status=$$?; rm -rf "$$work"; \
		rm -f /dev/shm/deepspeed_allreduce_buffer_*; exit $$status

test-slow: install
	$(PYTEST) -m "slow and not gpu" tests

# DeepSpeed runs leave 66 MB /dev/shm buffers behind; they are removed whatever the outcome.
test-dist: install ds-warmup
	OMP_NUM_THREADS=1 timeout 1800 $(PYTEST) -m "dist and not gpu and not reliability" tests; status=$$?; \
		rm -f /dev/shm/deepspeed_allreduce_buffer_*; exit $$status

# The failure-test catalogue T1-T23 (tests/reliability, docs/reliability.md): ~8 min on 2 cores.
test-reliability: install ds-warmup
	OMP_NUM_THREADS=1 timeout 1800 $(PYTEST) -m "reliability and not gpu" tests; status=$$?; \
		rm -f /dev/shm/deepspeed_allreduce_buffer_*; exit $$status

# SLURM tier: a real one-node cluster in a temp dir (needs root; apt-installs slurmctld/slurmd/slurm-client/munge
# if missing): pretrain.sbatch preempt -> requeue -> exact resume, and the prep.sbatch array + merge. ~3 min.
test-slurm: install
	OMP_NUM_THREADS=1 timeout 1200 $(PYTEST) -s -m slurm tests/slurm

# Multi-node tier (needs root, docs/multinode.md): two simulated nodes on this machine, each in its own namespaces
# (hostname, loopback address, pids, /dev/shm, scratch), sharing the data and run directories: torchrun and the
# DeepSpeed launcher (--no_ssh) against one node, a lost node, cross-node preflight, and pretrain.sbatch on a
# two-node SLURM cluster (apt-installs the SLURM daemons like test-slurm if missing).
test-multinode: install ds-warmup
	OMP_NUM_THREADS=1 timeout 2400 $(PYTEST) -s --durations=20 -m multinode tests

# Check the node(s) before a launch: make preflight ARGS="--config configs/train/x.yaml [--gpus-per-node 8] [k=v ...]"
preflight: install
	$(PY) launch/preflight.py $(ARGS)

test-kernels: install
	$(PYTEST) -m "kernels and not gpu" tests

test-gpu: install
	$(PYTEST) -m "gpu" tests

# Prepare the built-in offline corpus (the Python standard library's source) into data/default.
# A second run refuses to overwrite: `make prep ARGS="overwrite=true"` rebuilds.
prep: install
	$(PY) launch/prep.py --config configs/data/default.yaml $(ARGS)

train-debug: install
	$(PY) launch/pretrain.py --config configs/train/debug.yaml $(ARGS)

train-fsdp-cpu: install
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --nproc_per_node 2 launch/pretrain.py \
		--config configs/train/debug.yaml parallel.engine=fsdp $(ARGS)

train-ds-cpu: install ds-warmup
	DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 $(VENV)/bin/deepspeed --num_gpus 2 launch/pretrain.py \
		--config configs/train/debug.yaml parallel.engine=deepspeed parallel.zero_stage=2 $(ARGS)

# Pre-build DeepSpeed's CPU shared-memory comm op (~60 s once per venv path, cached in ~/.cache/torch_extensions).
ds-warmup: install
	DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()"

clean-shm:
	rm -f /dev/shm/deepspeed_allreduce_buffer_*

bench: install
	$(PY) launch/bench_model.py $(ARGS)

test-eval: install
	$(PYTEST) -m "$(DEFAULT_MARKERS)" tests/evaluation

# Passkey eval time and peak RSS of a tiny random-init model vs length (up to 1M tokens; ~15 min).
bench-eval: install
	$(PY) launch/bench_eval.py --out bench_eval.json $(ARGS)

# Training-step time of GCA vs same-depth sliding window vs full attention (1K/4K/16K), ZeRO-2 on 2 processes
# vs 1 process with the real trainer, and a bf16 run's gradients summed in fp32 vs bf16 under ZeRO-1/2 (prepares
# data/default first when missing). ~13 min on 2 cores.
bench-train: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/bench_train.py $(ARGS)

# The training step on one CUDA GPU (docs/benchmarks.md, make bench-gpu): gca / swa / full x plain / ZeRO-1 / FSDP2,
# step time, tokens/s, MFU, kernels per step, GPU busy, peak memory, compile time (ARGS="--agreement 30": eager vs
# compiled losses; --cpu: the tiny dry run).
BENCH_GPU_OUT ?= runs/bench_gpu.json
bench-gpu: install
	$(PY) launch/bench_gpu.py --out $(BENCH_GPU_OUT) $(ARGS)

bench-kernels: install
	$(PY) launch/bench_kernels.py

# Data prep tokens/s vs a raw SentencePiece batch encode of the same texts, 1 and N processes (ARGS: a prep config,
# overrides; e.g. ARGS="input=books/*.txt").
bench-prep: install
	$(PY) launch/bench_prep.py $(ARGS)

# The trainer's data reader (shards decoded in memory) vs the old decompressed copy on disk: tokens/s, bytes written.
bench-reader: install
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/bench_reader.py $(ARGS)

# Context parallelism: one sequence on 1 rank vs split over 2 (16K/32K/64K tokens; ARGS="--lengths 4096 8192" on a
# small machine): per-rank peak memory, step time and bytes sent, as ratios against the 1-rank run.
bench-cp: install
	$(PY) launch/bench_cp.py $(ARGS)

# The main job: prep (only when data/default is missing) -> DeepSpeed training of GCA + baseline on 2 CPU ranks
# -> passkey/ppl evaluation up to 1M tokens -> runs/demo/results.md. Interrupted? Run it again: it continues.
demo: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/demo.py --config configs/demo/demo.yaml $(ARGS)

# The demo's GCA model reading a passkey at 16M tokens (one sample per depth; the chunk memory on disk): the
# demo's stages are reused when done (run after `make demo`, or it runs them first). Interrupted? It continues.
demo-16m: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/demo.py --config configs/demo/demo.yaml longest=true $(ARGS)

# The sliding-window control of the demo (after make demo, or it runs it first): trained through the same stages
# and read with the same evaluations; its rows join runs/demo/results.md (docs/demo.md).
demo-baseline: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/demo.py --config configs/demo/demo.yaml "models=[gca,baseline]" $(ARGS)

# The demo's GCA model trained again with training seeds 1 and 2 (after make demo, or it runs it first), every
# seed read with the same passkey slices: results.md gains the spread over seeds. ARGS="prose=<folder of books>"
# adds each seed's passkey with English prose as the haystack (64K and 1M). Interrupted? It continues.
demo-seeds: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/demo.py --config configs/demo/demo.yaml "seeds=[1,2]" $(ARGS)

# The two-hop part of the demo alone: two retrieval groups against one, trained with the two-hop needle mix
# (the main demo is not run; its results already on disk stay in runs/demo/results.md). It continues when rerun.
demo-multihop: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/demo.py --config configs/demo/demo.yaml multihop.enabled=true multihop.only=true $(ARGS)

# The same pipeline in ~2 minutes with a few training steps and samples (plumbing only; numbers meaningless).
demo-smoke: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/demo.py --config configs/demo/smoke.yaml $(ARGS)

# The language-modelling demo: prep without held-out stdlib packages -> GCA, sliding-window and full-attention
# models trained alike -> perplexity of the same tokens with 1K..64K of context -> runs/demo_lm/results.md.
# Interrupted? Run it again: it continues.
demo-lm: install ds-warmup
	$(PY) launch/demo_lm.py --config configs/demo_lm/demo_lm.yaml $(ARGS)

demo-lm-smoke: install ds-warmup
	$(PY) launch/demo_lm.py --config configs/demo_lm/smoke.yaml $(ARGS)

# Continued pretraining (docs/cpt.md): a tiny dense Llama trained -> converted into GCA -> two training stages with
# the retrieval-task mix -> passkey 1K..1M and perplexity by context against the dense model ->
# runs/demo_cpt/results.md. Interrupted? Run it again: it continues.
demo-cpt: install ds-warmup
	$(PY) launch/demo_cpt.py --config configs/demo_cpt/demo_cpt.yaml $(ARGS)

demo-cpt-smoke: install ds-warmup
	$(PY) launch/demo_cpt.py --config configs/demo_cpt/smoke.yaml $(ARGS)

clean-venv:
	rm -rf $(VENV)

# GPU readiness (docs/gpu-check.md). The wheels a bare GPU image lacks (configs/gpu/wheels.txt), for CPython 3.12
# manylinux x86-64, into the git-ignored .whl/ that the device tool carries (~10 MiB; first run ~4 min: it builds
# deepspeed and zstd from their pinned sdists, zstd with python3.12).
GPU_WHEELS ?= .whl
gpu-wheels: install
	$(PY) -m pipeline.gpucheck.wheels --python-version 3.12 --dest $(GPU_WHEELS)

# The one-command GPU check: make gpu-check OUT=<dir> [ARGS="--budget-s 450 --export <dir>"]. No install step: on
# a GPU machine it runs under the image's python3 and installs .whl itself; without CUDA it is the CPU dry run.
OUT ?= gpu-check
GPU_CHECK_PY := $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_CHECK_PY) launch/gpu_check.py --out $(OUT) $(ARGS)

# Before a device run: the code's commit into the carried .whl (the device gets no .git). After it: the run's JSON
# into docs/results/gpu/<date>-<machine>.json and its table into docs/gpu-check.md.
gpu-stamp:
	$(GPU_CHECK_PY) launch/gpu_check.py --stamp
gpu-publish:
	$(GPU_CHECK_PY) launch/gpu_check.py --publish $(OUT)/gpu-check.json

# GCA, its random-retriever ablation and the sliding-window model on Project Gutenberg books, scored on held-out
# books, in one time-boxed GPU command (docs/demo-lm.md, GPU section); without CUDA: ARGS=--cpu for the dry run.
BOOKS ?= data/gutenberg
LM_GPU_OUT ?= runs/demo_lm_gpu
demo-lm-gpu:
	$(GPU_CHECK_PY) launch/demo_lm_gpu.py --books $(BOOKS) --out $(LM_GPU_OUT) $(ARGS)

# The wheel set installed into a clean venv that sees only the GPU image's packages; imports and a tiny
# prep/train/eval there (~1 min, plus ~4 min and network the first time for the wheels).
test-gpu-wheels: install
	OMP_NUM_THREADS=1 timeout 1800 $(PYTEST) -m gpuwheels tests/gpu_check

# Every Triton kernel compiled for sm_90 and sm_80 without a GPU (docs/gpu-check.md): fails on a compile error, a
# spill or too much shared memory, and regenerates docs/results/gpu-compile.md (212 configurations, ~2 min on 2
# idle cores).
test-gpu-compile: install
	$(PY) launch/gpu_compile.py --out docs/results/gpu-compile.md
	$(PYTEST) -m gpucompile tests/gpu_check

# The CPU dry runs of make gpu-check, make demo-lm-gpu and make bench-gpu: every stage at tiny shapes must finish ok
# (~7 min on 2 cores).
test-gpu-check: install ds-warmup
	OMP_NUM_THREADS=1 timeout 1800 $(PYTEST) -m gpucheck tests/gpu_check tests/pipeline/test_demo_lm_gpu.py tests/pipeline/test_bench_train_gpu.py
