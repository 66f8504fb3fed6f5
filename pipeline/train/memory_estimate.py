"""The host memory a training run needs at least, checked before any work (no process group, nothing written).

Per rank, arrays it must hold at once:

* the reader's shuffle window: ``data.shuffle_window x train.seq_len`` int64 token ids, which
  ``pipeline.data.reader.PackedSequences`` materializes whole;
* one optimizer step's micro-batches: ``train.global_batch / data-parallel ranks`` sequences of ``train.seq_len``
  int64 ids (``RankBatches.next_step`` makes them all before the first forward);
* on CPU (no CUDA device) the model state in host memory: fp32 weights, gradients and the two AdamW moments,
  16 bytes per parameter, divided by the world size (the most any engine shards them).

times the ranks on this node (``LOCAL_WORLD_SIZE``; the deepspeed launcher's ``LOCAL_SIZE``; 1 for a plain run).
Left out, each only adding to it: activations, the reader's transient copies while it cuts and permutes a window,
library and interpreter overhead. So a refused run could never have fit, and device (GPU) memory is not estimated
here: the accelerator's own out-of-memory error names the device.
"""

from __future__ import annotations

import os

import torch

from model import build_model, count_parameters
from pipeline.data import host_memory
from pipeline.train.config import ConfigError, TrainConfig

TOKEN_BYTES = 8
"""Token ids are int64 from the reader on."""
STATE_BYTES_PER_PARAM = 16
"""fp32 weights (4), gradients (4) and AdamW's two moments (8)."""


def local_ranks() -> int:
    """Ranks the launcher starts on this node (read before any process group exists)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)


def check_host_memory(cfg: TrainConfig, world_size: int) -> None:
    """Refuse a run whose lower bound (the module docstring) exceeds what this node's memory can give.

    Raises:
        ConfigError: naming the keys that decide the estimate, the estimate and what the host has.
    """
    memory = host_memory.available_memory()
    if memory is None:
        return
    t, window = cfg.train, cfg.data.shuffle_window
    window_bytes = window * t.seq_len * TOKEN_BYTES
    step_bytes = t.global_batch // cfg.data_parallel(world_size) * t.seq_len * TOKEN_BYTES
    state_bytes = 0
    if not torch.cuda.is_available():
        with torch.device("meta"):  # shapes only: no memory for a model that may not fit
            params = count_parameters(build_model(cfg.model))
        state_bytes = STATE_BYTES_PER_PARAM * params // world_size
    ranks = local_ranks()
    need = ranks * (window_bytes + step_bytes + state_bytes)
    if need <= memory.bytes:
        return
    gib = host_memory.gib
    state = f", the model state {gib(state_bytes)} (16 bytes per parameter on CPU)" if state_bytes else ""
    raise ConfigError(
        f"train.seq_len={t.seq_len} with data.shuffle_window={window} needs at least {gib(need)} of host memory on "
        f"this node: {ranks} rank(s) x (the shuffle window {gib(window_bytes)}, the step's micro-batches "
        f"{gib(step_bytes)} (train.global_batch={t.global_batch}, train.micro_batch={t.micro_batch}){state}), "
        f"but it has {gib(memory.bytes)} ({memory.limit}); lower data.shuffle_window or train.seq_len"
    )
