"""The model with the Triton GCA kernel (CPU interpreter here, native on GPU) matches the naive backend."""

import pytest
import torch
from helpers import tiny_config

from model import GCAConfig, GCAForCausalLM

pytestmark = pytest.mark.kernels


def _config(backend: str) -> GCAConfig:
    # Chunks of 5 and one KV head: odd sizes the kernel must mask; head dim 16, the kernel's smallest.
    return tiny_config(
        vocab_size=48,
        d_model=32,
        n_kv_heads=1,
        ffn_hidden=48,
        chunk_size=5,
        window=8,
        attn_backend=backend,
        gumbel_topk=False,
    )


def test_logits_and_gradients_match_naive_backend():
    torch.manual_seed(0)
    naive = GCAForCausalLM(_config("naive"))
    triton = GCAForCausalLM(_config("triton"))
    triton.load_state_dict(naive.state_dict())
    ids = torch.randint(0, 48, (1, 23))
    out_naive, out_triton = naive(ids, labels=ids), triton(ids, labels=ids)
    torch.testing.assert_close(out_triton.logits, out_naive.logits, rtol=1e-4, atol=1e-5)
    out_naive.loss.backward()
    out_triton.loss.backward()
    for (name, p_naive), p_triton in zip(naive.named_parameters(), triton.parameters()):
        torch.testing.assert_close(
            p_triton.grad, p_naive.grad, rtol=1e-3, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_streaming_decode_uses_the_kernel_and_matches():
    torch.manual_seed(1)
    naive = GCAForCausalLM(_config("naive")).eval()
    triton = GCAForCausalLM(_config("triton")).eval()
    triton.load_state_dict(naive.state_dict())
    ids = torch.randint(0, 48, (1, 17))
    with torch.no_grad():
        state = triton.new_stream_state()
        steps = torch.cat([triton.forward_stream(ids[:, t : t + 1], state) for t in range(17)], 1)
        torch.testing.assert_close(steps, naive(ids).logits, rtol=1e-4, atol=1e-5)
