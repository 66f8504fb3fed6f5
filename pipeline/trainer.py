"""The trainer: one loop for DeepSpeed, FSDP2 and plain PyTorch (``parallel.engine``).

``main(config_path, overrides)`` validates the config before anything starts, sets up the process group, and
runs ``Trainer.train()``: resume (``checkpoint.resume``), then ``train_step`` until ``train.max_steps`` with
periodic ``evaluate``, checkpoints, metrics, NaN/Inf stops and a collective save-and-exit on SIGTERM/SIGUSR1.

Failure handling (tests/reliability, docs/reliability.md): a config value that carries a secret is refused, and
the inputs are checked (`check_inputs`: dataset, tokenizer vocabulary, validation split, foreign checkpoint
directories) before anything starts; values from the environment never reach a log or a written file; resume
refuses corrupt checkpoints and changed data; every step runs under the hang watchdog, and a failed collective is
re-raised naming the step and the phase. SIGTERM/SIGUSR1 and a first Ctrl-C save at the next step boundary; a
failed evaluation saves the step before it stops the run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from data_prep import format as fmt
from data_prep.redaction import find_secret, is_secret_name, redact
from kernels.cpu_math import flush_denormals, retain_freed_memory
from model import build_model, read_export_config, save_pretrained
from model.io import ExportError, check_safetensors
from pipeline import dist, faults
from pipeline.checkpoint import OWNER_FILE, CheckpointManager, foreign_leftovers
from pipeline.config import ConfigError, TrainConfig, load_config, to_plain, to_yaml
from pipeline.data import (
    DataFingerprintError,
    EmptySplitError,
    MDSReader,
    PackedSequences,
    RankBatches,
    ShardCorruptError,
    UnsafeDatasetError,
    check_fingerprint,
    dataset_fingerprint,
    eos_id_of,
    is_remote,
    read_tokenizer,
)
from pipeline.logging import (
    MetricsLogger,
    flops_per_token,
    log_run_header,
    matmul_params,
    memory_gb,
    peak_flops,
    setup_logging,
)
from pipeline.needle import NeedleInserter
from pipeline.optim import lr_at, set_lr
from pipeline.parallel import build_engine

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.model"
EXIT_INTERRUPTED = 130
"""Exit code after a Ctrl-C (SIGINT): 128 + SIGINT, as a shell reports it; never the requeue code."""


class NonFiniteError(RuntimeError):
    """Loss or gradient norm became NaN/Inf; raised on every rank before the optimizer step (under DeepSpeed, whose
    step computes the gradient norm, right after it and before anything is saved)."""


class EvalError(RuntimeError):
    """The validation pass failed (on any rank); raised on every rank, after the step was saved."""


def check_no_secrets(cfg: TrainConfig) -> None:
    """Refuse a config that would carry a secret into logs, checkpoints and wandb (they all record the config).

    A value equal to or containing the value of a secret-named environment variable (``WANDB_API_KEY``,
    ``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ...; e.g. through ``${oc.env:WANDB_API_KEY}``) is refused, and so
    is any literal value under a key named like a secret, and any value shaped like a credential (an ``hf_...``
    or ``ghp_...`` token, an AWS key id, a password in a URL; ``data_prep.redaction``). Secrets are read from
    the environment by the libraries that need them, never through the config. The message names the key and
    the variable, never the value.

    Raises:
        ConfigError: naming the config key (and the environment variable).
    """
    from omegaconf import OmegaConf

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")
        elif isinstance(node, str) and node:
            if is_secret_name(path.rsplit(".", 1)[-1]):
                raise ConfigError(
                    f"config key '{path}' looks like a secret; secrets must come from the environment "
                    "(e.g. WANDB_API_KEY), never from the config, which is logged and checkpointed"
                )
            secret = find_secret(node)
            if secret is not None:
                raise ConfigError(
                    f"config key '{path}' holds {secret}; secrets must not enter the config (it is "
                    "logged, checkpointed and sent to wandb): pass credentials through the environment "
                    "variables the library in question reads, never through ${oc.env:...} or a literal"
                )

    walk(OmegaConf.to_container(OmegaConf.structured(cfg)), "")


def _check_tokenizer(cfg: TrainConfig) -> None:
    """The tokenizer next to data.path must fit ``model.vocab_size`` (else an IndexError deep in the embedding)."""
    path = Path(cfg.data.path) / TOKENIZER_FILE
    try:
        model = read_tokenizer(cfg.data.path)
    except UnsafeDatasetError as err:
        raise ConfigError(str(err)) from None
    if model is None:
        if cfg.data.needle_mix > 0:
            raise ConfigError(
                f"data.needle_mix={cfg.data.needle_mix} needs the tokenizer {path}, which does not "
                "exist; set data.needle_mix=0 or point data.path at a prepared dataset"
            )
        return  # a hand-written MDS dataset without one; the export says so
    import sentencepiece as spm

    try:
        pieces = spm.SentencePieceProcessor(model_proto=model).get_piece_size()
    except (RuntimeError, OSError) as err:
        raise ConfigError(
            f"{path} is not a readable SentencePiece model ({str(err).splitlines()[0]}); re-run data "
            "prep or point data.path at a prepared dataset"
        ) from None
    if pieces > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer {path} has {pieces} pieces but model.vocab_size={cfg.model.vocab_size}: "
            f"token ids would fall outside the embedding; set model.vocab_size={pieces} (or larger)"
        )


def _split_size(root: Path, split: str) -> int | None:
    """Size of a split: the manifest's token count when data prep wrote one, else the MDS index's sample count;
    None when the split has no index at all."""
    if (root / fmt.MANIFEST_FILENAME).is_file() or (root / fmt.COMPLETE_MARKER).is_file():
        try:
            stats = fmt.read_manifest(root).splits.get(split)
        except (fmt.IncompleteDatasetError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"data.path={root}: {str(err).splitlines()[0]}") from None
        if stats is not None:
            return stats.tokens
    index = root / split / "index.json"
    if not index.is_file():
        return None
    try:
        return sum(int(shard["samples"]) for shard in json.loads(index.read_text())["shards"])
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{index} is not a readable MDS index ({err}); re-run data prep") from None


def _check_val_split(cfg: TrainConfig) -> None:
    """``train.eval_every > 0`` needs a non-empty validation split (else the first eval crashes mid-run)."""
    if not cfg.train.eval_every:
        return
    root, split = Path(cfg.data.path), cfg.data.val_split
    found = _split_size(root, split)
    if not found:
        what = "has no" if found is None else "has an empty"
        raise ConfigError(
            f"train.eval_every={cfg.train.eval_every} but data.path={root} {what} validation split "
            f"'{split}' (data.val_split): set train.eval_every=0, or prepare the data with a larger "
            "val_fraction / more documents"
        )


def check_inputs(cfg: TrainConfig) -> None:
    """Everything about the inputs that can be checked before any work starts (no process group, no output).

    Raises:
        ConfigError: naming the key, file or value and the fix.
    """
    if not is_remote(cfg.data.path):  # a remote dataset is checked as its shards arrive
        if not Path(cfg.data.path).is_dir():
            raise ConfigError(
                f"data.path={cfg.data.path} is not a directory; run make prep (or launch/prep.py) "
                "and point data.path at its output"
            )
        _check_tokenizer(cfg)
        _check_val_split(cfg)
    foreign = foreign_leftovers(cfg.run_dir)
    if foreign:
        raise ConfigError(
            f"{foreign[0]} is not a committed checkpoint and was not written by this trainer (no "
            f"{OWNER_FILE}), so it is never deleted; move it out of {foreign[0].parent} and relaunch"
            + (f" ({len(foreign) - 1} more like it)" if len(foreign) > 1 else "")
        )


def init_weights_from(model: torch.nn.Module, export_dir: str) -> None:
    """Load the weights of an eval export into a freshly built model (``checkpoint.init_from``).

    Raises:
        ConfigError: the export holds another architecture, or tensors that do not fit this model (named).
    """
    from safetensors.torch import load_model

    weights = Path(export_dir) / "model.safetensors"
    try:
        exported, _ = read_export_config(export_dir)
        check_safetensors(weights)  # a pickle or damaged file is refused by its header, never loaded
    except (ExportError, FileNotFoundError) as exc:
        raise ConfigError(f"checkpoint.init_from: {exc}") from None
    if exported.arch != model.cfg.arch:
        raise ConfigError(
            f"checkpoint.init_from={export_dir!r} holds a model.arch={exported.arch!r} model; "
            f"this run builds model.arch={model.cfg.arch!r}"
        )
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except RuntimeError as exc:  # a tensor of another shape
        raise ConfigError(f"checkpoint.init_from: {weights} does not fit model.*: {exc}") from exc
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint.init_from: {weights} does not fit model.*: missing tensors "
            f"{sorted(missing)}, unexpected tensors {sorted(unexpected)}"
        )
    log.info("initial weights from %s", weights)


def use_bf16(cfg: TrainConfig, device: torch.device) -> bool:
    if cfg.precision.dtype == "auto":
        return device.type == "cuda"
    return cfg.precision.dtype == "bf16"


class Trainer:
    """Owns the engine (model + optimizer), the data stream, checkpoints and metrics of one run."""

    def __init__(self, cfg: TrainConfig, info: dist.DistInfo) -> None:
        self.cfg, self.info = cfg, info
        self.run_dir = Path(cfg.run_dir)
        self.accum = cfg.grad_accum(info.world_size)
        self.bf16 = use_bf16(cfg, info.device)
        dist.seed_all(cfg.seed)  # the same initial weights on every rank and every world size
        model = build_model(cfg.model).to(info.device)
        if cfg.checkpoint.init_from:
            init_weights_from(model, cfg.checkpoint.init_from)
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len, matmul_params(model))
        self.n_params = sum(p.numel() for p in model.parameters())
        self.engine = build_engine(model, cfg, info, self.bf16)
        dist.seed_all(cfg.seed + 1 + info.rank)  # per-rank stream for Gumbel top-k noise
        self.eos_id = eos_id_of(cfg.data.path)  # first: refuses an interrupted data-prep output
        self.tokenizer = read_tokenizer(cfg.data.path)  # once, read safely; the needles and every export use it
        cache = cfg.data.cache_dir or str(self.run_dir / "data_cache")
        reader = MDSReader(cfg.data.path, cfg.data.train_split, cache, cfg.data.validate_hash)
        stream = PackedSequences(
            reader, cfg.train.seq_len, cfg.seed, cfg.data.shuffle, cfg.data.shuffle_window, self.eos_id
        )
        needles = None
        if cfg.data.needle_mix > 0:
            needles = NeedleInserter(
                self.tokenizer or Path(cfg.data.path) / TOKENIZER_FILE, cfg.train.seq_len, cfg.model.chunk_size
            )
        self.batches = RankBatches(
            stream,
            cfg.train.global_batch,
            cfg.train.micro_batch,
            info.rank,
            info.world_size,
            needles,
            cfg.data.needle_mix,
            cfg.seed,
            cfg.data.needle_answer_weight,
        )
        self.data_fingerprint = dataset_fingerprint(reader, cfg.data.path)
        self._val_reader: MDSReader | None = None
        self.fault = faults.from_env()
        faults.install_inf_grad(self.fault, self.engine.module, info.rank, lambda: self.step + 1)
        self.ckpt = CheckpointManager(self.run_dir, cfg.checkpoint.keep_last, info, self.fault)
        self.step = 0
        self.tokens_seen = 0
        self._stop_signal: int | None = None
        self._phase = "setup"
        self.watchdog: dist.Watchdog | None = None
        self.metrics: MetricsLogger | None = None

    # -- one optimizer step -------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """Forward/backward over this rank's micro-batches, a collective finiteness check, then the update."""
        cfg, eng = self.cfg, self.engine
        lr = lr_at(self.step, cfg.train.max_steps, cfg.optim, cfg.schedule)
        set_lr(eng.param_groups, lr)
        t0 = time.perf_counter()
        faults.before_step(self.fault, self.step + 1, self.info.rank)
        eng.train(True)
        self._phase = "forward/backward (with the data-parallel gradient reduction)"
        micro = self.batches.next_step_weighted()
        losses = [
            eng.micro_step(
                x.to(self.info.device),
                self.accum,
                last=i == len(micro) - 1,
                weights=None if w is None else w.to(self.info.device),
            )
            for i, (x, w) in enumerate(micro)
        ]
        loss = torch.stack(losses).mean().float()
        if self.fault is not None and self.fault.hits("nan_loss", self.step + 1, self.info.rank):
            loss = loss * float("nan")
        self._phase = "gradient-norm reduction and clipping"
        grad_norm = eng.grad_norm_before_step(cfg.train.grad_clip)
        bad = not math.isfinite(loss.item()) or (grad_norm is not None and not math.isfinite(grad_norm))
        self._phase = "all-gather of the finiteness flags"
        flags = dist.all_gather_flags(bad, self.info.device)
        if any(flags):
            eng.discard_grads()
            ranks = [r for r, f in enumerate(flags) if f]
            raise NonFiniteError(
                f"non-finite loss or gradient norm at step {self.step + 1} on rank(s) {ranks} "
                f"(this rank: loss={loss.item()}, grad_norm={grad_norm}); stopped before the optimizer step, the "
                f"last checkpoint in {self.ckpt.root} is intact"
            )
        self._phase = "optimizer step"
        eng.optimizer_step()
        if grad_norm is None:
            # DeepSpeed computes (and clips by) the norm inside its step; an Inf/NaN is first visible here. ZeRO
            # 1-2 in fp32 skip such an update as an overflow, other modes may apply it; either way the run stops
            # before anything of this step is saved.
            grad_norm = eng.grad_norm_after_step()
            self._phase = "all-gather of the finiteness flags"
            flags = dist.all_gather_flags(grad_norm is not None and not math.isfinite(grad_norm), self.info.device)
            if any(flags):
                raise NonFiniteError(
                    f"non-finite gradient norm at step {self.step + 1} on rank(s) "
                    f"{[r for r, f in enumerate(flags) if f]} (loss={loss.item()}, grad_norm={grad_norm}), found by "
                    f"DeepSpeed inside its optimizer step; nothing of this step is saved, the last checkpoint in "
                    f"{self.ckpt.root} is intact"
                )
        self._phase = "loss all-reduce"
        global_loss = dist.all_reduce_mean(loss).item()
        dt = time.perf_counter() - t0
        tokens = cfg.tokens_per_step
        self.step += 1
        self.tokens_seen += tokens
        peak = peak_flops(cfg.logging.peak_tflops)
        tps = tokens / dt
        # Retrieval telemetry of this rank's last micro-batch (weight entropy, mean retrieved-chunk distance).
        telemetry = {k: float(v) for k, v in getattr(eng.module, "retrieval_stats", {}).items()}
        return {
            "loss": global_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tps,
            "step_time_s": dt,
            "mfu": self.flops_per_token * tps / (peak * self.info.world_size) if peak else None,
            "mem_gb": memory_gb(),
            "tokens": self.tokens_seen,
            **telemetry,
        }

    def _val_batches(self) -> tuple[list[torch.Tensor], Exception | None]:
        """This rank's validation micro-batches, or the error reading them; no collective inside, so a bad split
        on one rank cannot leave the others waiting in one."""
        cfg = self.cfg
        try:
            if self._val_reader is None:
                cache = cfg.data.cache_dir or str(self.run_dir / "data_cache")
                self._val_reader = MDSReader(cfg.data.path, cfg.data.val_split, cache, cfg.data.validate_hash)
            stream = PackedSequences(
                self._val_reader, cfg.train.seq_len, cfg.seed, False, cfg.train.global_batch, self.eos_id
            )
            batches = RankBatches(
                stream, cfg.train.global_batch, cfg.train.micro_batch, self.info.rank, self.info.world_size
            )
            return [x for _ in range(cfg.train.eval_batches) for x in batches.next_step()], None
        except Exception as err:  # whatever the reader raises (missing, corrupt, empty split): reported collectively
            return [], err

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``train.eval_batches`` global batches (the same sequences every time).

        Raises:
            EvalError: on every rank, when reading the validation split failed on any rank.
        """
        batches, error = self._val_batches()
        failed = dist.all_gather_flags(error is not None, self.info.device)
        if any(failed):
            ranks = [r for r, f in enumerate(failed) if f]
            cause = f": {type(error).__name__}: {(str(error).splitlines() or [''])[0]}" if error else ""
            raise EvalError(f"validation at step {self.step} failed on rank(s) {ranks}{cause}") from error
        with dist.isolated_rng():  # evaluation must not move the training RNG (Gumbel noise)
            self.engine.train(False)
            try:
                losses = [self.engine.loss(x.to(self.info.device)).float() for x in batches]
            finally:
                self.engine.train(True)
        return dist.all_reduce_mean(torch.stack(losses).mean()).item()

    def _evaluate_and_log(self) -> None:
        """``evaluate`` and record it; on failure the finished step is saved first, so nothing is lost."""
        try:
            val = self.evaluate()
        except EvalError as err:
            path = self._collective(f"checkpoint save of step {self.step}", self.save)
            raise EvalError(
                f"{err}; step {self.step} was saved first ({path}), so a relaunch resumes there: fix "
                f"the '{self.cfg.data.val_split}' split of data.path or set train.eval_every=0"
            ) from err
        log.info("step %d | val_loss=%.4f", self.step, val)
        if self.metrics is not None:
            self.metrics.event({"event": "eval", "step": self.step, "val_loss": val})

    # -- checkpoints and export ---------------------------------------------------------------------------
    def export(self, weights: dict[str, torch.Tensor], directory: Path) -> None:
        """Write an eval export (rank 0): safetensors weights, config.json and the tokenizer."""
        with dist.isolated_rng():  # the model's random init must not advance the training RNG
            model = build_model(self.cfg.model)
        model.load_state_dict(weights)
        save_pretrained(
            model, directory, extra={"step": self.step, "seq_len": self.cfg.train.seq_len, "tokenizer": TOKENIZER_FILE}
        )
        if self.tokenizer is not None:
            (directory / TOKENIZER_FILE).write_bytes(self.tokenizer)
        else:
            log.warning("no local %s next to data.path; the export in %s has no tokenizer", TOKENIZER_FILE, directory)

    def _parallel(self) -> dict[str, Any]:
        return {"engine": self.cfg.parallel.engine, "zero_stage": self.cfg.parallel.zero_stage}

    def save(self) -> Path:
        # The config text keeps ${oc.env:...} in place of values from the environment; every other field is a
        # number, a hash or a name from a fixed set, compared verbatim at resume.
        state = {
            "tokens_seen": self.tokens_seen,
            "data": self.batches.state_dict(),
            "model_config": self.cfg.model.to_dict(),
            "config_yaml": redact(to_yaml(self.cfg)),
            "parallel": self._parallel(),
            "data_fingerprint": self.data_fingerprint,
        }
        return self.ckpt.save(self.step, self.engine, state, self.export if self.cfg.checkpoint.export else None)

    def resume(self) -> bool:
        def same_data(path: Path, state: dict[str, Any]) -> None:
            check_fingerprint(state["data_fingerprint"], self.data_fingerprint, str(path))

        found = self.ckpt.restore(
            self.cfg.checkpoint.resume, self.engine, self.cfg.model.to_dict(), self._parallel(), check=same_data
        )
        if found is None:
            return False
        _, state = found
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.batches.load_state_dict(state["data"])
        return True

    # -- the loop -----------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: the save happens at the next step boundary, on all ranks, once. A repeated SIGTERM/SIGUSR1
        # (SLURM and launchers often send two) changes nothing; a Ctrl-C while a stop is pending means "now".
        if signum == signal.SIGINT and self._stop_signal is not None:
            raise KeyboardInterrupt
        if self._stop_signal is None:
            self._stop_signal = signum
            if signum == signal.SIGINT:
                log.warning(
                    "Ctrl-C: saving a checkpoint after step %d, then exiting with code %d; press Ctrl-C "
                    "again to stop at once without saving",
                    self.step + 1,
                    EXIT_INTERRUPTED,
                )

    def _stop_requested(self) -> int:
        """Collective: 0 = go on, else the exit code after the save (130 if any rank got a Ctrl-C, whose user
        asked to stop, else the requeue code)."""
        mine = 0.0 if self._stop_signal is None else 2.0 if self._stop_signal == signal.SIGINT else 1.0
        flag = torch.tensor([mine], device=self.info.device)
        worst = self._collective(f"step {self.step}: stop-flag all-reduce", lambda: dist.all_reduce_max(flag).item())
        return {0.0: 0, 1.0: self.cfg.train.requeue_exit_code}.get(worst, EXIT_INTERRUPTED)

    def _derived(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "world_size": self.info.world_size,
            "grad_accum": self.accum,
            "tokens_per_step": cfg.tokens_per_step,
            "total_tokens": cfg.tokens_per_step * cfg.train.max_steps,
            "params": self.n_params,
            "flops_per_token": self.flops_per_token,
            "bf16": self.bf16,
            "device": str(self.info.device),
        }

    def _write_resolved_config(self) -> None:
        """``<run_dir>/config.yaml``: the resolved config of the latest start (re-runnable with ``--config``)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / f"config.yaml.tmp-{os.getpid()}"
        tmp.write_text(redact(to_yaml(self.cfg)))
        os.replace(tmp, self.run_dir / "config.yaml")

    def train(self) -> int:
        """Run to ``train.max_steps``; returns the process exit code (``train.requeue_exit_code`` on a signal)."""
        cfg = self.cfg
        self.ckpt.remove_uncommitted()
        resumed = self.resume()
        if self.info.is_main:
            self._write_resolved_config()
            header = log_run_header(to_yaml(cfg), self._derived())
            self.metrics = MetricsLogger(self.run_dir, cfg, to_plain(cfg), header, self.step, resumed)
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
        self.watchdog = dist.Watchdog(dist.collective_timeout_s(), self.info.rank)
        try:
            while self.step < cfg.train.max_steps:
                metrics = self._guarded_step()
                if self.metrics is not None:
                    console = self.step % cfg.logging.every == 0 or self.step == cfg.train.max_steps
                    self.metrics.step(self.step, metrics, console)
                faults.after_step(self.fault, self.step, self.info.rank)
                if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                    self._evaluate_and_log()
                stop_code = self._stop_requested()
                periodic = cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0
                if periodic or stop_code or self.step == cfg.train.max_steps:
                    self._collective(f"checkpoint save of step {self.step}", self.save)
                if stop_code:
                    log.warning(
                        "stop signal received: saved step %d, exiting with code %d%s",
                        self.step,
                        stop_code,
                        "" if stop_code == EXIT_INTERRUPTED else " for a requeue",
                    )
                    return stop_code
            weights = self.engine.full_state_dict()
            if self.info.is_main:
                self.export(weights, self.run_dir / "export")
                log.info("done: %d steps, eval export in %s", self.step, self.run_dir / "export")
            dist.barrier()
            return 0
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            self.watchdog.close()
            if self.metrics is not None:
                self.metrics.close()

    def _collective_error(self, what: str, err: RuntimeError) -> dist.CollectiveError:
        return dist.CollectiveError(
            f"rank {self.info.rank}: {what} failed: a peer rank died or did not answer within "
            f"{dist.collective_timeout_s():.0f} s ({dist.TIMEOUT_ENV}): {str(err).splitlines()[0]}"
        )

    def _collective(self, what: str, fn: Any) -> Any:
        """Run ``fn``; a communication failure (peer gone, timeout) is re-raised naming ``what``."""
        try:
            return fn()
        except RuntimeError as err:
            if isinstance(err, dist.CollectiveError) or not dist.is_collective_failure(err):
                raise
            raise self._collective_error(what, err) from err

    def _guarded_step(self) -> dict[str, Any]:
        """``train_step`` under the hang watchdog; a failed collective is re-raised naming the step and phase."""
        step = self.step + 1
        assert self.watchdog is not None, "train() creates the watchdog"
        self.watchdog.arm(f"step {step}")
        try:
            return self.train_step()
        except torch.OutOfMemoryError:
            log.error(
                "rank %d: out of memory at step %d with train.micro_batch=%d; lower train.micro_batch (the "
                "accumulation steps grow to keep train.global_batch) or enable "
                "parallel.activation_checkpointing; nothing of this step was saved",
                self.info.rank,
                step,
                self.cfg.train.micro_batch,
            )
            raise
        except RuntimeError as err:
            if isinstance(err, NonFiniteError) or not dist.is_collective_failure(err):
                raise
            raise self._collective_error(f"step {step}, during {self._phase},", err) from err
        finally:
            self.watchdog.disarm()


