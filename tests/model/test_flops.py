"""Training FLOPs per token (``model.flops``) of the baselines in closed form."""

import pytest
from helpers import tiny_config

from model.flops import flops_per_token


@pytest.mark.parametrize("arch", ["full", "swa"])
def test_flops_per_token_of_the_baselines_in_closed_form(arch):
    """Per token: ``6 * matmul params`` plus ``12 * d * keys`` per layer, ``keys`` averaged over positions ``t``:
    ``t + 1`` for full attention (mean ``(T + 1) / 2``), ``min(t + 1, W + 1)`` for a window ``W``."""
    T, W, d, params = 64, 16, 32, 1000
    cfg = tiny_config(arch=arch, d_model=d, window=W)
    layers = cfg.n_baseline_layers
    assert layers == 3
    keys = (T + 1) / 2 if arch == "full" else ((W + 1) * (W + 2) / 2 + (T - W - 1) * (W + 1)) / T
    assert flops_per_token(cfg, T, params) == pytest.approx(6 * params + 12 * d * keys * layers, rel=1e-12)
