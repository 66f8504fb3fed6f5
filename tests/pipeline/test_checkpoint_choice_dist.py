"""With ``checkpoint.resume=auto`` every rank resumes from the checkpoint rank 0 chose, even when another node's
view of the shared run directory lags behind (a checkpoint committed just before a requeue, not yet visible there
through the file system's attribute cache): two gloo processes, the second one blind to the newest checkpoint."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from pipeline.train import checkpoint, dist

pytestmark = pytest.mark.dist


def _rank(rank: int, port: int, run_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    info = dist.init_distributed("none", timeout_s=60)
    if rank == 1:  # this node's cached view predates the newest commit
        newest = Path(run_dir) / "checkpoints/step_00000008"
        seen = checkpoint._is_committed
        checkpoint._is_committed = lambda p: Path(p) != newest and seen(p)
    manager = checkpoint.CheckpointManager(run_dir, keep_last=3, info=info)
    own_view = [p.name for p in manager.committed()]
    chosen = [p.name for p in manager.candidates("auto")]
    Path(out, f"rank{rank}").write_text(f"{','.join(own_view)};{','.join(chosen)}")
    dist.destroy()


def test_every_rank_resumes_from_rank_0s_choice(tmp_path):
    for step in (4, 8):
        path = tmp_path / "run/checkpoints" / f"step_{step:08d}"
        path.mkdir(parents=True)
        (path / checkpoint.COMMIT_MARKER).write_text("")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, (port, str(tmp_path / "run"), str(tmp_path)), nprocs=2, start_method="spawn")
    views = {r: (tmp_path / f"rank{r}").read_text().split(";") for r in (0, 1)}
    assert views[1][0] == "step_00000004", "rank 1 really lists an older directory state"
    assert views[0] == ["step_00000004,step_00000008", "step_00000008,step_00000004"]
    assert views[1][1] == views[0][1], "rank 1 takes rank 0's choice"
