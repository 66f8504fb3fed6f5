"""The trainer: one loop for DeepSpeed, FSDP2 and plain PyTorch (``parallel.engine``).

``main(config_path, overrides)`` validates the config before anything starts, sets up the process group, and
runs ``Trainer.train()``: resume (``checkpoint.resume``), then ``train_step`` until ``train.max_steps`` with
periodic ``evaluate``, checkpoints, metrics, NaN/Inf stops and a collective save-and-exit on SIGTERM/SIGUSR1.
"""

from __future__ import annotations

import logging
import math
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import torch

from model import build_model, save_pretrained
from pipeline import dist, faults
from pipeline.checkpoint import CheckpointManager
from pipeline.config import ConfigError, TrainConfig, load_config, to_yaml
from pipeline.data import MDSReader, PackedSequences, RankBatches, eos_id_of, is_remote
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


class NonFiniteError(RuntimeError):
    """Loss or gradient norm became NaN/Inf; raised on every rank before the optimizer step."""


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
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len, matmul_params(model))
        self.n_params = sum(p.numel() for p in model.parameters())
        self.engine = build_engine(model, cfg, info, self.bf16)
        dist.seed_all(cfg.seed + 1 + info.rank)  # per-rank stream for Gumbel top-k noise
        cache = cfg.data.cache_dir or str(self.run_dir / "data_cache")
        reader = MDSReader(cfg.data.path, cfg.data.train_split, cache, cfg.data.validate_hash)
        self.eos_id = eos_id_of(cfg.data.path)
        stream = PackedSequences(reader, cfg.train.seq_len, cfg.seed, cfg.data.shuffle, cfg.data.shuffle_window,
                                 self.eos_id)
        needles = None
        if cfg.data.needle_mix > 0:
            needles = NeedleInserter(Path(cfg.data.path) / TOKENIZER_FILE, cfg.train.seq_len, cfg.model.chunk_size)
        self.batches = RankBatches(stream, cfg.train.global_batch, cfg.train.micro_batch, info.rank,
                                   info.world_size, needles, cfg.data.needle_mix, cfg.seed)
        self._val_reader: MDSReader | None = None
        self.ckpt = CheckpointManager(self.run_dir, cfg.checkpoint.keep_last, info)
        self.step = 0
        self.tokens_seen = 0
        self.fault = faults.from_env()
        self._stop_signal: int | None = None
        self.metrics: MetricsLogger | None = None

    # -- one optimizer step -------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """Forward/backward over this rank's micro-batches, a collective finiteness check, then the update."""
        cfg, eng = self.cfg, self.engine
        lr = lr_at(self.step, cfg.train.max_steps, cfg.optim, cfg.schedule)
        set_lr(eng.param_groups, lr)
        t0 = time.perf_counter()
        eng.train(True)
        micro = self.batches.next_step()
        losses = [eng.micro_step(x.to(self.info.device), self.accum, last=i == len(micro) - 1)
                  for i, x in enumerate(micro)]
        loss = torch.stack(losses).mean().float()
        if self.fault is not None and self.fault.hits("nan_loss", self.step + 1, self.info.rank):
            loss = loss * float("nan")
        grad_norm = eng.grad_norm_before_step(cfg.train.grad_clip)
        bad = not math.isfinite(loss.item()) or (grad_norm is not None and not math.isfinite(grad_norm))
        flags = dist.all_gather_flags(bad, self.info.device)
        if any(flags):
            eng.discard_grads()
            ranks = [r for r, f in enumerate(flags) if f]
            raise NonFiniteError(
                f"non-finite loss or gradient norm at step {self.step + 1} on rank(s) {ranks} "
                f"(loss={loss.item()}, grad_norm={grad_norm}); stopped before the optimizer step, the last "
                f"checkpoint in {self.ckpt.root} is intact")
        eng.optimizer_step()
        if grad_norm is None:
            grad_norm = eng.grad_norm_after_step()
        global_loss = dist.all_reduce_mean(loss).item()
        dt = time.perf_counter() - t0
        tokens = cfg.tokens_per_step
        self.step += 1
        self.tokens_seen += tokens
        peak = peak_flops(cfg.logging.peak_tflops)
        tps = tokens / dt
        return {"loss": global_loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tps, "step_time_s": dt,
                "mfu": self.flops_per_token * tps / (peak * self.info.world_size) if peak else None,
                "mem_gb": memory_gb(), "tokens": self.tokens_seen}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``train.eval_batches`` global batches (the same sequences every time)."""
        cfg = self.cfg
        if self._val_reader is None:
            cache = cfg.data.cache_dir or str(self.run_dir / "data_cache")
            self._val_reader = MDSReader(cfg.data.path, cfg.data.val_split, cache, cfg.data.validate_hash)
        stream = PackedSequences(self._val_reader, cfg.train.seq_len, cfg.seed, False, cfg.train.global_batch,
                                 self.eos_id)
        batches = RankBatches(stream, cfg.train.global_batch, cfg.train.micro_batch, self.info.rank,
                              self.info.world_size)
        self.engine.train(False)
        losses = [self.engine.loss(x.to(self.info.device)).float()
                  for _ in range(cfg.train.eval_batches) for x in batches.next_step()]
        self.engine.train(True)
        return dist.all_reduce_mean(torch.stack(losses).mean()).item()

    # -- checkpoints and export ---------------------------------------------------------------------------
    def export(self, weights: dict[str, torch.Tensor], directory: Path) -> None:
        """Write an eval export (rank 0): safetensors weights, config.json and the tokenizer."""
        model = build_model(self.cfg.model)
        model.load_state_dict(weights)
        save_pretrained(model, directory, extra={"step": self.step, "seq_len": self.cfg.train.seq_len,
                                                 "tokenizer": TOKENIZER_FILE})
        tokenizer = Path(self.cfg.data.path) / TOKENIZER_FILE
        if not is_remote(self.cfg.data.path) and tokenizer.is_file():
            shutil.copyfile(tokenizer, directory / TOKENIZER_FILE)
        else:
            log.warning("no local %s next to data.path; the export in %s has no tokenizer", TOKENIZER_FILE, directory)

    def save(self) -> Path:
        state = {"tokens_seen": self.tokens_seen, "data": self.batches.state_dict(),
                 "model_config": self.cfg.model.to_dict(), "config_yaml": to_yaml(self.cfg)}
        return self.ckpt.save(self.step, self.engine, state, self.export if self.cfg.checkpoint.export else None)

    def resume(self) -> bool:
        path = self.ckpt.resolve_resume(self.cfg.checkpoint.resume)
        if path is None:
            return False
        state = self.ckpt.load(path, self.engine, self.cfg.model.to_dict())
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.batches.load_state_dict(state["data"])
        return True

    # -- the loop -----------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop_signal = signum  # only a flag: the save happens at the next step boundary, on all ranks

    def _derived(self) -> dict[str, Any]:
        cfg = self.cfg
        return {"world_size": self.info.world_size, "grad_accum": self.accum, "tokens_per_step": cfg.tokens_per_step,
                "total_tokens": cfg.tokens_per_step * cfg.train.max_steps, "params": self.n_params,
                "flops_per_token": self.flops_per_token, "bf16": self.bf16, "device": str(self.info.device)}

    def train(self) -> int:
        """Run to ``train.max_steps``; returns the process exit code (``train.requeue_exit_code`` on a signal)."""
        cfg = self.cfg
        self.ckpt.remove_uncommitted()
        resumed = self.resume()
        if self.info.is_main:
            header = log_run_header(to_yaml(cfg), self._derived())
            self.metrics = MetricsLogger(self.run_dir, cfg, _plain(cfg), header, self.step, resumed)
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGUSR1)}
        try:
            while self.step < cfg.train.max_steps:
                metrics = self.train_step()
                if self.metrics is not None:
                    console = self.step % cfg.logging.every == 0 or self.step == cfg.train.max_steps
                    self.metrics.step(self.step, metrics, console)
                faults.after_step(self.fault, self.step, self.info.rank)
                if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                    val = self.evaluate()
                    log.info("step %d | val_loss=%.4f", self.step, val)
                    if self.metrics is not None:
                        self.metrics.event({"event": "eval", "step": self.step, "val_loss": val})
                flag = torch.tensor([float(self._stop_signal is not None)], device=self.info.device)
                stop = dist.all_reduce_max(flag).item() > 0
                periodic = cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0
                if periodic or stop or self.step == cfg.train.max_steps:
                    self.save()
                if stop:
                    log.warning("stop signal received: saved step %d, exiting with code %d for a requeue",
                                self.step, cfg.train.requeue_exit_code)
                    return cfg.train.requeue_exit_code
            weights = self.engine.full_state_dict()
            if self.info.is_main:
                self.export(weights, self.run_dir / "export")
                log.info("done: %d steps, eval export in %s", self.step, self.run_dir / "export")
            dist.barrier()
            return 0
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            if self.metrics is not None:
                self.metrics.close()


def _plain(cfg: TrainConfig) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))  # type: ignore[return-value]


def main(config_path: str | None, overrides: list[str]) -> int:
    """Entry point of ``launch/pretrain.py``; returns the exit code (2 for a configuration error)."""
    setup_logging(dist.rank_from_env())
    try:
        cfg = load_config(config_path, overrides, dist.world_size_from_env())
    except ConfigError as err:
        log.error("configuration error: %s", err)
        return 2
    info = dist.init_distributed(cfg.parallel.engine)
    setup_logging(info.rank)
    try:
        return Trainer(cfg, info).train()
    finally:
        dist.destroy()
