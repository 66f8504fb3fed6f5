"""Sampling rules and bounded-memory generation."""

import pytest
import torch

from pipeline.evaluation.generate import Sampling, generate, sample_token
from pipeline.evaluation.runtime import StreamBudget


def test_greedy_top_k_top_p():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    assert sample_token(logits, 0.0, 0, 1.0, None) == 1
    gen = torch.Generator().manual_seed(0)
    assert {sample_token(logits, 1.0, 2, 1.0, gen) for _ in range(200)} == {1, 2}
    # p(1) = 0.63 < 0.7, so top-p keeps tokens 1 and 2 only
    assert {sample_token(logits, 1.0, 0, 0.7, gen) for _ in range(200)} == {1, 2}
    assert {sample_token(logits, 1.0, 0, 0.5, gen) for _ in range(50)} == {1}
    with pytest.raises(ValueError, match="top_p=0"):
        sample_token(logits, 1.0, 0, 0.0, gen)


def test_greedy_generation_equals_full_forward_argmax(tiny_model):
    prompt = torch.randint(0, 256, (40,)).tolist()
    out = list(
        generate(tiny_model, prompt, 4, sampling=Sampling(temperature=0.0), budget=StreamBudget(24, offload_mb=0))
    )
    ids = prompt[:]
    for _ in range(4):
        with torch.no_grad():
            ids.append(int(tiny_model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out == ids[len(prompt) :]
