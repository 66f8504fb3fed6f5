"""``model.retrieval=random`` exports like the learned model: the Hugging Face folder loads with every weight and,
drawing from the same seeded RNG, gives the native model's logits (whole forward and cached streaming)."""

from __future__ import annotations

import torch
from hf_export_helpers import hf_model_config
from transformers import AutoModelForCausalLM

from model import GCAConfig, GCAForCausalLM, load_pretrained, save_pretrained
from pipeline.hf import write_hf_files


def test_random_retriever_exports_and_loads(tmp_path):
    torch.manual_seed(0)
    native = GCAForCausalLM(GCAConfig(**{**hf_model_config(300).to_dict(), "retrieval": "random"})).eval()
    write_hf_files(save_pretrained(native, tmp_path / "export"))
    assert load_pretrained(tmp_path / "export").cfg.retrieval == "random"
    hf, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", trust_remote_code=True, output_loading_info=True
    )
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    hf.eval()
    ids = torch.randint(0, 300, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.manual_seed(7)
        expected = native(ids).logits
        torch.manual_seed(7)
        whole = hf(ids, use_cache=False).logits
        torch.manual_seed(8)
        other_draw = native(ids).logits
        streamed = hf(ids, use_cache=True).logits
    assert (whole - expected).abs().max() <= 1e-5
    assert (other_draw - expected).abs().max() > 1e-3  # the picks are random: another draw reads other chunks
    assert streamed.shape == expected.shape and torch.isfinite(streamed).all()
