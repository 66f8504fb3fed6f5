"""The trainer with ``model.retrieval_scope=document``: its separator comes from the dataset; bad settings: one line."""

import pytest
from conftest import prepared_copy

from model import read_export_config
from pipeline.train.config import ConfigError, load_config
from pipeline.train.trainer import main

FAST = {"train.max_steps": 4, "checkpoint.every": 0, "train.eval_every": 0}


def test_document_scope_trains_with_the_datasets_separator(tmp_path, tiny_data, overrides, metrics):
    data = prepared_copy(tmp_path, tiny_data)  # manifest: eos_id=1, joined between packed documents
    doc, seq = tmp_path / "doc", tmp_path / "seq"
    assert main(None, overrides(doc, data, **FAST, **{"model.retrieval_scope": "document"})) == 0
    assert main(None, overrides(seq, data, **FAST)) == 0
    cfg, _ = read_export_config(doc / "export")
    assert (cfg.retrieval_scope, cfg.eos_id) == ("document", 1)
    # Same seed, data and initial weights: the losses differ only because chunks of other documents are hidden.
    doc_losses, seq_losses = ([m["loss"] for m in metrics(run).values()] for run in (doc, seq))
    assert doc_losses != seq_losses


def test_a_dataset_without_a_separator_is_refused(tmp_path, tiny_data, overrides, caplog):
    run = tmp_path / "run"
    assert main(None, overrides(run, tiny_data, **FAST, **{"model.retrieval_scope": "document"})) == 2
    assert (
        f"model.retrieval_scope=document needs the end-of-document token between packed documents, and "
        f"data.path={tiny_data} has none" in caplog.text
    )
    assert not run.exists()


def test_another_separator_is_refused(tmp_path, tiny_data, overrides, caplog):
    data = prepared_copy(tmp_path, tiny_data)
    run = tmp_path / "run"
    assert main(None, overrides(run, data, **FAST, **{"model.retrieval_scope": "document", "model.eos_id": 5})) == 2
    assert f"model.eos_id=5 but the dataset {data} separates documents with token 1" in caplog.text


def test_context_parallel_is_refused(tmp_path, tiny_data, overrides):
    args = overrides(
        tmp_path / "run",
        tiny_data,
        **{"model.retrieval_scope": "document", "parallel.engine": "fsdp", "parallel.context_parallel": 2},
    )
    with pytest.raises(ConfigError, match="parallel.context_parallel=2 > 1 does not support model.retrieval_scope"):
        load_config(None, args, world_size=2)


def test_the_retrieval_mix_is_refused(tmp_path, tiny_data, overrides):
    args = overrides(
        tmp_path / "run", tiny_data, **{"model.retrieval_scope": "document", "data.retrieval_mix.fraction": 0.5}
    )
    with pytest.raises(ConfigError, match="model.retrieval_scope=document cannot train with the retrieval-task mix"):
        load_config(None, args)
