"""The next-token loss straight from the final hidden states, without the whole ``[tokens, vocab]`` logits.

At vocab 32,000 and 16K tokens the logits of one sequence are 2 GB in fp32, and ``lm_loss`` keeps several such
buffers alive at once (the head's output, its fp32 copy, the log-softmax, their gradients): it is what limits the
micro-batch. ``chunked_lm_loss`` computes the same loss over slices of rows: each slice's logits are made, turned
into its share of the loss and into the gradients of the hidden states and of the head weight, and freed before the
next slice. The gradients are computed in the forward pass (the loss is a scalar, so backward only scales them by
the incoming gradient): the head's matmul is done once per slice and never recomputed, three matmuls over the
vocabulary in all, as in the unchunked loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

LOSS_CHUNK_ELEMENTS = 1 << 26
"""Logit elements per slice (256 MB in fp32): at vocab 32,000 slices of 2,097 rows, 8 per 16K-token sequence; at
vocab 4,096 a 16K-token sequence is one slice. Fewer, larger slices mean fewer kernel launches."""


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` labels aligned with the inputs -> the target of every position (``labels[:, t + 1]``, ``-100`` at
    the last one, which predicts nothing)."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum_i coef[i] * CE(h[i] @ weight.T, target[i])`` over rows ``i`` of ``h [N, d]``, in slices of ``rows``.

    ``coef [N]`` fp32 (0 for ignored rows) carries the mean's normalisation, so the sum is the mean loss.
    The logits are made in the autocast dtype when autocast is on (as ``F.linear`` would), their softmax in fp32;
    the gradient of a slice's logits is cast back to that dtype before its two matmuls, as autograd does for
    ``lm_loss(F.linear(h, weight))``.

    Returns the loss and, with ``keep_rows``, every row's own cross-entropy ``[N]`` fp32 (not differentiable; the
    terms the loss sums, so keeping them changes no number of the loss or the gradients), else an empty tensor.
    """

    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        coef: torch.Tensor,
        rows: int,
        grad_enabled: bool,
        keep_rows: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        # Inside forward autograd is off and needs_input_grad only says what requires grad: under no_grad
        # (evaluation) no gradient is made at all.
        want_h, want_w = (grad_enabled and need for need in ctx.needs_input_grad[:2])
        with torch.autocast(device, enabled=False):
            hc, wc = h.to(dtype), weight.to(dtype)
            parts = []
            grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device) if want_h else None  # rows contiguous
            grad_w: torch.Tensor | None = None
            minus_one = torch.full((min(rows, h.shape[0]), 1), -1.0, device=h.device) if want_h or want_w else None
            row_ce = torch.empty(h.shape[0] if keep_rows else 0, dtype=torch.float32, device=h.device)
            for s in range(0, h.shape[0], rows):
                h_s, t_s, c_s = hc[s : s + rows], target[s : s + rows, None], coef[s : s + rows]
                logits = F.linear(h_s, wc).float()  # [n, V], the only vocabulary-wide buffer of the slice
                lse = torch.logsumexp(logits, dim=-1)
                ce_s = lse - logits.gather(1, t_s).squeeze(1)
                if keep_rows:
                    row_ce[s : s + rows] = ce_s
                parts.append(torch.dot(c_s, ce_s))
                if minus_one is None:
                    continue
                # d loss / d logits = coef * (softmax - onehot), made in place in the logits' buffer.
                probs = logits.sub_(lse[:, None]).exp_().scatter_add_(1, t_s, minus_one[: len(t_s)])
                g = probs.mul_(c_s[:, None]).to(dtype)
                if grad_h is not None and grad_h.dtype == dtype:
                    torch.mm(g, wc, out=grad_h[s : s + rows])
                elif grad_h is not None:
                    grad_h[s : s + rows] = g @ wc
                if want_w:  # summed in fp32 over the slices, whatever the products' dtype
                    grad_w_s = g.t() @ h_s
                    grad_w = grad_w_s.float() if grad_w is None else grad_w.add_(grad_w_s)
            loss = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
        ctx.save_for_backward(
            grad_h if grad_h is not None else h.new_empty(0),
            (grad_w.to(weight.dtype) if grad_w is not None else weight.new_empty(0)),
        )
        ctx.mark_non_differentiable(row_ce)
        return loss, row_ce

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_rows: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        return (
            grad_h * grad_loss.to(grad_h.dtype) if ctx.needs_input_grad[0] else None,
            grad_w * grad_loss.to(grad_w.dtype) if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
            None,
            None,
        )


def chunked_lm_loss(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_elements: int = LOSS_CHUNK_ELEMENTS
) -> torch.Tensor:
    """``lm_loss(F.linear(h, weight), labels)`` for final hidden states ``h [B, T, d]`` and the LM head ``weight [V,
    d]``, without ever holding more than ``chunk_elements`` logits: the mean next-token cross-entropy over the
    positions whose label (``labels [B, T]``, aligned with the inputs) is not ``-100``."""
    return _chunked(h, weight, labels, chunk_elements, keep_rows=False)[0]


def chunked_lm_loss_and_token_losses(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_elements: int = LOSS_CHUNK_ELEMENTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_lm_loss` (the same number, the same gradients) and each position's own next-token cross-entropy
    ``[B, T]`` fp32, detached: position ``t`` scored against ``labels[:, t + 1]``, 0 where nothing is scored (the
    last position, a ``-100`` label), as ``model.lm.token_losses`` lays them out."""
    loss, rows = _chunked(h, weight, labels, chunk_elements, keep_rows=True)
    target = shifted_targets(labels)
    return loss, torch.where(target != -100, rows.view(target.shape), 0.0)


def _chunked(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_elements: int, keep_rows: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    target = shifted_targets(labels).flatten()
    valid = target != -100
    coef = valid.float() / valid.sum()  # 0/0 = NaN when nothing is scored, as F.cross_entropy's mean gives
    rows = max(1, chunk_elements // weight.shape[0])
    return _ChunkedLinearCrossEntropy.apply(
        h.flatten(0, 1), weight, torch.where(valid, target, 0), coef, rows, torch.is_grad_enabled(), keep_rows
    )
