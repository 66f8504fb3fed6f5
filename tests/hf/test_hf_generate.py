"""``generate`` on the exported folder: the project's own streamed generation, token for token, one token per step."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.evaluation.generate import Sampling
from pipeline.evaluation.generate import generate as native_generate
from pipeline.evaluation.runtime import StreamBudget


@pytest.fixture(scope="module")
def hf_model(hf_export):
    return AutoModelForCausalLM.from_pretrained(hf_export[1], trust_remote_code=True).eval()


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    # Above id 2, so no prompt token is the EOS id that generate would treat as padding.
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("prompt_len", [5, 29])
def test_greedy_generate_equals_native_streamed_generation(hf_model, hf_export, prompt_len):
    """Across many chunk boundaries (chunk 8), and past the training length (64) from the longer prompt."""
    native, _ = hf_export
    prompt = _prompt(native.cfg.vocab_size, prompt_len, seed=prompt_len)
    new = 40
    expected = list(native_generate(native, prompt, new, sampling=Sampling(temperature=0.0), budget=StreamBudget(7)))
    out = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert out[0, :prompt_len].tolist() == prompt
    assert out[0, prompt_len:].tolist() == expected
    assert len(set(expected)) > 5  # a real comparison, not one token repeated


def test_decode_steps_feed_one_token_and_carry_the_chunk_memory(hf_model, hf_export, monkeypatch):
    native, _ = hf_export
    fed, states = [], []
    original = type(hf_model.gca).forward_stream

    def spy(self, input_ids, state, *args, **kwargs):
        fed.append(input_ids.shape[1])
        states.append(state)
        return original(self, input_ids, state, *args, **kwargs)

    monkeypatch.setattr(type(hf_model.gca), "forward_stream", spy)
    prompt = _prompt(native.cfg.vocab_size, 21, seed=0)
    hf_model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert fed == [21] + [1] * 29
    assert all(state is states[0] for state in states)  # one stream state, continued
    assert states[0].n_tokens == 50 and states[0].memory.size == 50 // native.cfg.chunk_size


def test_sampling_runs_and_follows_the_seed(hf_model, hf_export):
    native, _ = hf_export
    prompt = torch.tensor([_prompt(native.cfg.vocab_size, 12, seed=2)] * 2)
    settings = dict(max_new_tokens=25, do_sample=True, temperature=0.9, top_k=40, top_p=0.95, pad_token_id=0)
    torch.manual_seed(0)
    first = hf_model.generate(prompt, eos_token_id=None, **settings)
    torch.manual_seed(0)
    again = hf_model.generate(prompt, eos_token_id=None, **settings)
    assert first.shape == (2, 37) and torch.equal(first, again)
    assert not torch.equal(first[0], first[1])  # two independent samples
    assert int(first.max()) < native.cfg.vocab_size


def test_left_padded_batch_generates_each_row_as_alone(hf_model, hf_export):
    native, _ = hf_export
    prompts = [_prompt(native.cfg.vocab_size, n, seed=n) for n in (11, 18)]
    ids = torch.zeros(2, 18, dtype=torch.long)
    mask = torch.zeros(2, 18, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 18 - len(p) :], mask[b, 18 - len(p) :] = torch.tensor(p), 1
    out = hf_model.generate(
        ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    for b, p in enumerate(prompts):
        assert out[b, 18:].tolist() == list(native_generate(native, p, 20, sampling=Sampling(temperature=0.0)))