DATASET_ERRORS = (UnsafeDatasetError, ShardCorruptError, EmptySplitError, DataFingerprintError)
"""What a reader raises for a dataset it refuses: one line to the user, never a traceback."""


def main(config_path: str | None, overrides: list[str]) -> int:
    """Entry point of ``launch/pretrain.py``; returns the exit code (2 for a configuration error)."""
    flush_denormals()  # first, before torch starts its thread pool (see kernels/cpu_math.py)
    setup_logging(dist.rank_from_env())
    try:
        cfg = load_config(config_path, overrides, dist.world_size_from_env())
        check_no_secrets(cfg)
        check_inputs(cfg)
    except ConfigError as err:
        log.error("configuration error: %s", err)
        return 2
    if cfg.train.retain_freed_memory:
        retain_freed_memory()  # steps reuse their buffers instead of page-faulting fresh mappings
    info = dist.init_distributed(cfg.parallel.engine)
    setup_logging(info.rank)
    try:
        try:
            trainer = Trainer(cfg, info)
        except ConfigError as err:  # found while building the run (e.g. checkpoint.init_from does not fit)
            log.error("configuration error: %s", err)
            return 2
        except (*DATASET_ERRORS, fmt.IncompleteDatasetError, FileNotFoundError) as err:
            log.error("data error (data.path=%s): %s", cfg.data.path, err)
            return 2
        return trainer.train()
    except DataFingerprintError as err:  # found on resume, before any step
        log.error("data error: %s", err)
        return 2
    except DATASET_ERRORS as err:  # a shard damaged or changed since the start, found when it is first read
        log.error(
            "data error at step %d (data.path=%s): %s; nothing of this step was saved, the last checkpoint is intact",
            trainer.step + 1,
            cfg.data.path,
            err,
        )
        return 1
    except EvalError as err:
        log.error("%s", err)
        return 1
    except KeyboardInterrupt:
        log.error(
            "stopped at once by Ctrl-C (a second one, or one before training began): nothing saved since the "
            "last committed checkpoint in %s (an interrupted save is removed at the next start)",
            Path(cfg.run_dir) / "checkpoints",
        )
        return EXIT_INTERRUPTED
    finally:
        dist.destroy()
