"""Imports flow one way: kernels -> model -> pipeline -> launch, with data_prep beside (STYLE.md rule 1)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "kernels": {"model", "pipeline", "launch", "data_prep", "deepspeed", "omegaconf", "streaming", "transformers"},
    "model": {
        "pipeline",
        "launch",
        "data_prep",
        "deepspeed",
        "omegaconf",
        "streaming",
        "transformers",
        "torch.distributed",
    },
    "data_prep": {"kernels", "model", "pipeline", "launch"},
    "pipeline": {"launch"},
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports(package):
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[package]):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_model_reads_no_environment():
    """Device, ranks and environment belong to the pipeline; the model is a plain nn.Module."""
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "model").rglob("*.py") if "os.environ" in p.read_text()]
    assert not offenders, offenders
