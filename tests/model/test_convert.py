"""Dense Llama/Qwen2 checkpoints (tiny, random, built offline with ``transformers``) converted into GCA models:
the dense logits on in-window sequences, every tensor accounted for, unsupported layouts refused by key."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import GCAConfig
from model.convert import ConversionError, convert_dense, read_dense_weights

transformers = pytest.importorskip("transformers")

VOCAB = 64
LAYOUT = dict(n_lower_layers=2, groups=[2], n_encoder_layers=1, chunk_size=8, top_k=2, window=128)
IN_WINDOW_TOLERANCE = {"rtol": 0.0, "atol": 1e-5}
"""fp32: the converted model computes the same sums as transformers, in another order (and with fp64 RoPE angles
where transformers uses fp32 ones); measured max |difference| ~3e-7 on logits of magnitude ~1."""


def dense_checkpoint(tmp_path: Path, kind: str, **config) -> tuple[Path, torch.nn.Module]:
    """A random 4-layer dense model saved as a transformers folder; norm gains and biases moved off their
    initial values so that a misplaced one shows."""
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500.0,
    )
    torch.manual_seed(0)
    config = {"tie_word_embeddings": True, **config}
    model = model_cls(config_cls(**{**settings, **config}, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    directory = tmp_path / kind
    model.save_pretrained(directory)
    return directory, model


def layout(**overrides) -> GCAConfig:
    return GCAConfig(**{**LAYOUT, "tokens_see_landmarks": False, "swa_backend": "sdpa", **overrides})


@pytest.mark.parametrize("kind,tied", [("llama", True), ("qwen2", True), ("llama", False)])
def test_converted_logits_equal_the_dense_logits_in_the_window(tmp_path, kind, tied):
    directory, dense = dense_checkpoint(tmp_path, kind, tie_word_embeddings=tied)
    model, _ = convert_dense(directory, layout())
    assert (model.head is None) == tied
    ids = torch.randint(0, VOCAB, (2, 110))  # 110 tokens + 13 landmarks = 123 stream positions <= window 128
    with torch.no_grad():
        want = dense(ids).logits
        got = model.eval()(ids).logits
    torch.testing.assert_close(got, want, **IN_WINDOW_TOLERANCE)
    # Controls: past the window the sliding window replaces full attention, and landmarks left visible to the
    # tokens change the logits too (why converted models hide them).
    long_ids = torch.randint(0, VOCAB, (1, 200))
    visible, _ = convert_dense(directory, layout(tokens_see_landmarks=True))
    with torch.no_grad():
        assert (model(long_ids).logits - dense(long_ids).logits)[:, -1].abs().max() > 1e-3
        assert (visible.eval()(ids).logits - want).abs().max() > 1e-3


def test_every_dense_tensor_is_placed_and_every_gca_tensor_set(tmp_path):
    directory, _ = dense_checkpoint(tmp_path, "qwen2")
    model, source = convert_dense(directory, layout())
    assert set(source) == {name for name, _ in model.named_parameters()}
    origins = " ".join(source.values())
    assert all(name in origins for name in read_dense_weights(directory))
    assert source["groups.0.layers.1.attn.wq.bias"].startswith("model.layers.3.self_attn.q_proj.bias")
    assert source["encoder.layers.0.wo.weight"].startswith("model.layers.2.self_attn.o_proj.weight")
    new = {name for name, origin in source.items() if origin.startswith("new")}
    assert new == {
        "landmark",
        "groups.0.query_norm.weight",
        "encoder.prenorm.weight",
        *(f"groups.0.layers.{j}.gca.wo.{p}" for j in range(2) for p in ("weight", "bias")),
    }


def edit_config(directory: Path, **changes) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return directory


@pytest.mark.parametrize(
    "kind,build,changes,key",
    [
        ("llama", {}, {"hidden_act": "gelu"}, "hidden_act="),
        ("llama", {}, {"model_type": "gpt2"}, "model_type="),
        ("llama", {}, {"model_type": "qwen3"}, "q_norm"),
        ("llama", {}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling="),
        ("llama", {}, {"attention_bias": True}, "attention_bias="),
        ("mistral", {"sliding_window": 16}, {}, "sliding_window="),
        ("qwen2", {}, {"use_sliding_window": True}, "use_sliding_window="),
        ("llama", {}, {"head_dim": 16}, "head_dim="),
    ],
)
def test_unsupported_layouts_are_one_line_errors_naming_the_key(tmp_path, kind, build, changes, key):
    directory, _ = dense_checkpoint(tmp_path, kind, **build)
    with pytest.raises(ConversionError, match=key) as err:
        convert_dense(edit_config(directory, **changes), layout())
    assert "\n" not in str(err.value)


def test_a_layout_that_does_not_fit_names_the_model_key(tmp_path):
    directory, _ = dense_checkpoint(tmp_path, "llama")
    model, _ = convert_dense(directory, layout())
    from model.convert import convert_dense_into

    other = type(model)(GCAConfig.from_dict({**model.cfg.to_dict(), "d_model": 64}))
    with pytest.raises(ConversionError, match=r"model\.d_model=64 .* set model\.d_model=32"):
        convert_dense_into(other, directory)
    with pytest.raises(ConversionError, match=r"num_hidden_layers=4"):
        convert_dense(directory, layout(groups=[1]))


def test_a_tied_checkpoint_with_another_lm_head_is_refused(tmp_path):
    directory, _ = dense_checkpoint(tmp_path, "llama")
    weights = load_file(directory / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + 1
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="tie_word_embeddings=true but lm_head.weight differs"):
        convert_dense(directory, layout())


def test_an_unknown_checkpoint_tensor_is_refused_not_dropped(tmp_path):
    directory, _ = dense_checkpoint(tmp_path, "llama")
    weights = load_file(directory / "model.safetensors")
    weights["model.layers.0.self_attn.extra_gate.weight"] = torch.zeros(4)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="extra_gate"):
        convert_dense(directory, layout())
