"""``model.position=rope`` and ``model.tokens_see_landmarks=false`` in the sliding window: the attention against an
independent dense-mask reference, streaming parity, length-generality of the rotary positions, and that hidden
landmarks really are invisible to real tokens."""

import pytest
import torch
from helpers import FP32_REORDERED, assert_close
from helpers import tiny_config as shared_tiny_config

from model import GCAConfig, GCAForCausalLM, SlidingWindowLM
from model.layers import SlidingWindowAttention, window_positions

VOCAB = 64
SHAPES = dict(
    vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, groups=[1, 1], chunk_size=4, window=6
)
VARIANTS = {
    "rope": dict(position="rope"),
    "rope-hidden-untied": dict(position="rope", tokens_see_landmarks=False, tie_embeddings=False),
    "alibi-hidden": dict(tokens_see_landmarks=False),
}


def tiny_config(**overrides) -> GCAConfig:
    return shared_tiny_config(**{**SHAPES, **overrides})


def reference_attention(
    attn: SlidingWindowAttention, x: torch.Tensor, cfg: GCAConfig, start: int, landmarks: bool
) -> torch.Tensor:
    """The sliding window written out: a dense [L, L] mask from stream positions, RoPE as complex rotations of
    (even, odd) pairs at text positions, ALiBi as a distance bias, landmark keys masked for real-token queries."""
    B, L, _ = x.shape
    HQ, H, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = attn.wq(x).view(B, L, HQ, D)
    k = attn.wk(x).view(B, L, H, D).repeat_interleave(HQ // H, dim=2)
    v = attn.wv(x).view(B, L, H, D).repeat_interleave(HQ // H, dim=2)
    p = start + torch.arange(L)
    S1 = cfg.chunk_size + 1
    text_pos = p - p // S1 if landmarks else p
    is_landmark = (p % S1 == S1 - 1) if landmarks else torch.zeros(L, dtype=torch.bool)
    if cfg.position == "rope":
        freq = cfg.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        rot = torch.polar(torch.ones(L, D // 2, dtype=torch.float64), text_pos[:, None].double() * freq)
        q = torch.view_as_real(torch.view_as_complex(q.double().reshape(B, L, HQ, D // 2, 2)) * rot[:, None])
        k = torch.view_as_real(torch.view_as_complex(k.double().reshape(B, L, HQ, D // 2, 2)) * rot[:, None])
        q, k = q.reshape(B, L, HQ, D).to(x.dtype), k.reshape(B, L, HQ, D).to(x.dtype)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * D**-0.5
    dist = p[:, None] - p[None, :]
    if cfg.position == "alibi":
        slopes = torch.pow(2.0, -8.0 * torch.arange(1, HQ + 1) / HQ).to(x.dtype)
        logits = logits - slopes[:, None, None] * dist
    allowed = (dist >= 0) & (dist <= cfg.window)
    if not cfg.tokens_see_landmarks:
        allowed &= ~(~is_landmark[:, None] & is_landmark[None, :])
    o = torch.einsum("bhqk,bkhd->bqhd", logits.masked_fill(~allowed, float("-inf")).softmax(-1), v)
    return attn.wo(o.reshape(B, L, -1))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("backend", ["naive", "sdpa"])
def test_window_attention_matches_the_dense_mask_reference(variant, backend):
    cfg = tiny_config(**VARIANTS[variant], swa_backend=backend, qkv_bias=True)
    attn = SlidingWindowAttention(cfg).double()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 23, cfg.d_model, dtype=torch.float64)
    for start in (0, 7):  # a step that starts mid-chunk too
        pos = window_positions(cfg, start, x.shape[1], x.device, landmarks=True)
        got = attn(x, None, pos)
        assert_close(got, reference_attention(attn, x, cfg, start, landmarks=True), {"rtol": 1e-10, "atol": 1e-10})


def trained(cfg: GCAConfig, T: int) -> GCAForCausalLM:
    """A few large-LR steps move the norms and the landmark away from their initial values."""
    model = GCAForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (2, T))
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_streaming_matches_the_whole_sequence_forward(variant):
    """Token by token and in segments of 7 (steps starting mid-chunk): the same logits as one forward, so cached
    keys keep the rotation and the landmark flag of their own position."""
    model = trained(tiny_config(**VARIANTS[variant]), T=32)
    ids = torch.randint(0, VOCAB, (2, 30))  # 7 chunks: past the window, retrieval in both groups
    with torch.no_grad():
        full = model(ids).logits
        for segment in (1, 7):
            state = model.new_stream_state()
            parts = [model.forward_stream(ids[:, s : s + segment], state) for s in range(0, ids.shape[1], segment)]
            assert_close(torch.cat(parts, 1), full, FP32_REORDERED)


def test_memory_only_prefix_then_tail_matches_the_full_forward_with_rope():
    model = trained(tiny_config(position="rope", tokens_see_landmarks=False, groups=[2]), T=32)
    ids = torch.randint(0, VOCAB, (1, 60))
    with torch.no_grad():
        full = model(ids).logits
        state = model.new_stream_state()
        split = 60 - model.window_reach
        model.forward_stream(ids[:, :split], state, memory_only=True)
        tail = model.forward_stream(ids[:, split:], state)
    assert_close(tail[:, -1], full[:, -1], FP32_REORDERED)


def test_rope_window_reads_the_same_a_million_tokens_in():
    """Only relative positions matter, and the rotation angles stay exact far into a long input: the same tokens
    give the same logits at text position 10^6 as at 0 (fp32 angles would be off by up to 0.06 rad there)."""
    cfg = tiny_config(arch="swa", position="rope")
    model = SlidingWindowLM(cfg).eval()
    ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        near = model(ids).logits
        state = model.new_stream_state()
        state.n_tokens = 10**6
        far = model.forward_stream(ids, state)
    assert_close(far, near, {"rtol": 1e-5, "atol": 1e-5})
    assert not torch.equal(near, SlidingWindowLM(tiny_config(arch="swa")).eval()(ids).logits)


@pytest.mark.parametrize("see", [True, False])
def test_hidden_landmarks_do_not_reach_real_tokens(see):
    """With the GCA outputs zeroed, real tokens can only learn about a landmark through the window: hidden
    landmarks then leave every logit bitwise unchanged when the landmark vector changes; visible ones do not."""
    model = GCAForCausalLM(tiny_config(position="rope", tokens_see_landmarks=see)).eval()
    for group in model.groups:
        for layer in group.layers:
            torch.nn.init.zeros_(layer.gca.wo.weight)
            torch.nn.init.zeros_(layer.gca.wo.bias)
    ids = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        before = model(ids).logits
        model.landmark.add_(1.0)
        after = model(ids).logits
    assert torch.equal(before, after) != see
