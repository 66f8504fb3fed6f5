"""ZeRO-3's (and ZeRO-1's) export under bf16 holds the fp32 master weights, read through DeepSpeed's public
``safe_get_full_fp32_param``, not the 16-bit copy the module computes with: after a 2-rank bf16 run (launched as
users launch it) the export is fp32, holds values no bf16 number can, and equals bit for bit what DeepSpeed's own
public consolidation (``get_fp32_state_dict_from_zero_checkpoint``) reads from the run's checkpoint.

(ZeRO-3 and FSDP exports of the same run in fp32 each match one process: tests/pipeline/test_pipeline_dist.py.
Under bf16 DeepSpeed's fp32 masters start from the bf16-rounded initial weights, FSDP's from the fp32 ones, so the
two engines' bf16 exports are not bit-equal.)"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
LAUNCH = [str(REPO / "launch/pretrain.py"), "--config", str(REPO / "configs/train/debug.yaml")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_bf16(run: Path, stage: int, tiny_data: Path, overrides) -> dict[str, torch.Tensor]:
    """A 3-step 2-rank bf16 run under DeepSpeed ZeRO-``stage``, launched as users launch it; its export."""
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(_free_port())]
    args = overrides(run, tiny_data, **{"train.max_steps": 3, "checkpoint.every": 3, "precision.dtype": "bf16"})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("PIPE_FAULT", None)
    done = subprocess.run(
        cmd + LAUNCH + ["parallel.engine=deepspeed", f"parallel.zero_stage={stage}", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return load_file(run / "export/model.safetensors")


def test_zero3_bf16_export_is_the_fp32_master_weights(tmp_path, tiny_data, overrides, clean_shm):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    run = tmp_path / "zero3"
    exported = _train_bf16(run, 3, tiny_data, overrides)
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints/step_00000003/deepspeed"), "state")
    assert sorted(exported) == sorted(consolidated)
    for name, tensor in consolidated.items():
        assert exported[name].dtype == torch.float32, name
        assert torch.equal(exported[name], tensor.float()), name
    assert any(not torch.equal(t, t.bfloat16().float()) for t in exported.values()), "not a 16-bit copy"


def test_zero1_bf16_export_is_the_fp32_master_weights(tmp_path, tiny_data, overrides, clean_shm):
    """ZeRO-1 under bf16 with fp32 gradient sums (``parallel.grad_reduce_dtype=fp32``, the default; the paper
    config's path) runs DeepSpeed's ``BF16_Optimizer``, whose checkpoints DeepSpeed's consolidation cannot read: its
    export is held against ZeRO-2's of the same run (fp32 masters and fp32 gradient sums both, summed in another
    order), and must not be a 16-bit copy."""
    zero1 = _train_bf16(tmp_path / "zero1", 1, tiny_data, overrides)
    zero2 = _train_bf16(tmp_path / "zero2", 2, tiny_data, overrides)
    assert sorted(zero1) == sorted(zero2)
    for name, tensor in zero2.items():
        assert zero1[name].dtype == torch.float32, name
        torch.testing.assert_close(zero1[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(t, t.bfloat16().float()) for t in zero1.values()), "not a 16-bit copy"
