"""Continued pretraining from a dense checkpoint: ``checkpoint.init_from=hf:<dir>``, ``optim.trainable=new`` (stage 1
changes only what the conversion added, bitwise), ``optim.lr_scale`` per parameter role, the HF export of a
converted model, and (``dist``) DeepSpeed / FSDP2 runs that resume exactly."""

from pathlib import Path

import pytest
import torch
from helpers import save_tiny_dense
from safetensors.torch import load_file

from model import GCAConfig, GCAForCausalLM, load_pretrained
from model.convert import convert_dense, parameter_role
from pipeline.train import dist
from pipeline.train.config import ConfigError, OptimConfig, load_config
from pipeline.train.optim import build_optimizer, set_lr
from pipeline.train.trainer import Trainer, main

transformers = pytest.importorskip("transformers")

CONVERTED = {
    "model.position": "rope",
    "model.tokens_see_landmarks": False,
    "model.norm_eps": 1e-6,
    "model.rope_theta": 10000.0,
}
"""On top of the tests' tiny model (``helpers.TINY_TRAIN_OVERRIDES``): what the dense checkpoint below dictates."""


def save_dense(directory: Path, tied: bool) -> Path:
    """A random 2-layer Llama of the tiny trainer model's shapes, saved as a transformers folder."""
    return save_tiny_dense(directory, tied=tied)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return save_dense(tmp_path_factory.mktemp("dense") / "llama", tied=True)


def stage(dense_dir: Path, **extra) -> dict:
    return {**CONVERTED, "checkpoint.init_from": f"hf:{dense_dir}", **extra}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_stage_one_changes_only_the_new_parameters(tmp_path, tiny_data, overrides, dense_dir, tied):
    run = tmp_path / "stage1"
    if not tied:
        dense_dir = save_dense(tmp_path / "untied", tied=False)
    untie = {} if tied else {"model.tie_embeddings": False}
    assert main(None, overrides(run, tiny_data, **stage(dense_dir, **{"optim.trainable": "new"}, **untie))) == 0
    cfg = load_config(None, overrides(run, tiny_data, **stage(dense_dir, **untie)))
    start, _ = convert_dense(dense_dir, cfg.model)
    trained = load_file(run / "export" / "model.safetensors")
    initial = start.state_dict()
    assert trained.keys() == initial.keys()
    roles = {name: parameter_role(name) for name in trained}
    for name, role in roles.items():
        if role == "dense":
            assert torch.equal(trained[name], initial[name]), name
    moved = {roles[n] for n in trained if roles[n] != "dense" and not torch.equal(trained[n], initial[n])}
    assert moved == {"gca", "memory", "retriever"}
    assert_hf_export_generates(run / "export")


def assert_hf_export_generates(export: Path) -> None:
    """The run's export loads in transformers (its own shipped model code, with the RoPE window and the hidden
    landmarks), gives the native logits, and greedy ``generate`` continues like a native greedy stream."""
    native = load_pretrained(export).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True).eval()
    prompt = torch.randint(0, 64, (1, 40))  # 5 chunks: the continuation reads retrieved chunks
    with torch.no_grad():
        torch.testing.assert_close(hf(prompt).logits, native(prompt).logits, rtol=0, atol=1e-5)
        out = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        state = native.new_stream_state()
        logits, want = native.forward_stream(prompt, state, last_logits=1), []
        for _ in range(10):
            want.append(int(logits[0, -1].argmax()))
            logits = native.forward_stream(torch.tensor([[want[-1]]]), state)
    assert out[0, 40:].tolist() == want


def test_stage_two_trains_everything_from_the_conversion(tmp_path, tiny_data, overrides, dense_dir):
    cfg = load_config(None, overrides(tmp_path / "stage2", tiny_data, **stage(dense_dir)))
    trainer = Trainer(cfg, dist.init_distributed("none"))
    converted, _ = convert_dense(dense_dir, cfg.model)
    state = trainer.engine.module.state_dict()
    assert all(torch.equal(state[n], t) for n, t in converted.state_dict().items())
    assert all(p.requires_grad for p in trainer.engine.module.parameters())


