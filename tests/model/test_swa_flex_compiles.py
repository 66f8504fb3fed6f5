"""The compiled FlexAttention sliding window (``kernels/swa/gpu.py``) compiles once per shape and never falls back
to the unfused path: every layer and every step of the SWA and GCA models, training and streaming decode, share
one graph per (batch, query length, key length).

FlexAttention and ``torch.compile`` run on CPU, so the CUDA-only choice of the compiled kernel is lifted here.
Dynamo decides a recompile from its guards, whichever backend then compiles the graph, so the default-tier tests
compile with ``aot_eager`` (seconds on two cores) and train forward and backward: torch refuses a FlexAttention
backward on CPU in ``_validate_device`` (inductor has no CPU backward kernel), a check these tests lift, as
``aot_eager`` differentiates the reference maths. The ``slow`` test compiles the product's own inductor kernel,
forward only.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from helpers import tiny_config
from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

import kernels.swa.gpu as swa_gpu
from kernels.swa import alibi_slopes
from model import build_model

WINDOW = 8
TRAIN_T = 16
PREFILL_T = 3
DECODE_STEPS = 10  # the window cache grows from PREFILL_T to WINDOW keys, then stays full
# Layers: swa has n_lower + sum(groups) + n_encoder = 4 window layers, gca 3 (lower + upper).
SHAPES = dict(
    vocab_size=64,
    d_model=32,
    n_heads=2,
    n_kv_heads=1,
    ffn_hidden=64,
    n_lower_layers=1,
    groups=[2],
    chunk_size=4,
    top_k=2,
    window=WINDOW,
    swa_backend="gpu",
)


def flex_compiles() -> list[str | None]:
    """The recompile reason (``None``: a first compile) of every Dynamo compile of ``flex_attention`` so far."""
    return [m.recompile_reason for m in get_compilation_metrics() if m.co_name == "flex_attention"]


@pytest.fixture
def fresh_dynamo():
    """No compiled graph, block mask or record left from an earlier test, and none left for a later one."""
    torch._dynamo.reset()
    clear_compilation_metrics()
    swa_gpu._window_block_mask.cache_clear()
    yield
    torch._dynamo.reset()
    swa_gpu._window_block_mask.cache_clear()


@pytest.fixture
def unfused_calls(monkeypatch):
    """Every warning FlexAttention's eager path gives when it runs outside a compiled graph (the unfused fallback
    Dynamo takes past its recompile limit); torch warns once per process, so the spy sees each call."""
    seen: list[str] = []
    monkeypatch.setattr(
        flex_module, "_warn_once", lambda warning_id, message, category=UserWarning: seen.append(warning_id)
    )
    return seen


@pytest.fixture
def compiled_on_cpu(monkeypatch, fresh_dynamo):
    """The compiled kernel on CPU, compiled by ``aot_eager`` with the product's options, backward allowed."""
    monkeypatch.setattr(swa_gpu, "_compiles_on", lambda device: True)
    monkeypatch.setattr(
        swa_gpu, "_compiled_flex", torch.compile(flex_module.flex_attention, dynamic=False, backend="aot_eager")
    )
    monkeypatch.setattr(swa_gpu, "_compiled_create_block_mask", flex_module.create_block_mask)
    monkeypatch.setattr(flex_module, "_validate_device", lambda query, key, value: None)


def train_and_decode(arch: str, steps: int, backward: bool) -> None:
    """``steps`` training steps of a tiny model (all its window layers), then a prefill and ``DECODE_STEPS`` decode
    tokens through the window caches."""
    torch.manual_seed(0)
    model = build_model(tiny_config(arch=arch, **SHAPES))
    for _ in range(steps):
        ids = torch.randint(0, SHAPES["vocab_size"], (2, TRAIN_T))
        with torch.set_grad_enabled(backward):
            loss = model(ids, labels=ids).loss
        if backward:
            loss.backward()
    model.eval()
    state = model.new_stream_state()
    with torch.no_grad():
        model.forward_stream(ids[:, :PREFILL_T], state)
        for _ in range(DECODE_STEPS):
            model.forward_stream(torch.randint(0, SHAPES["vocab_size"], (2, 1)), state)


# Graphs: training, the prefill (grad mode off), a decode token (a new shape: the cache padded to one length) and,
# in GCA's stream, a token that closes a chunk (it brings its landmark: two queries).
GRAPHS = {"swa": 3, "gca": 4}


@pytest.mark.parametrize("arch", ["swa", "gca"])
def test_every_layer_and_step_shares_one_graph_per_shape(arch, compiled_on_cpu, unfused_calls):
    # Four training steps and ten decode tokens through every window layer compile nothing past one graph per shape.
    train_and_decode(arch, steps=4, backward=True)
    compiles = flex_compiles()
    assert len(compiles) == GRAPHS[arch], compiles
    assert compiles[0] is None and "grad_mode" in compiles[1], compiles
    assert all("size mismatch" in reason for reason in compiles[2:]), compiles
    assert unfused_calls == []
    with torch._dynamo.config.patch(error_on_recompile=True):  # a second run of the same shapes compiles nothing
        train_and_decode(arch, steps=2, backward=True)
    assert len(flex_compiles()) == GRAPHS[arch]


@pytest.mark.filterwarnings("ignore:.*recompile_limit.*:UserWarning")
def test_more_configurations_than_dynamos_default_limit_stay_compiled(compiled_on_cpu, unfused_calls):
    # The GPU test tier's matrix (tests/kernels/test_swa_gpu.py): 3 shapes x 3 dtypes are 9 graphs, one more than
    # Dynamo's default recompile limit; the 9th ran unfused (torch's warning in the first H200 run).
    cases = [(2, 24, 24, 4, 4, 16, 9), (2, 5, 24, 4, 2, 16, 6), (3, 1, 17, 4, 4, 32, 9)]
    for B, Tq, Tk, HQ, H, D, window in cases:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            q, k, v = (torch.randn(B, T, heads, D).to(dtype) for T, heads in ((Tq, HQ), (Tk, H), (Tk, H)))
            swa_gpu.gpu_sliding_window_attention(q, k, v, window=window, alibi_slopes=alibi_slopes(HQ))
    assert len(flex_compiles()) == 9
    assert unfused_calls == []


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["swa", "gca"])
def test_the_inductor_kernel_compiles_once_per_shape(arch, monkeypatch, fresh_dynamo, unfused_calls):
    # The product's compiled kernel as CUDA runs it (inductor), forward only: CPU has no compiled backward.
    monkeypatch.setattr(swa_gpu, "_compiles_on", lambda device: True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        train_and_decode(arch, steps=2, backward=False)
    compiles = flex_compiles()
    assert len(compiles) == GRAPHS[arch], compiles
    assert unfused_calls == []
