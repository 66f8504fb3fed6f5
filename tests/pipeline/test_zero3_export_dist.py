"""ZeRO-3's export under bf16 holds the fp32 master weights, read through DeepSpeed's public
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


def test_zero3_bf16_export_is_the_fp32_master_weights(tmp_path, tiny_data, overrides, clean_shm):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    run = tmp_path / "zero3"
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(_free_port())]
    args = overrides(run, tiny_data, **{"train.max_steps": 3, "checkpoint.every": 3, "precision.dtype": "bf16"})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("PIPE_FAULT", None)
    done = subprocess.run(
        cmd + LAUNCH + ["parallel.engine=deepspeed", "parallel.zero_stage=3", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    exported = load_file(run / "export/model.safetensors")
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints/step_00000003/deepspeed"), "state")
    assert sorted(exported) == sorted(consolidated)
    for name, tensor in consolidated.items():
        assert exported[name].dtype == torch.float32, name
        assert torch.equal(exported[name], tensor.float()), name
    assert any(not torch.equal(t, t.bfloat16().float()) for t in exported.values()), "not a 16-bit copy"
