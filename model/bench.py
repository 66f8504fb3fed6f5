"""Forward throughput and peak memory of a GCA model vs a same-size full-attention baseline (``make bench``).

Every measurement runs in a fresh subprocess so that the peak resident memory (``ru_maxrss``) belongs to that
configuration alone; results are printed as ratios against the baseline measured in the same run.
Usage: ``python -m model.bench [--lengths 1024 4096 16384] [--gca-only 65536] [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.cpu_math import flush_denormals
from model.config import GCAConfig
from model.gca import GCAForCausalLM
from model.layers import RMSNorm, SwiGLU

BENCH_CONFIG = GCAConfig(
    vocab_size=8192,
    d_model=256,
    n_heads=4,
    n_kv_heads=4,
    ffn_hidden=768,
    n_lower_layers=3,
    groups=[3],
    n_encoder_layers=1,
    chunk_size=63,
    top_k=8,
    window=512,
)


class FullAttentionBlock(nn.Module):
    """Pre-norm causal full-attention layer (PyTorch SDPA) with the GCA model's SwiGLU MLP."""

    def __init__(self, cfg: GCAConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, T, _ = h.shape
        q, k, v = self.qkv(self.attn_norm(h)).view(B, T, 3, self.n_heads, -1).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + self.wo(o.transpose(1, 2).reshape(B, T, -1))
        return h + self.mlp(self.mlp_norm(h))


class FullAttentionLM(nn.Module):
    """Baseline: causal full attention, same width and number of decoder layers as the GCA model."""

    def __init__(self, cfg: GCAConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        n_layers = cfg.n_lower_layers + cfg.n_upper_layers + cfg.n_encoder_layers
        self.layers = nn.ModuleList(FullAttentionBlock(cfg) for _ in range(n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return F.linear(self.norm(h), self.embed.weight)


def _measure(kind: str, length: int, repeats: int) -> dict:
    flush_denormals()  # as the trainer and the eval jobs do
    torch.manual_seed(0)
    model = (GCAForCausalLM(BENCH_CONFIG) if kind == "gca" else FullAttentionLM(BENCH_CONFIG)).eval()
    ids = torch.randint(0, BENCH_CONFIG.vocab_size, (1, length))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - start)
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    return {"kind": kind, "length": length, "tokens_per_s": length / min(times), "peak_mb": peak_mb}


def _run_isolated(kind: str, length: int, repeats: int) -> dict:
    cmd = [sys.executable, "-m", "model.bench", "--one", kind, str(length), "--repeats", str(repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"kind": kind, "length": length, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--gca-only", type=int, nargs="*", default=[65536])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one", nargs=2, metavar=("KIND", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        sys.stdout.write(json.dumps(_measure(args.one[0], int(args.one[1]), args.repeats)) + "\n")
        return
    n_params = GCAForCausalLM(BENCH_CONFIG).num_parameters()
    sys.stdout.write(f"GCA model: {n_params / 1e6:.1f}M parameters, {BENCH_CONFIG}\n")
    sys.stdout.write(f"torch {torch.__version__}, {torch.get_num_threads()} threads, forward only, batch 1\n\n")
    columns = [("T", 7), ("GCA tok/s", 10), ("full tok/s", 10), ("speed ratio", 11), ("GCA MB", 8), ("full MB", 8)]
    header = " | ".join(f"{name:>{width}}" for name, width in [*columns, ("mem ratio", 9)])
    sys.stdout.write(header + "\n" + "-" * len(header) + "\n")
    for length in args.lengths + args.gca_only:
        gca = _run_isolated("gca", length, args.repeats)
        full = _run_isolated("full", length, args.repeats) if length in args.lengths else None
        if "error" in gca:
            sys.stdout.write(f"{length:>7} | GCA failed: {gca['error']}\n")
            continue
        if full is None or "error" in full:
            sys.stdout.write(
                f"{length:>7} | {gca['tokens_per_s']:>10.0f} | {'-':>10} | {'-':>11} | "
                f"{gca['peak_mb']:>8.0f} | {'-':>8} | {'-':>9}\n"
            )
            continue
        sys.stdout.write(
            f"{length:>7} | {gca['tokens_per_s']:>10.0f} | {full['tokens_per_s']:>10.0f} | "
            f"{gca['tokens_per_s'] / full['tokens_per_s']:>10.2f}x | {gca['peak_mb']:>8.0f} | "
            f"{full['peak_mb']:>8.0f} | {gca['peak_mb'] / max(full['peak_mb'], 1e-9):>8.2f}x\n"
        )


if __name__ == "__main__":
    main()
