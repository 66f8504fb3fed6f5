"""Checkpoints: ``<run_dir>/checkpoints/step_NNNNNNNN/``, committed by a marker written last.

A save goes into ``step_N.tmp/`` (engine-native state, per-rank RNG, trainer state, optional eval export),
then rank 0 renames it to ``step_N/`` after a barrier and writes ``COMMITTED`` inside. Only directories with
that marker are ever resumed from, so a crash at any point of a save leaves the previous checkpoint in charge.
After a commit the oldest committed checkpoints beyond ``checkpoint.keep_last`` are deleted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline import dist

log = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
TRAINER_STATE = "trainer_state.json"
STATE_FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used for this run (missing marker, different architecture, ...)."""


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[1])


class CheckpointManager:
    """Find, save, load and prune the checkpoints of one run directory."""

    def __init__(self, run_dir: str | Path, keep_last: int, info: dist.DistInfo) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last, self.info = keep_last, info

    def committed(self) -> list[Path]:
        """Committed checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
                 and (p / COMMIT_MARKER).is_file()]
        return sorted(found, key=_step_of)

    def resolve_resume(self, resume: str) -> Path | None:
        """The checkpoint to resume from: ``auto`` = latest committed (or none), ``none``, or a path."""
        if resume == "none":
            return None
        if resume == "auto":
            done = self.committed()
            return done[-1] if done else None
        path = Path(resume)
        if not (path / COMMIT_MARKER).is_file():
            raise CheckpointError(f"checkpoint.resume={resume}: no {COMMIT_MARKER} marker; the save never finished")
        return path

    def remove_uncommitted(self) -> None:
        """Delete leftovers of interrupted saves (rank 0, at start, before any new save can be in progress)."""
        if self.info.is_main and self.root.is_dir():
            for p in self.root.glob("step_*"):
                if p.is_dir() and not (p / COMMIT_MARKER).is_file():
                    log.warning("removing uncommitted checkpoint directory %s (an interrupted save)", p)
                    shutil.rmtree(p, ignore_errors=True)
        dist.barrier()

    def save(self, step: int, engine: Any, trainer_state: dict[str, Any],
             export: Callable[[dict[str, torch.Tensor], Path], None] | None) -> Path:
        """Save everything needed for an exact resume (collective: every rank must call it)."""
        t0 = time.perf_counter()
        final = self.root / f"step_{step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        engine.save(tmp)
        torch.save(_rng_state(), tmp / f"rng_rank{self.info.rank}.pt")
        if export is not None:
            weights = engine.full_state_dict()
            if self.info.is_main:
                export(weights, tmp / "export")
        if self.info.is_main:
            state = {"format": STATE_FORMAT, "step": step, "world_size": self.info.world_size, **trainer_state}
            (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1, sort_keys=True))
        dist.barrier()
        if self.info.is_main:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            marker = final / COMMIT_MARKER
            with open(marker, "w") as f:
                f.write(json.dumps({"step": step, "time": time.time()}))
                f.flush()
                os.fsync(f.fileno())
            self._prune()
        dist.barrier()
        log.info("checkpoint step %d committed at %s (%.1f s)", step, final, time.perf_counter() - t0)
        return final

    def _prune(self) -> None:
        for old in self.committed()[: -self.keep_last]:
            try:
                # The marker goes first, so a half-deleted directory is never mistaken for a checkpoint.
                (old / COMMIT_MARKER).unlink()
                shutil.rmtree(old)
                log.info("deleted old checkpoint %s (checkpoint.keep_last=%d)", old, self.keep_last)
            except OSError as err:
                log.warning("could not delete old checkpoint %s: %s; training continues", old, err)

    def load(self, path: Path, engine: Any, model_config: dict[str, Any]) -> dict[str, Any]:
        """Restore engine state and this rank's RNG; return the trainer state (step, data cursor, ...)."""
        state = json.loads((path / TRAINER_STATE).read_text())
        if state.get("format") != STATE_FORMAT:
            raise CheckpointError(f"{path}: trainer state format {state.get('format')} is not {STATE_FORMAT}")
        saved = state.get("model_config", {})
        diff = sorted(k for k in set(saved) | set(model_config) if saved.get(k) != model_config.get(k))
        if diff:
            details = ", ".join(f"model.{k}: checkpoint {saved.get(k)!r} vs config {model_config.get(k)!r}"
                                for k in diff)
            raise CheckpointError(f"{path} was trained with a different architecture: {details}")
        engine.load(path)
        rng_file = path / f"rng_rank{self.info.rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        else:
            log.warning("%s has no RNG state for rank %d (world size changed from %s); RNG streams restart",
                        path, self.info.rank, state.get("world_size"))
        log.info("resumed from %s at step %d", path, state["step"])
        return state
