"""Periodic validation: the mean loss over ``train.eval_batches`` global batches every ``train.eval_every`` steps,
and for GCA models the far recall of the same forwards (``pipeline.evaluation.far_recall``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from model.retrieval import Picks
from pipeline.data.reader import MDSReader, PackedSequences, RankBatches
from pipeline.evaluation.far_recall import FarRecall
from pipeline.train import dist
from pipeline.train.callbacks.base import Callback

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
    has always run them: evaluate, then decide, then save."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._reader: MDSReader | None = None

    def post_step(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        if step % self.every:
            return
        try:
            val_loss, metrics = self.evaluate(trainer)
        except EvalError as err:
            path = trainer.save()
            raise EvalError(
                f"{err}; step {step} was saved first ({path}), so a relaunch resumes there: fix "
                f"the '{trainer.cfg.data.val_split}' split of data.path or set train.eval_every=0"
            ) from err
        trainer.callbacks.on_eval(trainer, step, val_loss, metrics)

    def post_train(self, trainer: Trainer) -> None:
        if self._reader is not None:
            self._reader.close()  # the shards it holds in memory go now, not whenever it is collected
            self._reader = None

    @torch.no_grad()
    def evaluate(self, trainer: Trainer) -> tuple[float, dict[str, float]]:
        """Mean validation loss over ``train.eval_batches`` global batches and the pass's far recall (collective).

        Raises:
            EvalError: on every rank, when reading the validation split failed on any rank.
        """
        batches, error = self._batches(trainer)
        failed = dist.all_gather_flags(error is not None, trainer.info.device)
        if any(failed):
            ranks = [r for r, f in enumerate(failed) if f]
            cause = f": {type(error).__name__}: {(str(error).splitlines() or [''])[0]}" if error else ""
            raise EvalError(f"validation at step {trainer.step} failed on rank(s) {ranks}{cause}") from error
        engine, model_cfg = trainer.engine, trainer.cfg.model
        # The unwrapped model (FSDP2 shards it in place; DDP and DeepSpeed keep it as .module) records its picks.
        recorder = engine.module if model_cfg.arch == "gca" else None
        recall = FarRecall.empty(len(model_cfg.groups))
        losses = []
        with dist.isolated_rng():  # evaluation must not move the training RNG (Gumbel noise)
            engine.train(False)
            try:
                for x in batches:
                    picks: Picks = {}
                    if recorder is not None:
                        recorder.picks = picks
                    losses.append(engine.loss(x.to(trainer.info.device)).float())
                    if recorder is not None:
                        tokens = x.numpy()
                        for b in range(len(tokens)):
                            recall += FarRecall.measure(tokens[b], picks, model_cfg, batch_row=b)
            finally:
                if recorder is not None:
                    recorder.picks = None
                engine.train(True)
        val_loss = dist.all_reduce_mean(torch.stack(losses).mean()).item()
        if recorder is None:
            return val_loss, {}
        sums = torch.tensor(recall.as_sums(), dtype=torch.float64, device=trainer.info.device)
        total = FarRecall.from_sums((dist.all_reduce_mean(sums) * trainer.info.world_size).tolist())
        # No far-recall rate when no target qualified (sequences shorter than the windows' reach): only the count.
        return val_loss, {k: v for k, v in total.metrics("retrieval/").items() if v is not None}

    def _batches(self, trainer: Trainer) -> tuple[list[torch.Tensor], Exception | None]:
        """This rank's validation micro-batches, or the error reading them; no collective inside, so a bad split
        on one rank cannot leave the others waiting in one."""
        cfg, info = trainer.cfg, trainer.info
        try:
            if self._reader is None:
                cache = cfg.data.cache_dir or str(trainer.run_dir / "data_cache")
                self._reader = MDSReader(cfg.data.path, cfg.data.val_split, cache, cfg.data.validate_hash)
            stream = PackedSequences(
                self._reader,
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
