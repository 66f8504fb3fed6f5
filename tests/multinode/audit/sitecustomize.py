"""Loaded at start-up by every Python process of a node whose ``PYTHONPATH`` names this directory (the multinode
tests' write audit): records each file it opens for writing, and each rename, under ``$GCA_AUDIT_ROOT`` into
``$GCA_AUDIT_DIR/<host>-<pid>.jsonl``, so a test can prove that each checkpoint file had exactly one writer.

Python's audit hooks see ``open`` and ``os.rename``/``os.replace``. ``torch.save`` to a file name opens the file in
C++, out of their sight, so ``torch.serialization.save`` is wrapped as the module is first imported (before
``torch/__init__`` binds it as ``torch.save``)."""

import importlib.abc
import importlib.machinery
import json
import os
import socket
import sys

_ROOT = os.environ.get("GCA_AUDIT_ROOT", "")
_OUT = os.environ.get("GCA_AUDIT_DIR", "")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _writes(mode: object, flags: object) -> bool:
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


def _record(event: str, path: str) -> None:
    line = json.dumps({"event": event, "path": path, "rank": os.environ.get("RANK"), "host": socket.gethostname()})
    name = os.path.join(_OUT, f"{socket.gethostname()}-{os.getpid()}.jsonl")
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _hook(event: str, args: tuple) -> None:
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        if path.startswith(_ROOT) and _writes(args[1] if len(args) > 1 else None, args[2] if len(args) > 2 else None):
            _record("write", path)
    elif event in ("os.rename", "os.replace") and len(args) >= 2:
        src = os.path.abspath(os.fsdecode(args[0]))
        if src.startswith(_ROOT):
            _record("rename", src + " -> " + os.path.abspath(os.fsdecode(args[1])))


def _wrap_save(module: object) -> None:
    save = module.save

    def audited_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(f))
            if path.startswith(_ROOT):
                _record("write", path)
        return save(obj, f, *args, **kwargs)

    module.save = audited_save


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _wrap_save(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.serialization":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if _ROOT and _OUT:
    sys.addaudithook(_hook)
    sys.meta_path.insert(0, _Finder())
