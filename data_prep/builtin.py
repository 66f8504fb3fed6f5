"""The built-in offline corpus: the Python standard library's own source code.

It is real, varied text (code, docstrings, comments, test data) present on every machine that can run this
project, so ``make prep`` and ``make demo`` need no network. Files are the ``*.py`` and ``*.txt`` files under
``sysconfig.get_paths()["stdlib"]``, excluding installed third-party packages, in sorted relative-path
order; each file is one document. Its exact content depends on the Python patch release, which is why the
manifest fingerprints it by content.
"""

import os
import sysconfig
from pathlib import Path

from data_prep.errors import InputError

__all__ = ["BUILTIN_PREFIX", "CORPORA", "corpus_files"]

BUILTIN_PREFIX = "builtin:"
CORPORA = ("python_stdlib",)
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_SUFFIXES = (".py", ".txt")  # the .txt files (test data, licenses) lift the corpus past 10M tokens


def _python_stdlib() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    # os.walk does not follow directory symlinks, so the corpus cannot loop or leave the stdlib tree.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        files.extend(Path(dirpath, name) for name in filenames if name.endswith(_SUFFIXES))
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def corpus_files(name: str) -> tuple[Path, list[Path]]:
    """The root directory and the sorted document files of the built-in corpus ``name``.

    Raises:
        InputError: ``name`` is not one of `CORPORA`, or the corpus has no files on this machine.
    """
    if name != "python_stdlib":
        raise InputError(
            f"unknown built-in corpus '{BUILTIN_PREFIX}{name}' (available: "
            f"{', '.join(BUILTIN_PREFIX + c for c in CORPORA)})"
        )
    root, files = _python_stdlib()
    if not files:
        raise InputError(f"built-in corpus '{BUILTIN_PREFIX}{name}': no .py or .txt files under {root}")
    return root, files
