"""Periodic validation: the mean loss over ``train.eval_batches`` global batches every ``train.eval_every`` steps,
and for GCA models the far recall of the same forwards (``pipeline.evaluation.far_recall``); a mixture of several
text sources is validated per source (``val/<label>/loss``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from model.retrieval import Picks
from pipeline.data.order import BlockShuffledSequences
from pipeline.data.reader import MDSReader, PackedSequences, RankBatches, SequenceStream
from pipeline.evaluation.far_recall import FarRecall
from pipeline.train import dist
from pipeline.train.callbacks.base import Callback
from pipeline.train.config import ConfigError
from pipeline.train.inputs import ValSource, per_source_validation, validation_sources

if TYPE_CHECKING:
    from pipeline.train.trainer import Trainer


class EvalError(RuntimeError):
    """The validation pass failed (on any rank); raised on every rank, after the step was saved."""


class PeriodicEval(Callback):
    """Evaluates after every ``train.eval_every``-th step, on the same sequences every time, without moving the
    training RNG; the result goes to the ``on_eval`` hooks: the loss, and for GCA models ``retrieval/far_recall``,
    ``retrieval/far_recall_random``, ``retrieval/far_recall_nearest`` and ``retrieval/far_recall_tokens`` (per
    group ``retrieval/far_recall_g<i>`` too with several groups) over every predicted token of those sequences,
    summed over the ranks. A failed pass saves the finished step first, so a relaunch loses nothing, then raises
    `EvalError` on every rank. Registered before the stop decision and the checkpoint cadence, as the step boundary
    has always run them: evaluate, then decide, then save.

    A mixture that declares several text sources (``pipeline.train.inputs.per_source_validation``) is validated
    per source: ``train.eval_batches`` global batches of each text source's own ``data.val_split`` (of its length
    bucket's documents when its manifest's length histogram allows; ``pipeline.train.inputs.validation_sources``,
    which also leaves out, with a warning at the start, a source without a val split), reported as
    ``val/<label>/loss``. ``val_loss`` is then the token mean over all those sources' batches: every source gives
    the same number of equal-length sequences, so it is the plain mean of the ``val/<label>/loss`` values (not
    weighted by the mixture's weights, so it means the same whatever the phases do). Retrieval sources get no
    validation of their own; the far recall is over every source's forwards together."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._readers: dict[str, MDSReader] = {}
        self._sources: list[ValSource] | None = None
        """The per-source plan (None: ``data.path`` alone, or not planned yet)."""
        self._planned = False

    def pre_train(self, trainer: Trainer) -> None:
        self._plan(trainer)

    def _plan(self, trainer: Trainer) -> list[ValSource] | None:
        """The text sources validated one by one, or None when validation reads ``data.path`` (checked, with its
        warnings logged, by ``check_inputs`` before any work; here only read again)."""
        if not self._planned:
            if per_source_validation(trainer.cfg):
                try:
                    self._sources = validation_sources(trainer.cfg, trainer.mixture)[0]
                except ConfigError as err:  # changed on disk since the start check
                    raise EvalError(f"validation: {err}") from None
            self._planned = True
        return self._sources

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        if step % self.every:
            return
        try:
            val_loss, metrics = self.evaluate(trainer)
        except EvalError as err:
            path = trainer.save()
            where = "data.path" if self._plan(trainer) is None else "the source's dataset"
            raise EvalError(
                f"{err}; step {step} was saved first ({path}), so a relaunch resumes there: fix "
                f"the '{trainer.cfg.data.val_split}' split of {where} or set train.eval_every=0"
            ) from err
        trainer.callbacks.on_eval(trainer, step, val_loss, metrics)

    def post_train(self, trainer: Trainer) -> None:
        for reader in self._readers.values():
            reader.close()  # the shards it holds in memory go now, not whenever it is collected
        self._readers = {}

    @torch.no_grad()
    def evaluate(self, trainer: Trainer) -> tuple[float, dict[str, float]]:
        """Mean validation loss over ``train.eval_batches`` global batches and the pass's far recall (collective);
        per source, the sources' ``val/<label>/loss`` too (class docstring).

        Raises:
            EvalError: on every rank, when reading the validation split failed on any rank.
        """
        sources = self._plan(trainer)
        sets: list[tuple[str | None, list[torch.Tensor]]] = []
        error: Exception | None = None
        failed_source = ""
        for source in sources if sources is not None else [None]:
            batches, error = self._batches(trainer, source)
            if error is not None:
                failed_source = "" if source is None else f" ({source.key}, {source.label})"
                break
            sets.append((None if source is None else source.label, batches))
        failed = dist.all_gather_flags(error is not None, trainer.info.device)
        if any(failed):
            ranks = [r for r, f in enumerate(failed) if f]
            cause = f"{failed_source}: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}" if error else ""
            raise EvalError(f"validation at step {trainer.step} failed on rank(s) {ranks}{cause}") from error
        engine, model_cfg = trainer.engine, trainer.cfg.model
        # The unwrapped model (FSDP2 shards it in place; DDP and DeepSpeed keep it as .module) records its picks.
        recorder = engine.module if model_cfg.arch == "gca" else None
        recall = FarRecall.empty(len(model_cfg.groups))
        means = []
        with dist.isolated_rng():  # evaluation must not move the training RNG (Gumbel noise)
            engine.train(False)
            try:
                for _, batches in sets:
                    losses = []
                    for x in batches:
                        picks: Picks = {}
                        if recorder is not None:
                            recorder.picks = picks
                        losses.append(engine.loss(x.to(trainer.info.device)).float())
                        if recorder is not None:
                            tokens = x.numpy()
                            for b in range(len(tokens)):
                                recall += FarRecall.measure(tokens[b], picks, model_cfg, batch_row=b)
                    means.append(torch.stack(losses).mean())
            finally:
                if recorder is not None:
                    recorder.picks = None
                engine.train(True)
        per_set = dist.all_reduce_mean(torch.stack(means)).tolist()  # each micro-batch: the same tokens
        if sources is None:
            val_loss, out = per_set[0], {}
        else:
            val_loss = sum(per_set) / len(per_set)  # every source: the same number of equal sequences
            out = {f"val/{label}/loss": loss for (label, _), loss in zip(sets, per_set)}
        if recorder is None:
            return val_loss, out
        sums = torch.tensor(recall.as_sums(), dtype=torch.float64, device=trainer.info.device)
        total = FarRecall.from_sums((dist.all_reduce_mean(sums) * trainer.info.world_size).tolist())
        # No far-recall rate when no target qualified (sequences shorter than the windows' reach): only the count.
        return val_loss, {**out, **{k: v for k, v in total.metrics("retrieval/").items() if v is not None}}

    def _batches(
        self, trainer: Trainer, source: ValSource | None = None
    ) -> tuple[list[torch.Tensor], Exception | None]:
        """This rank's validation micro-batches of ``data.path`` (or of ``source``), or the error reading them; no
        collective inside, so a bad split on one rank cannot leave the others waiting in one."""
        cfg, info = trainer.cfg, trainer.info
        try:
            path = cfg.data.path if source is None else source.path
            if path not in self._readers:
                cache = cfg.data.cache_dir or str(trainer.run_dir / "data_cache")
                self._readers[path] = MDSReader(path, cfg.data.val_split, cache, cfg.data.validate_hash)
            reader = self._readers[path]
            stream: SequenceStream
            if source is not None and source.bucket != (0, None):
                stream = BlockShuffledSequences(
                    reader,
                    seq_len=cfg.train.seq_len,
                    seed=cfg.seed,
                    block_mib=cfg.data.shuffle_block_mib,
                    eos_id=trainer.eos_id,
                    bucket=source.bucket,
                    spanning=source.spanning,
                )
            else:
                stream = PackedSequences(
                    reader,
                    seq_len=cfg.train.seq_len,
                    seed=cfg.seed,
                    shuffle=False,
                    window=cfg.train.global_batch,
                    eos_id=trainer.eos_id,
                )
            batches = RankBatches(
                stream,
                global_batch=cfg.train.global_batch,
                micro_batch=cfg.train.micro_batch,
                rank=info.rank,
                world_size=info.world_size,
            )
            return [x for _ in range(cfg.train.eval_batches) for x in batches.next_step()], None
        except Exception as err:  # whatever the reader raises (missing, corrupt, empty split): reported collectively
            return [], err
