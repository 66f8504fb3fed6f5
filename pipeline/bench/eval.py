"""Wall time and peak RSS of a passkey eval of a tiny random-init model vs length (``make bench-eval``), and the
per-token cost of streaming a long passkey prefix by position (``run_per_token``, ``make bench-eval
ARGS=--per-token``).

Each (model, length) runs in its own process (``python -m pipeline.cli.eval``), so its peak RSS is its own.
Models, same size (d_model 128, 4 heads, 2 lower + 2 upper layers, chunk 16): ``gca`` (window 64, top-4
retrieval, chunk K/V on disk from the first chunk: ``offload_mb=0``) and ``full`` (``model.arch=full`` of the same
size: full causal attention with RoPE, whose KV cache grows with the length and whose time grows with its square).
Targets: time linear in length (1M / 16K ~ 64x), 1M tokens in < 10 min and < 8 GiB on 2 cores.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from model import CausalLM, GCAForCausalLM, build_model, preset, save_pretrained
from model.offload import MemmapChunkMemory
from pipeline.evaluation.runtime import load_checkpoint, stream_segments

log = logging.getLogger(__name__)

TINY = preset("bench-eval")
EXPORT_EXTRA = {"train_seq_len": 1024}


def run_one(export: Path, length: int, out: Path, timeout: int, overrides: Sequence[str] = ()) -> dict:
    """One passkey eval of ``export`` at ``length`` tokens in a fresh process (extra eval ``overrides`` last): its
    time, peak RSS and speed, or the reason it failed."""
    cmd = [
        sys.executable,
        "-m",
        "pipeline.cli.eval",
        "--checkpoint",
        str(export),
        "--task",
        "passkey",
        "--out",
        str(out),
        f"lengths=[{length}]",
        "samples=1",
        "depths=[0.5]",
        "progress=false",
        "offload_mb=0",
        *overrides,
    ]
    try:
        subprocess.run(cmd, check=True, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"length": length, "error": f"timeout after {timeout}s"}
    except subprocess.CalledProcessError as err:
        return {"length": length, "error": f"exit {err.returncode}: " + (err.stderr.strip().splitlines() or [""])[-1]}
    result = json.loads((out / "passkey.json").read_text())
    return {
        "length": length,
        "seconds": result["results"][0]["seconds"],
        "peak_rss_mib": result["peak_rss_mib"],
        "tokens_per_s": result["results"][0]["tokens_per_s"],
    }


def run_bench(lengths: list[int], full_lengths: list[int], timeout: int) -> dict:
    """The GCA model at every length and full attention at ``full_lengths``, each row printed as it finishes; with
    two or more GCA rows, ``time_ratio`` compares the shortest and the longest."""
    report: dict = {"gca": [], "full": []}
    with tempfile.TemporaryDirectory(prefix="gca-bench-eval-") as tmp:
        torch.manual_seed(0)
        gca = save_pretrained(GCAForCausalLM(TINY), Path(tmp) / "gca", extra=EXPORT_EXTRA)
        for length in lengths:
            report["gca"].append(run_one(gca, length, Path(tmp) / f"gca-{length}", timeout))
            log.info("gca  %s", json.dumps(report["gca"][-1]))
        full = save_pretrained(
            build_model(dataclasses.replace(TINY, arch="full")), Path(tmp) / "full", extra=EXPORT_EXTRA
        )
        for length in full_lengths:
            report["full"].append(run_one(full, length, Path(tmp) / f"full-out-{length}", timeout))
            log.info("full %s", json.dumps(report["full"][-1]))
    done = {r["length"]: r["seconds"] for r in report["gca"] if "seconds" in r}
    if len(done) >= 2:
        lo, hi = min(done), max(done)
        report["time_ratio"] = [{"from": lo, "to": hi, "length_ratio": hi / lo, "time_ratio": done[hi] / done[lo]}]
        log.info("time %d/%d: %.1fx for %.0fx the tokens", hi, lo, done[hi] / done[lo], hi / lo)
    return report


def run_per_token(
    positions: list[int],
    window: int = 65536,
    segment: int = 4096,
    checkpoint: str | None = None,
    offload_dir: str | None = None,
) -> dict:
    """Stream one prefix of ``max(positions)`` random tokens once, the way the passkey eval streams its far prefix
    (``memory_only`` segments, chunk K/V on disk from the first chunk), and report at each position the speed over
    the ``window`` tokens before it with its ratio to the first position's (1.0 = flat): ``tokens_per_s`` (wall
    clock) and ``tokens_per_cpu_s`` (this process's CPU time, which time spent waiting for a busy CPU does not
    inflate), plus the resident memory, the chunk store's RAM part (landmark keys) and its bytes on disk.

    The model is ``TINY`` with the CPU's default operators (random init), or the export at ``checkpoint``.
    """
    positions = sorted(positions)
    if positions[0] < window or any(p % segment for p in positions) or window % segment:
        raise ValueError(
            f"positions={positions}, window={window}: every position must be >= the window, and positions and "
            f"window multiples of segment={segment}"
        )
    torch.manual_seed(0)
    model: CausalLM
    if checkpoint is None:
        model = GCAForCausalLM(dataclasses.replace(TINY, attn_backend="auto")).eval()
    else:
        model = load_checkpoint(checkpoint).model
    vocab = model.cfg.vocab_size
    recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=window // segment)  # (wall, cpu) s
    report: dict = {"window": window, "segment": segment, "checkpoint": checkpoint, "rows": []}
    with MemmapChunkMemory(ram_bytes=0, directory=offload_dir) as memory:
        state = model.new_stream_state(memory=memory)
        for start in range(0, positions[-1], segment):
            piece = torch.randint(0, vocab, (1, segment))
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in stream_segments(model, state, piece, segment, memory_only=True):
                pass
            recent.append((time.perf_counter() - wall, time.process_time() - cpu))
            if start + segment not in positions:
                continue
            row = {
                "position": start + segment,
                "tokens_per_s": round(window / sum(w for w, _ in recent), 1),
                "tokens_per_cpu_s": round(window / sum(c for _, c in recent), 1),
                "rss_mib": round(_rss_bytes() / 2**20, 1),
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "store_ram_mib": round(memory.ram_nbytes() / 2**20, 1),
                "store_disk_mib": round((memory.nbytes() - memory.ram_nbytes()) / 2**20, 1),
            }
            first = report["rows"][0] if report["rows"] else row
            row["ratio"] = round(row["tokens_per_s"] / first["tokens_per_s"], 3)
            row["cpu_ratio"] = round(row["tokens_per_cpu_s"] / first["tokens_per_cpu_s"], 3)
            report["rows"].append(row)
            log.info("%s", json.dumps(row))
    return report


def _rss_bytes() -> int:
    """This process's resident memory now (Linux: ``/proc/self/statm``, pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
