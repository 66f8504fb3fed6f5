"""The trainer: one step loop for DeepSpeed, FSDP2 and plain PyTorch (``parallel.engine``), extended by callbacks.

``main(config_path, overrides)`` validates the config and the inputs before anything starts
(``pipeline.train.inputs``), sets up the process group, and runs ``Trainer.train()``: resume
(``checkpoint.restore``), then ``train_step`` until ``train.max_steps``, then the eval export. Everything around
the step is a callback (``pipeline.train.callbacks``), in this order: the hang watchdog, the compile budget,
retrieval telemetry, the extrapolation monitor (only when ``eval.extrapolation_every > 0``), metrics and logging,
fault injection (only when ``PIPE_FAULT`` plans a fault), periodic evaluation, the signal stop and the checkpoint
cadence.

Failure handling (tests/reliability, docs/reliability.md): values from the environment never reach a log or a
written file; resume refuses corrupt checkpoints, changed data and config changes it cannot continue under
(``pipeline.train.resume_check``, which logs every changed key); a non-finite loss or gradient norm stops every
rank before the optimizer step; a failed collective is re-raised naming the step and the phase; SIGTERM/SIGUSR1
and a first Ctrl-C save at the next step boundary; a failed evaluation saves the step before it stops the run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_prep import format as fmt
from data_prep.safe_write import UnsafeWriteError
from kernels.cpu_math import flush_denormals, retain_freed_memory
from model import build_model, count_parameters
from model.flops import flops_per_token, matmul_params
from pipeline.data.mixture import MixtureResumeError, MixtureStream
from pipeline.data.order import epochs_needed
from pipeline.data.reader import (
    DataFingerprintError,
    EmptySplitError,
    RankBatches,
    ShardCorruptError,
    UnsafeDatasetError,
    check_fingerprint,
    eos_id_of,
    is_remote,
    read_tokenizer,
)
from pipeline.train import dist, run_lock
from pipeline.train.callbacks import (
    EXIT_INTERRUPTED,
    Callback,
    CallbackList,
    CheckpointCadence,
    CompileBudget,
    EvalError,
    ExtrapolationMonitor,
    HangWatchdog,
    MetricsLogging,
    PeriodicEval,
    RetrievalTelemetry,
    SignalStop,
    fault_injection,
)
from pipeline.train.checkpoint import CheckpointError, CheckpointManager
from pipeline.train.config import ConfigError, TrainConfig, check_context_parallel, load_config, mix_settings
from pipeline.train.export import EXPORT_DIR, write_export
from pipeline.train.inputs import (
    build_mix,
    check_inputs,
    check_no_secrets,
    init_weights_from,
    resolve_document_eos,
)
from pipeline.train.memory_estimate import check_device_memory, check_host_memory
from pipeline.train.metrics import MetricsWriteError, memory_gb, peak_flops, setup_logging
from pipeline.train.optim import freeze_for_stage, lr_at, set_lr
from pipeline.train.parallel import Needles, build_engine
from pipeline.train.preflight import version_mismatches
from pipeline.train.resume_check import ResumeRefusedError, check_data_settings, check_resume, config_record
from pipeline.train.run_files import check_run_files
from pipeline.train.save_failure import SaveFailedError
from pipeline.train.sources import build_stream, resolve_mixture

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Loss or gradient norm became NaN/Inf; raised on every rank before the optimizer step (under DeepSpeed, whose
    step computes the gradient norm, right after it and before anything is saved)."""


def use_bf16(cfg: TrainConfig, device: torch.device) -> bool:
    if cfg.precision.dtype == "auto":
        return device.type == "cuda"
    return cfg.precision.dtype == "bf16"


def default_callbacks(cfg: TrainConfig, info: dist.DistInfo) -> list[Callback]:
    """The callbacks of every run, in dispatch order (see ``pipeline.train.callbacks.base`` for why order matters)."""
    injector = fault_injection.from_env(info.rank)
    return [
        HangWatchdog(),
        CompileBudget(),
        RetrievalTelemetry(),
        *([ExtrapolationMonitor()] if cfg.eval.extrapolation_every else []),
        MetricsLogging(),
        *([injector] if injector is not None else []),
        *([PeriodicEval(cfg.train.eval_every)] if cfg.train.eval_every else []),
        SignalStop(),
        CheckpointCadence(cfg.checkpoint.every, cfg.train.max_steps),
    ]


