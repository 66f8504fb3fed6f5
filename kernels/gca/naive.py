"""Readable PyTorch reference of the GCA operator: the paper's maths, computed in fp32 (fp64 stays fp64).

Shapes (glossary in ``kernels/__init__.py``): ``q [B, HQ, Q, D]``, ``k, v [B, H, R, S, D]``, ``weights [B, R]``.
"""

from __future__ import annotations

import torch


def check_gca_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weights: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the argument when shapes do not fit the GCA contract."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, HQ, Q, D]; got shape {tuple(q.shape)}")
    if k.dim() != 5 or v.dim() != 5:
        raise ValueError(f"k and v must be [B, H, R, S, D]; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, HQ, _, D = q.shape
    Bk, H, R, S, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"k/v batch and head dim must match q: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if H == 0 or HQ % H != 0:
        raise ValueError(f"query heads HQ={HQ} must be a multiple of key/value heads H={H}")
    if R < 1 or S < 1:
        raise ValueError(f"need at least one retrieved chunk and one memory slot; got R={R}, S={S}")
    if tuple(weights.shape) != (B, R):
        raise ValueError(f"weights must be [B, R] = [{B}, {R}]; got {tuple(weights.shape)}")


def naive_gca(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    *,
    scale: float | None = None,
    softmax_off_by_one: bool = False,
) -> torch.Tensor:
    """GCA reference: ``o[b, h] = sum_r weights[b, r] * softmax_s(q[b, h] . k[b, h // G, r, s] * scale) v[...]``.

    Args:
        q: ``[B, HQ, Q, D]`` queries.
        k, v: ``[B, H, R, S, D]`` memories of the ``R`` retrieved chunks; ``HQ`` is a multiple of ``H``.
        weights: ``[B, R]`` retrieval weights, shared by all heads and query rows of a batch entry.
        scale: logit scale, default ``D ** -0.5``.
        softmax_off_by_one: add a virtual logit 0 with a zero value to every per-chunk softmax, so a query can
            attend to "nothing" in a chunk (``softmax1(z)_s = e^{z_s} / (1 + sum e^{z})``).

    Returns:
        ``o [B, HQ, Q, D]`` in the dtype of ``q``.
    """
    check_gca_inputs(q, k, v, weights)
    B, HQ, Q, D = q.shape
    H = k.shape[1]
    G = HQ // H
    scale = D**-0.5 if scale is None else scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(compute).view(B, H, G, Q, D)  # [B, H, G, Q, D]
    kf, vf, wf = k.to(compute), v.to(compute), weights.to(compute)

    logits = torch.einsum("bhgqd,bhrsd->bhgrqs", qf, kf) * scale  # [B, H, G, R, Q, S]
    if softmax_off_by_one:
        # The "+1" is a virtual slot with logit 0 and value 0: softmax over S+1 slots, then drop that slot.
        zero = logits.new_zeros(logits.shape[:-1] + (1,))
        probs = torch.softmax(torch.cat([logits, zero], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    per_chunk = torch.einsum("bhgrqs,bhrsd->bhgrqd", probs, vf)  # [B, H, G, R, Q, D]
    o = torch.einsum("bhgrqd,br->bhgqd", per_chunk, wf)  # [B, H, G, Q, D]
    return o.reshape(B, HQ, Q, D).to(q.dtype)
