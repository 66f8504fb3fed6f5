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

__all__ = ["BUILTIN_PREFIX", "CORPORA", "corpus_files", "labelled_corpus_files"]

BUILTIN_PREFIX = "builtin:"
CORPORA = ("python_stdlib",)
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_SUFFIXES = (".py", ".txt")  # the .txt files (test data, licenses) lift the corpus past 10M tokens


def _python_stdlib() -> tuple[Path, list[tuple[str, Path]]]:
    root = sysconfig.get_paths()["stdlib"]
    files: list[tuple[str, Path]] = []
    # os.walk does not follow directory symlinks, so the corpus cannot loop or leave the stdlib tree.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        # the relative directory once per directory: a Path.relative_to per file is most of the listing's time
        folder = os.path.relpath(dirpath, root)
        prefix = "" if folder == os.curdir else Path(folder).as_posix() + "/"
        files.extend((prefix + name, Path(dirpath, name)) for name in filenames if name.endswith(_SUFFIXES))
    files.sort(key=lambda entry: entry[0])
    return Path(root), files


def labelled_corpus_files(name: str) -> tuple[Path, list[tuple[str, Path]]]:
    """The root directory and the document files of the built-in corpus ``name``, each with its path relative to
    the root in POSIX form (its label), sorted by label.

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


def corpus_files(name: str) -> tuple[Path, list[Path]]:
    """The root directory and the sorted document files of the built-in corpus ``name`` (see
    `labelled_corpus_files`, which raises the same errors)."""
    root, files = labelled_corpus_files(name)
    return root, [path for _, path in files]