def test_resuming_with_other_trainable_parameters_is_refused(tmp_path, tiny_data, overrides, dense_dir, caplog):
    run = tmp_path / "run"
    first = stage(dense_dir, **{"optim.trainable": "new", "train.max_steps": 3})
    assert main(None, overrides(run, tiny_data, **first)) == 0
    caplog.clear()
    assert main(None, overrides(run, tiny_data, **{**first, "optim.trainable": "all", "train.max_steps": 4})) == 2
    assert "optim.trainable" in caplog.text and "parameter groups" in caplog.text


def test_per_role_learning_rates():
    model = GCAForCausalLM(GCAConfig(vocab_size=64, d_model=32, n_heads=2, n_kv_heads=2, ffn_hidden=64))
    plain = build_optimizer(model, OptimConfig())
    assert len(plain.param_groups) == 2 and all("lr_scale" not in g for g in plain.param_groups)
    scaled = build_optimizer(model, OptimConfig(lr_scale={"retriever": 3.0, "dense": 0.5}))
    set_lr(scaled.param_groups, 0.1)
    by_param = {id(p): g["lr"] for g in scaled.param_groups for p in g["params"]}
    want = {"retriever": 0.3, "dense": 0.05, "gca": 0.1, "memory": 0.1}
    for name, p in model.named_parameters():
        assert by_param[id(p)] == pytest.approx(want[parameter_role(name)]), name
    # The same parameters with the same decay either way: only the learning rates differ.
    decay = {id(p): g["weight_decay"] for g in plain.param_groups for p in g["params"]}
    assert all(decay[id(p)] == g["weight_decay"] for g in scaled.param_groups for p in g["params"])


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            {"model.d_model": 64, "model.ffn_hidden": 128},
            r"model\.d_model=64 \(in override .* does not fit .* set model\.d_model=32",
        ),
        ({"model.position": "alibi"}, r"model\.position='alibi' .* set model\.position='rope'"),
        ({"model.groups": "[2]"}, "num_hidden_layers=2"),
    ],
)
def test_a_model_that_does_not_fit_the_dense_checkpoint_is_a_config_error(
    tmp_path, tiny_data, overrides, dense_dir, extra, message
):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides(tmp_path / "run", tiny_data, **stage(dense_dir, **extra)))


def test_staged_training_keys_are_checked(tmp_path, tiny_data, overrides):
    with pytest.raises(ConfigError, match="optim.trainable=new needs model.arch=gca"):
        load_config(None, overrides(tmp_path, tiny_data, **{"optim.trainable": "new", "model.arch": "swa"}))
    with pytest.raises(ConfigError, match=r"optim.lr_scale: unknown role\(s\) \['retrieval'\]"):
        load_config(None, overrides(tmp_path, tiny_data, **{"optim.lr_scale": "{retrieval: 2.0}"}))
    with pytest.raises(ConfigError, match="optim.lr_scale.gca must be a finite number > 0"):
        load_config(None, overrides(tmp_path, tiny_data, **{"optim.lr_scale": "{gca: 0.0}"}))


def test_a_dataset_tokenized_with_another_tokenizer_than_the_dense_models_is_refused(
    tmp_path, tiny_data, overrides, dense_dir
):
    import shutil

    from data_prep import format as fmt
    from pipeline.train.inputs import check_inputs

    def checked(tokenizer_files: dict[str, bytes]) -> None:
        folder = tmp_path / f"dense{len(list(tmp_path.iterdir()))}"
        shutil.copytree(dense_dir, folder)
        for name, data in tokenizer_files.items():
            (folder / name).write_bytes(data)
        check_inputs(load_config(None, overrides(tmp_path / "run", tiny_data, **stage(folder))))

    ours = (tiny_data / fmt.TOKENIZER_FILENAME).read_bytes()
    checked({"tokenizer.model": ours})  # the dataset's own SentencePiece model: accepted
    checked({})  # no tokenizer in the folder: nothing to compare (logged)
    with pytest.raises(ConfigError, match=r"tokenized with another tokenizer .* tokenizer\.model=.*dense\d+/"):
        checked({"tokenizer.model": ours + b"\x00"})
    with pytest.raises(ConfigError, match=r"\(tokenizer\.json, sha256 .*tokenizer\.type=hf tokenizer\.path=.*dense\d+"):
        checked({"tokenizer.json": b"{}"})  # a Hugging Face tokenizer only: the dataset cannot be tokenized with it


