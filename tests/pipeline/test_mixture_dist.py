"""Weighted data mixtures (``data.sources``, ``data.phases``; pipeline/data/mixture.py) on several gloo ranks,
launched like users launch (the deepspeed launcher, torchrun), with hard timeouts and the whole job killed on one.

Three prepared datasets of one tokenizer, weighted 0.5/0.3/0.2, global batch 6 of micro-batch 1:

- the same global batches on 1, 2 and 3 ranks, for DeepSpeed ZeRO-2 and FSDP2: the per-step loss and each source's
  ``loss/<label>`` within the cross-world-size tolerance of test_pipeline_dist.py (rel 2e-5: the reduction order
  changes), the per-source ``tokens/<label>``, ``share/<label>`` and ``epoch/<label>`` metrics and the data state of
  every checkpoint exactly;
- a 2-rank FSDP2 run SIGKILLed after its step-3 checkpoint and relaunched on 1 rank continues as the uninterrupted
  2-rank run: losses within T7's rel 1e-5 (tests/reliability/test_reliability_world_size_dist.py; another world
  size, so not bitwise), metrics and data state exactly;
- a phase change (``data.phases``) on 2 ranks: every step after it draws the new weights exactly, and a run killed
  before the boundary (same command, or the phase added only at the relaunch) resumes across it bit for bit (same
  world size, as T1/T2).

About 3.5 min on 2 cores: 12 launches (a DeepSpeed one ~20 s, an FSDP2 one ~15 s).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from conftest import _tokenizer_bytes, prepared_copy, read_metrics, write_mds
from helpers import TINY_TRAIN_OVERRIDES, free_port
from torchrun_jobs import run_job, torchrun_cmd

from data_prep import format as fmt
from pipeline.data.mixture import exact_weights

pytestmark = pytest.mark.dist

STEPS = 6
BATCH = 6
SEQ_LEN = int(str(TINY_TRAIN_OVERRIDES["train.seq_len"]))
WEIGHTS = {"books": Fraction(1, 2), "code": Fraction(3, 10), "web": Fraction(1, 5)}
LABELS = tuple(WEIGHTS)
SETTINGS: dict[str, object] = {
    "train.max_steps": STEPS,
    "train.global_batch": BATCH,
    "train.micro_batch": 1,
    # Gumbel top-k noise is drawn per rank, so runs on other world sizes cannot agree with it on.
    "model.gumbel_topk": False,
    "train.eval_every": 0,
    "checkpoint.every": 3,
    "checkpoint.keep_last": 10,
    "checkpoint.export": False,
}
ENGINES = {"fsdp": ["parallel.engine=fsdp"], "deepspeed": ["parallel.engine=deepspeed", "parallel.zero_stage=2"]}
TIMEOUT = 300


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three prepared datasets (manifest, ``_COMPLETE``) of one tokenizer, other documents each."""
    root = tmp_path_factory.mktemp("mixture_sources")
    tokenizer = _tokenizer_bytes()
    out = {}
    for (label, docs), seed in zip({"books": 120, "code": 60, "web": 40}.items(), (11, 12, 13)):
        raw = root / f"raw_{label}"
        write_mds(raw, "train", docs, seed=seed)
        write_mds(raw, "val", 6, seed=seed + 100)
        (raw / fmt.TOKENIZER_FILENAME).write_bytes(tokenizer)
        out[label] = prepared_copy(root / label, raw)
    return out


def mixture_args(run: Path, sources: dict[str, Path], phases: str | None = None, **extra: object) -> list[str]:
    """The tiny model's overrides with ``data.sources`` (0.5/0.3/0.2) and optional ``data.phases``. ``data.path`` is
    the first source (the debug config's own would otherwise give the tokenizer and the validation split)."""
    merged = {"run_dir": str(run), "data.path": str(sources["books"]), **TINY_TRAIN_OVERRIDES, **SETTINGS, **extra}
    listed = ", ".join(
        f"{{path: {sources[label]}, label: {label}, weight: {float(w)}, max_repeat: 50}}"
        for label, w in WEIGHTS.items()
    )
    args = [f"{k}={v}" for k, v in merged.items()] + [f"data.sources=[{listed}]"]
    return args + ([f"data.phases={phases}"] if phases else [])


