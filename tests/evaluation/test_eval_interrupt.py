"""Ctrl-C during an eval (issue 64, finding 13): one line, like the trainer's, saying how many finished samples
are kept and where, and that the same command continues; exit 130, no KeyboardInterrupt traceback. The rerun
continues from the kept samples."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.evaluation.resume import SAMPLES_FILE

REPO = Path(__file__).resolve().parents[2]
SAMPLES = 40
"""About 0.1 s each on one CPU thread: the run is still going when the first one is on disk."""


def test_ctrl_c_during_an_eval_is_one_line_naming_the_kept_samples_and_the_rerun_continues(tiny_export, tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "launch/eval.py",
        "--checkpoint",
        str(tiny_export),
        "--task",
        "passkey",
        "--out",
        str(out),
        "lengths=[16000]",
        "depths=[0.5]",
        f"samples={SAMPLES}",
        "segment=1000",
        "progress=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples = out / SAMPLES_FILE
    deadline = time.monotonic() + 120
    while not (samples.is_file() and len(samples.read_text().splitlines()) >= 2):  # the settings, then a sample
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)

    assert proc.returncode == 130, stderr[-4000:]
    assert "Traceback" not in stderr and stdout == "", stderr[-4000:]
    last = stderr.splitlines()[-1]
    found = re.fullmatch(
        rf"interrupted: (\d+) finished samples are kept in {re.escape(str(samples))}; rerun the same command to "
        "continue",
        last,
    )
    assert found, stderr[-4000:]
    assert sum("interrupted" in line for line in stderr.splitlines()) == 1
    kept = int(found[1])
    lines = samples.read_text().splitlines()
    assert 1 <= kept < SAMPLES and len(lines) == 1 + kept, (kept, len(lines))

    rerun = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert f"{kept} of {SAMPLES} samples finished earlier ({samples}), skipping them" in rerun.stderr
    after = samples.read_text().splitlines()
    assert after[: len(lines)] == lines and len(after) == 1 + SAMPLES  # the kept ones kept, each sample once
    assert (out / "passkey.json").is_file()
