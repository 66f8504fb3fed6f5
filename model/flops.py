"""Training FLOPs per token of the three architectures (the numerator of MFU), from the config and the count of
matmul parameters."""

from __future__ import annotations

import torch

from model.config import GCAConfig


def _mean_keys(positions: int, window: int | None) -> float:
    """Mean number of keys a causal query reads over ``positions`` stream positions: ``t + 1``, at most
    ``window + 1`` (``None``: full attention)."""
    keys = torch.arange(positions, dtype=torch.float64) + 1
    return float((keys if window is None else keys.clamp(max=window + 1)).mean())


def flops_per_token(cfg: GCAConfig, seq_len: int, n_matmul_params: int) -> float:
    """Training FLOPs (forward + backward = 3x forward, 2 FLOPs per MAC) per raw token of the ``cfg.arch`` model.

    Dense part: ``6 * n_matmul_params`` per stream position (``n_matmul_params`` counts every linear weight and
    the tied LM head), and in a GCA model every chunk adds one landmark position, hence the factor ``(S + 1) / S``.
    Attention, per position and layer, costs ``12 * d * keys`` (QK^T and PV, 3x for backward) where ``keys`` is
    what the position really reads -- not the dense ``T / 2``:
      - sliding-window self-attention (lower and upper layers): the mean of ``min(t + 1, window + 1)``;
      - chunk encoder: the ``S + 1`` positions of its own chunk;
      - GCA (upper layers): ``top_k * S`` retrieved memory tokens;
      - retrieval (once per group): each landmark scores every earlier chunk, ``N^2 / 2 * 2d`` per sequence.
    The baselines have no landmarks, encoder, GCA or retrieval: all their ``n_baseline_layers`` layers are
    self-attention over the tokens, sliding-window (``swa``) or causal (``full``,
    the mean of ``t + 1``).
    """
    S, d = cfg.chunk_size, cfg.d_model
    if cfg.arch != "gca":
        n_layers = cfg.n_baseline_layers
        keys = _mean_keys(seq_len, None if cfg.arch == "full" else cfg.window)
        return 6.0 * n_matmul_params + 12.0 * d * keys * n_layers
    n_chunks = max(seq_len // S, 1)
    stream = seq_len + n_chunks
    mean_window = _mean_keys(stream, cfg.window)
    per_position = (
        6.0 * n_matmul_params
        + 12.0 * d * mean_window * (cfg.n_lower_layers + cfg.n_upper_layers)
        + 12.0 * d * (S + 1) * cfg.n_encoder_layers
        + 12.0 * d * cfg.top_k * S * cfg.n_upper_layers
    )
    retrieval = 3.0 * len(cfg.groups) * n_chunks * n_chunks * d / seq_len
    return per_position * stream / seq_len + retrieval


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that are matmul operands per token: linear weights (an untied LM head among them) plus the tied LM
    head (= the embedding) when there is no untied one."""
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    if getattr(model, "head", None) is None:
        n += sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return n
