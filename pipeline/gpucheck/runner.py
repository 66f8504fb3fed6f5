"""Run the stages of ``make gpu-check`` under one time budget and write ``gpu-check.json`` + ``gpu-check.log``.

Each stage is a subprocess in its own process group with a timeout of its box, cut to what the budget has left
once the later stages' expected times are kept aside (never below its own expected time); on timeout the whole
group is killed (DeepSpeed and pytest start children). So a stage that hangs costs its share and not the stages
after it. A stage whose prerequisite did not finish ok is ``skipped`` with the reason, so is one that the budget
can no longer fit. The JSON is rewritten after every stage: a run cut short still leaves every finished stage's
numbers, with the code's commit (``source``) and the machine's torch/triton/CUDA versions (``machine``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

from data_prep.redaction import redact, redact_tree
from data_prep.safe_write import open_append, write_text
from pipeline.gpucheck.stages import ROOT, Plan, Stage, StageError, build, summary

SCHEMA = 2  # 2: "source" (the code's commit), the stages' expected times
MIN_STAGE_S = 20.0
STAMP_NAME = "gca-source.json"
"""The source stamp ``launch/gpu_check.py --stamp`` writes into the carried wheel folder: the device gets a copy
of the working tree without ``.git``, so the commit travels in this file."""
TAIL_LINES = 40
STATUSES = ("ok", "failed", "timeout", "skipped")


def machine() -> dict:
    """What ran the check: interpreter, torch/triton/CUDA versions and the device (read by a subprocess, so this
    process never initializes CUDA before its stages do)."""
    probe = (
        "import json, torch, triton; c = torch.cuda.is_available(); p = torch.cuda.get_device_properties(0) if c "
        "else None; print(json.dumps({'torch': torch.__version__, 'triton': triton.__version__, 'cuda': "
        "torch.version.cuda, 'cuda_available': c, 'device': p.name if c else None, 'device_count': "
        "torch.cuda.device_count(), 'capability': f'sm_{p.major}{p.minor}' if c else None, 'sms': "
        "p.multi_processor_count if c else None, 'memory_gib': round(p.total_memory / 2**30, 1) if c else None}))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return {"python": platform.python_version(), "probe_error": redact(done.stderr[-500:])}
    info = json.loads(done.stdout.strip().splitlines()[-1])
    return {"python": platform.python_version(), "host": platform.node(), "cpus": os.cpu_count(), **info}


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_source() -> dict | None:
    """The checkout's commit and whether tracked files differ from it (they travel too), or None without git."""
    if not (ROOT / ".git").exists():  # a copy of the tree (the device's): never ask a git repository around it
        return None
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return None
    changed = (_git("status", "--porcelain", "--untracked-files=no") or "").splitlines()
    return {"commit": commit, "dirty": bool(changed), "changed_files": len(changed)}


def write_stamp(path: Path) -> dict:
    """Record the checkout's commit in ``path`` for a device that receives the tree without ``.git``."""
    source = git_source()
    if source is None:
        raise RuntimeError(f"{ROOT} is not a git checkout (git rev-parse HEAD failed): nothing to stamp")
    source["stamped"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(source, indent=2) + "\n")
    return source


def source_info(stamp: Path | None = None) -> dict:
    """The code this run is: from git where the checkout has it, else from the stamp, else unknown (said so)."""
    source = git_source()
    if source is not None:
        return {**source, "from": "git"}
    stamp = stamp or ROOT / ".whl" / STAMP_NAME
    try:
        stamped = json.loads(stamp.read_text())
        return {**stamped, "from": f"stamp {stamp.name}"}
    except (OSError, ValueError):
        return {
            "commit": None,
            "from": f"no .git and no readable {stamp}: run `make gpu-stamp` (or launch/gpu_check.py --stamp) "
            "before carrying",
        }


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(path: Path) -> list[str]:
    lines = path.read_text(errors="replace").splitlines()[-TAIL_LINES:]
    return [redact(line) for line in lines]


