"""The export folder is self-contained: its code is the repository's, and it loads where the repository is absent."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

from pipeline.hf.bundle import MANIFEST_NAME, REPO_ROOT, derived_from, shipped_files


def test_shipped_code_is_the_current_sources_with_relative_imports(hf_export):
    """Regenerated from today's sources, every shipped file is byte-identical to the export's, and undoing the
    import rewrite gives back its repository source exactly: the folder carries no second copy of the model."""
    _, directory = hf_export
    files = shipped_files()
    modules = {f.module for f in files}
    assert {"model.gca", "model.stream", "kernels.gca", "pipeline.hf.modeling_gca"} <= modules
    assert not any("triton" in m or m == "kernels.swa.gpu" for m in modules)  # optional GPU code is not shipped
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    assert set(manifest) == {f.name for f in files}
    for f in files:
        shipped = (directory / f.name).read_text(encoding="utf-8")
        assert shipped == f.text
        assert derived_from(shipped, f.source.read_text(encoding="utf-8"), modules), f.name
        assert manifest[f.name]["source"] == f.source.relative_to(REPO_ROOT).as_posix()
        assert manifest[f.name]["source_sha256"] == hashlib.sha256(f.source.read_bytes()).hexdigest()
    assert sorted(p.name for p in directory.glob("*.py")) == sorted(f.name for f in files)


def test_derived_from_notices_an_edit(hf_export):
    f = next(f for f in shipped_files() if f.module == "model.gca")
    source = f.source.read_text(encoding="utf-8")
    modules = {s.module for s in shipped_files()}
    assert derived_from(f.text, source, modules)
    assert not derived_from(f.text.replace("def forward_stream", "def forward_streamed"), source, modules)


_LOAD_SCRIPT = """
import importlib.util, json, sys
for name in ("model", "kernels", "pipeline", "data_prep"):
    assert importlib.util.find_spec(name) is None, f"{name} is importable"
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("copy", trust_remote_code=True).eval()
tok = AutoTokenizer.from_pretrained("copy")
ids = tok("The river crossed the old stone bridge at dawn.")["input_ids"]
with torch.no_grad():
    logits = model(torch.tensor([ids]), use_cache=False).logits[0]
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
print(json.dumps({"ids": ids, "logits": logits.tolist(), "generated": out[0, len(ids):].tolist()}))
"""


def test_folder_loads_without_the_repository(hf_export, tmp_path):
    """A copy outside the repository, loaded by a Python that sees only the installed packages (``-S`` skips the
    editable install's path entry, ``-I`` the working directory and ``PYTHONPATH``), with a fresh module cache."""
    native, directory = hf_export
    shutil.copytree(directory, tmp_path / "copy")
    site_packages = sysconfig.get_paths()["purelib"]
    script = f"import sys; sys.path.append({site_packages!r})\n" + _LOAD_SCRIPT
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert str(REPO_ROOT) not in run.stdout + run.stderr
    ids = torch.tensor([result["ids"]])
    with torch.no_grad():
        expected = native(ids).logits[0]
    assert (torch.tensor(result["logits"]) - expected).abs().max() <= 1e-5
    from pipeline.evaluation.generate import Sampling, generate

    assert result["generated"] == list(generate(native, result["ids"], 12, sampling=Sampling(temperature=0.0)))
    assert Path(tmp_path / "hf_home" / "modules" / "transformers_modules" / "copy" / "model_gca.py").is_file()
