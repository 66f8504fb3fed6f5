"""The Python sources an export ships so that ``transformers`` loads it without this repository.

The model code is not rewritten for Hugging Face: the export carries the repository's own modules (the HF entry
points in ``pipeline/hf`` plus every ``model/`` and ``kernels/`` module they import at module level), flattened
into one folder. ``model/gca.py`` becomes ``model_gca.py``, ``kernels/gca/__init__.py`` becomes ``kernels_gca.py``,
and every import of a shipped module becomes a relative import of its flat file (``from .model_gca import ...``),
which is the form ``transformers``' dynamic-module loader copies along with the entry file. Nothing else in a file
changes, so each shipped file is its source with only those import lines rewritten (``derived_from`` checks that).

Imports inside functions or ``try`` blocks that name a module outside the shipped set (the Triton kernels, the
GPU sliding-window path) stay absolute: the loader ignores them, and at run time they fail with ``ImportError``
only if that optional path is asked for.
"""

from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ENTRY_MODULES = ("pipeline.hf.configuration_gca", "pipeline.hf.modeling_gca")
"""The HF entry points; their flat names are the bare module names, which ``auto_map`` in config.json names."""
_SHIPPABLE_PACKAGES = ("model", "kernels", "pipeline.hf")
LOADER_NOTE = (
    "\n# Added by the export (pipeline/hf/bundle.py): transformers copies only the relative imports of the file it\n"
    "# loads from a local folder, not theirs, so every shipped module is named here.\n"
)
MANIFEST_NAME = "gca_sources.json"
"""Which repository file each shipped file came from, with the source's sha256 (for drift checks)."""


@dataclass(frozen=True)
class ShippedFile:
    module: str
    """Dotted module name in this repository, e.g. ``model.gca``."""
    source: Path
    """The repository file it is derived from."""
    name: str
    """File name in the export folder, e.g. ``model_gca.py``."""
    text: str
    """The source with imports of shipped modules made relative."""


def flat_name(module: str) -> str:
    """File stem of ``module`` in the export folder: entry points keep their own name, others join with ``_``."""
    if module in ENTRY_MODULES:
        return module.rsplit(".", 1)[1]
    return module.replace(".", "_")


def _source_path(module: str) -> Path:
    base = REPO_ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    raise FileNotFoundError(f"module {module} has no source file under {REPO_ROOT}")


def _is_repo_module(module: str) -> bool:
    return any(module == pkg or module.startswith(pkg + ".") for pkg in _SHIPPABLE_PACKAGES)


def _top_level_imports(tree: ast.Module) -> list[str]:
    """Repository modules imported unconditionally at module level (what importing the module needs)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise ValueError("a relative import cannot be shipped: the folder is flat; import by absolute name")
    for node in tree.body:
        if isinstance(node, ast.Import) and any(_is_repo_module(a.name) for a in node.names):
            raise ValueError(f"'import {node.names[0].name}' cannot be shipped; use 'from ... import ...'")
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_repo_module(node.module):
            found.append(node.module)
    return found


def _closure(roots: tuple[str, ...]) -> dict[str, Path]:
    """Every module the roots need at import time, with its source file, in discovery order."""
    modules: dict[str, Path] = {}
    todo = list(roots)
    while todo:
        module = todo.pop(0)
        if module in modules:
            continue
        path = _source_path(module)
        modules[module] = path
        todo.extend(_top_level_imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))))
    return modules


def _rewrite(text: str, shipped: set[str], path: Path) -> str:
    """Make every ``from <shipped module> import`` relative to the flat folder, wherever it appears."""
    lines = text.splitlines(keepends=True)
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in shipped):
            continue
        row = node.lineno - 1
        pattern = re.compile(rf"^(\s*from\s+){re.escape(node.module)}(\s+import\b)")
        new, count = pattern.subn(rf"\1.{flat_name(node.module)}\2", lines[row])
        if count != 1:
            raise ValueError(f"{path}:{node.lineno}: cannot rewrite this import of {node.module} to a relative one")
        lines[row] = new
    return "".join(lines)


def _check_no_repo_imports(text: str, path: Path) -> None:
    """Refuse a repository import left outside a ``try`` block: ``transformers`` checks every such import is
    installed before loading, and this repository is not."""

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Try):
            return
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            if name.split(".")[0] in {pkg.split(".")[0] for pkg in _SHIPPABLE_PACKAGES}:
                raise ValueError(
                    f"{path}:{getattr(node, 'lineno', '?')}: 'import {name}' is not shipped and not inside try/except; "
                    "the exported folder could not load without this repository"
                )
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(text, filename=str(path)))


def shipped_files() -> list[ShippedFile]:
    """The remote-code files of an export, derived from the current sources."""
    modules = _closure(ENTRY_MODULES)
    shipped = set(modules)
    files = []
    for module, path in modules.items():
        text = _rewrite(path.read_text(encoding="utf-8"), shipped, path)
        _check_no_repo_imports(text, path)
        if module in ENTRY_MODULES:
            text += _import_every_module(sorted(shipped - {module}))
        files.append(ShippedFile(module, path, flat_name(module) + ".py", text))
    return files


def _import_every_module(modules: list[str]) -> str:
    """The block that makes ``transformers`` copy every shipped module along with an entry file."""
    lines = [f"from .{flat_name(m)} import __name__ as _{flat_name(m)}  # noqa: E402, F401\n" for m in modules]
    return LOADER_NOTE + "".join(lines)


def manifest(files: list[ShippedFile]) -> dict[str, dict[str, str]]:
    """``file name -> {source, sha256 of the source}``, written next to the shipped files."""
    return {
        f.name: {
            "source": f.source.relative_to(REPO_ROOT).as_posix(),
            "source_sha256": hashlib.sha256(f.source.read_bytes()).hexdigest(),
        }
        for f in files
    }


def derived_from(shipped_text: str, source_text: str, shipped_modules: set[str]) -> bool:
    """Whether ``shipped_text`` is ``source_text`` with only shipped-module imports made relative."""
    flat_to_module = {flat_name(m): m for m in shipped_modules}
    shipped_text = shipped_text.split(LOADER_NOTE, 1)[0]

    def restore(match: re.Match[str]) -> str:
        return f"{match.group(1)}{flat_to_module.get(match.group(2), '.' + match.group(2))}{match.group(3)}"

    restored = re.sub(r"(?m)^(\s*from\s+)\.(\w+)(\s+import\b)", restore, shipped_text)
    return restored == source_text
