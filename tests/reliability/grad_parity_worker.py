"""T16 worker (run by test_reliability_grad_parity_dist.py under torchrun, 2 ranks): one fp64 step of the tiny
GCA model with uneven shapes, each rank on its half of a fixed global batch, through the trainer's own
engines (DDP, FSDP2). Rank 0 writes the full (gathered) gradients before and after clipping and the gradient
norm, per engine."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from model import GCAForCausalLM
from pipeline.train import dist
from pipeline.train.config import load_config
from pipeline.train.parallel import TorchEngine

MODEL = [
    "model.vocab_size=67",
    "model.d_model=20",
    "model.n_heads=2",
    "model.n_kv_heads=2",
    "model.ffn_hidden=37",
    "model.n_lower_layers=1",
    "model.groups=[1]",
    "model.n_encoder_layers=1",
    "model.chunk_size=8",
    "model.top_k=2",
    "model.window=16",
    "model.attn_backend=naive",
    "model.gumbel_topk=false",
]
"""Odd vocabulary and MLP sizes, so FSDP2 shards rows unevenly (torchtitan #1136)."""
GLOBAL_BATCH, SEQ_LEN = 4, 64


def batch() -> torch.Tensor:
    return torch.randint(0, 67, (GLOBAL_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))


def model() -> GCAForCausalLM:
    torch.manual_seed(0)
    cfg = load_config(None, ["run_dir=unused-run", "data.path=unused-data", *MODEL])
    return GCAForCausalLM(cfg.model).double()


def loss_of(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp64 (the model's own loss casts logits to fp32)."""
    logits = module(x).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run(engine: str, info: dist.DistInfo) -> dict[str, torch.Tensor]:
    cfg = load_config(
        None,
        [
            "run_dir=unused-run",
            "data.path=unused-data",
            *MODEL,
            f"parallel.engine={engine}",
            f"train.global_batch={GLOBAL_BATCH}",
            "train.micro_batch=2",
        ],
        info.world_size,
    )
    eng = TorchEngine(model(), cfg, info, bf16=False)
    per = GLOBAL_BATCH // info.world_size
    mine = batch()[info.rank * per : (info.rank + 1) * per]
    loss_of(eng.model, mine).backward()
    norm = eng.grad_norm_before_step(0.0)  # 0 = no clipping; the norm over all ranks' shards
    out = {f"grad.{n}": full(p.grad).detach().clone() for n, p in eng.module.named_parameters()}
    eng.grad_norm_before_step(norm / 3)  # clip to a third of the norm
    out.update({f"clip.{n}": full(p.grad).detach().clone() for n, p in eng.module.named_parameters()})
    out["norm"] = torch.tensor([norm], dtype=torch.float64)
    return out


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    info = dist.init_distributed("fsdp")
    for engine in ("none", "fsdp"):
        result = run(engine, info)
        if info.is_main:
            save_file({k: v.contiguous() for k, v in result.items()}, f"{out_dir}/{engine}.safetensors")
        dist.barrier()
    dist.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
