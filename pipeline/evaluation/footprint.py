"""What one eval sample of the longest length needs at least, checked against this host before the export loads.

Samples run one at a time, so the longest of ``lengths`` decides. The estimate is a lower bound, each term an
array the run must hold at once:

* host memory: the sample's token ids (int64: 8 bytes per token, ``pipeline.evaluation.haystack``); for a GCA
  model also the landmark keys (``d_model`` fp32 values per chunk, always in RAM) and the chunk K/V kept in RAM,
  ``min(kv, offload_mb MiB)`` (all of it with ``offload_mb=-1``);
* disk, in ``offload_dir`` (default: the system temp dir): the chunk K/V past ``offload_mb``, where ``kv`` is
  2 (K and V) x ``d_model`` x 4 bytes (fp32) per token (``model.offload.MemmapChunkMemory``).

Activations, the weights and the spill file's doubling headroom come on top and are left out, so a run refused
here could never have fit. ``ppl`` on a dataset or text files scores only the documents that hold a length (no
array of it is made for shorter ones) and is not checked.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from data_prep.schema import ConfigError
from model import GCAConfig, read_export_config
from model.io import ExportError
from pipeline.data import host_memory
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.haystack import UNBOUNDED

TOKEN_BYTES = 8
"""A haystack token id is an int64."""
FP32_BYTES = 4


def needs(model: GCAConfig, length: int, offload_mb: int) -> tuple[int, int]:
    """(host memory, disk) bytes that a sample of ``length`` tokens needs at least (the module docstring)."""
    ram = TOKEN_BYTES * length
    if model.arch != "gca":
        return ram, 0
    chunks = length // model.chunk_size
    kv = 2 * model.d_model * FP32_BYTES * chunks * model.chunk_size
    in_ram = kv if offload_mb < 0 else min(kv, offload_mb << 20)
    return ram + chunks * model.d_model * FP32_BYTES + in_ram, kv - in_ram


def check_footprint(checkpoint: str, task: str, cfg: EvalConfig) -> None:
    """Refuse, before the export's weights load, a length whose sample cannot fit this host's memory or the disk
    of ``offload_dir``. Only the export's ``config.json`` is read; an export without a readable one is left to the
    loader, which names the problem.

    Raises:
        ConfigError: naming ``lengths``, the estimate, what is available and the key that helps.
    """
    if task == "ppl" and cfg.data not in UNBOUNDED:
        return
    try:
        model, _ = read_export_config(checkpoint)
    except (ExportError, FileNotFoundError):
        return
    length = max(cfg.lengths)
    ram, disk = needs(model, length, cfg.offload_mb)
    memory = host_memory.available_memory()
    if memory is not None and ram > memory.bytes:
        parts = "its token ids, 8 bytes each" + (
            ", the landmark keys, the chunk K/V in RAM" if model.arch == "gca" else ""
        )
        spill = (
            " or offload_mb=1024 (the chunk K/V past it go to disk)"
            if model.arch == "gca" and cfg.offload_mb < 0
            else ""
        )
        raise ConfigError(
            f"lengths={cfg.lengths}: a sample of {length} tokens needs at least {host_memory.gib(ram)} of memory "
            f"({parts}), but this host has {host_memory.gib(memory.bytes)} ({memory.limit}); evaluate shorter "
            f"lengths{spill}"
        )
    if disk:
        where = cfg.offload_dir if cfg.offload_dir is not None else tempfile.gettempdir()
        free = host_memory.free_disk_bytes(Path(where))
        if disk > free:
            raise ConfigError(
                f"lengths={cfg.lengths}: a sample of {length} tokens spills at least {host_memory.gib(disk)} of chunk "
                f"K/V past offload_mb={cfg.offload_mb} to offload_dir={where}, which has {host_memory.gib(free)} free; "
                "set offload_dir to a larger disk, raise offload_mb, or evaluate shorter lengths"
            )
