"""Helpers shared by the Triton GCA tests (CPU interpreter tier and GPU tier).

Tolerance (STYLE rule 16, flash-attn's rule): for every tensor, the kernel's error against an fp64 ``naive_gca``
must be at most ``RATIO`` times the error of the reference maths run in the input dtype, plus a small floor of a
fraction of an ulp of the tensor's scale. For fp32/fp64 "the reference in the input dtype" is ``naive_gca``
itself; ``naive_gca`` always upcasts half precision, so for fp16/bf16 it is the same einsum maths with every op
kept in the input dtype (flash-attn's ``attention_ref(upcast=False)``).
"""

from __future__ import annotations

import torch

from kernels.gca.naive import naive_gca

NAMES = ("o", "dq", "dk", "dv", "dweights")
RATIO = 2.0
# Absolute floor, relative to max |fp64 value| of the tensor: protects tensors whose reference error is ~0.
FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}


def make_inputs(B, HQ, H, Q, S, R, D, dtype, device="cpu"):
    """Random GCA inputs and an upstream gradient ``do``; weights in (0, 1) like a softmax over chunk scores."""
    q = torch.randn(B, HQ, Q, D, device=device).to(dtype)
    k = torch.randn(B, H, R, S, D, device=device).to(dtype)
    v = torch.randn(B, H, R, S, D, device=device).to(dtype)
    weights = torch.rand(B, R, device=device).to(dtype)
    do = torch.randn(B, HQ, Q, D, device=device).to(dtype)
    return q, k, v, weights, do


def gca_in_dtype(q, k, v, weights, *, scale=None, softmax_off_by_one=False):
    """``naive_gca``'s maths with every op in the input dtype (no upcast): the low-precision error baseline."""
    if q.dtype in (torch.float32, torch.float64):
        return naive_gca(q, k, v, weights, scale=scale, softmax_off_by_one=softmax_off_by_one)
    B, HQ, Q, D = q.shape
    H = k.shape[1]
    scale = D**-0.5 if scale is None else scale
    qg = q.view(B, H, HQ // H, Q, D)  # [B, H, G, Q, D]
    logits = torch.einsum("bhgqd,bhrsd->bhgrqs", qg, k) * scale  # [B, H, G, R, Q, S]
    if softmax_off_by_one:
        logits = torch.cat([logits, logits.new_zeros(logits.shape[:-1] + (1,))], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    per_chunk = torch.einsum("bhgrqs,bhrsd->bhgrqd", probs, v)  # [B, H, G, R, Q, D]
    return torch.einsum("bhgrqd,br->bhgqd", per_chunk, weights.to(q.dtype)).reshape(B, HQ, Q, D)


def forward_backward(fn, q, k, v, weights, do, **kw):
    """``(o, dq, dk, dv, dweights)`` of ``fn`` on leaf copies of the inputs."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, weights)]
    o = fn(*leaves, **kw)
    grads = torch.autograd.grad(o, leaves, do)
    return (o.detach(), *grads)


def max_errors(fn, q, k, v, weights, do, **kw):
    """Per-tensor max |kernel - fp64 truth| and the baseline error of the in-dtype reference; for reports."""
    truth = forward_backward(naive_gca, *(t.double() for t in (q, k, v, weights, do)), **kw)
    base = forward_backward(gca_in_dtype, q, k, v, weights, do, **kw)
    out = forward_backward(fn, q, k, v, weights, do, **kw)
    return {
        name: ((o.double() - t).abs().max().item(), (b.double() - t).abs().max().item(), t.abs().max().item())
        for name, o, b, t in zip(NAMES, out, base, truth)
    }


def assert_gca_close(fn, q, k, v, weights, do, **kw):
    """Check ``o`` and every gradient of ``fn`` against fp64 ``naive_gca`` with the ratio rule; name the tensor."""
    floor = FLOOR[q.dtype]
    for name, (err, base_err, scale) in max_errors(fn, q, k, v, weights, do, **kw).items():
        bound = RATIO * base_err + floor * max(1.0, scale)
        assert err == err, f"{name}: NaN in the kernel output (an unwritten tile?)"
        assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e} ({RATIO} x reference {base_err:.3e} + floor)"
