"""Wall time and peak RSS of a passkey eval of a tiny random-init model vs length (``make bench-eval``).

Each (model, length) runs in its own process (``python -m pipeline.cli.eval``), so its peak RSS is its own.
Models, same size (d_model 128, 4 heads, 2 lower + 2 upper layers, chunk 16): ``gca`` (window 64, top-4
retrieval, chunk K/V on disk from the first chunk: ``offload_mb=0``) and ``full`` (``model.arch=full`` of the same
size: full causal attention with RoPE, whose KV cache grows with the length and whose time grows with its square).
Targets: time linear in length (1M / 16K ~ 64x), 1M tokens in < 10 min and < 8 GiB on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from model import GCAConfig, GCAForCausalLM, build_model, save_pretrained

TINY = GCAConfig(
    vocab_size=512,
    d_model=128,
    n_heads=4,
    n_kv_heads=4,
    ffn_hidden=384,
    n_lower_layers=2,
    groups=[2],
    chunk_size=16,
    top_k=4,
    window=64,
    attn_backend="naive",
)
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
            print(f"gca  {json.dumps(report['gca'][-1])}", flush=True)
        full = save_pretrained(
            build_model(dataclasses.replace(TINY, arch="full")), Path(tmp) / "full", extra=EXPORT_EXTRA
        )
        for length in full_lengths:
            report["full"].append(run_one(full, length, Path(tmp) / f"full-out-{length}", timeout))
            print(f"full {json.dumps(report['full'][-1])}", flush=True)
    done = {r["length"]: r["seconds"] for r in report["gca"] if "seconds" in r}
    if len(done) >= 2:
        lo, hi = min(done), max(done)
        report["time_ratio"] = [{"from": lo, "to": hi, "length_ratio": hi / lo, "time_ratio": done[hi] / done[lo]}]
        print(f"time {hi}/{lo}: {done[hi] / done[lo]:.1f}x for {hi / lo:.0f}x the tokens")
    return report
