"""Model level on CUDA: the GPU backends (Triton GCA + FlashAttention/FlexAttention window, ``attn_backend=auto``)
give the logits and gradients of the readable references (``naive``), at a DRT-like shape with several chunks
retrieved per group; and a bf16 training step stays finite and close to fp32. Part of ``pytest -m gpu``, the
first stage of ``make gpu-check``."""

from __future__ import annotations

import pytest
import torch

from model import GCAConfig, GCAForCausalLM, preset

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

T = 2048


def _config(backend: str) -> GCAConfig:
    # The benchmarks' DRT-like size (d_model 256, chunk 63, top-8), smaller, with grouped-query attention.
    return preset(
        "bench",
        vocab_size=512,
        n_kv_heads=2,
        ffn_hidden=512,
        n_lower_layers=2,
        groups=[2],
        window=256,
        attn_backend=backend,
        gumbel_topk=False,
    )


def _pair() -> tuple[GCAForCausalLM, GCAForCausalLM, torch.Tensor]:
    torch.manual_seed(0)
    ref = GCAForCausalLM(_config("naive")).cuda()
    fast = GCAForCausalLM(_config("auto")).cuda()
    fast.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 512, (2, T), device="cuda")
    return ref, fast, ids


def test_gpu_backends_match_the_references_in_fp32():
    ref, fast, ids = _pair()
    out_ref, out_fast = ref(ids, labels=ids), fast(ids, labels=ids)
    torch.testing.assert_close(out_fast.logits, out_ref.logits, rtol=1e-3, atol=1e-3)
    out_ref.loss.backward()
    out_fast.loss.backward()
    for (name, p_ref), p_fast in zip(ref.named_parameters(), fast.parameters()):
        scale = p_ref.grad.abs().max().item() + 1e-12
        err = (p_fast.grad - p_ref.grad).abs().max().item()
        assert err <= 1e-2 * scale, f"{name}: max grad error {err:.3g} vs max |grad| {scale:.3g}"


def test_bf16_step_is_finite_and_close_to_fp32():
    ref, fast, ids = _pair()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_bf16 = fast(ids, labels=ids)
    out_bf16.loss.backward()
    loss_fp32 = ref(ids, labels=ids).loss.item()
    assert torch.isfinite(out_bf16.loss)
    assert abs(out_bf16.loss.item() - loss_fp32) < 2e-2 * loss_fp32
    assert all(torch.isfinite(p.grad).all() for p in fast.parameters() if p.grad is not None)
