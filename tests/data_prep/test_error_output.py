"""A failing ``launch/prep.py`` prints its error line and nothing after it, also when the error ends the run while the
background import of streaming is inside torch's own import (``data_prep.cli._setup_logging``).

torch registers an exit hook that logs FakeTensor cache statistics at INFO before its import sets its loggers to
WARNING; when prep logged INFO from every logger, those lines followed the error. The moment is made certain here,
not left to timing: a ``sitecustomize`` holds the background thread's import at ``torch.compiler`` (imported after
that hook is registered and before torch configures its loggers) and lets prep's main thread go on only then.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

HOLD = '''
import os, sys, threading

_held = threading.Event()


class _Hold:
    """Finds torch.compiler as usual, but the background import thread that loads it stops there for good."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch.compiler" or threading.current_thread() is threading.main_thread():
            return None
        spec = next(s for f in sys.meta_path if f is not self for s in [f.find_spec(name, path, target)] if s)

        def hold(module):
            open(os.environ["HELD_MARK"], "w").close()
            _held.set()
            threading.Event().wait()

        spec.loader.exec_module = hold
        return spec


sys.meta_path.insert(0, _Hold())
_start = threading.Thread.start


def start(self):
    _start(self)
    if self.name == "import-streaming":  # data_prep.shard's background import: go on once it is held
        _held.wait(120)


threading.Thread.start = start
'''


def test_a_prep_error_during_the_background_import_is_the_only_line(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("one two three four five six seven eight nine ten\n" * 20)
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(HOLD)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "hook"), "HELD_MARK": str(tmp_path / "held")}
    # val_fraction=0: nothing to log before the tokenizer; a vocabulary larger than the text allows fails its training
    args = [f"input={corpus}", f"output={tmp_path / 'out'}", "tokenizer.vocab_size=5000", "val_fraction=0"]
    done = subprocess.run(
        [sys.executable, str(REPO / "launch" / "prep.py"), *args, "progress=false"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=env,
    )
    assert (tmp_path / "held").exists(), "the background import was not held inside torch's import"
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith("prep: error: bad value tokenizer.vocab_size=5000: "), done.stderr