def launch(engine: str, ranks: int, args: list[str], fault: str | None = None) -> tuple[int, str]:
    """``launch/pretrain.py`` on ``ranks`` CPU ranks (the deepspeed launcher for DeepSpeed, torchrun otherwise, on
    loopback); its exit code and output. Past `TIMEOUT` the whole job is killed and the test fails."""
    if engine == "deepspeed":
        launcher = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks)]
        cmd = [*launcher, "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "launch/pretrain.py"]
        cmd += ["--config", "configs/train/debug.yaml", *ENGINES[engine], *args]
    else:
        cmd = torchrun_cmd(ranks, [*ENGINES[engine], *args])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_SILENT": "true"}
    env.pop("PIPE_FAULT", None)
    if fault:
        env["PIPE_FAULT"] = fault
    rc, out, _ = run_job(cmd, env, timeout=TIMEOUT)
    return rc, out


def data_state(run: Path, step: int) -> dict:
    return json.loads((run / f"checkpoints/step_{step:08d}/trainer_state.json").read_text())["data"]


def committed(run: Path) -> list[int]:
    root = run / "checkpoints"
    return sorted(int(p.name.split("_")[1]) for p in root.iterdir() if (p / "COMMITTED").is_file())


def source_metrics(record: dict) -> dict[str, object]:
    return {k: v for k, v in record.items() if k.split("/")[0] in ("tokens", "share", "epoch") and "/" in k}


def source_losses(record: dict) -> dict[str, float]:
    """``loss/<label>``: each source's mean loss over the step's sequences."""
    return {k: v for k, v in record.items() if k.startswith("loss/")}


def assert_same_run(reference: Path, run: Path, steps: range, rel: float) -> None:
    """Per step: the loss and each source's loss within ``rel`` of the reference's, the per-source tokens, shares
    and epochs equal; the LR equal."""
    ref, got = read_metrics(reference), read_metrics(run)
    for step in steps:
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=rel), step
        assert source_losses(got[step]) == pytest.approx(source_losses(ref[step]), rel=rel), step
        assert got[step]["lr"] == ref[step]["lr"], step
        assert source_metrics(got[step]) == source_metrics(ref[step]), step


def assert_bitwise(reference: Path, run: Path, steps: range) -> None:
    ref, got = read_metrics(reference), read_metrics(run)
    for step in steps:
        for key in ("loss", "grad_norm", *source_losses(ref[step])):
            assert got[step][key].hex() == ref[step][key].hex(), (step, key)
        assert source_metrics(got[step]) == source_metrics(ref[step]), step


def assert_declared_shares(run: Path) -> None:
    """Every source is drawn: each prefix of the run within one sequence of its weight's share (the Pfair schedule),
    and a step's shares are that step's sequences."""
    records = read_metrics(run)
    for step, record in records.items():
        assert set(source_metrics(record)) == {f"{k}/{label}" for k in ("tokens", "share", "epoch") for label in LABELS}
        assert set(source_losses(record)) == {f"loss/{label}" for label in LABELS}, step
        assert sum(record[f"share/{label}"] for label in LABELS) == pytest.approx(1.0)
        for label, w in WEIGHTS.items():
            drawn = Fraction(record[f"tokens/{label}"], SEQ_LEN)
            assert abs(drawn - w * BATCH * step) < 1, (step, label, drawn)


@pytest.fixture(scope="module")
def fsdp_runs(sources, tmp_path_factory) -> dict[int, Path]:
    """FSDP2 on 1, 2 and 3 ranks: the same mixture, global batch and checkpoints (steps 3 and 6)."""
    runs = {}
    for ranks in (1, 2, 3):
        run = tmp_path_factory.mktemp(f"fsdp_{ranks}") / "run"
        rc, out = launch("fsdp", ranks, mixture_args(run, sources))
        assert rc == 0, out[-4000:]
        runs[ranks] = run
    return runs


def assert_same_global_batches(runs: dict[int, Path]) -> None:
    reference = runs[1]
    assert_declared_shares(reference)
    for ranks, run in runs.items():
        assert_same_run(reference, run, range(1, STEPS + 1), rel=2e-5)
        assert committed(run) == [3, 6], ranks
        for step in (3, 6):
            assert data_state(run, step) == data_state(reference, step), (ranks, step)


