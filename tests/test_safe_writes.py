"""Every file the project's tools write goes through ``data_prep.safe_write``, never through a planted link.

Two halves. `test_every_write_goes_through_safe_write` reads the code: any call that could create, append to or
replace a file by following a name (``open`` for writing, ``write_text``, ``torch.save``, ``savefig``, ``rename``,
...) outside ``data_prep/safe_write.py`` fails it, unless its path is the temporary file a ``with replacing(...)``
block handed out. So the next file a tool writes cannot escape the guard by being missing from a hand list. The
other tests check the helper itself against real links, FIFOs and hard links.
"""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest

from data_prep import safe_write
from data_prep.safe_write import UnsafeWriteError

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data_prep", "kernels", "launch", "model", "pipeline")
HELPER = "data_prep/safe_write.py"

_PATH_WRITERS = {"save_model", "save_file"}
"""Functions (safetensors') that write the path given as their second argument."""
_QUALIFIED_WRITERS = {
    ("os", "replace"),
    ("os", "rename"),
    ("os", "truncate"),
    ("torch", "save"),
    ("np", "save"),
    ("numpy", "save"),
    ("shutil", "copy"),
    ("shutil", "copy2"),
    ("shutil", "copyfile"),
    ("shutil", "copytree"),
    ("shutil", "move"),
    ("logging", "FileHandler"),
}
_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}
REVIEWED = {"pipeline/demos/dense_llama.py:.save_pretrained()"}
"""Writes by a library into a folder the same function has just created empty (nothing in it can be planted)."""


def _mode_writes(mode: ast.expr | None) -> bool:
    """Whether an ``open`` mode argument may open for writing (anything but a literal read mode may)."""
    if mode is None:
        return False
    if not (isinstance(mode, ast.Constant) and isinstance(mode.value, str)):
        return True
    return any(c in mode.value.split(":")[0] for c in "wax+")


def _mode_argument(call: ast.Call, position: int) -> ast.expr | None:
    for keyword in call.keywords:
        if keyword.arg == "mode":
            return keyword.value
    return call.args[position] if len(call.args) > position else None


class _Scanner(ast.NodeVisitor):
    """Collects the write calls of one module whose target is not a ``with replacing(...) as name`` temp path."""

    def __init__(self, path: str) -> None:
        self.path, self.offenders = path, []
        self.scopes: list[set[str]] = [set()]

    def _safe(self, node: ast.expr | None) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str" and node.args:
            node = node.args[0]
        return isinstance(node, ast.Name) and any(node.id in scope for scope in self.scopes)

    def _flag(self, node: ast.Call, what: str) -> None:
        if f"{self.path}:{what}" not in REVIEWED:
            self.offenders.append(f"{self.path}:{node.lineno}: {what}")

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scopes.append(set())
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            call = item.context_expr
            is_replacing = isinstance(call, ast.Call) and (
                (isinstance(call.func, ast.Name) and call.func.id == "replacing")
                or (isinstance(call.func, ast.Attribute) and call.func.attr == "replacing")
            )
            if is_replacing and isinstance(item.optional_vars, ast.Name):
                self.scopes[-1].add(item.optional_vars.id)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        first = node.args[0] if node.args else None
        if isinstance(func, ast.Name):
            if func.id == "open" and _mode_writes(_mode_argument(node, 1)) and not self._safe(first):
                self._flag(node, "open() for writing")
            elif func.id in _PATH_WRITERS and not self._safe(node.args[1] if len(node.args) > 1 else None):
                self._flag(node, f"{func.id}()")
        elif isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else None
            if (owner, func.attr) in _QUALIFIED_WRITERS:
                target = node.args[1] if func.attr == "save" and len(node.args) > 1 else None
                if not self._safe(target):
                    self._flag(node, f"{owner}.{func.attr}()")
            elif owner == "os" and func.attr == "open":
                flags = (
                    {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                    if len(node.args) > 1
                    else set()
                )
                if flags & _WRITE_FLAGS:
                    self._flag(node, "os.open() for writing")
            elif func.attr == "open" and owner not in ("os", "tarfile", "zipfile", "gzip", "bz2", "lzma"):
                if _mode_writes(_mode_argument(node, 0)) and not self._safe(func.value):
                    self._flag(node, ".open() for writing")
            elif func.attr in ("write_text", "write_bytes", "touch", "rename") and not self._safe(func.value):
                self._flag(node, f".{func.attr}()")
            elif func.attr == "replace" and len(node.args) == 1 and not node.keywords:
                self._flag(node, ".replace() (Path.replace)")
            elif func.attr in ("savefig", "save_pretrained") and not self._safe(first):
                self._flag(node, f".{func.attr}()")
        self.generic_visit(node)


def write_calls_outside_helper(root: Path) -> list[str]:
    """Each call under ``root``'s packages that writes a file by name without `data_prep.safe_write`."""
    offenders: list[str] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if relative == HELPER:
                continue
            scanner = _Scanner(relative)
            scanner.visit(ast.parse(path.read_text(encoding="utf-8"), filename=relative))
            offenders += scanner.offenders
    return offenders


def test_every_write_goes_through_safe_write():
    offenders = write_calls_outside_helper(ROOT)
    assert not offenders, "write these through data_prep.safe_write:\n" + "\n".join(offenders)


def test_the_scan_finds_each_kind_of_write(tmp_path):
    """The scan is not vacuous: a module with one write of each kind is caught line by line, and the same writes
    into a ``replacing`` temp path are not."""
    source = """
import os, shutil, torch
from pathlib import Path

def unsafe(p, fig, m):
    open(p, "a")
    Path(p).write_text("x")
    p.open("wb")
    torch.save({}, p)
    fig.savefig(p)
    os.replace(p, p)
    Path(p).rename(p)
    shutil.copyfile(p, p)
    os.open(p, os.O_WRONLY | os.O_CREAT)
    Path(p).touch()

def safe(p, fig):
    with replacing(p) as tmp:
        open(tmp, "w")
        tmp.write_text("x")
        torch.save({}, tmp)
        fig.savefig(tmp)
    open(p)
    "a b".replace("a", "b")
    os.open(p, os.O_RDONLY)
"""
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "m.py").write_text(source)
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
    lines = [int(o.split(":")[1]) for o in write_calls_outside_helper(tmp_path)]
    assert lines == list(range(6, 16))


