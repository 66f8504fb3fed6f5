"""DeepSpeed's process group on CPU: where its JIT-built comm op lives, and the shared memory its ranks leave.

**The op's build lives with the venv.** ``deepspeed.init_distributed`` loads the shared-memory allreduce op
(``ShareMemCommBuilder``), which torch JIT-compiles (~60 s) into ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``: one directory for every checkout of the user. The build is keyed to the absolute
paths of the sources and includes, which lie inside the venv, so two clones evict each other's build and every
launch after the other clone's rebuilds (70 s to the first step instead of 11 s). `use_venv_extensions` points the
variable at ``<venv>/torch_extensions`` unless the user set it, and has the venv's ninja do the build (a system
ninja of another version rebuilt it as well); torch reads both when it builds or loads an op. `pipeline.train.dist`
calls it before it imports DeepSpeed, so it holds in every rank whatever launched it (python, torchrun, the
deepspeed launcher), and ``make ds-warmup`` (`build_shm_op`) builds into the same place.

**Each rank removes its own buffer.** When all ranks are on one node (``LOCAL_SIZE`` = world size), each rank creates
the ``/dev/shm`` file `own_shm_buffer` names, 66 MB, maps every other rank's, and never unlinks its own
(``shm_initialize`` in DeepSpeed's ``csrc/cpu/comm/shm.cpp``). `releasing_shm_buffer` unlinks it as soon as every
rank has mapped every buffer: the mappings stay valid, the kernel frees the memory when the last rank ends, and
nothing is left whichever way the job ends afterwards (normal exit, error, Ctrl-C, SIGTERM, kill -9). Only a rank
killed in the moment between creating its buffer and the barrier after it leaves its file; ``make clean-shm`` and
``launch/preflight.py`` remove such files when no process maps them (`pipeline.train.preflight.clean_stale_shm`).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"
SHM_DIR = Path("/dev/shm")
SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer"
"""``SHM_BUFFER_NAME`` of DeepSpeed's shm.cpp."""


def extensions_dir() -> Path | None:
    """Where torch builds and finds DeepSpeed's JIT ops for this interpreter: the user's ``TORCH_EXTENSIONS_DIR``,
    else ``<venv>/torch_extensions`` inside a venv, else ``None`` (torch's default, outside any venv)."""
    if EXTENSIONS_ENV in os.environ:
        return Path(os.environ[EXTENSIONS_ENV])
    if sys.prefix == sys.base_prefix:
        return None
    return Path(sys.prefix) / "torch_extensions"


def use_venv_extensions() -> None:
    """Set ``TORCH_EXTENSIONS_DIR`` to `extensions_dir` (a value the user set is kept), and put the venv's ``bin``
    first on ``PATH`` when it holds ``ninja``: torch builds with the first ``ninja`` on ``PATH``, and two ninja
    versions (the venv's 1.13, a system 1.11) hash the build commands differently, so a launch from an activated
    shell and one from ``make`` or ``.venv/bin/deepspeed`` each took the other's build for stale and rebuilt it."""
    where = extensions_dir()
    if where is not None:
        os.environ[EXTENSIONS_ENV] = str(where)
    venv_bin = Path(sys.prefix) / "bin"
    ninja = venv_bin / "ninja"
    if sys.prefix != sys.base_prefix and ninja.is_file() and shutil.which("ninja") != str(ninja):
        os.environ["PATH"] = os.pathsep.join(filter(None, [str(venv_bin), os.environ.get("PATH")]))


def build_shm_op() -> None:
    """Build (or find) DeepSpeed's CPU shared-memory comm op where the training ranks look for it."""
    use_venv_extensions()
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    ShareMemCommBuilder().load()


def own_shm_buffer(environ: Mapping[str, str], rank: int, world: int, shm_dir: Path = SHM_DIR) -> Path | None:
    """The file DeepSpeed's CPU allreduce creates for ``rank`` under the launcher variables ``environ``:
    ``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``, or ``None`` when it creates none
    (its condition: ``LOCAL_SIZE`` equals the world size, all ranks on this node)."""
    local = environ.get("LOCAL_SIZE", "")
    if not local.isdigit() or int(local) != world:
        return None
    addr, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    return shm_dir / f"{SHM_BUFFER_PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"


def mapped_by_this_process(path: Path, maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether this process maps ``path`` (and it has not been unlinked since): the proof that the buffer of that
    name is this job's, not a stale or foreign file that happens to carry the name."""
    suffix = f" {path}"
    return any(line.endswith(suffix) for line in maps.read_text().splitlines())


@contextmanager
def releasing_shm_buffer(rank: int, world: int, barrier: Callable[[], None]) -> Iterator[None]:
    """Around ``deepspeed.init_distributed``: after it, wait at ``barrier`` until every rank has mapped every
    buffer (a rank maps its peers' before it returns), then unlink this rank's own. On an error or an interrupt
    the buffer is unlinked too, if this process created it; a peer still waiting for it is ended by its launcher
    with the failing rank."""
    own = own_shm_buffer(os.environ, rank, world)
    try:
        yield
        if own is not None:  # ranks on several nodes make no buffer: nothing to wait for
            barrier()
    finally:
        if own is not None and mapped_by_this_process(own):
            own.unlink(missing_ok=True)
