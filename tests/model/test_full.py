"""The full-attention baseline (``model.arch=full``): a dense causal RoPE reference, streaming in any segmentation,
bounded attention masks over a long cache, and the export."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import FP32_REORDERED, FP64_REFERENCE, assert_close, tiny_config

import model.full
from model import ConfigError, FullAttentionLM, build_model, count_parameters, load_pretrained, save_pretrained
from model.archs import MODEL_CLASSES
from model.config import ARCHS

VOCAB = 50


def _config(**kw):
    # Grouped-query heads (4 over 2), 1 + 2 + 1 = 4 layers, a small RoPE base so that positions matter strongly, and
    # weights spread enough that attention is far from uniform.
    base = dict(arch="full", vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, groups=[2], rope_theta=100.0)
    return tiny_config(**{**base, "init_std": 0.2, **kw})


def _model(**kw) -> FullAttentionLM:
    torch.manual_seed(0)
    built = build_model(_config(**kw)).eval()
    assert isinstance(built, FullAttentionLM)
    return built


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _rotate_pairs(x: torch.Tensor, theta: float) -> torch.Tensor:
    """``x [B, T, H, D]``: the pair (2i, 2i+1) at position p turned by the angle ``p * theta ** (-2i / D)``."""
    out = torch.empty_like(x)
    D = x.shape[-1]
    for p in range(x.shape[1]):
        for i in range(D // 2):
            angle = p * theta ** (-2 * i / D)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[:, p, :, 2 * i], x[:, p, :, 2 * i + 1]
            out[:, p, :, 2 * i], out[:, p, :, 2 * i + 1] = a * c - b * s, a * s + b * c
    return out


def _reference_logits(m: FullAttentionLM, ids: torch.Tensor) -> torch.Tensor:
    """The model's maths written out: explicit softmax under a causal mask, RoPE by rotating pairs, grouped-query
    heads by repeating each key/value head, pre-norm residual layers with a SwiGLU MLP and a tied head."""
    cfg = m.cfg
    B, T = ids.shape
    D, group = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    h = m.embed.weight[ids]
    for layer in m.layers:
        attn = layer.attn
        x = _rms_norm(h, layer.attn_norm.weight, cfg.norm_eps)
        q = _rotate_pairs((x @ attn.wq.weight.T).view(B, T, cfg.n_heads, D), cfg.rope_theta)
        k = _rotate_pairs((x @ attn.wk.weight.T).view(B, T, cfg.n_kv_heads, D), cfg.rope_theta)
        v = (x @ attn.wv.weight.T).view(B, T, cfg.n_kv_heads, D)
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)  # query head j reads kv j // group
        scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D)
        scores = scores.masked_fill(~causal, -math.inf)
        weights = scores.exp() / scores.exp().sum(-1, keepdim=True)
        o = torch.einsum("bhij,bjhd->bihd", weights, v).reshape(B, T, -1)
        h = h + o @ attn.wo.weight.T
        x = _rms_norm(h, layer.mlp_norm.weight, cfg.norm_eps)
        mlp = layer.mlp
        h = h + (F.silu(x @ mlp.w_gate.weight.T) * (x @ mlp.w_up.weight.T)) @ mlp.w_down.weight.T
    return _rms_norm(h, m.norm.weight, cfg.norm_eps) @ m.embed.weight.T


def _streamed(m: FullAttentionLM, ids: torch.Tensor, segment: int) -> torch.Tensor:
    state = m.new_stream_state()
    return torch.cat([m.forward_stream(ids[:, t : t + segment], state) for t in range(0, ids.shape[1], segment)], 1)


def test_layers_and_parameters_match_the_sliding_window_baseline():
    m = _model()
    assert len(m.layers) == 1 + 2 + 1  # n_lower_layers + sum(groups) + n_encoder_layers
    assert count_parameters(m) == count_parameters(build_model(_config(arch="swa")))


def test_whole_forward_and_streaming_match_the_dense_reference_in_fp64(monkeypatch):
    m = _model().double()
    ids = _ids(2, 23)
    with torch.no_grad():
        want = _reference_logits(m, ids)
        assert_close(m(ids).logits, want, FP64_REFERENCE)
        # Three query rows per attention call over a cache: the blocked path, not one dense mask.
        monkeypatch.setattr(model.full, "_MASK_ELEMENTS", 3 * 23)
        assert_close(_streamed(m, ids, 10), want, FP64_REFERENCE)


@pytest.mark.parametrize("segment", [1, 3, 16, 40, 64])
def test_streaming_in_any_segmentation_equals_one_forward(segment):
    m = _model()
    ids = _ids(2, 64)
    with torch.no_grad():
        assert_close(_streamed(m, ids, segment), m(ids).logits, FP32_REORDERED)


def test_attention_over_a_long_cache_is_computed_in_bounded_query_blocks(monkeypatch):
    """A segment continuing a cache is attended in blocks whose boolean mask stays under the budget, with the
    same result as one call over the whole lower-right causal mask."""
    limit = 40
    monkeypatch.setattr(model.full, "_MASK_ELEMENTS", limit)
    calls: list[tuple[int, int]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        if attn_mask is not None:
            calls.append(tuple(attn_mask.shape))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(model.full.F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 7, 4, 8), torch.randn(1, 19, 2, 8), torch.randn(1, 19, 2, 8)
    got = model.full.causal_attention(q, k, v)
    assert len(calls) == 4 and all(rows * keys <= limit for rows, keys in calls)
    dense = torch.ones(7, 19, dtype=torch.bool).tril(19 - 7)
    want = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=dense, enable_gqa=True)
    assert_close(got, want.transpose(1, 2), FP32_REORDERED)


def test_memory_only_prefix_then_logits_equal_the_whole_forward():
    m = _model()
    ids = _ids(2, 50)
    split = 50 - m.window_reach
    with torch.no_grad():
        whole = m(ids).logits
        state = m.new_stream_state()
        assert m.forward_stream(ids[:, :split], state, memory_only=True).shape == (2, 0, VOCAB)
        assert state.n_tokens == split
        tail = m.forward_stream(ids[:, split:], state)
        assert_close(tail, whole[:, split:], FP32_REORDERED)
        state = m.new_stream_state()
        m.forward_stream(ids[:, :20], state, memory_only=True)
        assert_close(m.forward_stream(ids[:, 20:], state, last_logits=1), whole[:, -1:], FP32_REORDERED)


def test_gradient_reaches_every_parameter():
    m = _model().train()
    ids = _ids(2, 24)
    m(ids, labels=ids).loss.backward()
    without = [name for name, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert without == []


def test_export_round_trip(tmp_path):
    m = _model()
    ids = _ids(1, 30)
    save_pretrained(m, tmp_path)
    loaded = load_pretrained(tmp_path)
    assert isinstance(loaded, FullAttentionLM)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, m(ids).logits, rtol=0, atol=0)


def test_every_arch_has_a_model_class():
    assert tuple(MODEL_CLASSES) == ARCHS == ("gca", "swa", "full")


def test_config_errors_name_the_archs_and_the_rope_pairs():
    with pytest.raises(ConfigError, match=r"model.arch='bogus' is not one of \('gca', 'swa', 'full'\)"):
        _config(arch="bogus")
    with pytest.raises(ConfigError, match="must be even: the RoPE of model.arch=full"):
        _config(d_model=30, n_heads=2, n_kv_heads=2, n_encoder_layers=0)
