"""The stored reference loss curves (``tests/reference_curves.py``): every engine reproduces its curve, and a
one-line numerics change does not."""

from __future__ import annotations

from pathlib import Path

import pytest
from reference_curves import ENGINES, load_reference, mismatches, prepare_corpus, train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("reference_corpus") / "data"
    sha = prepare_corpus(data)
    recorded = load_reference()["corpus"]
    assert sha == recorded["input_sha256"], (
        f"the built-in corpus slice differs from the one the reference curves were made on (Python "
        f"{recorded['python']}); after checking why, regenerate them with `make reference-curves`"
    )
    return data


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_training_reproduces_the_reference_curve(engine: str, corpus: Path, tmp_path: Path, clean_shm: None) -> None:
    reference = load_reference()
    losses = train(engine, corpus, tmp_path / "run")
    off = mismatches(reference["curves"][engine], losses, reference["rtol"])
    assert not off, f"{engine} moved off its reference curve (a numerics change?):\n" + "\n".join(off)


def test_a_one_line_numerics_change_moves_the_curve(corpus: Path, tmp_path: Path) -> None:
    """A 1% larger initialisation scale is the kind of edit the curve must catch."""
    reference = load_reference()
    losses = train("single", corpus, tmp_path / "run", ["model.init_std=0.0202"])
    assert mismatches(reference["curves"]["single"], losses, reference["rtol"])


def test_mismatches_reports_each_step_beyond_the_tolerance() -> None:
    reference = [2.0, 2.0, 2.0]
    assert mismatches(reference, [2.0, 2.0 * (1 + 5e-6), 2.0]) == []
    off = mismatches(reference, [2.0, 2.0 * (1 + 2e-5), 1.9])
    assert [line.split(":")[0] for line in off] == ["step 2", "step 3"]
    assert mismatches(reference, [2.0, 2.0]) == ["2 steps, the reference has 3"]
