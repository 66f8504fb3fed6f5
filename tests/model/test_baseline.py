"""The sliding-window baseline: bounded receptive field, streaming parity, export through the same loader."""

import torch
from helpers import tiny_config

from model import GCAConfig, SlidingWindowLM, build_model, load_pretrained, save_pretrained


def _config(**kw) -> GCAConfig:
    # 1 + 1 + 1 = 3 window layers of span 5; the default (auto) backends, as a real baseline runs.
    base = dict(
        arch="swa",
        vocab_size=50,
        d_model=32,
        ffn_hidden=384,
        window=5,
        top_k=4,
        gca_backend="auto",
        swa_backend="auto",
    )
    return tiny_config(**{**base, **kw})


def test_receptive_field_is_layers_times_window():
    model = build_model(_config()).eval()
    assert isinstance(model, SlidingWindowLM) and len(model.layers) == 3
    ids = torch.randint(0, 50, (1, 40))
    changed = ids.clone()
    changed[0, 10] += 1
    diff = (model(changed).logits - model(ids).logits).abs().amax(dim=(0, 2))
    assert diff[:10].max() == 0  # causal
    assert diff[10 : 10 + 3 * 5 + 1].min() > 0  # reached within 3 layers x window 5
    assert diff[10 + 3 * 5 + 1 :].max() == 0  # and never beyond


def test_streaming_matches_full_forward_and_export_round_trip(tmp_path):
    model = build_model(_config()).eval()
    ids = torch.randint(0, 50, (2, 33))
    with torch.no_grad():
        state = model.new_stream_state()
        steps = torch.cat([model.forward_stream(ids[:, t : t + 4], state) for t in range(0, 33, 4)], 1)
        torch.testing.assert_close(steps, model(ids).logits)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    assert isinstance(loaded, SlidingWindowLM)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_memory_only_prefix_is_exact_beyond_the_receptive_field():
    model = build_model(_config()).eval()
    ids = torch.randint(0, 50, (1, 60))
    with torch.no_grad():
        full = model(ids).logits
        for split, exact in ((60 - model.window_reach, True), (61 - model.window_reach, False)):
            state = model.new_stream_state()
            assert model.forward_stream(ids[:, :split], state, memory_only=True).shape == (1, 0, 50)
            tail = model.forward_stream(ids[:, split:], state)
            assert torch.allclose(tail[:, -1], full[:, -1], atol=1e-5) == exact
