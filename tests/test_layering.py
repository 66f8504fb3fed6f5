"""Imports flow one way: kernels -> model -> pipeline -> launch, with data_prep beside."""

import ast
import re
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


# Context parallelism is model math over a process group the caller creates and passes in: its one home may run
# collectives on that group, never create a group or find out ranks by itself (the pipeline owns both). Every file
# the project writes goes through data_prep.safe_write (never through a planted link), the model's export included.
ALLOWED = {
    ("model/context_parallel.py", "torch.distributed"),
    ("model/io.py", "data_prep.safe_write"),
    ("model/io.py", "data_prep.json_file"),
    ("model/convert.py", "data_prep.json_file"),
}
GROUP_SETUP = re.compile(r"\b(?:init_process_group|new_group|init_device_mesh|destroy_process_group)\b")


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports(package):
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            allowed = (str(path.relative_to(ROOT)), name) in ALLOWED
            if not allowed and any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[package]):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "\n".join(offenders)


# Inside pipeline/: its job groups, lowest first (pipeline/__init__.py says what each owns). A group may import
# itself and the groups before it, never one after it.
PIPELINE_GROUPS = ("data", "hf", "evaluation", "train", "demos", "bench", "gpucheck", "cli")


def pipeline_group_violations(root: Path) -> list[str]:
    """Each import of a later pipeline group, and each pipeline module that sits outside every group."""
    offenders = []
    for path in sorted((root / "pipeline").rglob("*.py")):
        parts = path.relative_to(root / "pipeline").parts
        if len(parts) == 1:
            if parts[0] != "__init__.py":
                offenders.append(f"pipeline/{parts[0]} is outside every group of {PIPELINE_GROUPS}")
            continue
        if parts[0] not in PIPELINE_GROUPS:
            offenders.append(f"pipeline/{parts[0]}/ is not one of the groups {PIPELINE_GROUPS}")
            continue
        rank = PIPELINE_GROUPS.index(parts[0])
        for name in _imports(path):
            target = name.split(".")
            if target[0] == "pipeline" and len(target) > 1 and target[1] in PIPELINE_GROUPS:
                if PIPELINE_GROUPS.index(target[1]) > rank:
                    offenders.append(f"{path.relative_to(root)} ({parts[0]}) imports {name} ({target[1]})")
    return offenders


def test_pipeline_groups_import_only_lower_groups():
    offenders = pipeline_group_violations(ROOT)
    assert not offenders, "\n".join(offenders)


def test_pipeline_group_check_flags_an_upward_import(tmp_path):
    (tmp_path / "pipeline" / "data").mkdir(parents=True)
    (tmp_path / "pipeline" / "train").mkdir()
    (tmp_path / "pipeline" / "data" / "reader.py").write_text("from pipeline.train.config import TrainConfig\n")
    (tmp_path / "pipeline" / "train" / "trainer.py").write_text("from pipeline.data.reader import RankBatches\n")
    (tmp_path / "pipeline" / "stray.py").write_text("")
    offenders = pipeline_group_violations(tmp_path)
    assert len(offenders) == 2
    assert "pipeline/data/reader.py (data) imports pipeline.train.config" in offenders[0]
    assert "pipeline/stray.py is outside every group" in offenders[1]


def test_model_never_sets_up_process_groups():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "model").rglob("*.py") if GROUP_SETUP.search(p.read_text())]
    assert not offenders, offenders


def test_model_reads_no_environment():
    """Device, ranks and environment belong to the pipeline; the model is a plain nn.Module."""
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "model").rglob("*.py") if "os.environ" in p.read_text()]
    assert not offenders, offenders


