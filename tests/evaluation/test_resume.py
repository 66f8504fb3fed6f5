"""A passkey run keeps its finished samples in --out: a killed run resumes from them, other settings are refused."""

import json

import pytest

from data_prep.schema import ConfigError
from pipeline.evaluation import passkey
from pipeline.evaluation.resume import SAMPLES_FILE, SampleLog
from pipeline.evaluation.run import run_eval

SETTINGS = ["lengths=[300,400]", "depths=[0.5]", "samples=2", "segment=100", "progress=false"]
ONE_SAMPLE = ["lengths=[300]", "depths=[0.5]", "samples=1", "segment=100", "progress=false"]
TIMING = ("seconds", "seconds_per_sample", "tokens_per_s")


class Killed(Exception):
    """Stands for the run being killed between two samples."""


def _count_predictions(monkeypatch, kill_after: int | None = None) -> list[int]:
    """Count ``predict_answer`` calls (sample lengths); raise ``Killed`` once ``kill_after`` samples finished."""
    calls: list[int] = []
    real = passkey.predict_answer

    def counting(model, sample, *args, **kwargs):
        if kill_after is not None and len(calls) == kill_after:
            raise Killed
        calls.append(len(sample.ids))
        return real(model, sample, *args, **kwargs)

    monkeypatch.setattr(passkey, "predict_answer", counting)
    return calls


def _outcome(result: dict) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in result["results"]]


def test_killed_run_resumes_without_recomputing_finished_samples(tiny_export, tmp_path, monkeypatch, caplog):
    with monkeypatch.context() as m:
        calls = _count_predictions(m)
        whole = run_eval(str(tiny_export), "passkey", tmp_path / "whole", SETTINGS)
    assert len(calls) == 4  # 2 lengths x 1 depth x 2 samples

    out = tmp_path / "killed"
    with monkeypatch.context() as m:
        _count_predictions(m, kill_after=1)
        with pytest.raises(Killed):
            run_eval(str(tiny_export), "passkey", out, SETTINGS)
    lines = (out / SAMPLES_FILE).read_text().splitlines()
    assert len(lines) == 1 + 1 and not (out / "passkey.json").exists()  # the settings, then the finished sample

    with monkeypatch.context() as m, caplog.at_level("INFO", logger="pipeline.evaluation.passkey"):
        calls = _count_predictions(m)
        resumed = run_eval(str(tiny_export), "passkey", out, SETTINGS)
    assert calls == [300, 400, 400]  # the second sample of length 300 and both of length 400
    assert f"length=300: 1 of 2 samples finished earlier ({out / SAMPLES_FILE}), skipping them" in caplog.text
    assert _outcome(resumed) == _outcome(whole)
    assert json.loads((out / "passkey.json").read_text())["results"] == resumed["results"]

    with monkeypatch.context() as m:  # more samples: only the new ones run
        calls = _count_predictions(m)
        run_eval(str(tiny_export), "passkey", out, [*SETTINGS[:2], "samples=3", *SETTINGS[3:]])
    assert calls == [300, 400]


def test_rerun_with_other_settings_is_refused_unless_restarted(tiny_export, tmp_path, monkeypatch):
    run_eval(str(tiny_export), "passkey", tmp_path, [*ONE_SAMPLE, "seed=0"])
    with pytest.raises(ConfigError, match=r"finished with seed=0, but this run has seed=1.*restart=true"):
        run_eval(str(tiny_export), "passkey", tmp_path, [*ONE_SAMPLE, "seed=1"])
    # A re-exported model at the same path is another model.
    weights = tiny_export / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # same bytes: still the same model
    run_eval(str(tiny_export), "passkey", tmp_path, [*ONE_SAMPLE, "seed=0"])
    with open(weights, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(ConfigError, match="export_sha256"):
        run_eval(str(tiny_export), "passkey", tmp_path, [*ONE_SAMPLE, "seed=0"])

    calls = _count_predictions(monkeypatch)
    run_eval(str(tiny_export), "passkey", tmp_path, [*ONE_SAMPLE, "seed=1", "restart=true"])
    assert len(calls) == 1
    header = json.loads((tmp_path / SAMPLES_FILE).read_text().splitlines()[0])
    assert header["settings"]["seed"] == 1


@pytest.mark.parametrize(("before", "after"), [("value_kind=number", "value_kind=uuid"), ("hops=2", "hops=3")])
def test_every_key_that_shapes_a_sample_is_a_resume_setting(tiny_export, tmp_path, before, after):
    """The values' kind and the families' counts change the samples, so finished ones of the other setting are
    not reused."""
    run_eval(str(tiny_export), "passkey", tmp_path, [*ONE_SAMPLE, before])
    key = before.split("=")[0]
    with pytest.raises(ConfigError, match=f"finished with {key}=.*, but this run has {key}="):
        run_eval(str(tiny_export), "passkey", tmp_path, [*ONE_SAMPLE, after])


def test_a_line_cut_by_a_kill_is_dropped_and_its_sample_reruns(tmp_path):
    path = tmp_path / SAMPLES_FILE
    settings = {"seed": 0}
    log = SampleLog(path, settings)
    record = {"length": 300, "depth_index": 0, "depth": 0.0, "sample": 0, "answer": [1], "predicted": [1]}
    log.add(record)
    with open(path, "a") as f:
        f.write('{"length": 300, "depth_index": 0, "depth": 0.0, "sample": 1, "ans')  # killed mid-line
    resumed = SampleLog(path, settings)
    assert resumed.get((300, 0, 0.0, 0)) == record and resumed.get((300, 0, 0.0, 1)) is None
    resumed.add({**record, "sample": 1})
    assert len(SampleLog(path, settings).done) == 2  # the next line started on a line of its own


def test_a_damaged_samples_file_is_refused(tmp_path):
    path = tmp_path / SAMPLES_FILE
    path.write_text("not json\n")
    with pytest.raises(ConfigError, match="not a passkey samples file"):
        SampleLog(path, {"seed": 0})
    SampleLog(path, {"seed": 0}, restart=True)
    assert json.loads(path.read_text()) == {"settings": {"seed": 0}}
