"""DeepSpeed on CPU, fast checks: the /dev/shm buffer name is the one DeepSpeed's own C++ source builds, a rank
unlinks exactly its own buffer (on success and on error) and never another job's, and the JIT op directory is the
venv's. The 2-rank runs are in test_deepspeed_cpu_dist.py."""

from __future__ import annotations

import importlib.util
import mmap
import os
import re
import shutil
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
from helpers import free_port
from torch.utils import cpp_extension

from pipeline.train import deepspeed_cpu


def _deepspeed_source(name: str) -> str:
    """A file of DeepSpeed's CPU comm op as installed (read, not imported: importing deepspeed takes seconds)."""
    spec = importlib.util.find_spec("deepspeed")
    assert spec is not None and spec.submodule_search_locations
    return (Path(spec.submodule_search_locations[0]) / "ops/csrc/cpu/comm" / name).read_text()


def _deepspeed_buffer_name(uid: int, addr: str, port: str, rank: int) -> str:
    """The name shm.cpp's ``shm_initialize`` gives a rank's buffer, with the format strings taken from the source."""
    src = _deepspeed_source("shm.cpp")
    base = re.search(r'#define SHM_BUFFER_NAME "([^"]+)"', src)
    prefix = re.search(
        r'snprintf\(shm_name_prefix,\s*NAME_BUF_SIZE,\s*"([^"]+)",\s*SHM_BUFFER_NAME,\s*getuid\(\),\s*addr_string,'
        r"\s*port_string\);",
        src,
    )
    own = re.search(r'snprintf\(shm_name, NAME_BUF_SIZE, "([^"]+)", shm_name_prefix, rank\);', src)
    assert base and prefix and own, "DeepSpeed's shm.cpp names its buffers another way now"
    return own.group(1) % (prefix.group(1) % (base.group(1), uid, addr, port), rank)


def test_the_buffer_name_is_the_one_deepspeed_builds():
    interface = _deepspeed_source("shm_interface.cpp")
    # DeepSpeed creates a buffer only when every rank is on this node, and takes the address and port from the env.
    for read in ('getenv("LOCAL_SIZE")', 'getenv("MASTER_ADDR")', 'getenv("MASTER_PORT")', "size == ls"):
        assert read in interface
    env = {"LOCAL_SIZE": "2", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29517"}
    for rank in (0, 1):
        path = deepspeed_cpu.own_shm_buffer(env, rank, 2)
        assert path == Path("/dev/shm") / _deepspeed_buffer_name(os.getuid(), "10.0.0.7", "29517", rank)
    assert deepspeed_cpu.own_shm_buffer({**env, "LOCAL_SIZE": "1"}, 0, 2) is None  # ranks on two nodes: no shm
    assert deepspeed_cpu.own_shm_buffer({k: v for k, v in env.items() if k != "LOCAL_SIZE"}, 0, 2) is None


def _create_like_deepspeed(path: Path, keep: list[mmap.mmap]) -> None:
    """What shm.cpp's ``shared_create`` + ``shared_open`` do: create the file and map it shared."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.write(fd, b"\0" * mmap.PAGESIZE)
        keep.append(mmap.mmap(fd, mmap.PAGESIZE))
    finally:
        os.close(fd)


@pytest.fixture
def job_env(monkeypatch):
    """This job's launcher variables on a port no other job uses, and its rank 0 buffer's path; afterwards every
    /dev/shm file named for that port (or the next, "another job's") is gone."""
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("LOCAL_SIZE", "2")
    yield port
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
        path.unlink()
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port + 1}_*"):
        path.unlink()


def _name(port: int, rank: int) -> Path:
    return Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{rank}")


@pytest.mark.parametrize("fails", [False, True])
def test_a_rank_unlinks_its_own_buffer_and_nothing_else(job_env, fails):
    port = job_env
    own, peer, other_job = _name(port, 0), _name(port, 1), _name(port + 1, 0)
    maps: list[mmap.mmap] = []
    _create_like_deepspeed(other_job, maps)  # another job's, mapped by it and named like ours but for its port
    barriers = []
    with pytest.raises(RuntimeError) if fails else nullcontext():
        with deepspeed_cpu.releasing_shm_buffer(0, 2, lambda: barriers.append(own.exists())):
            _create_like_deepspeed(own, maps)  # init_distributed: this rank's buffer, then its peer's mapped
            _create_like_deepspeed(peer, maps)
            if fails:
                raise RuntimeError("the rendezvous failed after the buffer was made")
    assert not own.exists()
    assert barriers == ([] if fails else [True])  # on success, unlinked only after every rank met
    assert peer.exists() and other_job.exists()  # the peer unlinks its own; another job's is never touched
    assert maps[1][:4] == b"\0" * 4  # the mapping outlives the name


def test_a_buffer_this_process_did_not_create_is_left_alone(job_env):
    """A file with this rank's name that this process never mapped (a crashed run's, or a live job's on the same
    address and port): the rendezvous failed before DeepSpeed made the buffer, so it is not this job's."""
    own = _name(job_env, 0)
    own.write_bytes(b"x")
    with pytest.raises(RuntimeError), deepspeed_cpu.releasing_shm_buffer(0, 2, lambda: None):
        raise RuntimeError("address in use")
    assert own.exists()


def test_the_extension_dir_is_the_venvs_unless_the_user_chose_one(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    venv = Path(sys.executable).parents[1]  # the tests run in the project's venv: <venv>/bin/python
    assert (venv / "pyvenv.cfg").is_file()
    deepspeed_cpu.use_venv_extensions()
    assert Path(os.environ["TORCH_EXTENSIONS_DIR"]).resolve() == (venv / "torch_extensions").resolve()
    # torch's own resolution, the one DeepSpeed's JIT build and load go through
    built = Path(cpp_extension._get_build_directory("deepspeed_shm_comm", verbose=False))
    assert built.resolve() == (venv / "torch_extensions" / "deepspeed_shm_comm").resolve()

    # built by the venv's ninja even from a shell without the venv on PATH (as make runs): another ninja version
    # would take its build for stale
    assert shutil.which("ninja") == str(venv / "bin" / "ninja")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    deepspeed_cpu.use_venv_extensions()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "mine")

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(sys, "prefix", sys.base_prefix)  # outside any venv: torch's default stays
    deepspeed_cpu.use_venv_extensions()
    assert "TORCH_EXTENSIONS_DIR" not in os.environ