# Library code starts other processes by module name (``python -m pipeline.cli.eval``), never by a launch/ script
# path: launch/ is the top layer, and a path only resolves from the repository root. Forbidden in kernels/, model/,
# pipeline/ and data_prep/: a string constant that IS a path through launch/ (an argv element such as
# "launch/eval.py", the "launch" component of ``ROOT / "launch" / "eval.py"``, an f-string part "/launch/x.py"),
# and any string holding a ``python launch/...`` command. Allowed: docstrings, and messages (text with spaces)
# that tell a user which command to run, e.g. "run make prep (or launch/prep.py) first".
LIBRARY_PACKAGES = ("kernels", "model", "pipeline", "data_prep")
LAUNCH_PATH = re.compile(r"(?:.*/)?launch(?:/.*)?")
PYTHON_LAUNCH = re.compile(r"\bpython[0-9.]*\s+(?:\S*/)?launch/")


def _docstring_ids(tree: ast.AST) -> set[int]:
    """String expressions standing alone as statements: module/class/function and attribute docstrings."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def launch_references(source: str) -> list[str]:
    """The string constants of ``source`` that name a launch/ script or directory as something to run."""
    tree = ast.parse(source)
    docstrings = _docstring_ids(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docstrings:
            continue
        text = node.value
        if LAUNCH_PATH.fullmatch(text.strip()) or PYTHON_LAUNCH.search(text):
            found.append(f"line {node.lineno}: {text!r}")
    return found


@pytest.mark.parametrize(
    "source",
    [
        'subprocess.run([sys.executable, "launch/eval.py", "--task", "ppl"])',
        'EVAL = Path(__file__).parents[2] / "launch" / "eval.py"',
        'cmd = f"{ROOT}/launch/pretrain.py"',
        'os.system("python launch/prep.py --config x.yaml")',
        'cmd = ["deepspeed", "--num_gpus", "2", "launch/pretrain.py"]',
    ],
)
def test_launch_reference_detector_flags_process_starts(source):
    assert launch_references(source)


@pytest.mark.parametrize(
    "source",
    [
        '"""Run it with ``python launch/eval.py --task ppl``."""',
        'def f():\n    """Entry point of ``launch/preflight.py``."""',
        'raise ValueError("data.path is not a directory; run make prep (or launch/prep.py) first")',
        'subprocess.run([sys.executable, "-m", "pipeline.cli.eval", "--task", "ppl"])',
        'name = "launcher"',
    ],
)
def test_launch_reference_detector_allows_docs_and_module_starts(source):
    assert not launch_references(source)


@pytest.mark.parametrize("package", LIBRARY_PACKAGES)
def test_library_never_starts_launch_scripts(package):
    offenders = [
        f"{path.relative_to(ROOT)} {hit}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for hit in launch_references(path.read_text())
    ]
    assert not offenders, "\n".join(offenders)


_ROOT_MODULES = [
    ("pipeline.bench.cp", "ROOT"),
    ("pipeline.bench.step_ops", "ROOT"),
    ("pipeline.bench.train", "ROOT"),
    ("pipeline.bench.train_gpu", "ROOT"),
    ("pipeline.demos.demo", "ROOT"),
    ("pipeline.demos.demo_lm", "ROOT"),
    ("pipeline.gpucheck.cli", "ROOT"),
    ("pipeline.gpucheck.stages", "ROOT"),
    ("pipeline.gpucheck.wheels", "ROOT"),
    ("pipeline.hf.bundle", "REPO_ROOT"),
]


@pytest.mark.parametrize(("module", "name"), _ROOT_MODULES)
def test_repository_root_constants_point_at_the_root(module, name):
    """Modules that run commands or read configs from the repository root find it by climbing from their own file:
    a module moved one package deeper must climb one level more."""
    import importlib

    root = getattr(importlib.import_module(module), name)
    assert root == ROOT, f"{module}.{name} = {root}, not the repository root {ROOT}"


def test_every_module_climbing_to_the_root_is_checked():
    climbing = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "pipeline").rglob("*.py")
        if re.search(r"^[A-Z_]*ROOT = Path\(__file__\)", path.read_text(), re.M)
    }
    checked = {f"{module.replace('.', '/')}.py" for module, _ in _ROOT_MODULES}
    assert climbing == checked
