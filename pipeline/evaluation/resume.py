"""Finished passkey samples kept on disk as they finish, so that a killed long run continues from them.

``<out>/passkey.samples.jsonl`` holds a header line with the settings every sample's outcome depends on, then one
line per finished sample, appended and flushed to disk as the sample finishes. A rerun into the same ``--out`` reads
the file back and skips the samples it holds; one with other settings is refused naming the key that differs
(eval key ``restart=true`` discards the file and starts over), so results of different settings never mix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from data_prep.redaction import redact_tree
from data_prep.safe_write import open_append
from data_prep.schema import ConfigError

if TYPE_CHECKING:
    from pipeline.evaluation.config import EvalConfig

log = logging.getLogger(__name__)

SAMPLES_FILE = "passkey.samples.jsonl"
SETTING_KEYS = (
    "data",
    "seed",
    "segment",
    "device",
    "attn_backend",
    "variant",
    "needle",
    "question",
    "answer",
    "link",
    "needles",
    "values",
    "queries",
    "hops",
    "chains",
    "key_digits",
    "value_kind",
)
"""Eval keys a sample's outcome depends on (its text, its numerics). Not among them: ``lengths``, ``depths`` and
``samples`` choose which samples run, and each line names its own (length, depth index, depth, sample), so a rerun
with more of them reuses the ones that match; ``offload_mb`` and ``offload_dir`` give exactly the logits of the
in-RAM store (tests/evaluation/test_offload.py); ``progress`` and ``restart`` change nothing computed."""

SampleKey = tuple[int, int, float, int]
"""``(length, depth index, depth, sample)``: the sample's seed is ``[seed, length, depth index, sample]``."""


def export_digest(checkpoint: str | Path) -> str:
    """SHA-256 over the export's ``config.json`` and ``model.safetensors``: the model a sample was scored with (a
    re-export to the same path is a different model)."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        with open(Path(checkpoint) / name, "rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()


def sample_settings(cfg: EvalConfig, checkpoint: str | Path, keys: Sequence[str] = SETTING_KEYS) -> dict:
    """The header of the samples file: the export (path and digest) and the ``keys`` of ``cfg`` (the ones a
    sample's outcome depends on; passkey's: ``SETTING_KEYS``), redacted like the result JSON (a file in ``--out``
    holds no secret a value carried)."""
    values = asdict(cfg)
    settings = {
        "checkpoint": str(Path(checkpoint).resolve()),
        "export_sha256": export_digest(checkpoint),
        **{key: values[key] for key in keys},
    }
    return redact_tree(settings)


class SampleLog:
    """The finished samples of a passkey run in ``path``, appended to as samples finish.

    ``key``: which sample a record is (default: passkey's ``SampleKey``, from its ``length``, ``depth_index``,
    ``depth`` and ``sample``).

    Raises:
        ConfigError: ``path`` holds samples of other settings (the message names the first key that differs and
            both values) and ``restart`` is false.
    """

    def __init__(
        self, path: Path, settings: dict, restart: bool = False, key: Callable[[dict], Hashable] | None = None
    ) -> None:
        self.path = path
        self._key = key or _key
        self.done: dict[Hashable, dict] = {}
        if path.exists() and restart:
            log.info("restart=true: discarding the finished samples in %s", path)
            path.unlink()
        if path.exists():
            self._read(settings)
        else:
            self._append({"settings": settings})

    def _read(self, settings: dict) -> None:
        text = self.path.read_text()
        # Every line is written with its newline in one write: a last line without one was cut by a kill, and
        # its sample reruns. Cutting it here lets the next append start a line of its own.
        complete = text[: text.rfind("\n") + 1]
        if len(complete) < len(text):
            with open_append(self.path, binary=True) as f:
                os.ftruncate(f.fileno(), len(complete.encode()))
        lines = complete.splitlines()
        if not lines:
            self._append({"settings": settings})
            return
        try:
            header = json.loads(lines[0])["settings"]
        except (json.JSONDecodeError, KeyError, TypeError):
            header = None
        if not isinstance(header, dict):
            raise ConfigError(
                f"{self.path} is not a passkey samples file (its first line holds no settings); move it away, or "
                "pass restart=true to replace it"
            )
        for key in sorted(set(header) | set(settings)):
            if header.get(key) != settings.get(key):
                raise ConfigError(
                    f"{self.path} holds samples finished with {key}={header.get(key)!r}, but this run has "
                    f"{key}={settings.get(key)!r}; rerun with the same settings to resume, choose another --out, or "
                    "pass restart=true to discard them"
                )
        for i, line in enumerate(lines[1:], start=2):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(
                    f"{self.path}:{i} is not a JSON line; the file is damaged: move it away, or pass restart=true"
                ) from None
            self.done[self._key(record)] = record

    def get(self, key: Hashable) -> dict | None:
        """The finished sample ``key``, or ``None`` if it still has to run."""
        return self.done.get(key)

    def add(self, record: dict) -> None:
        """Keep a finished sample (``length``, ``depth_index``, ``depth``, ``sample`` and its outcome) on disk."""
        self._append(record)
        self.done[self._key(record)] = record

    def kept(self) -> int:
        """How many finished samples the file holds now, which a rerun skips: its complete lines but the header (an
        interrupt may have come between writing a sample's line and adding it to ``done``)."""
        return max(self.path.read_bytes().count(b"\n") - 1, 0)

    def _append(self, record: dict) -> None:
        """One line, written and synced before the next sample starts: a kill loses at most the running sample."""
        with open_append(self.path, binary=True) as f:
            f.write((json.dumps(record) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())


def _key(record: dict) -> SampleKey:
    return (record["length"], record["depth_index"], record["depth"], record["sample"])
