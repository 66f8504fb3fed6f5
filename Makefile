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

.PHONY: install lint format typecheck test test-slow test-dist test-gpu test-kernels test-reliability test-slurm test-multinode preflight demo demo-baseline demo-seeds demo-16m demo-multihop demo-smoke demo-lm demo-lm-smoke demo-cpt demo-cpt-smoke demo-ruler demo-ruler-long demo-ruler-smoke prep bench bench-train bench-kernels bench-cp bench-reader bench-prep test-eval bench-eval train-debug train-fsdp-cpu train-ds-cpu ds-warmup clean-shm clean-venv gpu-wheels gpu-check gpu-stamp gpu-publish demo-lm-gpu bench-gpu test-gpu-wheels test-gpu-check test-gpu-compile reference-curves help train prep-text test-quickstart bench-data-order bench-mixture report

## create .venv and install the pinned dependencies (every target runs it first)
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
## ruff check and ruff format --check
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Rewrite the files the way `make lint` expects them (ruff's formatter and its safe fixes).
## rewrite the files the way make lint expects them
format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

## mypy on the library packages
typecheck: install
	$(VENV)/bin/mypy

## lint, type check, then the default CPU test tier (what CI runs)
test: install lint typecheck
	$(PYTEST) -m "$(DEFAULT_MARKERS)" tests

# Regenerate tests/assets/reference_curves.json (debug config, 20 steps, single / FSDP2 / ZeRO-2 on 2 ranks), only
# after a deliberate numerics change; the commit says why the curves moved (tests/reference_curves.py, docs/testing.md).
## regenerate tests/assets/reference_curves.json (only after a deliberate numerics change)
reference-curves: install ds-warmup
	work=$$(mktemp -d) && $(PY) tests/reference_curves.py --work $$work; status=$$?; rm -rf "$$work"; exit $$status

## the slow test tier
test-slow: install
	$(PYTEST) -m "slow and not gpu" tests

## multi-process tests over gloo (DeepSpeed, FSDP2, torchrun)
test-dist: install ds-warmup
	OMP_NUM_THREADS=1 timeout 1800 $(PYTEST) -m "dist and not gpu and not reliability" tests

# The failure-test catalogue T1-T23 (tests/reliability, docs/reliability.md): ~8 min on 2 cores.
## the failure-test catalogue T1-T23 (~8 min)
test-reliability: install ds-warmup
	OMP_NUM_THREADS=1 timeout 1800 $(PYTEST) -m "reliability and not gpu" tests

# SLURM tier: a real one-node cluster in a temp dir (needs root; apt-installs slurmctld/slurmd/slurm-client/munge
# if missing): pretrain.sbatch preempt -> requeue -> exact resume, and the prep.sbatch array + merge. ~3 min.
## a real one-node SLURM cluster in a temp dir: requeue, exact resume, prep array (root, ~3 min)
test-slurm: install
	OMP_NUM_THREADS=1 timeout 1200 $(PYTEST) -s -m slurm tests/slurm

# Multi-node tier (needs root, docs/multinode.md): two simulated nodes on this machine, each in its own namespaces
# (hostname, loopback address, pids, /dev/shm, scratch), sharing the data and run directories: torchrun and the
# DeepSpeed launcher (--no_ssh) against one node, a lost node, cross-node preflight, and pretrain.sbatch on a
# two-node SLURM cluster (apt-installs the SLURM daemons like test-slurm if missing).
## two simulated nodes: torchrun, DeepSpeed --no_ssh, a lost node, SLURM (root)
test-multinode: install ds-warmup
	OMP_NUM_THREADS=1 timeout 2400 $(PYTEST) -s --durations=20 -m multinode tests

# Check the node(s) before a launch: make preflight ARGS="--config configs/train/x.yaml [--gpus-per-node 8] [k=v ...]"
## check the node(s) before a launch: ARGS="--config configs/train/x.yaml"
preflight: install
	$(PY) launch/preflight.py $(ARGS)

## the Triton kernel tests under the CPU interpreter
test-kernels: install
	$(PYTEST) -m "kernels and not gpu" tests

## the tests that need a CUDA GPU
test-gpu: install
	$(PYTEST) -m "gpu" tests

# Prepare the built-in offline corpus (the Python standard library's source) into data/default.
# A second run refuses to overwrite: `make prep ARGS="overwrite=true"` rebuilds.
## the built-in offline corpus -> data/default (ARGS="overwrite=true" rebuilds)
prep: install
	$(PY) launch/prep.py --config configs/data/default.yaml $(ARGS)

# Your own text files (one file = one document) -> data prep with a SentencePiece tokenizer of VOCAB pieces trained
# on them (docs/quickstart.md): make prep-text INPUT=<folder or glob of .txt files> OUTPUT=data/<name> [ARGS="k=v"]
VOCAB ?= 8000
ifneq ($(filter prep-text,$(MAKECMDGOALS)),)
ifeq ($(and $(INPUT),$(OUTPUT)),)
$(error make prep-text needs INPUT=<folder or glob of .txt files> and OUTPUT=data/<name>)
endif
endif
## your own text: INPUT=<folder or glob of .txt files> OUTPUT=data/<name> [VOCAB=8000] [ARGS=k=v]
prep-text: install
	$(PY) launch/prep.py "input=$(INPUT)" "output=$(OUTPUT)" tokenizer.vocab_size=$(VOCAB) $(ARGS)

# The training targets take CONFIG (a YAML of configs/train/), DATA (a prepared dataset: data.path) and RUN (run_dir;
# both default to the config's own) and ARGS (more key=value overrides): make train CONFIG=configs/train/tiny.yaml
# DATA=data/mine RUN=runs/mine. A config that leaves model.vocab_size out takes the dataset's tokenizer size.
CONFIG ?= configs/train/debug.yaml
TRAIN_ARGS = --config $(CONFIG) $(if $(DATA),data.path=$(DATA)) $(if $(RUN),run_dir=$(RUN))
## train in one process (CPU or 1 GPU): CONFIG=<yaml> DATA=<prepared dir> RUN=<run dir> ARGS="k=v ..."
train: install
	$(PY) launch/pretrain.py $(TRAIN_ARGS) $(ARGS)

## make train with its defaults: configs/train/debug.yaml on data/default
train-debug: train

## train on 2 CPU ranks with FSDP2 (torchrun); CONFIG, DATA, RUN, ARGS as for make train
train-fsdp-cpu: install
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --nproc_per_node 2 launch/pretrain.py \
		$(TRAIN_ARGS) parallel.engine=fsdp $(ARGS)

## train on 2 CPU ranks with DeepSpeed ZeRO-2; CONFIG, DATA, RUN, ARGS as for make train
train-ds-cpu: install ds-warmup
	DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 $(VENV)/bin/deepspeed --num_gpus 2 launch/pretrain.py \
		$(TRAIN_ARGS) parallel.engine=deepspeed parallel.zero_stage=2 $(ARGS)

# docs/quickstart.md's commands as written, from a shell without .venv on PATH, on text files the test writes (prep ->
# 2 training steps -> ppl, passkey, report -> export -> transformers), and its two-rank DeepSpeed block.
## docs/quickstart.md run as written from a fresh shell, and its two-rank DeepSpeed block
test-quickstart: install ds-warmup
	OMP_NUM_THREADS=1 timeout 1800 $(PYTEST) -m "slow or dist" tests/test_quickstart.py

# Pre-build DeepSpeed's CPU shared-memory comm op (~60 s once per venv) into .venv/torch_extensions, where every
# run of this venv looks for it (pipeline/train/deepspeed_cpu.py).
## pre-build DeepSpeed's CPU shared-memory comm op (~60 s, once)
ds-warmup: install
	DS_ACCELERATOR=cpu $(PY) -c "from pipeline.train.deepspeed_cpu import build_shm_op; build_shm_op()"

# Runs remove their own /dev/shm buffers; this removes those of runs killed during start-up (and of killed
# streaming readers) that no process maps any more, so a running job's are never touched.
## remove shared-memory buffers (/dev/shm) that killed runs left behind
clean-shm: install
	$(PY) -c "from pipeline.train.preflight import clean_stale_shm; print(len(clean_stale_shm()), 'stale files removed from /dev/shm')"

## forward throughput and memory, GCA vs full attention
bench: install
	$(PY) launch/bench_model.py $(ARGS)

## the evaluation tests of the default tier
test-eval: install
	$(PYTEST) -m "$(DEFAULT_MARKERS)" tests/evaluation

# Passkey eval time and peak RSS of a tiny random-init model vs length (up to 1M tokens; ~15 min).
## passkey eval time and peak memory vs length, up to 1M tokens (~15 min)
bench-eval: install
	$(PY) launch/bench_eval.py --out bench_eval.json $(ARGS)

# Training-step time of GCA vs same-depth sliding window vs full attention (1K/4K/16K), ZeRO-2 on 2 processes
# vs 1 process with the real trainer, and a bf16 run's gradients summed in fp32 vs bf16 under ZeRO-1/2 (prepares
# data/default first when missing). ~13 min on 2 cores.
## training-step time: GCA vs sliding window vs full attention; ZeRO-2 on 2 ranks (~13 min)
bench-train: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/bench_train.py $(ARGS)

# The training step on one CUDA GPU (docs/benchmarks.md, make bench-gpu): gca / swa / full x plain / ZeRO-1 / FSDP2,
# step time, tokens/s, MFU, kernels per step, GPU busy, peak memory, compile time (ARGS="--agreement 30": eager vs
# compiled losses; --cpu: the tiny dry run).
BENCH_GPU_OUT ?= runs/bench_gpu.json
## the training step on one CUDA GPU: step time, tokens/s, MFU, memory (ARGS=--cpu: dry run)
bench-gpu: install
	$(PY) launch/bench_gpu.py --out $(BENCH_GPU_OUT) $(ARGS)

## the GCA kernels on CUDA against the fastest exact attention
bench-kernels: install
	$(PY) launch/bench_kernels.py

# Data prep tokens/s vs a raw SentencePiece batch encode of the same texts, 1 and N processes (ARGS: a prep config,
# overrides; e.g. ARGS="input=books/*.txt").
## data prep tokens/s against a raw SentencePiece batch encode
bench-prep: install
	$(PY) launch/bench_prep.py $(ARGS)

# The trainer's data reader (shards decoded in memory) vs the old decompressed copy on disk: tokens/s, bytes written;
# then the block data order vs the window order over the same reader: tokens/s and peak memory.
## the trainer's data reader: tokens/s and bytes written; the block vs the window data order
bench-reader: install
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/bench_reader.py $(ARGS)

## documents per global batch of each data order vs uniform random windows, PG19-shaped (ARGS="--lengths-from DIR")
bench-data-order: install
	$(PY) launch/bench_data_order.py $(ARGS)

# Three prepared datasets cut from data/default (prepared first when missing) read as a 0.5/0.3/0.2 and a
# size-weighted data.sources mixture vs data/default alone, through the trainer's batches: tokens/s and peak memory.
## tokens/s of a 3-source data mixture vs one dataset through the trainer's reader (target >= 0.95x)
bench-mixture: install
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/bench_mixture.py --out bench_mixture.json $(ARGS)

ifneq ($(filter report,$(MAKECMDGOALS)),)
ifeq ($(EVAL),)
$(error make report needs EVAL=<an eval --out directory> (several, quoted, compare side by side))
endif
endif
## one markdown report of eval outputs: EVAL="<eval --out dir> [more dirs side by side]" [ARGS="--out r.md"]
report: install
	$(PY) launch/report.py $(EVAL) $(ARGS)

# Context parallelism: one sequence on 1 rank vs split over 2 (16K/32K/64K tokens; ARGS="--lengths 4096 8192" on a
# small machine): per-rank peak memory, step time and bytes sent, as ratios against the 1-rank run.
## context parallelism: one sequence on 1 rank vs split over 2 (memory, time, bytes sent)
bench-cp: install
	$(PY) launch/bench_cp.py $(ARGS)

# The main job: prep (only when data/default is missing) -> DeepSpeed training of GCA + baseline on 2 CPU ranks
# -> passkey/ppl evaluation up to 1M tokens -> runs/demo/results.md. Interrupted? Run it again: it continues.
## the whole pipeline on the built-in corpus (27 min): passkey to 1M tokens -> runs/demo/results.md
demo: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/demo.py --config configs/demo/demo.yaml $(ARGS)

# The demo's GCA model reading a passkey at 16M tokens (one sample per depth; the chunk memory on disk): the
# demo's stages are reused when done (run after `make demo`, or it runs them first). Interrupted? It continues.
## the demo's model reading a passkey at 16M tokens (~10 min per sample)
demo-16m: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/demo.py --config configs/demo/demo.yaml longest=true $(ARGS)

# The sliding-window control of the demo (after make demo, or it runs it first): trained through the same stages
# and read with the same evaluations; its rows join runs/demo/results.md (docs/demo.md).
## the demo's sliding-window control, same stages (~20 min more)
demo-baseline: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/demo.py --config configs/demo/demo.yaml "models=[gca,baseline]" $(ARGS)

# The demo's GCA model trained again with training seeds 1 and 2 (after make demo, or it runs it first), every
# seed read with the same passkey slices: results.md gains the spread over seeds. ARGS="prose=<folder of books>"
# adds each seed's passkey with English prose as the haystack (64K and 1M). Interrupted? It continues.
## the demo's GCA model again with training seeds 1 and 2
demo-seeds: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/demo.py --config configs/demo/demo.yaml "seeds=[1,2]" $(ARGS)

# The two-hop part of the demo alone: two retrieval groups against one, trained with the two-hop needle mix
# (the main demo is not run; its results already on disk stay in runs/demo/results.md). It continues when rerun.
## two-hop retrieval alone: two retrieval groups against one
demo-multihop: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/demo.py --config configs/demo/demo.yaml multihop.enabled=true multihop.only=true $(ARGS)

# The same pipeline in ~2 minutes with a few training steps and samples (plumbing only; numbers meaningless).
## the demo's plumbing in ~2 min (numbers meaningless)
demo-smoke: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/demo.py --config configs/demo/smoke.yaml $(ARGS)

# The language-modelling demo: prep without held-out stdlib packages -> GCA, sliding-window and full-attention
# models trained alike -> perplexity of the same tokens with 1K..64K of context -> runs/demo_lm/results.md.
# Interrupted? Run it again: it continues.
## GCA vs sliding window vs full attention on held-out text -> runs/demo_lm/results.md
demo-lm: install ds-warmup
	$(PY) launch/demo_lm.py --config configs/demo_lm/demo_lm.yaml $(ARGS)

## make demo-lm's plumbing in ~3 min
demo-lm-smoke: install ds-warmup
	$(PY) launch/demo_lm.py --config configs/demo_lm/smoke.yaml $(ARGS)

# Continued pretraining (docs/cpt.md): a tiny dense Llama trained -> converted into GCA -> trained with the
# retrieval-task mix and the retriever's supervised loss -> passkey 1K..1M, RULER and perplexity by context against
# the dense model ->
# runs/demo_cpt/results.md. Interrupted? Run it again: it continues.
## continued pretraining: a dense Llama converted into GCA -> runs/demo_cpt/results.md
demo-cpt: install ds-warmup
	$(PY) launch/demo_cpt.py --config configs/demo_cpt/demo_cpt.yaml $(ARGS)

## make demo-cpt's plumbing at tiny sizes
demo-cpt-smoke: install ds-warmup
	$(PY) launch/demo_cpt.py --config configs/demo_cpt/smoke.yaml $(ARGS)

# RULER's needle families (single 1-3, multikey, multivalue, multiquery) from one recipe of its own: two training
# stages from scratch, then passkey to 1M, ppl, RULER at 4K/64K and the needle tasks at 1M (docs/demo.md).
# ARGS="seeds=[1]" also trains and reads a second training seed. Interrupted? Run it again: it continues.
## RULER's needle families from one recipe -> runs/demo_ruler/results.md
demo-ruler: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/demo.py --config configs/demo_ruler/demo.yaml $(ARGS)

# make demo-ruler with its mixed stage run twice (~22 min more training): the budget that reads niah_single_3 too.
## make demo-ruler past its 45-min budget (mixed stage twice) -> runs/demo_ruler_long/results.md
demo-ruler-long: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/demo.py --config configs/demo_ruler/long.yaml $(ARGS)

## make demo-ruler's plumbing at tiny sizes (both stages, a second seed, every eval)
demo-ruler-smoke: install ds-warmup
	@test -f data/default/_COMPLETE || $(PY) launch/prep.py --config configs/data/default.yaml
	$(PY) launch/demo.py --config configs/demo_ruler/smoke.yaml $(ARGS)

## delete .venv
clean-venv:
	rm -rf $(VENV)

# GPU readiness (docs/gpu-check.md). The wheels a bare GPU image lacks (configs/gpu/wheels.txt), for CPython 3.12
# manylinux x86-64, into the git-ignored .whl/ that the device tool carries (~10 MiB; first run ~4 min: it builds
# deepspeed and zstd from their pinned sdists, zstd with python3.12).
GPU_WHEELS ?= .whl
## the wheels a bare GPU image lacks, into .whl/ (~4 min the first time)
gpu-wheels: install
	$(PY) -m pipeline.gpucheck.wheels --python-version 3.12 --dest $(GPU_WHEELS)

# The one-command GPU check: make gpu-check OUT=<dir> [ARGS="--budget-s 450 --export <dir>"]. No install step: on
# a GPU machine it runs under the image's python3 and installs .whl itself; without CUDA it is the CPU dry run.
OUT ?= gpu-check
GPU_CHECK_PY := $(if $(wildcard $(PY)),$(PY),python3)
## the one-command GPU check: OUT=<dir> ARGS=... (the CPU dry run without CUDA)
gpu-check:
	$(GPU_CHECK_PY) launch/gpu_check.py --out $(OUT) $(ARGS)

# Before a device run: the code's commit into the carried .whl (the device gets no .git). After it: the run's JSON
# into docs/results/gpu/<date>-<machine>.json and its table into docs/gpu-check.md.
## before a device run: the code's commit into .whl
gpu-stamp:
	$(GPU_CHECK_PY) launch/gpu_check.py --stamp
## after a device run: its JSON into docs/results/gpu/, its table into docs/gpu-check.md
gpu-publish:
	$(GPU_CHECK_PY) launch/gpu_check.py --publish $(OUT)/gpu-check.json

# GCA, its random-retriever ablation and the sliding-window model on Project Gutenberg books, scored on held-out
# books, in one time-boxed GPU command (docs/demo-lm.md, GPU section); without CUDA: ARGS=--cpu for the dry run.
BOOKS ?= data/gutenberg
LM_GPU_OUT ?= runs/demo_lm_gpu
## the language-modelling demo on one GPU: BOOKS=<dir> LM_GPU_OUT=<dir> (ARGS=--cpu: dry run)
demo-lm-gpu:
	$(GPU_CHECK_PY) launch/demo_lm_gpu.py --books $(BOOKS) --out $(LM_GPU_OUT) $(ARGS)

# The wheel set installed into a clean venv that sees only the GPU image's packages; imports and a tiny
# prep/train/eval there (~1 min, plus ~4 min and network the first time for the wheels).
## the GPU wheel set in a clean venv: imports and a tiny prep/train/eval (~1 min)
test-gpu-wheels: install
	OMP_NUM_THREADS=1 timeout 1800 $(PYTEST) -m gpuwheels tests/gpu_check

# Every Triton kernel compiled for sm_90 and sm_80 without a GPU (docs/gpu-check.md): fails on a compile error, a
# spill or too much shared memory, and regenerates docs/results/gpu-compile.md (212 configurations, ~2 min on 2
# idle cores).
## every Triton kernel compiled for sm_90 and sm_80 without a GPU (~2 min)
test-gpu-compile: install
	$(PY) launch/gpu_compile.py --out docs/results/gpu-compile.md
	$(PYTEST) -m gpucompile tests/gpu_check

# The CPU dry runs of make gpu-check, make demo-lm-gpu and make bench-gpu: every stage at tiny shapes must finish ok
# (~7 min on 2 cores).
## the CPU dry runs of gpu-check, demo-lm-gpu and bench-gpu (~7 min)
test-gpu-check: install ds-warmup
	OMP_NUM_THREADS=1 timeout 1800 $(PYTEST) -m gpucheck tests/gpu_check tests/pipeline/test_demo_lm_gpu.py tests/pipeline/test_bench_train_gpu.py

# Every job with one line: the `## ` comment right above each target (tests/test_make_help.py keeps them complete).
## every job with one line (this list)
help:
	@awk '/^## /{text = substr($$0, 4); next} /^[a-zA-Z0-9_-]+:/ && text != "" \
		{sub(/:.*/, ""); printf "  %-18s %s\n", $$0, text} {text = ""}' $(firstword $(MAKEFILE_LIST))
