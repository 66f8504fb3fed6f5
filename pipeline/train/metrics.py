"""Run logging: rank-0 console logger, run header, device peak FLOP/s for MFU (the FLOPs per token are
``model.flops``'s), metrics.jsonl + wandb + progress bar."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import torch

from data_prep.redaction import install_log_redaction, redact_tree
from data_prep.safe_write import open_append, write_text
from pipeline.train.run_files import METRICS_FILE, WANDB_ID_FILE
from pipeline.train.save_failure import describe
from pipeline.train.wandb_online import asked_online, online_problem

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peak per device, TFLOP/s (vendor datasheets); used only when logging.peak_tflops is unset.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A10G": 125.0, "L40S": 362.0, "L4": 121.0}


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.ERROR


def setup_logging(rank: int, level: int = logging.INFO) -> None:
    """Console logging for this process: rank 0 logs everything, other ranks only errors.

    Every record, Python warnings and uncaught tracebacks included, passes ``data_prep.redaction``: values that
    came from the environment and known secret shapes never reach the console.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s [%(levelname)s] %(name)s: %(message)s", "%H:%M:%S"))
    handler.addFilter(_RankFilter(rank))
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_gca_pipeline", False):
            root.removeHandler(h)
    handler._gca_pipeline = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)  # library warnings (paths, URLs) go through the redacting handlers too
    install_log_redaction()


