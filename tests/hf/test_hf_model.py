"""The export loads as a ``transformers`` model whose logits are the native model's, at any length."""

from __future__ import annotations

import pytest
import torch
from helpers import FP32_REORDERED, assert_close
from hf_export_helpers import hf_model_config
from transformers import AutoModelForCausalLM

from model import GCAConfig, build_model, lm_loss, load_pretrained, save_pretrained
from pipeline.hf import write_hf_files
from pipeline.hf.configuration_gca import GCAHFConfig
from pipeline.hf.modeling_gca import native_config

LENGTHS = (1, 7, 8, 9, 31, 64, 150)
"""Chunk size 8, training length 64: within one chunk, at and around a chunk boundary, odd, and past training."""
ATOL = 1e-5


@pytest.fixture(scope="module")
def hf_model(hf_export):
    _, directory = hf_export
    model, info = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and info["mismatched_keys"] == []
    return model.eval()


def _ids(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_loaded_class_and_config(hf_model, hf_export):
    native, _ = hf_export
    assert type(hf_model).__name__ == "GCAHFForCausalLM"
    assert hf_model.config.model_type == "gca" and hf_model.config.vocab_size == native.cfg.vocab_size
    assert next(hf_model.parameters()).dtype == torch.float32


@pytest.mark.parametrize("length", LENGTHS)
def test_logits_equal_native(hf_model, hf_export, length):
    native, _ = hf_export
    ids = _ids(native.cfg.vocab_size, 2, length, seed=length)
    with torch.no_grad():
        expected = native(ids).logits
        whole = hf_model(ids, use_cache=False).logits
        streamed = hf_model(ids, use_cache=True).logits
    assert (whole - expected).abs().max() <= ATOL
    assert (streamed - expected).abs().max() <= ATOL


def test_cached_continuation_equals_native_streaming(hf_model, hf_export):
    """Feeding the input in pieces through ``past_key_values`` is the native ``forward_stream`` with the same cuts
    (cut points off chunk boundaries, single tokens included), and the one-pass logits up to summation order."""
    native, _ = hf_export
    ids = _ids(native.cfg.vocab_size, 1, 100, seed=1)
    cuts = ((0, 13), (13, 14), (14, 15), (15, 41), (41, 100))
    with torch.no_grad():
        state = native.new_stream_state()
        streamed = torch.cat([native.forward_stream(ids[:, a:b], state) for a, b in cuts], 1)
        cache, parts = None, []
        for start, end in cuts:
            out = hf_model(ids[:, start:end], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            parts.append(out.logits)
        one_pass = native(ids).logits
    assert cache.get_seq_length() == 100
    assert (torch.cat(parts, 1) - streamed).abs().max() <= ATOL
    assert_close(torch.cat(parts, 1), one_pass, FP32_REORDERED)


@pytest.mark.parametrize("use_cache", [False, True])
def test_padded_rows_equal_rows_alone(hf_model, hf_export, use_cache):
    """Left and right padding: every real position gets the logits of its row run alone."""
    native, _ = hf_export
    rows = [_ids(native.cfg.vocab_size, 1, n, seed=n)[0] for n in (20, 33)]
    for left in (True, False):
        ids = torch.zeros(2, 33, dtype=torch.long)
        mask = torch.zeros(2, 33, dtype=torch.long)
        for b, row in enumerate(rows):
            span = slice(33 - len(row), 33) if left else slice(0, len(row))
            ids[b, span], mask[b, span] = row, 1
        with torch.no_grad():
            logits = hf_model(ids, attention_mask=mask, use_cache=use_cache).logits
            for b, row in enumerate(rows):
                expected = native(row[None]).logits[0]
                assert (logits[b, mask[b].bool()] - expected).abs().max() <= ATOL


def test_labels_give_the_native_loss(hf_model, hf_export):
    native, _ = hf_export
    ids = _ids(native.cfg.vocab_size, 2, 40, seed=3)
    labels = ids.clone()
    labels[:, :5] = -100
    with torch.no_grad():
        loss = hf_model(ids, labels=labels, use_cache=False).loss
        expected = lm_loss(native(ids).logits, labels)
    assert torch.allclose(loss, expected, atol=ATOL)


def test_the_folder_still_loads_natively(hf_export):
    native, directory = hf_export
    ids = _ids(native.cfg.vocab_size, 1, 50, seed=4)
    with torch.no_grad():
        assert torch.equal(load_pretrained(directory)(ids).logits, native(ids).logits)


@pytest.mark.parametrize(
    ("saved", "runs"),
    [
        ({"gca_backend": "auto", "swa_backend": "auto"}, ("matmul", "auto")),
        ({"gca_backend": "triton", "swa_backend": "gpu"}, ("matmul", "auto")),
        ({"gca_backend": "sdpa", "swa_backend": "naive"}, ("sdpa", "naive")),
        ({"attn_backend": "naive"}, ("naive", "naive")),
    ],
)
def test_backends_the_folder_cannot_ship_are_replaced(saved, runs):
    """The Triton kernels and the GPU window path are not shipped: the PyTorch operators run instead."""
    cfg = native_config(GCAHFConfig(model={"vocab_size": 300, "d_model": 64, "n_heads": 2, "n_kv_heads": 2, **saved}))
    assert (cfg.gca_backend, cfg.swa_backend) == runs


@pytest.mark.parametrize("arch", ["swa", "full"])
def test_the_baselines_export_too(tmp_path, arch):
    """``model.arch=swa`` and ``model.arch=full`` exports load the same way (``build_model`` picks the class, and
    the export ships its module): the native logits whole and streamed, and greedy generation is the native
    model's argmax continuation recomputed from scratch at every step."""
    torch.manual_seed(0)
    native = build_model(GCAConfig(**{**hf_model_config(300).to_dict(), "arch": arch})).eval()
    write_hf_files(save_pretrained(native, tmp_path / arch))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / arch, trust_remote_code=True).eval()
    shipped = type(hf.gca)  # the export's own copy of the native class (model/full.py -> model_full.py)
    assert shipped.__name__ == type(native).__name__
    assert shipped.__module__.endswith("." + type(native).__module__.replace(".", "_"))
    ids = _ids(300, 2, 70, seed=5)
    with torch.no_grad():
        expected = native(ids).logits
        assert (hf(ids, use_cache=False).logits - expected).abs().max() <= ATOL
        assert (hf(ids, use_cache=True).logits - expected).abs().max() <= ATOL
        want = ids[:1, :10]
        for _ in range(8):
            want = torch.cat([want, native(want).logits[:, -1].argmax(-1, keepdim=True)], 1)
    out = hf.generate(ids[:1, :10], max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, want)


def test_writer_names_the_config_class_model_type():
    from pipeline.hf.export import MODEL_TYPE

    assert MODEL_TYPE == GCAHFConfig.model_type
