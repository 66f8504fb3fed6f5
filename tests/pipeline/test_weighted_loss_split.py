"""The weighted loss (``data.retrieval_mix.answer_weight != 1``) is the global batch's weighted mean
``sum(w * ce) / sum(w)`` whatever the split of the global batch: one process with accumulation 1, 4 or 8
(micro-batch 1), and two ranks under DDP, FSDP2, DeepSpeed ZeRO-2 and context parallelism (cp=2) all train on the
gradient one fp64 process computes for that mean over the whole batch.

Each split runs the trainer's own ``Trainer.train_step`` (the engines' ``micro_step``, the gradient reductions)
on one fixed global batch whose sequences carry different weight sums, so that normalising each micro-batch by its
own ``sum(w)`` (what the trainer did before) is visibly wrong: it moved the whole gradient by 25% (accumulation 4)
and 42% (micro-batch 1) of its norm. The gradients are read before the optimizer step (``train.grad_clip=0``,
nothing clipped). The two-rank runs are this file run as a script under torchrun or the deepspeed launcher (gloo on
127.0.0.1, a hard timeout that kills the whole launch); rank 0 writes the gradients and the logged loss.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.bench.step_ops import count_ops
from pipeline.train import dist
from pipeline.train.callbacks import Callback
from pipeline.train.config import load_config
from pipeline.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
GLOBAL_BATCH, SEQ_LEN, VOCAB, ANSWER_WEIGHT = 8, 64, 64, 5.0
SETTINGS = {
    "train.global_batch": GLOBAL_BATCH,
    "train.seq_len": SEQ_LEN,
    "train.grad_clip": 0.0,  # the gradients are compared as the backward left them
    "model.gumbel_topk": False,  # per-rank noise could not match one process
    "train.eval_every": 0,
    "checkpoint.export": False,
}
TIMEOUT_S = 300
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
"""fp32 against fp64 (measured: 2e-7 of the gradient's norm); the per-micro-batch normalisation is off by up to 4x in
single elements."""


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[8, 64]`` and loss weights aligned with them as labels: answer spans of weight 5 whose length
    differs from sequence to sequence (none in two of them), so the sequences' weight sums all differ. The first
    position is never predicted; its weight (5 in one sequence) must count for nothing."""
    tokens = torch.randint(2, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    weights = torch.ones(GLOBAL_BATCH, SEQ_LEN)
    for row, answer in enumerate([0, 2, 6, 12, 24, 0, 40, 4]):
        weights[row, SEQ_LEN - answer :] = ANSWER_WEIGHT
    weights[1, 0] = ANSWER_WEIGHT
    return tokens, weights


class FixedBatches:
    """Every step the same global batch, shared out as ``RankBatches`` shares one: this data-parallel rank's
    contiguous slice, cut into micro-batches of ``micro_batch`` (without ``weighted``: no weights, as
    ``RankBatches`` gives with ``answer_weight=1``)."""

    def __init__(self, micro_batch: int, rank: int, world_size: int, weighted: bool = True) -> None:
        tokens, weights = global_batch()
        per_rank = GLOBAL_BATCH // world_size
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        parts = weights[rows].split(micro_batch) if weighted else [None] * GLOBAL_BATCH
        self.micro = list(zip(tokens[rows].split(micro_batch), parts))

    epoch = 0

    def next_step_weighted(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return list(self.micro)


class GradCapture(Callback):
    """The full gradient of every parameter right before the optimizer step (collective under FSDP2 and ZeRO: every
    rank gathers, in the same order)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def pre_optim_step(self, trainer: Trainer, step: int, loss: torch.Tensor) -> None:
        for name, param in trainer.engine.module.named_parameters():
            grad = full_grad(param, trainer.cfg.parallel.engine)
            if grad is not None:
                self.grads[name] = grad.detach().float().cpu().clone()


def full_grad(param: torch.nn.Parameter, engine: str) -> torch.Tensor | None:
    if engine == "deepspeed":
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(param)
    if param.grad is None:
        return None
    return param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad


def trained_step(overrides: list[str], world_size: int) -> tuple[dict[str, torch.Tensor], float, Trainer]:
    """One ``train_step`` of the fixed global batch under ``overrides`` in this process (one of ``world_size``
    ranks): the gradients, the logged loss and the trainer."""
    cfg = load_config(None, overrides, world_size)
    capture = GradCapture()
    trainer = Trainer(cfg, dist.init_distributed(cfg.parallel.engine), callbacks=[capture])
    trainer.batches = FixedBatches(cfg.train.micro_batch, trainer.info.dp_rank, trainer.info.dp_size)
    loss = trainer.train_step()["loss"]
    return capture.grads, loss, trainer


def reference(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], float]:
    """The gradient and value, in fp64 in one process, of the global weighted mean over the whole batch, computed
    here from the logits (not by the trainer's loss functions)."""
    model = copy.deepcopy(model).double().train()
    tokens, weights = global_batch()
    logits = model(tokens).logits.double()
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    w = weights[:, 1:].flatten().double()
    loss = (w * ce).sum() / w.sum()
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, float(loss.detach())


def assert_matches(grads: dict[str, torch.Tensor], loss: float, want: tuple[dict[str, torch.Tensor], float]) -> None:
    want_grads, want_loss = want
    assert grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(
            grads[name].double(), grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert abs(loss - want_loss) <= 1e-5 * want_loss, (loss, want_loss)


def split_settings(micro_batch: int, **extra: object) -> dict[str, object]:
    return {**SETTINGS, "data.retrieval_mix.answer_weight": ANSWER_WEIGHT, "train.micro_batch": micro_batch, **extra}


@pytest.mark.parametrize("micro_batch", [8, 2, 1], ids=["accumulation-1", "accumulation-4", "micro-batch-1"])
def test_one_process_trains_the_global_weighted_mean_whatever_the_accumulation(
    micro_batch, tmp_path, tiny_data, overrides
):
    before = Trainer(
        load_config(None, overrides(tmp_path / "ref", tiny_data, **SETTINGS)), dist.init_distributed("none")
    )
    want = reference(before.engine.module)
    grads, loss, _ = trained_step(overrides(tmp_path / "run", tiny_data, **split_settings(micro_batch)), 1)
    assert_matches(grads, loss, want)


def test_the_weights_add_no_host_sync_to_the_step(tmp_path, tiny_data, overrides):
    """The normaliser stays on the device: a weighted step waits for the device exactly as often as a plain one."""
    syncs = {}
    for weighted in (False, True):
        layer = split_settings(2, **{"data.retrieval_mix.answer_weight": ANSWER_WEIGHT if weighted else 1.0})
        cfg = load_config(None, overrides(tmp_path / str(weighted), tiny_data, **layer))
        trainer = Trainer(cfg, dist.init_distributed("none"))
        trainer.batches = FixedBatches(2, 0, 1, weighted)
        syncs[weighted] = count_ops(trainer.train_step).syncs
    assert syncs[True] == syncs[False]


# -- two ranks ----------------------------------------------------------------------------------------------------

TWO_RANKS = {
    "ddp": {"parallel.engine": "none"},
    "fsdp": {"parallel.engine": "fsdp"},
    "zero2": {"parallel.engine": "deepspeed", "parallel.zero_stage": 2},
    "fsdp-cp2": {"parallel.engine": "fsdp", "parallel.context_parallel": 2},
}


def launch_two_ranks(engine: str, out: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    """This file as a script on two ranks (the deepspeed launcher for DeepSpeed, torchrun otherwise); past
    ``TIMEOUT_S`` the launcher and every rank are killed (a failure)."""
    from helpers import free_port, run_process_group  # here: the ranks run this file as a script

    if engine == "deepspeed":
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PIPE_COLLECTIVE_TIMEOUT_S": "120"}
    env.pop("PIPE_FAULT", None)
    return run_process_group([*cmd, __file__, "--out", str(out), *overrides], env, REPO, TIMEOUT_S)


@pytest.mark.dist
@pytest.mark.parametrize("layout", sorted(TWO_RANKS))
def test_two_ranks_train_the_global_weighted_mean(layout, tmp_path, tiny_data, overrides, clean_shm):
    """Each rank normalises by the weight sum of the whole global batch, the other rank's sequences included."""
    before = Trainer(
        load_config(None, overrides(tmp_path / "ref", tiny_data, **SETTINGS)), dist.init_distributed("none")
    )
    want = reference(before.engine.module)
    # Micro-batches of 2: accumulation 2 on each of two data-parallel ranks; under cp=2 one data-parallel rank,
    # accumulation 4, every sequence split over both ranks.
    layer = split_settings(2, **TWO_RANKS[layout])
    out = tmp_path / "rank0.pt"
    proc = launch_two_ranks(str(layer["parallel.engine"]), out, overrides(tmp_path / "run", tiny_data, **layer))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=True)
    assert_matches(got["grads"], float(got["loss"]), want)


def rank_main() -> None:
    """One rank of ``launch_two_ranks``: one ``train_step``; rank 0 saves the gradients and the logged loss."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)  # the deepspeed launcher's; unused
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        grads, loss, trainer = trained_step(args.overrides, dist.world_size_from_env())
        if trainer.info.is_main:
            torch.save({"grads": grads, "loss": torch.tensor(loss, dtype=torch.float64)}, args.out)
        dist.barrier()
    finally:
        dist.destroy()


if __name__ == "__main__":
    rank_main()
