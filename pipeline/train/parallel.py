"""Parallelism applied from the outside to the plain ``GCAForCausalLM``, and one ``Engine`` interface over it.

``build_deepspeed_config`` generates the DeepSpeed JSON from the typed config (no hand-written ds_config can
drift). ``apply_activation_checkpointing`` and ``apply_fsdp`` transform the module. The engines give the
trainer one vocabulary -- ``micro_step``, ``grad_norm_before_step``, ``optimizer_step``, ``save``, ``load``,
``full_state_dict`` -- so ``pipeline/train/trainer.py`` has no per-backend branches.

Ordering: activation checkpointing wraps blocks first, then FSDP shards them (or DeepSpeed wraps the model),
then the optimizer is built over the final (possibly sharded) parameters.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as torch_dist
import torch.nn as nn

from data_prep.safe_write import replacing
from model.context_parallel import cp_loss, cp_loss_and_token_losses
from model.lm import CausalLMOutput, lm_loss, scored_positions, weighted_lm_loss
from pipeline.train.config import TrainConfig, check_grad_reduce_dtype
from pipeline.train.dist import DistInfo
from pipeline.train.optim import build_optimizer

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from model.gca import GCAForCausalLM

log = logging.getLogger(__name__)

_WRAPPED = "_checkpoint_wrapped_module."


def _has_module_list(module: nn.Module) -> bool:
    return any(isinstance(m, nn.ModuleList) for m in module.modules())


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: children of ``nn.ModuleList``s that hold no ``nn.ModuleList`` themselves (the
    lower, encoder and upper layers; a retrieval group is a container of upper layers, not a block)."""
    return [
        child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m if not _has_module_list(child)
    ]


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every block in the backward pass (non-reentrant, so it composes with FSDP2 and ZeRO-3).

    Must run before ``apply_fsdp`` / DeepSpeed wrapping. Saved state dicts keep the original names (the
    wrapper strips its prefix).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    targets = {id(b) for b in blocks(model)}
    for parent in [m for m in model.modules() if isinstance(m, nn.ModuleList)]:
        for i, child in enumerate(parent):
            if id(child) in targets:
                parent[i] = checkpoint_wrapper(child)
    log.info("activation checkpointing: wrapped %d blocks", len(targets))


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """``torch.compile`` every transformer block in place (``train.compile=blocks``); returns how many.

    In place (``Module.compile``), so parameter names and state dicts stay as they were. Dynamo treats a block's
    parameters as inputs, so blocks of one class share one graph (a compile per class, per grad mode and shape, not
    per block). Static shapes: a training step's never change. Must run before ``apply_activation_checkpointing``,
    which then wraps the compiled blocks.
    """
    targets = blocks(model)
    for block in targets:
        block.compile(backend=backend, dynamic=False)
    log.info("torch.compile: %d blocks (%s)", len(targets), backend)
    return len(targets)