@pytest.mark.dist
@pytest.mark.parametrize("engine", ["fsdp", "zero2"])
def test_a_converted_model_trains_on_two_ranks_and_resumes_exactly(
    engine, tmp_path, tiny_data, overrides, metrics, dense_dir, clean_shm
):
    """Stage 1 of a converted model under FSDP2 / DeepSpeed ZeRO-2 (frozen dense weights, a retriever LR): a run
    stopped at step 3 and resumed gives the uninterrupted run's losses, gradient norms and weights bitwise, and the
    dense weights stay the converted ones."""
    from test_pipeline_dist import launch

    settings = stage(dense_dir, **{"optim.trainable": "new", "optim.lr_scale": "{retriever: 3.0}"})
    settings.update({"train.max_steps": 6, "model.gumbel_topk": False})
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    proc = launch(engine, overrides(straight, tiny_data, **settings))
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = launch(engine, overrides(stopped, tiny_data, **settings), fault="sigusr1:step=3:rank=1")
    assert first.returncode != 0 and (stopped / "checkpoints/step_00000003/COMMITTED").exists()
    again = launch(engine, overrides(stopped, tiny_data, **settings))
    assert again.returncode == 0, again.stderr[-4000:]
    got, resumed = metrics(straight), metrics(stopped)
    for step in range(1, 7):
        for key in ("loss", "grad_norm"):
            assert resumed[step][key].hex() == got[step][key].hex(), (step, key)
    w_got, w_res = load_file(straight / "export/model.safetensors"), load_file(stopped / "export/model.safetensors")
    assert all(torch.equal(w_res[n], w_got[n]) for n in w_got)
    initial, _ = convert_dense(
        dense_dir, load_config(None, overrides(tmp_path / "x", tiny_data, **stage(dense_dir))).model
    )
    for name, tensor in initial.state_dict().items():
        assert torch.equal(w_got[name], tensor) == (parameter_role(name) == "dense"), name


def test_the_tinyllama_recipe_fits_a_checkpoint_of_tinyllamas_shapes(tmp_path, tiny_data):
    """configs/cpt/tinyllama.yaml loads against a config.json of TinyLlama-1.1B's published shapes (no weights are
    read when a config is loaded)."""
    repo = Path(__file__).resolve().parents[2]
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    config.save_pretrained(tmp_path / "tinyllama")
    extra = [f"checkpoint.init_from=hf:{tmp_path / 'tinyllama'}", f"run_dir={tmp_path / 'run'}"]
    cfg = load_config(repo / "configs/cpt/tinyllama.yaml", [*extra, f"data.path={tiny_data}"])
    assert cfg.optim.trainable == "new" and cfg.model.n_lower_layers + sum(cfg.model.groups) == 22
    # The recipe holds only the layout: the shapes are the checkpoint's.
    assert (cfg.model.d_model, cfg.model.n_kv_heads, cfg.model.ffn_hidden, cfg.model.tie_embeddings) == (
        2048,
        4,
        5632,
        False,
    )


DENSE_MODEL_KEYS = {
    "model.arch",
    "model.vocab_size",
    "model.d_model",
    "model.n_heads",
    "model.n_kv_heads",
    "model.ffn_hidden",
    "model.norm_eps",
    "model.rope_theta",
    "model.qkv_bias",
    "model.tie_embeddings",
    "model.position",
}
"""What a CPT config no longer spells: the checkpoint decides it (written out here, not imported, as the reference)."""


@pytest.fixture(scope="module")
def odd_dense(tmp_path_factory) -> Path:
    """A dense Llama whose every shape differs from the schema's defaults (GQA, untied, its own RoPE base), so a
    value taken from the defaults cannot pass for one read from the checkpoint."""
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("odd") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def layout_only(overrides, run: Path, data: Path, **extra) -> list[str]:
    """The tiny run's overrides without any dense shape key (what a CPT config holds)."""
    return [o for o in overrides(run, data, **extra) if o.partition("=")[0] not in DENSE_MODEL_KEYS]


