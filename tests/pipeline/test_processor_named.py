"""Every generated CPU figure names the processor it was measured on (issue 65, finding 8: the docs' CPU figures
never did): the demo reports, and each training run's header in metrics.jsonl."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from pipeline.train.metrics import processor
from pipeline.train.trainer import main


def _lscpu_name() -> str:
    """The processor as a person reads it off ``/proc/cpuinfo`` (what ``lscpu`` prints as Model name)."""
    found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    assert found is not None, "this test reads a Linux /proc/cpuinfo"
    return f"{len(os.sched_getaffinity(0))}-core {found.group(1).strip()}"


def test_the_processor_is_the_cores_this_process_may_use_and_the_cpu_model():
    assert processor() == _lscpu_name()


@pytest.mark.parametrize("demo", ["demo", "demo_lm", "demo_cpt"])
def test_each_demo_report_names_the_processor(tmp_path, demo):
    from pipeline.demos.demo_cpt_report import write_demo_cpt_report
    from pipeline.demos.demo_lm_report import write_demo_lm_report
    from pipeline.demos.demo_report import write_report

    write = {
        "demo": lambda: write_report(tmp_path, [], {"stage": 1.0}),
        "demo_lm": lambda: write_demo_lm_report(tmp_path, [], {"stage": 1.0}),
        "demo_cpt": lambda: write_demo_cpt_report(tmp_path, {"stage": 1.0}),
    }[demo]
    markdown = write()
    assert f"Measured on a {_lscpu_name()}." in markdown
    assert markdown == (tmp_path / "results.md").read_text()


def test_a_training_runs_header_names_the_processor(tmp_path, tiny_data, overrides):
    run = tmp_path / "run"
    args = {"train.max_steps": 3, "train.eval_every": 0, "checkpoint.export": False, "checkpoint.every": 3}
    assert main("configs/train/debug.yaml", overrides(run, tiny_data, **args)) == 0
    start = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["derived"]["processor"] == _lscpu_name()