def build_deepspeed_config(cfg: TrainConfig, world_size: int, bf16: bool) -> dict[str, Any]:
    """The DeepSpeed config dict for ``deepspeed.initialize(config=...)``, derived from ``cfg``.

    The optimizer is our torch AdamW passed as a client optimizer (no JIT-built FusedAdam/CPUAdam), and the LR
    is set on it by the trainer each step, so no ``optimizer``/``scheduler`` sections are generated.

    A bf16 run names its gradient dtype (``parallel.grad_reduce_dtype``): left out, DeepSpeed accumulates and
    reduces gradients in the model dtype, bf16. An fp32 run's config has neither key: it is fp32 throughout.
    """
    p = cfg.parallel
    check_grad_reduce_dtype(cfg, bf16)  # precision.dtype=auto is resolved only now
    zero: dict[str, Any] = {"stage": p.zero_stage}
    if p.zero_stage >= 1:
        zero.update(overlap_comm=False, contiguous_gradients=True)
    if p.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if p.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config: dict[str, Any] = {
        "train_batch_size": cfg.train.global_batch,
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum(world_size),
        "gradient_clipping": cfg.train.grad_clip,
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # Offload with a torch optimizer: we accept CPU AdamW speed rather than JIT-building DeepSpeedCPUAdam.
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if bf16:
        # grad_accum_dtype: what micro-batches add into (ZeRO-1 without offload: BF16_Optimizer's whole gradient;
        # otherwise the ZeRO optimizer's gradient partition). communication_data_type: what the reduction runs in;
        # left bf16, it would round even an fp32 buffer (ZeRO-1 all-reduces BF16_Optimizer's buffer in it).
        config["data_types"] = {"grad_accum_dtype": p.grad_reduce_dtype}
        config["communication_data_type"] = p.grad_reduce_dtype
    return config


def _clean(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {k.replace(_WRAPPED, ""): v.detach().cpu() for k, v in state.items()}


@dataclass(frozen=True)
class Needles:
    """A micro-batch's retrieval labels (``RankBatches.retrieval_labels``) and the weight of the retriever's
    supervised loss (``data.retrieval_mix.retriever_loss``), which the training objective adds to the LM loss."""

    labels: torch.Tensor
    weight: float


def _with_needles(loss: torch.Tensor, out: CausalLMOutput, needles: Needles | None) -> torch.Tensor:
    if needles is None:
        return loss
    assert out.needle_loss is not None  # the model returns it whenever retrieval_labels were passed
    return loss + needles.weight * out.needle_loss


def next_token_loss(
    model: nn.Module,
    x: torch.Tensor,
    weights: torch.Tensor | None,
    weight_norm: torch.Tensor | None = None,
    needles: Needles | None = None,
) -> torch.Tensor:
    """Next-token loss of ``x`` (``model.lm_loss``): the model's own mean loss, or with ``weights [B, T]``
    (aligned with ``x`` as labels) ``sum(w * ce)`` over the predicted positions divided by ``weight_norm``, by
    default by their own ``sum(w)`` (the weighted mean of ``x`` alone).

    The weights stay outside the model's forward: FSDP's mixed precision would cast a floating-point forward
    argument to bf16. Without them the model computes the loss from its final hidden states in slices
    (``return_logits=False``, ``model.chunked_loss``): the ``[B, T, vocab]`` logits are never held whole.
    ``needles``: the objective adds the retriever's supervised loss, from the same forward.
    """
    labels = None if needles is None else needles.labels
    if weights is None:
        out = model(x, labels=x, return_logits=False, retrieval_labels=labels)
        return _with_needles(out.loss, out, needles)
    out = model(x, retrieval_labels=labels)
    return _with_needles(lm_loss(out.logits, x, weights, weight_norm), out, needles)


def next_token_loss_rows(
    model: nn.Module,
    x: torch.Tensor,
    weights: torch.Tensor | None,
    weight_norm: torch.Tensor | None = None,
    needles: Needles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`next_token_loss` (the same number and gradients) and the micro-batch's `row_stats`, from the same forward:
    per row the *unweighted* next-token cross-entropy whatever ``weights`` (the per-source losses report how well
    each source is modelled, not the training objective's weighting)."""
    labels = None if needles is None else needles.labels
    if weights is None:
        out = model(x, labels=x, return_logits=False, token_loss=True, retrieval_labels=labels)
        loss, per_token = out.loss, out.token_loss
    else:
        out = model(x, retrieval_labels=labels)
        loss, per_token = weighted_lm_loss(out.logits, x, weights, weight_norm)
    return _with_needles(loss, out, needles), row_stats(per_token, scored_positions(x))


def row_stats(token_loss: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """``[B, 2]`` fp32 of per-position losses ``[B, n]`` (0 where nothing is scored) and which are scored: per row
    the loss summed over its scored positions, and their count. Sums: those of a context-parallel group's spans add
    up to the whole row's."""
    return torch.stack([token_loss.float().sum(1), scored.sum(1).float()], dim=1)


def _bf16_all_reduce(process_group, bucket):  # unannotated: DDP rejects the string annotations of this module
    """DDP communication hook for ``parallel.grad_reduce_dtype=bf16``: each bucket of fp32 gradients is averaged
    over the ranks in bf16 (half the traffic) and written back as fp32.

    torch's own ``bf16_compress_hook`` does the same but is refused at registration on every build without CUDA and
    NCCL (or XPU), so CPU runs over gloo, which all-reduces bf16, could not use it."""
    compressed = bucket.buffer().to(torch.bfloat16).div_(torch_dist.get_world_size(process_group))
    future = torch_dist.all_reduce(compressed, group=process_group, async_op=True).get_future()

    def decompress(done: torch.futures.Future) -> torch.Tensor:
        buffer = bucket.buffer()
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(decompress)


class TorchEngine:
    """``parallel.engine=none`` (plain module, DDP when several ranks) and ``fsdp`` (FSDP2, with context
    parallelism when ``info.context_parallel > 1``)."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, info: DistInfo, bf16: bool) -> None:
        self.kind, self.info, self.cfg = cfg.parallel.engine, info, cfg
        self.autocast = bf16 and self.kind == "none"
        self.cp_group: torch_dist.ProcessGroup | None = None
        if self.kind == "fsdp":
            mesh = device_mesh(info)
            apply_fsdp(model, cfg, info, bf16, mesh)
            if info.context_parallel > 1:
                self.cp_group = mesh.get_group("cp")
            self.module = model
            self.model: nn.Module = model
        elif info.world_size > 1:
            self.module = model
            # The query norms get no gradient when nothing trains the retriever (random picks, or the stop-gradient
            # ablation); DDP must be told, or it fails at the next step waiting for their reduction.
            untrained = cfg.model.arch == "gca" and (cfg.model.retrieval == "random" or not cfg.model.retrieval_grad)
            self.model = torch.nn.parallel.DistributedDataParallel(
                model,
                device_ids=[info.device.index] if info.device.type == "cuda" else None,
                find_unused_parameters=untrained,
            )
            if bf16 and cfg.parallel.grad_reduce_dtype == "bf16":
                self.model.register_comm_hook(None, _bf16_all_reduce)
        else:
            self.module = self.model = model
        self.optimizer = build_optimizer(self.module, cfg.optim)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def _sync_context(self, sync: bool) -> Any:
        if sync:
            return contextlib.nullcontext()
        if self.kind == "fsdp":
            self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
            return contextlib.nullcontext()
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def loss(
        self,
        x: torch.Tensor,
        weights: torch.Tensor | None = None,
        weight_norm: torch.Tensor | None = None,
        rows: list[torch.Tensor] | None = None,
        needles: Needles | None = None,
    ) -> torch.Tensor:
        """The micro-batch's loss (``next_token_loss``); with ``rows``, its `row_stats` are appended to it."""
        with torch.autocast(self.info.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if rows is None:
                return next_token_loss(self.model, x, weights, weight_norm, needles)
            loss, stats = next_token_loss_rows(self.model, x, weights, weight_norm, needles)
        rows.append(stats)
        return loss

    def micro_step(
        self,
        x: torch.Tensor,
        accum: int,
        last: bool,
        weights: torch.Tensor | None = None,
        weight_norm: torch.Tensor | None = None,
        rows: list[torch.Tensor] | None = None,
        needles: Needles | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its loss over whole sequences (what one process
        computes), also under context parallelism. ``weight_norm``: what the weighted loss divides by
        (``next_token_loss``; the trainer's global normaliser). ``rows``: where to append the micro-batch's
        `row_stats` (under context parallelism, of this rank's span of each row), from the same forward.
        ``needles``: add the retriever's supervised loss (whole sequences: the config refuses it with context
        parallelism)."""
        if self.kind == "fsdp" and last:
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]
        if self.cp_group is not None:
            if needles is not None:
                raise ValueError(
                    "the retriever's supervised loss scores whole sequences: not under context parallelism"
                )
            return self._cp_micro_step(x, accum, last, weights, weight_norm, rows)
        with self._sync_context(last):
            loss = self.loss(x, weights, weight_norm, rows, needles)
            (loss / accum).backward()
        return loss.detach()

    def _cp_micro_step(
        self,
        x: torch.Tensor,
        accum: int,
        last: bool,
        weights: torch.Tensor | None,
        weight_norm: torch.Tensor | None,
        rows: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        """Every rank of the CP group runs its span of the same ``x`` (``cp_loss``: its share of the loss).

        FSDP2 averages each gradient over all the ranks it shards over, dp x cp, but the shares of one sequence
        must be summed: scaling the share by ``cp`` turns the average into the sum over the CP group divided by
        the data-parallel degree, the single-process gradient of the dp ranks' mean loss."""
        cp = self.info.context_parallel
        model = cast("GCAForCausalLM", self.model)
        with self._sync_context(last):
            if rows is None:
                share = cp_loss(model, x, x, self.cp_group, weights, weight_norm)
            else:
                share, token_ce, scored = cp_loss_and_token_losses(model, x, x, self.cp_group, weights, weight_norm)
                rows.append(row_stats(token_ce, scored))
            (share * (cp / accum)).backward()
        loss = share.detach().clone()
        torch_dist.all_reduce(loss, group=self.cp_group)  # the sequences' loss, the same on every rank of the group
        return loss

    def grad_norm_before_step(self, max_norm: float) -> float | None:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def discard_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def grad_norm_after_step(self) -> float | None:
        return None

    def save(self, directory: Path) -> None:
        if self.kind == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

            state = {
                "model": get_model_state_dict(self.model),
                "optim": get_optimizer_state_dict(self.model, self.optimizer),
            }
            dcp.save(state, checkpoint_id=str(directory / "dcp"))
        elif self.info.is_main:
            with replacing(directory / "state.pt") as state_file:
                torch.save({"model": self.module.state_dict(), "optim": self.optimizer.state_dict()}, state_file)

    def load(self, directory: Path) -> None:
        if self.kind == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import (
                get_model_state_dict,
                get_optimizer_state_dict,
                set_state_dict,
            )

            state: dict[str, Any] = {
                "model": get_model_state_dict(self.model),
                "optim": get_optimizer_state_dict(self.model, self.optimizer),
            }
            dcp.load(state, checkpoint_id=str(directory / "dcp"))
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            # weights_only: a checkpoint file never gets to run code when unpickled.
            state = torch.load(directory / "state.pt", map_location=self.info.device, weights_only=True)
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optim"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded fp32 model weights on rank 0 (collective under FSDP; other ranks get ``{}``)."""
        if self.kind == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return _clean(get_model_state_dict(self.model, options=opts))
        return _clean(self.module.state_dict()) if self.info.is_main else {}


def device_mesh(info: DistInfo) -> DeviceMesh:
    """The ``("dp", "cp")`` mesh of all ranks, numbered as ``DistInfo`` numbers them (``rank = dp_rank * cp +
    cp_rank``): a context-parallel group is consecutive ranks, so its point-to-point traffic stays within a node."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(info.device.type, (info.dp_size, info.context_parallel), mesh_dim_names=("dp", "cp"))


def apply_fsdp(model: nn.Module, cfg: TrainConfig, info: DistInfo, bf16: bool, mesh: DeviceMesh) -> None:
    """Shard every block, then the root, with FSDP2 ``fully_shard`` over all ranks of ``mesh`` (its ``dp`` and
    ``cp`` dimensions flattened).

    The ranks of a context-parallel group hold the same parameters and optimizer state, so sharding over them too
    divides that memory by the whole world instead of by the data-parallel degree: CP is for sequences whose
    activations already crowd a device. The price is that the parameter all-gathers span the CP group as well,
    and that FSDP averages gradients over dp x cp (``TorchEngine`` scales the CP loss to make that a sum over CP).

    ``parallel.fsdp_reshard_after_forward`` applies to the blocks; the root keeps its parameters gathered until
    its backward (docs/training.md, "FSDP2 and the model's output").

    On gloo, FSDP2's built-in gradient averaging is wrong (pytorch#162338), so reductions are forced to plain
    sums with FSDP doing the division itself; ``tests/pipeline/test_pipeline_dist.py`` checks the gradients against a
    single process on the whole batch.

    Under bf16, ``reduce_dtype`` is ``parallel.grad_reduce_dtype``: fp32 makes FSDP2 add each micro-batch's bf16
    gradient into an fp32 buffer and reduce-scatter that; bf16 (equal to the parameter dtype, so FSDP2 drops the
    cast) accumulates and reduce-scatters in bf16. The sharded gradient is fp32 either way (the parameters' dtype).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    shard_mesh = mesh._flatten("dp_cp")
    reduce_dtype = torch.float32 if cfg.parallel.grad_reduce_dtype == "fp32" else torch.bfloat16
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype) if bf16 else MixedPrecisionPolicy()
    reshard = cfg.parallel.fsdp_reshard_after_forward
    for block in blocks(model):
        fully_shard(block, mesh=shard_mesh, mp_policy=mp, reshard_after_forward=reshard)
    # The root is left to FSDP's own choice (None): it keeps its parameters -- the embedding, the LM head tied to
    # it, the landmark, the query norms -- gathered from forward into backward, whose first op is the head's. An
    # explicit value would free them after forward and gather the largest weight again at once.
    fully_shard(model, mesh=shard_mesh, mp_policy=mp, reshard_after_forward=None)
    if info.device.type == "cpu":
        model.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    log.info(
        "FSDP2: sharded %d blocks + root over %d ranks (data parallel %d x context parallel %d)",
        len(blocks(model)),
        info.world_size,
        info.dp_size,
        info.context_parallel,
    )


class DeepSpeedEngine:
    """``parallel.engine=deepspeed``: ZeRO 0-3 with our AdamW as the client optimizer."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, info: DistInfo, bf16: bool) -> None:
        import deepspeed

        self.info, self.cfg = info, cfg
        self.optimizer = build_optimizer(model, cfg.optim)
        self.ds_config = build_deepspeed_config(cfg, info.world_size, bf16)
        self.model, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=self.ds_config)
        self.module = self.model.module

    @property
    def param_groups(self) -> list[dict]:
        # DeepSpeed's ZeRO optimizers step the client optimizer's own param-group dicts, so setting "lr" on
        # them is what the next update uses.
        return self.optimizer.param_groups

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def loss(
        self,
        x: torch.Tensor,
        weights: torch.Tensor | None = None,
        weight_norm: torch.Tensor | None = None,
        rows: list[torch.Tensor] | None = None,
        needles: Needles | None = None,
    ) -> torch.Tensor:
        if rows is None:
            return next_token_loss(self.model, x, weights, weight_norm, needles)
        loss, stats = next_token_loss_rows(self.model, x, weights, weight_norm, needles)
        rows.append(stats)
        return loss

    def micro_step(
        self,
        x: torch.Tensor,
        accum: int,
        last: bool,
        weights: torch.Tensor | None = None,
        weight_norm: torch.Tensor | None = None,
        rows: list[torch.Tensor] | None = None,
        needles: Needles | None = None,
    ) -> torch.Tensor:
        """As ``TorchEngine.micro_step`` (no context parallelism)."""
        loss = self.loss(x, weights, weight_norm, rows, needles)
        self.model.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
        if not last:
            self.model.step()  # off the accumulation boundary this only advances DeepSpeed's counters
        return loss.detach().float()

    def grad_norm_before_step(self, max_norm: float) -> float | None:
        return None  # DeepSpeed computes (and clips) the norm inside step(); see grad_norm_after_step

    def optimizer_step(self) -> None:
        self.model.step()

    def discard_grads(self) -> None:
        self.model.zero_grad()

    def grad_norm_after_step(self) -> float | None:
        norm = self.model.get_global_grad_norm()
        return None if norm is None else float(norm)

    def save(self, directory: Path) -> None:
        self.model.save_checkpoint(str(directory / "deepspeed"), tag="state", save_latest=False)

    def load(self, directory: Path) -> None:
        path, _ = self.model.load_checkpoint(
            str(directory / "deepspeed"), tag="state", load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint under {directory / 'deepspeed'}")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded fp32 weights on rank 0, as the FSDP export writes them (other ranks get ``{}``).

        Each parameter comes from DeepSpeed's public ``safe_get_full_fp32_param``: the optimizer's fp32 master copy
        (a collective gather of the partitions under ZeRO-3, so every rank calls it in the same order), not the
        16-bit copy the module computes with under bf16. Without a master copy (no ZeRO, no mixed precision) the
        parameter itself is fp32. Buffers are never partitioned and are taken from the module."""
        from deepspeed.utils import safe_get_full_fp32_param

        params = dict(self.module.named_parameters())
        state: dict[str, torch.Tensor] = {}
        for name, value in self.module.state_dict().items():
            if name in params:
                full = safe_get_full_fp32_param(params[name])
                value = params[name] if full is None else full
            if self.info.is_main:
                state[name] = value.detach().float().cpu().clone()
        return _clean(state) if self.info.is_main else {}


def build_engine(model: nn.Module, cfg: TrainConfig, info: DistInfo, bf16: bool) -> TorchEngine | DeepSpeedEngine:
    if cfg.train.compile == "blocks":
        compile_blocks(model)
    if cfg.parallel.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.parallel.engine == "deepspeed":
        return DeepSpeedEngine(model, cfg, info, bf16)
    return TorchEngine(model, cfg, info, bf16)
