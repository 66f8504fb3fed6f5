"""DeepSpeed on CPU with 2 real ranks started by the deepspeed launcher (as ``make train-ds-cpu`` does): whichever
way the run ends (done, an error, Ctrl-C, a rank killed with SIGKILL) it leaves none of the 66 MB
``/dev/shm/deepspeed_allreduce_buffer_*`` files it made, another job's buffer stays, and the ranks load the shm
comm op from the venv's build (``make ds-warmup``) instead of building their own into ``~/.cache``."""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port
from torchrun_jobs import REPO, run_job

pytestmark = pytest.mark.dist

VENV_OP = Path(sys.prefix) / "torch_extensions" / "deepspeed_shm_comm"
VENV_BIN = Path(sys.prefix) / "bin"
WARM_UP = [sys.executable, "-c", "from pipeline.train.deepspeed_cpu import build_shm_op; build_shm_op()"]


def buffers(port: int) -> list[str]:
    """The DeepSpeed buffers in /dev/shm of the job whose rendezvous port is ``port``."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def build_files() -> dict[str, int]:
    """The venv's build of the op: each file's modification time (a rebuild rewrites the library and the log)."""
    return {p.name: p.stat().st_mtime_ns for p in VENV_OP.iterdir() if p.suffix == ".so" or p.name == ".ninja_log"}


@pytest.fixture
def user_env(tmp_path: Path) -> dict[str, str]:
    """A user's shell as make runs the targets: no TORCH_EXTENSIONS_DIR, the venv not on PATH, and an empty home
    whose cache a rank would build into if the venv's build were not used."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "PIPE_FAULT")}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() != VENV_BIN.resolve()]
    home = tmp_path / "home"
    home.mkdir()
    env.update(PATH=os.pathsep.join(path), HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), OMP_NUM_THREADS="1")
    return env


@pytest.fixture
def other_job() -> Iterator[Path]:
    """Another job's live buffer: its port held open (no rendezvous can take it) and its file mapped."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        path = Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0")
        path.write_bytes(b"\0" * mmap.PAGESIZE)
        with path.open("r+b") as f, mmap.mmap(f.fileno(), mmap.PAGESIZE):
            try:
                yield path
            finally:
                path.unlink(missing_ok=True)


def launch(run: Path, data: Path, overrides, env: dict[str, str], fault: str | None = None) -> tuple[int, str, int]:
    """A 3-step ZeRO-2 run on 2 ranks; its exit code, output and rendezvous port."""
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(port)]
    cmd += ["launch/pretrain.py", "--config", "configs/train/debug.yaml", "parallel.engine=deepspeed"]
    cmd += ["parallel.zero_stage=2", *overrides(run, data, **{"train.max_steps": 3})]
    job_env = {**env, "DS_ACCELERATOR": "cpu", **({"PIPE_FAULT": fault} if fault else {})}
    try:
        rc, out, _ = run_job(cmd, job_env, timeout=600)
    finally:
        leftovers = buffers(port)
        for name in leftovers:  # so a failing run of this test leaves nothing either
            Path("/dev/shm", name).unlink(missing_ok=True)
    assert not leftovers, f"left in /dev/shm: {leftovers}\n{out[-3000:]}"
    return rc, out, port


def test_a_run_removes_its_buffers_and_loads_the_op_from_the_venv(tmp_path, tiny_data, overrides, user_env, other_job):
    # make ds-warmup, here from a shell with the venv activated (its ninja first on PATH)
    activated = {**user_env, "PATH": os.pathsep.join([str(VENV_BIN), user_env["PATH"]])}
    subprocess.run(WARM_UP, env=activated, cwd=REPO, check=True, capture_output=True, timeout=600)
    built = build_files()
    assert "deepspeed_shm_comm.so" in built

    rc, out, _ = launch(tmp_path / "run", tiny_data, overrides, user_env)
    assert rc == 0, out[-3000:]
    assert out.count("deepspeed_shm_comm_op built successfully") == 2  # both ranks loaded the op (and used shm)
    assert build_files() == built  # found in the venv, not rebuilt
    assert not (Path(user_env["XDG_CACHE_HOME"]) / "torch_extensions").exists()
    assert other_job.exists()


@pytest.mark.parametrize(
    "fault", ["nan_loss:step=2", "sigint:step=2", "kill:step=2:rank=1"], ids=["error", "ctrl-c", "sigkill"]
)
def test_a_run_that_fails_or_is_stopped_removes_its_buffers(fault, tmp_path, tiny_data, overrides, user_env):
    rc, out, _ = launch(tmp_path / "run", tiny_data, overrides, user_env, fault)
    assert rc != 0, out[-3000:]
    assert out.count("deepspeed_shm_comm_op built successfully") == 2
