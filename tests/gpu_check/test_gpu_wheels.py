"""The carried wheel set (configs/gpu/wheels.txt, ``make gpu-wheels``) completes the GPU image for this project.

The GPU image is simulated by a clean venv (``python -m venv --without-pip``, no system site packages) that sees
only the distributions of ``configs/gpu/image.txt``: each is linked from the project venv, so the files are those
a pip install of the pinned versions gives, without a multi-GB download. The carried wheels are then installed
with the GPU machine's command (``pip install --no-index --no-deps --target``) and the project is imported and run
in that environment. Binary wheels for CPython 3.12 cannot load into this machine's 3.11, so the 3.11 set is
fetched by the same script into ``build/gpu-wheels/cp311`` and must name the same packages and versions as the
3.12 set in ``.whl/``; a CPython 3.12 interpreter, when one is on PATH, loads every 3.12 wheel that needs no torch.

Network: the first run downloads ~20 MiB of wheels and builds deepspeed and zstd (~4 min); later runs reuse them.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import random
import shutil
import string
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.gpucheck import wheels
from pipeline.gpucheck.cli import PIP_INSTALL_INTO

pytestmark = [pytest.mark.gpuwheels, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
LOCAL_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
LOCAL_WHEELS = ROOT / "build" / "gpu-wheels" / f"cp{LOCAL_VERSION.replace('.', '')}"
GPU_WHEELS = ROOT / ".whl"
TIMEOUT_S = 600


def _run(cmd: list[str], env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _collect(python_version: str, dest: Path) -> None:
    done = _run(
        [sys.executable, "-m", "pipeline.gpucheck.wheels", "--python-version", python_version, "--dest", str(dest)],
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _image_names() -> set[str]:
    lines = (ROOT / "configs" / "gpu" / "image.txt").read_text().splitlines()
    return {wheels.normalize(ln) for ln in lines if ln.strip() and not ln.startswith("#")}


def _link_image(farm: Path) -> list[str]:
    """Link every top-level file of each image distribution the project venv has into ``farm``."""
    farm.mkdir()
    linked = []
    for dist in md.distributions():
        if wheels.normalize(dist.metadata["Name"]) not in _image_names():
            continue
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (farm / top).exists():
                (farm / top).symlink_to(source)
        linked.append(dist.metadata["Name"])
    return linked


@pytest.fixture(scope="module")
def gpu_env(tmp_path_factory) -> dict:
    """A clean venv seeing only the image's distributions, plus the carried wheels under ``site``."""
    _collect(LOCAL_VERSION, LOCAL_WHEELS)
    base = tmp_path_factory.mktemp("gpu-image")
    linked = _link_image(base / "image")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=TIMEOUT_S)
    python = venv / "bin" / "python"
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        env={"PATH": os.environ["PATH"]},
    ).stdout.strip()
    Path(purelib, "gpu_image.pth").write_text(str(base / "image") + "\n")
    site = base / "site"
    done = _run(
        [sys.executable, *PIP_INSTALL_INTO, str(site), *map(str, sorted(LOCAL_WHEELS.glob("*.whl")))],
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/tmp"),
        "OMP_NUM_THREADS": "1",
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": f"{site}:{ROOT}",
        "TMPDIR": str(base),
    }
    return {"python": str(python), "env": env, "site": site, "image": base / "image", "linked": linked, "base": base}


def test_image_alone_lacks_the_carried_packages(gpu_env):
    """Control: without the wheels the trainer does not import, so the simulated image is really bare."""
    env = {**gpu_env["env"], "PYTHONPATH": str(ROOT)}
    done = _run([gpu_env["python"], "-c", "import pipeline.train.trainer"], env)
    assert done.returncode != 0
    assert "ModuleNotFoundError: No module named 'omegaconf'" in done.stderr
    assert {"torch", "triton", "pytest", "numpy", "sentencepiece"} <= {n.lower() for n in gpu_env["linked"]}
    assert not {"deepspeed", "omegaconf", "mosaicml-streaming"} & {n.lower() for n in gpu_env["linked"]}


PROBE = textwrap.dedent("""
    import importlib, json, sys
    sys.path.insert(0, "launch")
    import torch, deepspeed, omegaconf, pydantic_core, zstd, brotli, snappy
    import pipeline.train.trainer, pipeline.train.parallel, pipeline.evaluation.run, data_prep.shard
    import kernels.gca.triton_gca, kernels.swa.gpu, pipeline.bench.kernels
    import pretrain, eval, prep, gpu_check
    import deepspeed.runtime.engine
    from deepspeed.runtime.config import DeepSpeedConfig
    from pipeline.train.config import DataConfig, ParallelConfig, TrainConfig
    from pipeline.train.parallel import build_deepspeed_config
    cfg = TrainConfig(run_dir="r", data=DataConfig(path="d"), parallel=ParallelConfig(engine="deepspeed",
                                                                                    zero_stage=1))
    ds = DeepSpeedConfig(build_deepspeed_config(cfg, world_size=1, bf16=True))
    from data_prep.streaming_compat import ensure_streaming_importable
    ensure_streaming_importable()
    from streaming.base.compression import compress, decompress
    blob = bytes(range(256)) * 64
    assert all(decompress(c, compress(c, blob)) == blob for c in ("zstd", "br", "snappy"))
    print(json.dumps({"zero_stage": ds.zero_optimization_stage, "bf16": ds.bfloat16_config.enabled,
                      "files": {m: sys.modules[m].__file__ for m in
                                ("deepspeed", "omegaconf", "streaming", "pydantic_core", "zstd", "torch",
                                 "numpy", "sentencepiece", "pipeline")}}))
""")