class Trainer:
    """Owns the engine (model + optimizer), the data stream and the checkpoints of one run, and runs its steps.

    Args:
        cfg: the validated config.
        info: this process's rank, world size and device.
        callbacks: run after the `default_callbacks`, in this order.
    """

    def __init__(self, cfg: TrainConfig, info: dist.DistInfo, callbacks: list[Callback] | None = None) -> None:
        check_context_parallel(cfg, info.world_size)  # the process group's world size, not the announced one
        info = dataclasses.replace(info, context_parallel=cfg.parallel.context_parallel)
        self.cfg, self.info = cfg, info
        self.run_dir = Path(cfg.run_dir)
        check_run_files(self.run_dir)  # before any work: a link planted in run_dir is refused now, not at the end
        self.accum = cfg.grad_accum(info.world_size)
        self.retriever_loss = mix_settings(cfg.data).retriever_loss
        self.bf16 = use_bf16(cfg, info.device)
        resolve_document_eos(cfg)  # the model needs its document separator (a Trainer may be built without main)
        dist.seed_all(cfg.seed)  # the same initial weights on every rank and every world size
        model = build_model(cfg.model).to(info.device)
        if cfg.checkpoint.init_from:
            init_weights_from(model, cfg.checkpoint.init_from)
        freeze_for_stage(model, cfg.optim)  # optim.trainable=new: before any engine wraps the model
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len, matmul_params(model))
        self.n_params = count_parameters(model)
        self.engine = build_engine(model, cfg, info, self.bf16)
        # Gumbel top-k noise: one stream per data-parallel rank; a CP group's ranks must draw the same noise.
        dist.seed_all(cfg.seed + 1 + info.dp_rank)
        self.eos_id = eos_id_of(cfg.data.path)  # first: refuses an interrupted data-prep output
        self.tokenizer = read_tokenizer(cfg.data.path)  # once, read safely; the needles and every export use it
        self.batches, self.data_fingerprint = self._train_batches()
        self.callbacks = CallbackList([*default_callbacks(cfg, info), *(callbacks or [])])
        self.ckpt = CheckpointManager(self.run_dir, cfg.checkpoint.keep_last, info, cfg.checkpoint.fallback_to_previous)
        self.step = 0
        self.tokens_seen = 0
        self.epoch = 0
        """The epoch of the training split the last step drew from (``RankBatches.epoch``)."""
        self.resumed = False
        self.exit_code: int | None = None
        self._phase = "setup"
        self.source_sequences: np.ndarray | None = None
        """Sequences drawn from each mixture source so far (set at the first step, from the schedule)."""

    def _train_batches(self) -> tuple[RankBatches, dict[str, Any]]:
        """This rank's share of the training mixture (``pipeline.train.sources``: ``data.sources``, or
        ``data.path`` with the retrieval tasks), and the fingerprint of ``data.path``, which a resume compares."""
        cfg, info = self.cfg, self.info
        cache = cfg.data.cache_dir or str(self.run_dir / "data_cache")
        self.mixture = resolve_mixture(cfg)
        stream, fingerprint = build_stream(cfg, self.mixture, self.eos_id, cache)
        if not self.mixture.declared:
            warn_if_data_repeats(cfg, self.eos_id is not None)
        mix = build_mix(cfg, self.tokenizer)
        batches = RankBatches(
            stream,
            global_batch=cfg.train.global_batch,
            micro_batch=cfg.train.micro_batch,
            rank=info.dp_rank,  # the ranks of a context-parallel group train on the same sequences
            world_size=info.dp_size,
            mix=mix,
            seed=cfg.seed,
            answer_weight=mix_settings(cfg.data).answer_weight,
            needle_labels=mix_settings(cfg.data).retriever_loss > 0,
            each_needle_chunk=mix_settings(cfg.data).retriever_loss_each,
        )
        return batches, fingerprint

    # -- the loop -----------------------------------------------------------------------------------------
    def train(self) -> int:
        """Run to ``train.max_steps``; returns the process exit code (``train.requeue_exit_code`` on a signal)."""
        self.ckpt.remove_uncommitted()
        self.resumed = self.resume()
        try:
            self.callbacks.pre_train(self)
            while self.step < self.cfg.train.max_steps and self.exit_code is None:
                metrics = self._guarded_step()
                self.callbacks.post_step(self, self.step, metrics)
            if self.exit_code is not None:
                return self.exit_code
            weights = self.engine.full_state_dict()
            if self.info.is_main:
                self.export(weights, self.run_dir / EXPORT_DIR)
                log.info("done: %d steps, eval export in %s", self.step, self.run_dir / EXPORT_DIR)
            dist.barrier()
            return 0
        finally:
            self.callbacks.post_train(self)

    def request_stop(self, exit_code: int) -> None:
        """Finish this step boundary (the callbacks after the caller still run; the checkpoint cadence saves),
        then leave the loop with ``exit_code``."""
        self.exit_code = exit_code

    def _guarded_step(self) -> dict[str, Any]:
        """The ``pre_step`` hooks (the watchdog arms first) and ``train_step``; an out-of-memory error is explained,
        a failed collective is re-raised naming the step and the phase."""
        step = self.step + 1
        try:
            self.callbacks.pre_step(self, step)
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
            raise dist.named_failure(self.info.rank, f"step {step}, during {self._phase},", err) from err

    # -- one optimizer step -------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """Forward/backward over this rank's micro-batches, a collective finiteness check, then the update.

        With loss weights every micro-batch's ``sum(w * ce)`` is divided by one normaliser of the whole global
        batch, so the step trains on the global batch's weighted mean whatever its split into ranks and
        micro-batches; without weights there is no extra collective. A mixture of several sources also logs each
        source's loss, from the same forwards (`_source_losses`: one all-reduce of a ``[sources, 2]`` tensor)."""
        cfg, eng, step = self.cfg, self.engine, self.step + 1
        lr = lr_at(self.step, cfg.train.max_steps, cfg.optim, cfg.schedule)
        set_lr(eng.param_groups, lr)
        t0 = time.perf_counter()
        eng.train(True)
        self._phase = "all-reduce of the loss weights"
        micro = self.batches.next_step_weighted()
        weights = [w for _, w in micro if w is not None]  # every rank has weights or none has
        # The global batch's weight sum per micro-batch: the engines average the micro-batches' gradients over the
        # accumulation steps and the data-parallel ranks, which makes this step's gradient (and logged loss) the
        # global weighted mean. A micro-batch's own sum(w) would weigh its tokens by how the batch is split.
        weight_norm = dist.mean_weight_sum(weights, self.info.device) / self.accum if weights else None
        self._phase = "forward/backward (with the data-parallel gradient reduction)"
        rows: list[torch.Tensor] | None = [] if len(self.mixture.labels) > 1 else None  # per-source losses
        needles = self.batches.retrieval_labels if self.retriever_loss > 0 else []
        losses = [
            eng.micro_step(
                x.to(self.info.device),
                self.accum,
                last=i == len(micro) - 1,
                weights=None if w is None else w.to(self.info.device),
                weight_norm=weight_norm,
                rows=rows,
                needles=Needles(needles[i].to(self.info.device), self.retriever_loss) if needles else None,
            )
            for i, (x, w) in enumerate(micro)
        ]
        loss = torch.stack(losses).mean().float()
        self._phase = "gradient-norm reduction and clipping"
        grad_norm = eng.grad_norm_before_step(cfg.train.grad_clip)
        self.callbacks.pre_optim_step(self, step, loss)
        bad = not math.isfinite(loss.item()) or (grad_norm is not None and not math.isfinite(grad_norm))
        self._phase = "all-gather of the finiteness flags"
        flags = dist.all_gather_flags(bad, self.info.device)
        if any(flags):
            eng.discard_grads()
            ranks = [r for r, f in enumerate(flags) if f]
            raise NonFiniteError(
                f"non-finite loss or gradient norm at step {step} on rank(s) {ranks} "
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
                    f"non-finite gradient norm at step {step} on rank(s) "
                    f"{[r for r, f in enumerate(flags) if f]} (loss={loss.item()}, grad_norm={grad_norm}), found by "
                    f"DeepSpeed inside its optimizer step; nothing of this step is saved, the last checkpoint in "
                    f"{self.ckpt.root} is intact"
                )
        self._phase = "loss all-reduce"
        global_loss = dist.all_reduce_mean(loss).item()
        self._phase = "per-source loss all-reduce"
        source_losses = self._source_losses(rows) if rows is not None else {}
        dt = time.perf_counter() - t0
        tokens = cfg.tokens_per_step
        self.step = step
        self.tokens_seen += tokens
        mixture_metrics = self._mixture_metrics()
        if self.batches.epoch != self.epoch:
            self.epoch = self.batches.epoch
            if self.info.is_main:
                log.info("data: step %d began epoch %d of the training split", step, self.epoch)
        peak = peak_flops(cfg.logging.peak_tflops)
        tps = tokens / dt
        return {
            "loss": global_loss,
            **source_losses,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tps,
            "step_time_s": dt,
            "mfu": self.flops_per_token * tps / (peak * self.info.world_size) if peak else None,
            "mem_gb": memory_gb(),
            "tokens": self.tokens_seen,
            "epoch": self.epoch,
            **mixture_metrics,
        }

    def _source_losses(self, rows: list[torch.Tensor]) -> dict[str, float]:
        """``loss/<label>`` of a mixture of several sources: the mean per-token training loss of this step's
        sequences from that source, over the whole global batch (one all-reduce of a ``[sources, 2]`` tensor: each
        source's loss sum and token count over the ranks; a context-parallel group's ranks each add their spans, so
        every sequence counts once). The cross-entropy is unweighted, also under ``data.retrieval_mix.answer_weight``
        (the logged ``loss`` is the weighted objective), and taken from the training forward itself, before the
        optimizer step. A source with no sequence in the step has no key that step.

        ``rows``: this rank's `pipeline.train.parallel.row_stats` of each micro-batch, in the order of
        ``RankBatches.rank_sources``."""
        labels = self.mixture.labels
        stats = torch.cat(rows).double()
        sources = torch.as_tensor(self.batches.rank_sources, dtype=torch.int64, device=stats.device)
        assert len(sources) == len(stats), "one source index per row of this rank's micro-batches"
        sums = torch.zeros(len(labels), 2, dtype=torch.float64, device=stats.device).index_add_(0, sources, stats)
        totals = dist.all_reduce_sum(sums).tolist()
        return {f"loss/{label}": total / count for label, (total, count) in zip(labels, totals) if count > 0}

    def _mixture_metrics(self) -> dict[str, Any]:
        """A mixture of several sources: per source the tokens drawn so far (``tokens/<label>``), its share of this
        step's sequences (``share/<label>``) and the epoch of each text source (``epoch/<label>``)."""
        labels = self.mixture.labels
        if len(labels) == 1:
            return {}
        stream = self.batches.stream
        assert isinstance(stream, MixtureStream)
        step = np.bincount(self.batches.step_sources, minlength=len(labels))
        if self.source_sequences is None:  # first step of this process: what the run drew before it, from the schedule
            before = stream.consumed - len(self.batches.step_sources)
            self.source_sequences = stream.schedule.counts(before, len(labels))
        self.source_sequences = self.source_sequences + step
        seq_len, total = self.cfg.train.seq_len, max(1, int(step.sum()))
        out: dict[str, Any] = {}
        for i, label in enumerate(labels):
            out[f"tokens/{label}"] = int(self.source_sequences[i]) * seq_len
            out[f"share/{label}"] = float(step[i]) / total
        if self.mixture.declared:
            out.update({f"epoch/{label}": epoch for label, epoch in stream.epochs().items()})
        return out

    # -- checkpoints and export ---------------------------------------------------------------------------
    def export(self, weights: dict[str, torch.Tensor], directory: Path) -> None:
        """Write an eval export (rank 0): safetensors weights, config.json and the tokenizer, plus the files that make
        it a Hugging Face model folder (remote code and tokenizer files; never fails the run)."""
        with dist.isolated_rng():  # the model's random init must not advance the training RNG
            model = build_model(self.cfg.model)
        model.load_state_dict(weights)
        if self.tokenizer is None:
            log.warning("no local tokenizer next to data.path; the export in %s has no tokenizer", directory)
        write_export(model, directory, step=self.step, seq_len=self.cfg.train.seq_len, tokenizer=self.tokenizer)

    def _parallel(self) -> dict[str, Any]:
        return {"engine": self.cfg.parallel.engine, "zero_stage": self.cfg.parallel.zero_stage}

    def save(self) -> Path:
        """Save the current step (collective; a failed collective names the save), then the ``post_checkpoint``
        hooks."""
        # The config text keeps ${oc.env:...} in place of values from the environment; every other field is a
        # number, a hash or a name from a fixed set, compared verbatim at resume.
        state = {
            "tokens_seen": self.tokens_seen,
            "data": self.batches.state_dict(),
            "model_config": self.cfg.model.to_dict(),
            "config_yaml": config_record(self.cfg),
            "parallel": self._parallel(),
            "data_fingerprint": self.data_fingerprint,
        }
        export = self.export if self.cfg.checkpoint.export else None
        path = dist.guarded_collective(
            self.info.rank,
            f"checkpoint save of step {self.step}",
            lambda: self.ckpt.save(self.step, self.engine, state, export, self._save_point),
        )
        self.callbacks.post_checkpoint(self, self.step, path)
        return path

    def _save_point(self, point: str) -> None:
        self.callbacks.on_save_point(self, self.step, point)

    def _check_mixture(self, path: Path, data: dict[str, Any]) -> None:
        """The checkpoint's position fits this run's mixture (``MixtureStream.check_resume``).

        Raises:
            ResumeRefusedError: one line naming what changed."""
        stream = self.batches.stream
        assert isinstance(stream, MixtureStream)
        try:
            stream.check_resume(data)
        except MixtureResumeError as err:
            raise ResumeRefusedError(f"cannot resume {path}: {err}") from None

    def resume(self) -> bool:
        """Load the checkpoint ``checkpoint.resume`` picks, if any, after comparing this run's config with the one
        it recorded (``pipeline.train.resume_check``: refused changes stop here) and its dataset fingerprint."""

        def may_continue(path: Path, state: dict[str, Any]) -> None:
            check_resume(path, state["config_yaml"], self.cfg, int(state["step"]))
            check_data_settings(path, state["data"], self.cfg)
            self._check_mixture(path, state["data"])
            check_fingerprint(state["data_fingerprint"], self.data_fingerprint, str(path))

        found = self.ckpt.restore(
            self.cfg.checkpoint.resume, self.engine, self.cfg.model.to_dict(), self._parallel(), check=may_continue
        )
        if found is None:
            return False
        _, state = found
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.batches.load_state_dict(state["data"])
        self.epoch = self.batches.epoch
        return True