class Runner:
    """Runs stages under one budget. A subclass (``make demo-lm-gpu``) sets ``NAME`` (its JSON, log and header
    lines) and ``summarize`` (the JSON's ``summary``, recomputed after every stage)."""

    NAME = "gpu-check"

    def __init__(self, plan: Plan, out: Path, budget_s: float) -> None:
        self.plan, self.out, self.budget_s = plan, out, budget_s
        out.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()
        self.results: dict[str, dict] = {}
        self.log_path = out / f"{self.NAME}.log"
        self.report = {
            "schema": SCHEMA,
            "mode": "cuda" if plan.cuda else "cpu-dry-run",
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "budget_s": budget_s,
            "work_dir": str(plan.work),
            "source": source_info(plan.stamp),
            "machine": machine(),
            "stages": self.results,
        }

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def log(self, text: str) -> None:
        line = redact(text.rstrip("\n")) + "\n"
        sys.stdout.write(line)
        sys.stdout.flush()
        with open_append(self.log_path) as log:
            log.write(line)

    def summarize(self) -> dict:
        return summary(self.results)

    def write(self) -> None:
        self.report["seconds"] = round(time.monotonic() - self.start, 1)
        self.report["summary"] = self.summarize()
        write_text(self.out / f"{self.NAME}.json", json.dumps(redact_tree(self.report), indent=2) + "\n")

    def skip_reason(self, stage: Stage) -> str | None:
        missing = [n for n in stage.needs if self.results.get(n, {}).get("status") != "ok"]
        if missing:
            return f"needs {', '.join(missing)}, which did not finish ok"
        if self.left_s() < MIN_STAGE_S:
            return f"time budget: {max(self.left_s(), 0):.0f} s of {self.budget_s:.0f} s left"
        return None

    @staticmethod
    def stage_env(stage: Stage) -> dict[str, str]:
        """The repository on PYTHONPATH: a GPU image has no editable install, and every stage imports it."""
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **stage.env}

    def reserve_s(self, later: list[Stage]) -> float:
        """The expected seconds of the later stages that can still run (their prerequisites not failed)."""
        failed = {n for n, r in self.results.items() if r.get("status") != "ok"}
        return sum(s.expect_s for s in later if not failed & set(s.needs))

    def run_stage(self, stage: Stage, reserve_s: float = 0.0) -> dict:
        """Run one stage, keeping ``reserve_s`` of the budget for the stages after it; every failure becomes a
        status with the log's last lines, never an exception."""
        result: dict = {"what": stage.what, "command": " ".join(stage.cmd)}
        reason = self.skip_reason(stage)
        if reason:
            return {**result, "status": "skipped", "reason": reason, "seconds": 0.0}
        left = self.left_s()
        timeout = min(stage.box_s, left, max(stage.expect_s, MIN_STAGE_S, left - reserve_s))
        stage_log = self.plan.work / "logs" / f"{stage.name}.log"
        stage_log.parent.mkdir(parents=True, exist_ok=True)
        begin = time.monotonic()
        write_text(stage_log, "")
        with open_append(stage_log) as sink:
            proc = subprocess.Popen(
                stage.cmd,
                cwd=ROOT,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=self.stage_env(stage),
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = None
        result.update(seconds=round(time.monotonic() - begin, 1), timeout_s=round(timeout, 1), expect_s=stage.expect_s)
        self.log(stage_log.read_text(errors="replace"))
        if rc is None:
            return {**result, "status": "timeout", "log_tail": _tail(stage_log)}
        if rc != 0:
            return {**result, "status": "failed", "exit_code": rc, "log_tail": _tail(stage_log)}
        try:
            return {**result, "status": "ok", "numbers": stage.parse()}
        except (StageError, OSError, ValueError, KeyError, IndexError) as err:
            return {
                **result,
                "status": "failed",
                "reason": f"{type(err).__name__}: {err}",
                "log_tail": _tail(stage_log),
            }

    def run(self, stages: list[Stage]) -> dict:
        write_text(self.log_path, "")
        self.log(f"== {self.NAME} ({self.report['mode']}), budget {self.budget_s:.0f} s, work dir {self.plan.work}")
        self.log(f"== machine: {json.dumps(self.report['machine'])}")
        self.write()
        self.log(f"== source: {json.dumps(self.report['source'])}")
        for i, stage in enumerate(stages):
            self.log(f"== stage {stage.name}: {stage.what}\n$ {' '.join(stage.cmd)}")
            self.results[stage.name] = self.run_stage(stage, self.reserve_s(stages[i + 1 :]))
            res = self.results[stage.name]
            self.log(
                f"== stage {stage.name}: {res['status']} in {res['seconds']} s"
                + (f" ({res['reason']})" if "reason" in res else "")
            )
            self.write()
        self.log(f"== {self.NAME} done in {self.report['seconds']} s: {json.dumps(self.report['summary'])}")
        return self.report


def run_check(plan: Plan, out: Path, budget_s: float) -> dict:
    """Run every stage of ``plan``; returns the report also written to ``out/gpu-check.json``."""
    return Runner(plan, out, budget_s).run(build(plan))