def test_carried_wheels_import_the_trainer_eval_and_kernels(gpu_env):
    done = _run([gpu_env["python"], "-c", PROBE], gpu_env["env"])
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["zero_stage"], report["bf16"]) == (1, True)
    files = report["files"]
    for carried in ("deepspeed", "omegaconf", "streaming", "pydantic_core", "zstd"):
        assert files[carried].startswith(str(gpu_env["site"])), (carried, files[carried])
    for image in ("torch", "numpy", "sentencepiece"):
        assert files[image].startswith(str(gpu_env["image"])), (image, files[image])
    assert files["pipeline"].startswith(str(ROOT))


def test_carried_wheels_run_prep_training_and_eval(gpu_env, tmp_path):
    """A real prep (sentencepiece + streaming's MDS writer, zstd), two training steps (streaming's reader,
    omegaconf) and a passkey eval in the simulated image."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    for i in range(40):
        words = ("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7))) for _ in range(400))
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(words))
    data, run = tmp_path / "data", tmp_path / "run"
    python, env = gpu_env["python"], gpu_env["env"]
    steps = [
        [
            python,
            "launch/prep.py",
            f"input={corpus}",
            f"output={data}",
            "tokenizer.vocab_size=320",
            "val_fraction=0.1",
            "num_proc=1",
            "progress=false",
        ],
        [
            python,
            "launch/pretrain.py",
            "--config",
            "configs/train/debug.yaml",
            f"run_dir={run}",
            f"data.path={data}",
            "model.vocab_size=320",
            "train.max_steps=2",
            "schedule.warmup_steps=1",
            "train.eval_every=0",
            "logging.progress=false",
            "checkpoint.every=0",
        ],
        [
            python,
            "launch/eval.py",
            "--checkpoint",
            str(run / "export"),
            "--task",
            "passkey",
            "--out",
            str(tmp_path / "eval"),
            "lengths=[512]",
            "samples=1",
            "depths=[0.5]",
            "data=builtin",
            "progress=false",
        ],
    ]
    for cmd in steps:
        done = _run(cmd, env)
        assert done.returncode == 0, f"{cmd[1]}: {done.stderr[-4000:]}"
    metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln]
    assert [m["step"] for m in metrics] == [1, 2]
    assert json.loads((tmp_path / "eval" / "passkey.json").read_text())["results"][0]["length"] == 512


def test_gpu_test_tier_collects_in_the_image(gpu_env):
    """`pytest -m gpu` (the first stage of `make gpu-check`) imports its modules; without CUDA they skip."""
    done = _run(
        [
            gpu_env["python"],
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            "tests/kernels/test_gca_triton_gpu.py",
            "tests/kernels/test_swa_gpu.py",
        ],
        gpu_env["env"],
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert " skipped" in done.stdout and "error" not in done.stdout.lower()


def test_cp312_set_matches_the_local_set_and_the_list():
    _collect("3.12", GPU_WHEELS)
    pins = {p.key: p.version for p in wheels.read_pins()}
    gpu = {name: version for name, (version, _) in wheels.wheels_in(GPU_WHEELS).items()}
    local = {name: version for name, (version, _) in wheels.wheels_in(LOCAL_WHEELS).items()}
    assert gpu == local == pins
    assert all(wheels.fits(f, "3.12") for _, f in wheels.wheels_in(GPU_WHEELS).values())
    assert not any(n.startswith(("torch", "triton", "nvidia")) for n in gpu)
    assert sum(p.stat().st_size for p in GPU_WHEELS.glob("*.whl")) < 40 * 2**20


@pytest.mark.skipif(shutil.which("python3.12") is None, reason="no CPython 3.12 on PATH")
def test_cp312_binary_wheels_load_in_cpython_312(tmp_path):
    """The GPU install command with a real CPython 3.12: every carried module that needs no torch imports and
    works (with the image's pure-Python typing_extensions and PyYAML linked from the project venv); the sources of
    deepspeed and streaming compile under 3.12 (they import torch, and torch 2.13 for 3.12 is not on this machine)."""
    _collect("3.12", GPU_WHEELS)
    python = shutil.which("python3.12")
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "PYENV_VERSION": "3.12"}
    site = tmp_path / "site"
    done = _run([python, *PIP_INSTALL_INTO, str(site), *map(str, sorted(GPU_WHEELS.glob("*.whl")))], env)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = textwrap.dedent("""
        import sys, brotli, catalogue, cramjam, hjson, omegaconf, pydantic, snappy, zstd
        assert sys.version_info[:2] == (3, 12), sys.version
        blob = bytes(range(256)) * 64
        assert zstd.decompress(zstd.compress(blob)) == blob and brotli.decompress(brotli.compress(blob)) == blob
        assert snappy.decompress(snappy.compress(blob)) == blob
        class M(pydantic.BaseModel):
            stage: int
        assert M.model_validate({"stage": "1"}).stage == 1
        assert omegaconf.OmegaConf.create({"a": "${b}", "b": 3}).a == 3 and hjson.loads("{a: 1}")["a"] == 1
        print("ok")
    """)
    image = tmp_path / "image"
    image.mkdir()
    for module in ("typing_extensions", "yaml"):
        spec = importlib.util.find_spec(module)
        source = Path(spec.origin).parent if spec.submodule_search_locations else Path(spec.origin)
        (image / source.name).symlink_to(source)
    done = _run([python, "-c", probe], {**env, "PYTHONPATH": f"{site}:{image}"}, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    done = _run([python, "-m", "compileall", "-q", str(site / "deepspeed"), str(site / "streaming")], env)
    assert done.returncode == 0, done.stdout[-3000:]
