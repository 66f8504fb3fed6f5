"""`import streaming` works in the project's environment for any script, through the startup hook that
`make install` writes (data_prep.streaming_compat.write_startup_hook), not only after our code ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from data_prep.streaming_compat import STARTUP_HOOK_FILE, write_startup_hook

READ_WITH_STREAMING_FIRST = """
import json, sys
{before}
from streaming import StreamingDataset
ds = StreamingDataset(remote=sys.argv[1], local=sys.argv[2], shuffle=False, batch_size=1)
print(json.dumps([[int(ds[i]["doc_id"]), ds[i]["tokens"].tolist()] for i in range(len(ds))]))
"""


def _fresh_interpreter(code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The venv's python with nothing of ours on the path: no PYTHONPATH, started outside the repository."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_a_fresh_interpreter_imports_streaming_first_and_reads_a_prepared_split(run_prep, read_split, tmp_path):
    run_prep(output=tmp_path / "ds")
    split = tmp_path / "ds" / "train"
    code = READ_WITH_STREAMING_FIRST.format(before="")
    done = _fresh_interpreter(code, str(split), str(tmp_path / "cache_fresh"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    expected = [[int(s["doc_id"]), s["tokens"].tolist()] for s in read_split(split)]
    assert json.loads(done.stdout) == expected and expected


def test_without_the_hook_the_same_script_fails_on_torchvision(tmp_path):
    """The control: the hook (first in sys.meta_path) is what makes the import work."""
    unhook = (
        "from data_prep.streaming_hook import PrepareBeforeStreaming\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, PrepareBeforeStreaming)]"
    )
    done = _fresh_interpreter(READ_WITH_STREAMING_FIRST.format(before=unhook), "x", "y", cwd=tmp_path)
    assert done.returncode != 0 and "No module named 'torchvision'" in done.stderr, done.stderr


def test_before_streaming_is_imported_torchvision_is_not_faked(tmp_path):
    """Libraries that probe for torchvision (transformers does) must not be told it exists."""
    code = "import importlib.util; print(importlib.util.find_spec('torchvision'))"
    done = _fresh_interpreter(code, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr


def test_the_hook_file_runs_in_a_site_directory(tmp_path):
    """The written .pth line itself, processed by `site` as at startup, registers the finder exactly once."""
    write_startup_hook(tmp_path)
    write_startup_hook(tmp_path)  # rewriting is harmless
    code = (
        "import site, sys; site.addsitedir(sys.argv[1]); site.addsitedir(sys.argv[1]);"
        "from data_prep.streaming_hook import PrepareBeforeStreaming as F;"
        "print(sum(isinstance(f, F) for f in sys.meta_path))"
    )
    assert (tmp_path / STARTUP_HOOK_FILE).is_file()
    done = _fresh_interpreter(code, str(tmp_path), cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr


PREP_WITH_STREAMING_BROKEN = """
import sys
from pathlib import Path

class RefuseStreaming:
    def find_spec(self, fullname, path, target=None):
        if fullname == "streaming":
            raise ImportError("streaming is broken in this test")
        return None

sys.meta_path.insert(0, RefuseStreaming())
from data_prep.config import load_config
from data_prep.shard import main

out = Path(sys.argv[2])
try:
    main(load_config(None, [f"input=[{sys.argv[1]}]", f"output={out}", "tokenizer.vocab_size=300", "progress=false"]))
except ImportError as exc:
    print("raised:", exc)
print("left:", sorted(p.name for p in out.parent.iterdir()))
"""


def test_prep_raises_a_failed_streaming_import_in_the_main_thread_and_leaves_nothing(tmp_path):
    """Prep starts importing streaming on a background thread; an import that fails there must still stop the run
    with that ImportError (not hang, not pass silently) and remove the work directory."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"document {i} says hello to the world number {i * 7}.\n" for i in range(400)))
    work = tmp_path / "work"
    work.mkdir()
    done = _fresh_interpreter(
        PREP_WITH_STREAMING_BROKEN, str(corpus), str(work / "ds"), cwd=Path(__file__).resolve().parents[2]
    )
    assert done.returncode == 0, done.stderr
    assert "raised: streaming is broken in this test" in done.stdout, done.stdout + done.stderr
    assert "left: []" in done.stdout, done.stdout
