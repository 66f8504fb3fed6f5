"""The GCA operator through PyTorch's fused ``scaled_dot_product_attention`` (the fast CPU path).

Same contract as ``naive_gca``. Every (query chunk, retrieved chunk) pair is one SDPA problem, so the queries are
repeated over ``R`` and the ``R`` per-chunk softmaxes run as one batched call (on CPU: the flash kernel, fused
softmax and backward); the per-chunk outputs are then mixed by the retrieval weights, which keeps
``d o / d weights`` = the per-chunk output (the retriever's gradient) to autograd.

Softmax-off-by-one is exact here: a memory slot whose key and value are zero has logit ``q . 0 = 0`` and adds
nothing to the output, which is precisely the virtual ``+1`` slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.gca.naive import check_gca_inputs


def sdpa_gca(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    *,
    scale: float | None = None,
    softmax_off_by_one: bool = False,
) -> torch.Tensor:
    """``o [B, HQ, Q, D]`` for ``q [B, HQ, Q, D]``, ``k, v [B, H, R, S, D]``, ``weights [B, R]``; see ``naive_gca``."""
    check_gca_inputs(q, k, v, weights)
    B, HQ, Q, D = q.shape
    H, R = k.shape[1], k.shape[2]
    # One copy each: [B, H, R, S, D] -> [B, R, H, S(+1), D], with the zero slot appended for off-by-one.
    extra = 1 if softmax_off_by_one else 0
    k = F.pad(k.transpose(1, 2), (0, 0, 0, extra)).reshape(B * R, H, -1, D)
    v = F.pad(v.transpose(1, 2), (0, 0, 0, extra)).reshape(B * R, H, -1, D)
    if HQ != H:  # grouped-query attention: every query head reads its key/value head
        k, v = k.repeat_interleave(HQ // H, dim=1), v.repeat_interleave(HQ // H, dim=1)
    q = q.unsqueeze(1).expand(B, R, HQ, Q, D).reshape(B * R, HQ, Q, D)
    per_chunk = F.scaled_dot_product_attention(q, k, v, scale=scale).view(B, R, HQ, Q, D)
    return torch.einsum("brhqd,br->bhqd", per_chunk, weights.to(per_chunk.dtype))
