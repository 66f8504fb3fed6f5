"""The host memory a training run needs at least, checked before any work (no process group, nothing written).

Per rank, arrays it must hold at once:

* what the reader cuts sequences into: with ``data.shuffle_scope=window`` (or ``data.shuffle=false``) its window,
  ``data.shuffle_window x train.seq_len`` int64 token ids, which ``pipeline.data.reader.PackedSequences``
  materializes whole; with ``blocks`` the whole global batch, ``train.global_batch x train.seq_len`` int64 ids,
  which every rank cuts before it takes its share (the block's own tokens, up to ``data.shuffle_block_mib`` but
  no more than the split holds, are left out: the split's size is not read here);
* one optimizer step's micro-batches: ``train.global_batch / data-parallel ranks`` sequences of ``train.seq_len``
  int64 ids (``RankBatches.next_step`` makes them all before the first forward);
* on CPU (no CUDA device) the model state in host memory: fp32 weights, gradients and the two AdamW moments,
  16 bytes per parameter, divided by the world size (the most any engine shards them).

times the ranks on this node (``LOCAL_WORLD_SIZE``; the deepspeed launcher's ``LOCAL_SIZE``; 1 for a plain run).
Left out, each only adding to it: activations, the reader's transient copies while it cuts and permutes a window,
library and interpreter overhead. So a refused run could never have fit.

On a CUDA device, per rank, what it must hold at once (`device_lower_bound`):

* the model state, 16 bytes per parameter (fp32 master weights, fp32 gradients, AdamW's two moments) over all
  ranks: the most any engine shards it (FSDP2 and ZeRO-3 hold exactly that share; ZeRO-1/2 more);
* the input of every transformer block for one micro-batch, ``micro_batch x seq_len / context_parallel x d_model``
  values of the compute dtype: what activation checkpointing keeps through the forward for the backward (without
  it every block keeps more).

Left out: the logits, each block's recomputed activations during backward, attention workspaces, the CUDA
context and the allocator's fragmentation. The bound is checked against the device's total memory, so it never
refuses a run that could fit; a run that passes can still run out, and then the device's own error names it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from model import build_model, count_parameters
from pipeline.data import host_memory
from pipeline.train import launch_env
from pipeline.train.config import ConfigError, TrainConfig
from pipeline.train.dist import local_rank_from_env
from pipeline.train.parallel import blocks

TOKEN_BYTES = 8
"""Token ids are int64 from the reader on."""
STATE_BYTES_PER_PARAM = 16
"""fp32 weights (4), gradients (4) and AdamW's two moments (8)."""
BF16_BYTES = 2
FP32_BYTES = 4


def local_ranks() -> int:
    """Ranks the launcher starts on this node (read before any process group exists)."""
    return launch_env.integer(os.environ, "LOCAL_WORLD_SIZE", 0) or launch_env.integer(os.environ, "LOCAL_SIZE", 1)


def check_host_memory(cfg: TrainConfig, world_size: int) -> None:
    """Refuse a run whose lower bound (the module docstring) exceeds what this node's memory can give.

    Raises:
        ConfigError: naming the keys that decide the estimate, the estimate and what the host has.
    """
    memory = host_memory.available_memory()
    if memory is None:
        return
    t, d = cfg.train, cfg.data
    if d.order() == "blocks":
        window_bytes, source = t.global_batch * t.seq_len * TOKEN_BYTES, "the global batch the reader cuts"
        window_key = f"train.global_batch={t.global_batch}"
    else:
        window_bytes, source = d.shuffle_window * t.seq_len * TOKEN_BYTES, "the shuffle window"
        window_key = f"data.shuffle_window={d.shuffle_window}"
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
        f"train.seq_len={t.seq_len} with {window_key} needs at least {gib(need)} of host memory on "
        f"this node: {ranks} rank(s) x ({source} {gib(window_bytes)}, the step's micro-batches "
        f"{gib(step_bytes)} (train.global_batch={t.global_batch}, train.micro_batch={t.micro_batch}){state}), "
        f"but it has {gib(memory.bytes)} ({memory.limit}); lower {window_key.split('=')[0]} or train.seq_len"
    )


@dataclass(frozen=True)
class DeviceBound:
    """Per rank, in bytes: `state_bytes` + `activation_bytes` = `total`."""

    state_bytes: int
    activation_bytes: int
    n_params: int
    n_blocks: int

    @property
    def total(self) -> int:
        return self.state_bytes + self.activation_bytes


def device_lower_bound(cfg: TrainConfig, world_size: int, value_bytes: int) -> DeviceBound:
    """The device memory one rank needs at least (the module docstring), with ``value_bytes`` per activation value
    (2 in bf16, 4 in fp32). Builds the model on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    n_params, n_blocks = count_parameters(model), len(blocks(model))
    tokens = cfg.train.micro_batch * cfg.train.seq_len // cfg.parallel.context_parallel
    return DeviceBound(
        state_bytes=STATE_BYTES_PER_PARAM * n_params // world_size,
        activation_bytes=n_blocks * tokens * cfg.model.d_model * value_bytes,
        n_params=n_params,
        n_blocks=n_blocks,
    )


def device_total_bytes() -> tuple[int, str] | None:
    """This rank's CUDA device's total memory and name, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    index = local_rank_from_env() % torch.cuda.device_count()
    props = torch.cuda.get_device_properties(index)
    return props.total_memory, f"cuda:{index} ({props.name})"


def check_device_memory(cfg: TrainConfig, world_size: int, device: tuple[int, str] | None = None) -> None:
    """Refuse a run whose device lower bound (the module docstring) exceeds the device's total memory.
    ``device`` (total bytes, name) defaults to this rank's CUDA device; without one nothing is checked.

    Raises:
        ConfigError: naming the keys that decide the bound, its parts and what the device has.
    """
    device = device if device is not None else device_total_bytes()
    if device is None:
        return
    total, name = device
    bf16 = cfg.precision.dtype in ("auto", "bf16")  # auto is bf16 on CUDA
    bound = device_lower_bound(cfg, world_size, BF16_BYTES if bf16 else FP32_BYTES)
    if bound.total <= total:
        return
    gib, t, cp = host_memory.gib, cfg.train, cfg.parallel.context_parallel
    raise ConfigError(
        f"train.seq_len={t.seq_len} with train.micro_batch={t.micro_batch} needs at least {gib(bound.total)} of "
        f"GPU memory per rank: the model state {gib(bound.state_bytes)} ({bound.n_params:,} parameters x 16 bytes "
        f"over {world_size} rank(s)) and the {bound.n_blocks} blocks' inputs kept for the backward "
        f"{gib(bound.activation_bytes)} (micro_batch x seq_len / parallel.context_parallel={cp} x "
        f"model.d_model={cfg.model.d_model} x {2 if bf16 else 4} bytes each), but {name} has {gib(total)}; lower "
        "train.seq_len or train.micro_batch, or raise parallel.context_parallel"
    )