DATASET_ERRORS = (UnsafeDatasetError, ShardCorruptError, EmptySplitError, DataFingerprintError)
"""What a reader raises for a dataset it refuses: one line to the user, never a traceback."""


def warn_if_data_repeats(cfg: TrainConfig, eos: bool) -> None:
    """Say at the start when ``train.max_steps`` draws more tokens than the training split holds (from data prep's
    manifest; a dataset without one, or a remote one, is not counted)."""
    if is_remote(cfg.data.path) or not (Path(cfg.data.path) / fmt.MANIFEST_FILENAME).is_file():
        return
    split = fmt.read_manifest(cfg.data.path).splits.get(cfg.data.train_split)
    if split is None:
        return
    needed = cfg.tokens_per_step * cfg.train.max_steps
    epochs = epochs_needed(split.tokens, split.documents, eos, needed)
    if epochs > 1:
        order = {
            "blocks": "each in a new order",
            "window": "in windows of data.shuffle_window sequences (a split of few shards is read in the same "
            "document order every epoch: data.shuffle_scope=blocks reshuffles it)",
            "file": "each in file order (data.shuffle=false)",
        }[cfg.data.order()]
        log.warning(
            "the run repeats its data: train.max_steps=%d x %d tokens per step = %d tokens, the training split %s "
            "holds %d, so about %.1f epochs, %s",
            cfg.train.max_steps,
            cfg.tokens_per_step,
            needed,
            Path(cfg.data.path) / cfg.data.train_split,
            split.tokens,
            epochs,
            order,
        )


