"""wandb online without a server or a key (docs/reliability.md C7): one line before any work saying what to do, or,
in ``auto``, offline logging; never a hang.

No test reaches the internet: the wandb server is ``WANDB_BASE_URL`` on a loopback port that nothing listens on
(connection refused at once), or a loopback socket that accepts nothing and never answers (a silent network), and
the netrc file is a private empty one. Runs that used to hang run in a subprocess under a hard timeout.
"""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import pytest
from reliability_harness import overrides, train_process

from pipeline.train.trainer import main
from pipeline.train.wandb_online import server_unreachable

pytestmark = pytest.mark.reliability

FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"
"""Well-formed for wandb (40 characters), valid nowhere; only ever offered to a loopback port."""


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def no_server(monkeypatch, tmp_path) -> str:
    """wandb's server is a closed loopback port; no key anywhere (no variables, an empty netrc)."""
    url = f"http://127.0.0.1:{closed_port()}"
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("")
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setenv("WANDB_BASE_URL", url)
    monkeypatch.setenv("WANDB_SILENT", "true")
    return url


def wandb_args(run: Path, data: Path, **extra: object) -> list[str]:
    return overrides(run, data, **{"train.max_steps": 3, "logging.wandb": True, **extra})


def test_online_without_a_key_is_one_line_before_any_work(data, tmp_path, no_server, caplog):
    """Before: wandb.init raised a traceback at once, after run_dir (config.yaml, metrics.jsonl) was written."""
    run = tmp_path / "run"
    assert main(None, wandb_args(run, data, **{"logging.wandb_mode": "online"})) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "logging.wandb_mode=offline" in errors[0] and "WANDB_API_KEY" in errors[0], errors
    assert not run.exists()


def test_online_with_an_unreachable_server_is_one_line_before_any_work(data, tmp_path, no_server, monkeypatch):
    """Before: the run hung ~107 s in wandb.init, then a traceback, with run_dir written."""
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    run = tmp_path / "run"
    done = train_process(wandb_args(run, data, **{"logging.wandb_mode": "online"}), timeout=60)
    assert done.returncode == 2, done.output[-3000:]
    errors = [line for line in done.output.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1, done.output[-3000:]
    assert no_server in errors[0] and "logging.wandb_mode=offline" in errors[0], errors[0]
    assert "Traceback" not in done.output and FAKE_KEY not in done.output
    assert not run.exists()


def test_auto_with_a_key_and_no_server_falls_back_to_offline(data, tmp_path, no_server, monkeypatch):
    """``auto`` goes online because WANDB_API_KEY is set; the server does not answer, so the run logs offline (a
    warning names the server) and trains to the end. Before: the same ~107 s hang and traceback."""
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    run = tmp_path / "run"
    done = train_process(wandb_args(run, data), timeout=60)
    assert done.returncode == 0, done.output[-3000:]
    warnings = [line for line in done.output.splitlines() if "[WARNING]" in line and no_server in line]
    assert len(warnings) == 1 and "offline" in warnings[0], done.output[-3000:]
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1
    assert FAKE_KEY not in done.output


def test_a_server_that_never_answers_is_given_up_on_within_the_bound():
    """A silent network (the connection is accepted by the kernel, nothing ever answers) costs the bound, not
    wandb's ~107 s."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        reason = server_unreachable(url, timeout_s=1.0)
        waited = time.monotonic() - t0
    assert reason is not None and "1 s" in reason, reason
    assert waited < 3.0
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        port = other.getsockname()[1]
    assert "refused" in (server_unreachable(f"http://127.0.0.1:{port}", timeout_s=1.0) or "")
