"""``make bench-cp``'s byte counting: the bytes it attributes to a rank are what the rank sends (closed forms of a
point-to-point send and an uneven all-to-all), and a real context-parallel step sends no more than the documented
bound and at least its sliding-window halos. Two gloo ranks on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import tiny_config

from model import GCAForCausalLM
from model.context_parallel import cp_loss
from pipeline.bench.cp import FP32_BYTES, count_sent_bytes, cp_bytes_formula

pytestmark = pytest.mark.dist

CFG = dict(vocab_size=64, d_model=32, n_heads=2, n_kv_heads=2, ffn_hidden=64, chunk_size=4, window=6, top_k=2)
T = 61


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        with count_sent_bytes() as plain:
            if rank == 0:
                dist.isend(torch.zeros(3, 5), dst=1).wait()
            else:
                dist.recv(torch.empty(3, 5), src=0)
            splits = [[2, 3], [1, 4]][rank]  # rows this rank sends to rank 0 and rank 1
            received = [[2, 1], [3, 4]][rank]
            dist.all_to_all_single(torch.empty(sum(received), 6), torch.zeros(sum(splits), 6), received, splits)
        torch.manual_seed(0)
        model = GCAForCausalLM(tiny_config(**CFG, groups=[1, 1])).train()
        ids = torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(1))
        with count_sent_bytes() as step:
            cp_loss(model, ids, ids).backward()
        Path(out, f"rank{rank}.json").write_text(json.dumps({"plain": plain, "step": step}))
    finally:
        dist.destroy_process_group()


def test_counted_bytes_are_the_bytes_sent(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, (port, str(tmp_path)), nprocs=2, start_method="spawn")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    row = 6 * FP32_BYTES
    assert got[0]["plain"] == {"p2p": 3 * 5 * FP32_BYTES, "all_to_all": 3 * row}  # 3 rows to rank 1
    assert got[1]["plain"] == {"p2p": 0, "all_to_all": 1 * row}  # 1 row to rank 0

    cfg = tiny_config(**CFG, groups=[1, 1])
    mean_sent = sum(sum(g["step"].values()) for g in got) / 2
    halo = cfg.window * 2 * cfg.n_kv_heads * cfg.head_dim * FP32_BYTES * (cfg.n_lower_layers + cfg.n_upper_layers)
    # rank 0 sends every layer's halo forward, rank 1 its gradient back; the bound covers everything
    assert got[0]["step"]["p2p"] >= halo and got[1]["step"]["p2p"] >= halo
    assert halo <= mean_sent <= cp_bytes_formula(cfg, T, 2)
