"""Exact sliding-window ALiBi attention for GPUs: FlashAttention when installed, else PyTorch FlexAttention.

Both paths compute exactly what ``kernels/swa/naive.py`` computes (no approximation, only a different summation
order): query ``i`` sits at key position ``qpos = Tk - Tq + i``, attends to key positions ``p`` with
``0 <= qpos - p <= window``, and adds the logit bias ``-slope_h * (qpos - p)`` to the scaled score. Both are
differentiable.

``flash_attn`` is an optional extra, imported lazily; it covers fp16/bf16 CUDA tensors with ``D % 8 == 0`` and
``D <= 256``. Everything else goes through FlexAttention (compiled on CUDA, eager elsewhere, so the same code is
checkable on CPU). Compiled, it holds one graph per (shape, dtype, grad mode) for the whole process: every layer
and step of a shape shares it (tests/model/test_swa_flex_compiles.py counts the compiles), and a key cache shorter
than ``window + Tq`` is padded to that length so that decode compiles once per query length, not once per token.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _flash_attn_func():
    """``flash_attn.flash_attn_func`` if the optional package is installed, else ``None``."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


FLEX_RECOMPILE_LIMIT = 64
"""Graphs the compiled FlexAttention may hold in one process: one per (shape, dtype, grad mode) it meets. Dynamo's
default limit (8) is shared by every caller of ``flex_attention`` and, once passed, silently runs the unfused
implementation, which materialises the full score matrix; a training run with validation, an fp32 evaluation copy
and streaming decode, or a test tier with many cases, needs more. Past this limit the call raises instead."""

# One compiled function for every layer, step and model of the process (the FlexAttention authors' pattern); static
# shapes, so each new (B, Tq, Tk) compiles once and the kernel is specialised to it.
_compiled_flex = torch.compile(flex_attention, dynamic=False)
# Compiled mask creation avoids materialising a dense [Tq, Tk] mask on long CUDA sequences; torch deprecates
# create_block_mask(_compile=True) in favour of this.
_compiled_create_block_mask = torch.compile(create_block_mask, dynamic=False)


def _compiles_on(device: torch.device) -> bool:
    """Whether the compiled kernel serves ``device``. Only CUDA: on CPU FlexAttention has no backward (eager or
    compiled), and the eager path keeps the CPU checks free of compile time."""
    return device.type == "cuda"


@functools.lru_cache(maxsize=32)
def _window_block_mask(Tq: int, Tk: int, window: int, device: torch.device) -> BlockMask:
    """Block-sparse mask of the causal window; every layer and step of a shape shares it, hence the cache (the
    compiled kernel then also sees one ``mask_mod`` per shape, so its Python ints never add a guard)."""
    offset = Tk - Tq

    def in_window(b, h, q_idx, kv_idx):
        dist = q_idx + offset - kv_idx
        return (dist >= 0) & (dist <= window)

    make = _compiled_create_block_mask if _compiles_on(device) else create_block_mask
    return make(in_window, None, None, Tq, Tk, device=device)


@functools.lru_cache(maxsize=256)
def _index(value: int, device: torch.device) -> torch.Tensor:
    """``value`` as a 0-d int32 tensor on ``device``, made once: the score_mod reads positions from tensors, which
    Dynamo passes as graph inputs, where a captured Python int would be a constant guarded by value."""
    return torch.tensor(value, dtype=torch.int32, device=device)


def _alibi(slopes: torch.Tensor, offset: torch.Tensor, first_key: torch.Tensor):
    """The ALiBi score_mod: per-head slopes indexed by the head, offsets as tensors; keys before ``first_key`` (the
    padding of a short key cache) score ``-inf``."""

    def alibi(score, b, h, q_idx, kv_idx):
        biased = score - slopes[h] * (q_idx + offset - kv_idx)
        return torch.where(kv_idx >= first_key, biased, -float("inf"))

    return alibi


def _pad_keys(k: torch.Tensor, v: torch.Tensor, Tq: int, window: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Give a key cache longer than the queries the one length ``window + Tq`` (decode and streaming: the cache
    grows token by token until it holds ``window`` positions), so a run compiles once per query length instead of
    once per cache length. Keys older than ``window + Tq`` are seen by no query and dropped; a shorter cache is
    front-padded with zeros that the score_mod masks. Returns the keys, the values and the first real key."""
    Tk, span = k.shape[1], window + Tq
    if Tk == Tq:  # no cache (training, a first segment): the shape is already the step's
        return k, v, 0
    if Tk >= span:
        return k[:, Tk - span :], v[:, Tk - span :], 0
    pad = span - Tk
    return F.pad(k, (0, 0, 0, 0, pad, 0)), F.pad(v, (0, 0, 0, 0, pad, 0)), pad


def _flex_sliding_window(q, k, v, window, slopes, scale):
    Tq, HQ = q.shape[1], q.shape[2]
    k, v, first_key = _pad_keys(k, v, Tq, window)
    Tk, H = k.shape[1], k.shape[2]
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # [B, HQ, Tq, D], [B, H, Tk, D] x 2
    kwargs = dict(
        score_mod=_alibi(slopes, _index(Tk - Tq, q.device), _index(first_key, q.device)),
        block_mask=_window_block_mask(Tq, Tk, window, q.device),
        scale=scale,
        enable_gqa=HQ != H,
    )
    if _compiles_on(q.device):
        with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
            o = _compiled_flex(*args, **kwargs)
    else:
        o = flex_attention(*args, **kwargs)
    return o.transpose(1, 2)  # [B, Tq, HQ, D]


def gpu_sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    alibi_slopes: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal sliding-window attention with ALiBi, exact, on fused GPU kernels.

    Args:
        q: ``[B, Tq, HQ, D]``; query ``i`` sits at key position ``Tk - Tq + i``.
        k, v: ``[B, Tk, H, D]`` with ``Tk >= Tq`` and ``HQ`` a multiple of ``H``.
        window: each query sees itself and the ``window`` positions before it (``window >= 0``).
        alibi_slopes: ``[HQ]`` per-head slopes; logit bias ``-slope_h * (qpos - p)``.
        scale: default ``D ** -0.5``.

    Returns:
        ``[B, Tq, HQ, D]`` in the dtype of ``q``.
    """
    B, Tq, HQ, D = q.shape
    Tk, H = k.shape[1], k.shape[2]
    if Tk < Tq:
        raise ValueError(f"keys (Tk={Tk}) must cover the queries (Tq={Tq})")
    if HQ % H != 0:
        raise ValueError(f"query heads HQ={HQ} must be a multiple of key/value heads H={H}")
    if window < 0:
        raise ValueError(f"window={window} must be >= 0")
    if tuple(alibi_slopes.shape) != (HQ,):
        raise ValueError(f"alibi_slopes must be [HQ] = [{HQ}]; got {tuple(alibi_slopes.shape)}")
    if Tq == 0:
        return q.new_zeros(q.shape)
    scale = D**-0.5 if scale is None else scale
    slopes = alibi_slopes.to(device=q.device, dtype=torch.float32)

    flash_attn_func = _flash_attn_func()
    if flash_attn_func is not None and q.is_cuda and q.dtype in _FLASH_DTYPES and D % 8 == 0 and D <= 256:
        # causal=True aligns the mask bottom-right (query i at key Tk - Tq + i); window_size=(window, 0) keeps
        # keys in [qpos - window, qpos]; the ALiBi bias is -slope * |qpos - p|, the same as ours inside the window.
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=True, window_size=(window, 0), alibi_slopes=slopes)
    return _flex_sliding_window(q, k, v, window, slopes, scale)