@pytest.fixture
def elsewhere(tmp_path):
    """A file outside the folder being written, which a planted link points at."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "out").mkdir()
    return victim


def _plant(kind: str, path: Path, victim: Path) -> None:
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "hardlink":
        os.link(victim, path)
    elif kind == "dangling":
        path.symlink_to(victim.with_name("missing"))
    else:
        os.mkfifo(path)


KINDS = ["symlink", "hardlink", "dangling", "fifo"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "write",
    [
        lambda p: safe_write.write_text(p, "new"),
        lambda p: safe_write.write_bytes(p, b"new", fsync=True),
        lambda p: safe_write.open_append(p).close(),
        lambda p: os.close(safe_write.open_lock(p)),
        lambda p: safe_write.check_name(p),
    ],
    ids=["write_text", "write_bytes", "open_append", "open_lock", "check_name"],
)
def test_a_planted_link_is_refused_and_never_written_through(kind, write, elsewhere):
    path = elsewhere.parent / "out" / "metrics.jsonl"
    _plant(kind, path, elsewhere)
    before = os.lstat(path)
    with pytest.raises(UnsafeWriteError) as info:
        write(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert {"symlink": "symbolic link", "dangling": "symbolic link", "hardlink": "hard link", "fifo": "FIFO"}[
        kind
    ] in message
    assert elsewhere.read_text() == "precious\n"
    assert not elsewhere.with_name("missing").exists()
    assert os.lstat(path).st_ino == before.st_ino  # the planted entry itself is left alone, for its owner
    assert sorted(p.name for p in path.parent.iterdir()) == ["metrics.jsonl"]  # no temporary file left behind


def test_writes_replace_append_and_keep_the_umask_mode(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with safe_write.open_append(path) as f:
        f.write("a\n")
    with safe_write.open_append(path) as f:
        f.write("b\n")
    assert path.read_text() == "a\nb\n"
    safe_write.write_text(path, "c\n")
    assert path.read_text() == "c\n"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), safe_write.replacing(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_move_never_lands_on_a_link(elsewhere):
    out = elsewhere.parent / "out"
    source = out / "step.tmp"
    source.mkdir()
    (out / "step").symlink_to(elsewhere.parent)
    with pytest.raises(UnsafeWriteError, match="symbolic link"):
        safe_write.move(source, out / "step")
    assert source.is_dir()
    file = out / "new.json"
    file.write_text("new")
    os.link(elsewhere, out / "final.json")
    with pytest.raises(UnsafeWriteError, match="hard link"):
        safe_write.move(file, out / "final.json")
    assert elsewhere.read_text() == "precious\n"


def test_a_failed_write_names_its_file_and_how_far_it_got(tmp_path):
    """A library's error that names no file (safetensors, torch's zip writer) still says which file it was and how
    many bytes it had written: the temporary file is removed, so a report could not find them on disk."""
    path = tmp_path / "state.pt"
    with pytest.raises(RuntimeError) as info, safe_write.replacing(path) as tmp:
        tmp.write_bytes(b"x" * 1234)
        raise RuntimeError("unexpected pos 1234 vs 1000")
    assert safe_write.failed_write(info.value) == safe_write.FailedWrite(path, 1234)
    assert safe_write.failed_write(RuntimeError("elsewhere")) is None
