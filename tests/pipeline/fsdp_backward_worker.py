"""One rank of ``test_fsdp_backward.py``: one forward and backward of the tiny GCA model under the trainer's own
FSDP2 setup (``apply_activation_checkpointing`` then ``apply_fsdp``, bf16 parameters, fp32 reductions, tied head),
on this rank's share of a fixed batch; rank 0 writes the unsharded gradients and the loss to ``--out``.

``--traversal pytree`` makes FSDP2 find the tensors a module returns the way torch 2.11 does (``tree_flatten``:
a dataclass is one opaque leaf) on a torch that walks dataclasses itself; on a torch without that walk the
option changes nothing. This is what reproduces the H200 crash on this machine's torch.

Launched as plain processes with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` (loopback) and ``MASTER_PORT`` set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as torch_dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers

from helpers import TINY_TRAIN_OVERRIDES  # noqa: E402

from model import build_model  # noqa: E402
from pipeline.train.config import load_config  # noqa: E402
from pipeline.train.dist import DistInfo  # noqa: E402
from pipeline.train.parallel import _WRAPPED, apply_activation_checkpointing, apply_fsdp, device_mesh  # noqa: E402

BATCH, SEQ_LEN, DATA_SEED, MODEL_SEED = 4, 64, 11, 7
MODEL_OVERRIDES = {
    **{k: v for k, v in TINY_TRAIN_OVERRIDES.items() if k.startswith("model.")},
    "model.gumbel_topk": False,  # per-rank noise could not match one process
}


def tiny_config(world_size: int):
    overrides = [f"{k}={v}" for k, v in MODEL_OVERRIDES.items()]
    paths = ["run_dir=unused-run", "data.path=unused-data"]  # required keys; nothing is read or written there
    return load_config(None, [*paths, *overrides, "train.global_batch=4", "train.micro_batch=2"], world_size)


def batch() -> torch.Tensor:
    """The fixed global batch every run and the single-process reference use."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    return torch.randint(2, int(MODEL_OVERRIDES["model.vocab_size"]), (BATCH, SEQ_LEN), generator=generator)


def fresh_model(world_size: int) -> torch.nn.Module:
    torch.manual_seed(MODEL_SEED)
    return build_model(tiny_config(world_size).model)


def _pytree_grad_tensors(output: object) -> tuple[torch.Tensor, ...]:
    leaves, _ = tree_flatten(output)
    return tuple(t for t in leaves if torch.is_tensor(t) and t.requires_grad)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--traversal", choices=("pytree", "native"), required=True)
    args = parser.parse_args()
    if args.traversal == "pytree":
        from torch.distributed.fsdp._fully_shard import _fsdp_state

        if hasattr(_fsdp_state, "collect_grad_tensors"):
            _fsdp_state.collect_grad_tensors = _pytree_grad_tensors

    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo")
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    try:
        info = DistInfo(rank=rank, local_rank=rank, world_size=world, device=torch.device("cpu"))
        cfg = tiny_config(world)
        model = fresh_model(world)
        apply_activation_checkpointing(model)
        apply_fsdp(model, cfg, info, True, device_mesh(info))
        share = BATCH // world
        x = batch()[rank * share : (rank + 1) * share]
        out = model(x, labels=x)
        # Between forward and backward: the root's parameters (embedding = tied head) stay gathered, the blocks'
        # are sharded again (parallel.fsdp_reshard_after_forward=true).
        root_gathered = not isinstance(model.embed.weight, DTensor)
        blocks_sharded = isinstance(model.lower[0].attn_norm.weight, DTensor)
        out.loss.backward()
        loss = out.loss.detach().float().clone()
        torch_dist.all_reduce(loss)
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor()  # collective: every rank, same order
            grads[name.replace(_WRAPPED, "")] = grad.float().contiguous()
        if rank == 0:
            save_file(grads, str(args.out / "grads.safetensors"))
            facts = {
                "loss": loss.item() / world,
                "tied_head": model.head is None,
                "root_gathered_after_forward": root_gathered,
                "blocks_sharded_after_forward": blocks_sharded,
                "torch": torch.__version__,
            }
            (args.out / "facts.json").write_text(json.dumps(facts))
    finally:
        torch_dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