def test_a_cpt_config_of_layout_keys_only_takes_the_dense_shapes_from_the_checkpoint(
    tmp_path, tiny_data, overrides, odd_dense
):
    hf = transformers.AutoConfig.from_pretrained(odd_dense)
    want = {
        "arch": "gca",
        "vocab_size": hf.vocab_size,
        "d_model": hf.hidden_size,
        "n_heads": hf.num_attention_heads,
        "n_kv_heads": hf.num_key_value_heads,
        "ffn_hidden": hf.intermediate_size,
        "norm_eps": hf.rms_norm_eps,
        "rope_theta": 500000.0,
        "qkv_bias": False,
        "tie_embeddings": False,
        "position": "rope",
    }
    assert {f"model.{k}" for k in want} == DENSE_MODEL_KEYS
    init = f"checkpoint.init_from=hf:{odd_dense}"
    cfg = load_config(None, [*layout_only(overrides, tmp_path / "run", tiny_data), init])
    assert {k: getattr(cfg.model, k) for k in want} == want
    model = Trainer(cfg, dist.init_distributed("none")).engine.module
    dense = load_file(odd_dense / "model.safetensors")
    assert torch.equal(model.embed.weight, dense["model.embed_tokens.weight"])
    assert torch.equal(model.head.weight, dense["lm_head.weight"])
    # A value given explicitly must agree with the checkpoint, even one equal to the schema default.
    for key, value, theirs in (
        ("rope_theta", 10000.0, 500000.0),
        ("n_kv_heads", 4, 1),
        ("tie_embeddings", True, False),
    ):
        with pytest.raises(ConfigError, match=rf"model\.{key}={value}\b.*override 'model\.{key}=\.\.\.'.*{theirs}"):
            load_config(None, [*layout_only(overrides, tmp_path / "run", tiny_data), init, f"model.{key}={value}"])
    cfg_file = tmp_path / "cpt.yaml"
    cfg_file.write_text("model:\n  norm_eps: 1.0e-5\n")
    with pytest.raises(ConfigError, match=rf"model\.norm_eps=1e-05 \(in config file {cfg_file}\).*1e-06"):
        load_config(cfg_file, [*layout_only(overrides, tmp_path / "run", tiny_data), init])
    agreed = load_config(None, [*layout_only(overrides, tmp_path / "run", tiny_data), init, "model.d_model=32"])
    assert agreed.model == cfg.model


def test_a_stage_from_a_native_export_takes_the_shapes_from_its_config_json(tmp_path, tiny_data, overrides, odd_dense):
    import json

    from pipeline.cli.convert import main as convert

    layout = [o for o in layout_only(overrides, tmp_path, tiny_data) if o.startswith("model.")]
    export = tmp_path / "export"
    assert convert(["--dense", str(odd_dense), "--out", str(export), *layout]) == 0
    exported = json.loads((export / "config.json").read_text())["model"]
    init = f"checkpoint.init_from={export}"
    cfg = load_config(None, [*layout_only(overrides, tmp_path / "run", tiny_data), init])
    assert {k: getattr(cfg.model, k.removeprefix("model.")) for k in DENSE_MODEL_KEYS} == {
        k: exported[k.removeprefix("model.")] for k in DENSE_MODEL_KEYS
    }
    model = Trainer(cfg, dist.init_distributed("none")).engine.module
    weights = load_file(export / "model.safetensors")
    assert all(torch.equal(t, weights[n]) for n, t in model.state_dict().items())
    with pytest.raises(ConfigError, match=r"model\.d_model=64\b.*override 'model\.d_model=\.\.\.'.*32"):
        load_config(None, [*layout_only(overrides, tmp_path / "run", tiny_data), init, "model.d_model=64"])


def test_a_dense_checkpoint_with_a_non_finite_weight_is_refused_before_training(tmp_path, tiny_data, overrides, caplog):
    """An inf in the dense model's weights would carry into the GCA model and make the first loss NaN; refused at
    start (exit 2), naming the checkpoint folder and the converted tensor."""
    from safetensors.torch import save_file

    dense = save_dense(tmp_path / "diverged", tied=True)
    weights = dense / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("inf")
    save_file(tensors, weights, metadata={"format": "pt"})
    run = tmp_path / "run"
    assert main(None, overrides(run, tiny_data, **stage(dense))) == 2
    assert f"checkpoint.init_from: {dense}: tensor " in caplog.text and "1 non-finite value(s)" in caplog.text
    assert not (run / "checkpoints").exists()