def test_fsdp2_draws_the_same_global_batches_on_one_two_and_three_ranks(fsdp_runs):
    assert_same_global_batches(fsdp_runs)


def test_deepspeed_zero2_draws_the_same_global_batches_on_one_two_and_three_ranks(sources, tmp_path, clean_shm):
    runs = {}
    for ranks in (1, 2, 3):
        runs[ranks] = tmp_path / f"ranks_{ranks}"
        rc, out = launch("deepspeed", ranks, mixture_args(runs[ranks], sources))
        assert rc == 0, out[-4000:]
    assert_same_global_batches(runs)


def test_a_two_rank_mixture_killed_after_a_checkpoint_resumes_on_one_rank(fsdp_runs, sources, tmp_path):
    run = tmp_path / "run"
    rc, out = launch("fsdp", 2, mixture_args(run, sources), fault="kill:step=5:rank=1")
    assert rc != 0, out[-4000:]
    assert committed(run) == [3], out[-4000:]
    rc, out = launch("fsdp", 1, mixture_args(run, sources))
    assert rc == 0, out[-4000:]
    assert "saved by 2 ranks, resuming on 1" in out, out[-4000:]
    assert_same_run(fsdp_runs[2], run, range(1, STEPS + 1), rel=1e-5)
    assert data_state(run, 6) == data_state(fsdp_runs[2], 6), "the same sequences were consumed"


PHASE_STEP = 4
NEW_WEIGHTS = {"books": Fraction(1, 6), "code": Fraction(1, 3), "web": Fraction(1, 2)}
PHASES = f"[{{start_step: {PHASE_STEP}, weights: {{books: 1, code: 2, web: 3}}}}]"


def test_a_phase_change_on_two_ranks_draws_the_new_weights_and_resumes_across_the_boundary(
    fsdp_runs, sources, tmp_path
):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    rc, out = launch("fsdp", 2, mixture_args(straight, sources, PHASES))
    assert rc == 0, out[-4000:]
    assert_bitwise(fsdp_runs[2], straight, range(1, PHASE_STEP + 1))  # the first phase: as without phases
    records = read_metrics(straight)
    for step in range(PHASE_STEP + 1, STEPS + 1):  # global batch 6: each of the new phase's steps is exact
        shares = {label: Fraction(records[step][f"share/{label}"]).limit_denominator(BATCH) for label in LABELS}
        assert shares == NEW_WEIGHTS, step
    for label in LABELS:  # the new phase continues each source's count where the first stopped
        drawn = records[STEPS][f"tokens/{label}"] - records[PHASE_STEP][f"tokens/{label}"]
        assert drawn == NEW_WEIGHTS[label] * BATCH * (STEPS - PHASE_STEP) * SEQ_LEN, label
    phases = data_state(straight, STEPS)["mixture"]["phases"]
    assert [p["start"] for p in phases] == [0, PHASE_STEP * BATCH]
    recorded = exact_weights([1, 2, 3])  # 1/6 and 1/3 as the nearest multiples of 2^-16
    assert phases[1]["weights"] == {label: str(w) for label, w in zip(NEW_WEIGHTS, recorded)}

    # SIGKILLed in the new phase, relaunched with the same command: it resumes before the boundary and crosses it.
    rc, out = launch("fsdp", 2, mixture_args(killed, sources, PHASES), fault=f"kill:step={PHASE_STEP + 1}:rank=1")
    assert rc != 0 and committed(killed) == [3], out[-4000:]
    rc, out = launch("fsdp", 2, mixture_args(killed, sources, PHASES))
    assert rc == 0, out[-4000:]
    assert_bitwise(straight, killed, range(1, STEPS + 1))
    assert data_state(killed, STEPS) == data_state(straight, STEPS)

    # The run without phases, resumed from its step-3 checkpoint with the phase added (it starts after the
    # checkpoint's position, so the resume takes it): it ends as if the phase had been declared from the start.
    added = Path(shutil.copytree(fsdp_runs[2], tmp_path / "added"))
    shutil.rmtree(added / "checkpoints/step_00000006")
    rc, out = launch("fsdp", 2, mixture_args(added, sources, PHASES))
    assert rc == 0, out[-4000:]
    assert_bitwise(straight, added, range(1, STEPS + 1))
    assert data_state(added, STEPS) == data_state(straight, STEPS)