def git_sha() -> str:
    try:
        repo = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("triton", "deepspeed", "mosaicml-streaming", "omegaconf", "wandb", "sentencepiece", "numpy"):
        try:
            found[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            found[pkg] = "not installed"
    if torch.cuda.is_available():
        found["cuda"] = str(torch.version.cuda)
        found["device"] = torch.cuda.get_device_name()
    return found


def processor() -> str:
    """The CPU a figure measured in this process ran on, as reports and docs name it: ``<cores>-core <model name>``
    (the cores this process may use; the model name of ``/proc/cpuinfo``, else ``platform.processor()``). A CPU
    figure without it cannot be compared with another machine's (a virtual machine's model name may be generic,
    ``AMD EPYC``: it is what the guest sees)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return f"{cores}-core {_cpu_model()}"


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or "unknown processor"


WandbMode = Literal["online", "offline", "disabled"]
_WANDB_ENV_MODES: dict[str, WandbMode] = {
    "online": "online",
    "run": "online",
    "offline": "offline",
    "dryrun": "offline",
    "disabled": "disabled",
}
"""The ``WANDB_MODE`` values wandb itself accepts, as the modes ``wandb.init(mode=...)`` takes."""


def resolve_wandb_mode(setting: str, environ: Mapping[str, str]) -> WandbMode:
    """The mode passed to ``wandb.init``: ``logging.wandb_mode`` unless it is ``auto``; then ``WANDB_MODE`` when set
    (the variable wandb users already know, and the one ``pretrain.sbatch`` defaults to offline), else online only
    when ``WANDB_API_KEY`` is set. ``wandb.init(mode=...)`` outranks the variable inside wandb, so it is read here."""
    if setting != "auto":
        return _WANDB_ENV_MODES[setting]  # the config allows only auto and wandb's own three modes
    env_mode = environ.get("WANDB_MODE", "").strip().lower()
    if env_mode:
        if env_mode not in _WANDB_ENV_MODES:
            raise ValueError(f"WANDB_MODE={env_mode!r} is not a wandb mode; use one of {sorted(_WANDB_ENV_MODES)}")
        return _WANDB_ENV_MODES[env_mode]
    return "online" if environ.get("WANDB_API_KEY") else "offline"


def log_run_header(config_yaml: str, derived: dict[str, Any]) -> dict[str, Any]:
    """Log everything needed to reproduce the run; return it (also stored in metrics.jsonl's first line)."""
    sha, found = git_sha(), versions()
    header = {"git_sha": sha, "versions": found, "derived": derived}
    log.info("resolved config:\n%s", config_yaml)
    log.info("git %s | %s", sha, " ".join(f"{k}={v}" for k, v in found.items()))
    log.info("derived: %s", ", ".join(f"{k}={v}" for k, v in derived.items()))
    if torch.cuda.is_available():
        try:
            smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
            log.info("nvidia-smi:\n%s", smi)
        except (OSError, subprocess.SubprocessError):
            log.info("nvidia-smi unavailable")
    return header


def peak_flops(configured_tflops: float | None) -> float | None:
    if configured_tflops is not None:
        return configured_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, tflops in _PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30


class MetricsWriteError(Exception):
    """``metrics.jsonl`` (or the wandb run id beside it) could not be written: a full disk, a quota, ...; the
    message is one line naming the file, the cause and what to do (``save_failure.describe``'s words)."""


def write_failed(err: OSError, path: Path) -> MetricsWriteError:
    """The one-line report of ``err``, met writing ``path`` (an error of a write names no file)."""
    named = OSError(err.errno, err.strerror, str(path))
    return MetricsWriteError(describe(named, path.parent) or f"cannot write {path}: {err}")


CONSOLE_HIDDEN = ("tokens/", "share/")
"""Key prefixes of a step's metrics left out of the console line (metrics.jsonl and wandb keep them): a mixture's
per-source token counts and shares, two keys per source that the startup table and the weights already say; the
per-source ``loss/<label>`` and ``epoch/<label>`` stay on the line."""


class MetricsLogger:
    """Rank-0 sink for per-step metrics: ``<run_dir>/metrics.jsonl`` (always), console, wandb, progress bar.

    wandb runs offline unless ``logging.wandb_mode=online`` or (``auto``) ``WANDB_API_KEY`` is set, and ``auto``
    falls back to offline when the server does not answer (``pipeline.train.wandb_online``), so a run never waits
    on the network for more than a few seconds. Only the resolved training config and metrics are sent; the
    environment (which holds keys and tokens) never is, and values that came from the environment stay
    ``${oc.env:...}``.
    """

    def __init__(
        self,
        run_dir: Path,
        cfg: Any,
        config_dict: dict[str, Any],
        header: dict[str, Any],
        start_step: int,
        resumed: bool,
    ) -> None:
        self.cfg, self.path = cfg, run_dir / METRICS_FILE
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.file = open_append(self.path)
        except OSError as err:
            raise write_failed(err, self.path) from None
        self._write({"event": "start", "start_step": start_step, **header})
        self.wandb: Any = None
        if cfg.logging.wandb:
            self.wandb = self._init_wandb(run_dir, config_dict, header, resumed)
        self.bar: Any = None
        if cfg.logging.progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=cfg.train.max_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr
            )
        self.t_last = time.perf_counter()

    def _init_wandb(self, run_dir: Path, config_dict: dict[str, Any], header: dict[str, Any], resumed: bool) -> Any:
        import wandb

        mode = resolve_wandb_mode(self.cfg.logging.wandb_mode, os.environ)
        if mode == "online" and asked_online(self.cfg.logging.wandb_mode, os.environ) is None:
            # auto chose online only because WANDB_API_KEY is set (online asked for was checked before any work,
            # in pipeline.train.inputs): a server that does not answer means offline logging, not a ~90 s hang.
            problem = online_problem(os.environ)
            if problem is not None:
                log.warning(
                    "wandb: logging.wandb_mode=auto went online because WANDB_API_KEY is set, but %s; logging "
                    "offline into %s instead (upload it later with `wandb sync`)",
                    problem,
                    run_dir / "wandb",
                )
                mode = "offline"
        run_id_file = run_dir / WANDB_ID_FILE
        run_id = run_id_file.read_text().strip() if resumed and run_id_file.is_file() else uuid.uuid4().hex[:8]
        try:
            write_text(run_id_file, run_id)
        except OSError as err:
            raise write_failed(err, run_id_file) from None
        log.info("wandb: mode=%s project=%s id=%s", mode, self.cfg.logging.wandb_project, run_id)
        return wandb.init(
            project=self.cfg.logging.wandb_project,
            dir=str(run_dir),
            mode=mode,
            id=run_id,
            resume="allow",
            config={**config_dict, "git_sha": header["git_sha"], "versions": header["versions"], **header["derived"]},
        )

    def _write(self, record: dict[str, Any]) -> None:
        try:
            self.file.write(json.dumps(redact_tree(record)) + "\n")
            self.file.flush()
        except OSError as err:
            with contextlib.suppress(OSError):  # closing flushes the line that did not fit again, to fail again
                self.file.close()
            raise write_failed(err, self.path) from None

    def step(self, step: int, metrics: dict[str, Any], console: bool) -> None:
        self._write({"step": step, **metrics})
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if v is not None}, step=step)
        if self.bar is not None:  # the postfix first: update() draws the bar, with this step's loss
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
            self.bar.update(step - self.bar.n)
        if console:
            shown = " ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in metrics.items()
                if v is not None and not k.startswith(CONSOLE_HIDDEN)
            )
            log.info("step %d | %s", step, shown)

    def event(self, record: dict[str, Any]) -> None:
        """Write ``record`` (``event``, ``step``, values); wandb gets its numbers as ``<event>/<key>``, or under
        their own name when the key already names its section (``retrieval/far_recall``)."""
        self._write(record)
        if self.wandb is not None and "step" in record:
            self.wandb.log(
                {
                    k if "/" in k else f"{record['event']}/{k}": v
                    for k, v in record.items()
                    if isinstance(v, (int, float)) and k != "step"
                },
                step=record["step"],
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.file.close()