def _say_once(message: str) -> None:
    """Log ``message``, an error every rank may hit alike, unless another rank of the job said it already."""
    if dist.first_to_say(message):
        log.error("%s", message)
    else:
        log.debug("%s (another rank reported it)", message)


def _last_committed(cfg: TrainConfig, info: dist.DistInfo) -> str:
    good = CheckpointManager(cfg.run_dir, cfg.checkpoint.keep_last, info).committed()
    if not good:
        return f"no checkpoint was committed in {Path(cfg.run_dir) / 'checkpoints'}: a relaunch starts from step 0"
    return f"the last committed checkpoint is {good[-1]}: a relaunch resumes from it (checkpoint.resume=auto)"


def main(config_path: str | None, overrides: list[str]) -> int:
    """Entry point of ``pipeline.cli.train``; returns the exit code (2 for a configuration error).

    An error every rank hits alike (the configuration, the data, a refused resume) is one line for the job, not one
    per rank (`_say_once`); an error of one rank is still that rank's line.
    """
    flush_denormals()  # first, before torch starts its thread pool (see kernels/cpu_math.py)
    try:
        dist.check_launch()  # within seconds, before the config work and long before a rendezvous could hang
    except ValueError as err:
        setup_logging(0)  # RANK itself may be what is wrong; an error shows whatever the rank
        log.error("%s", err)
        return 2
    setup_logging(dist.rank_from_env())
    try:
        cfg = load_config(config_path, overrides, dist.world_size_from_env())
        check_no_secrets(cfg)
        check_inputs(cfg)
        check_host_memory(cfg, dist.world_size_from_env())
        check_device_memory(cfg, dist.world_size_from_env())
    except ConfigError as err:
        _say_once(f"configuration error: {err}")
        return 2
    if cfg.train.retain_freed_memory:
        retain_freed_memory()  # steps reuse their buffers instead of page-faulting fresh mappings
    try:
        info = dist.init_distributed(cfg.parallel.engine)
    except dist.RendezvousError as err:
        log.error("%s", err)
        return 1
    setup_logging(info.rank)
    lock: run_lock.RunLock | None = None
    try:
        mismatches = version_mismatches(info)  # every rank gets the same list, so all of them stop together
        if mismatches:
            if info.is_main:
                for line in mismatches:
                    log.error("%s", line)
                log.error("the nodes run different library versions (above); not starting the training")
            return 2
        try:
            lock = run_lock.hold(Path(cfg.run_dir), info)  # before anything is written into run_dir
        except run_lock.RunDirLockError as err:
            if info.is_main:
                log.error("%s", err)
            return 2
        try:
            trainer = Trainer(cfg, info)
        except ConfigError as err:  # found while building the run (e.g. checkpoint.init_from does not fit)
            _say_once(f"configuration error: {err}")
            return 2
        except (*DATASET_ERRORS, fmt.IncompleteDatasetError, FileNotFoundError) as err:
            _say_once(f"data error (data.path={cfg.data.path}): {err}")
            return 2
        return trainer.train()
    except ResumeRefusedError as err:  # found on resume, before any step
        _say_once(f"configuration error: {err}")
        return 2
    # Found on resume before any tensor loads (a corrupt or unsafe file; a checkpoint of another layout, e.g. ZeRO
    # state of 2 ranks resumed without the launcher), or at a save (a foreign folder where it goes): one line.
    except CheckpointError as err:
        _say_once(f"checkpoint error: {err}")
        return 2
    except DataFingerprintError as err:  # found on resume, before any step
        _say_once(f"data error: {err}")
        return 2
    except DATASET_ERRORS as err:  # a shard damaged or changed since the start, found when it is first read
        _say_once(
            f"data error at step {trainer.step + 1} (data.path={cfg.data.path}): {err}; nothing of this step was "
            "saved, the last checkpoint is intact"
        )
        return 1
    except EvalError as err:  # one line, naming what the relaunch resumes from
        _say_once(str(err))
        return 1
    except SaveFailedError as err:  # every rank holds the same line (the ranks agree on a failed save): logged once
        if info.is_main:
            log.error("%s", err)
        return 1
    except MetricsWriteError as err:  # a full disk met by the one rank that writes metrics: its line, no traceback
        log.error("%s; %s", err, _last_committed(cfg, info))
        return 1
    except UnsafeWriteError as err:  # a link planted in run_dir after the start check (one rank writes: its line)
        log.error("%s; %s", err, _last_committed(cfg, info))
        return 2
    except dist.CollectiveError as err:  # a peer died or hangs: this rank's traceback, ending in where to resume
        err.add_note(_last_committed(cfg, info))
        raise
    except KeyboardInterrupt:
        _say_once(
            "stopped at once by Ctrl-C (a second one, or one before training began): nothing saved since the "
            f"last committed checkpoint in {Path(cfg.run_dir) / 'checkpoints'} (an interrupted save is removed at "
            "the next start)"
        )
        return EXIT_INTERRUPTED
    finally:
        if lock is not None:
            lock.release()
        dist.destroy()
