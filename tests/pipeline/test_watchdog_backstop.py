"""The hang watchdog's C-level backstop: a step stuck in C code that holds the GIL (the Python watchdog thread
can then never run) still ends the process, with every thread's stack, shortly after the deadline."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A regular expression with catastrophic backtracking runs in C for hours without releasing the GIL.
STUCK = """
import re, sys
from pipeline.train.dist import Watchdog
watchdog = Watchdog(0.2, rank=0, backstop_grace_s=1.0)
watchdog.arm("step 7")
print("armed", flush=True)
re.match(r"(a+)+$", "a" * 64 + "b")
"""

RELEASED = """
from pipeline.train.dist import Watchdog
import time
watchdog = Watchdog(0.2, rank=0, backstop_grace_s=1.0)
watchdog.arm("step 7")
watchdog.disarm()
time.sleep(2.5)  # past the deadline and the backstop's grace
watchdog.close()
print("done", flush=True)
"""


def _run(code: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    return run, time.monotonic() - start


def test_a_step_holding_the_gil_is_ended_by_the_backstop():
    run, seconds = _run(STUCK)
    assert run.stdout == "armed\n"
    assert run.returncode == 1, run.stderr[-2000:]
    assert "Timeout (0:00:" in run.stderr and "in <module>" in run.stderr, "faulthandler dumped the stacks"
    assert seconds < 60


def test_a_disarmed_backstop_never_fires():
    run, _ = _run(RELEASED)
    assert run.returncode == 0 and run.stdout == "done\n", run.stderr[-2000:]
