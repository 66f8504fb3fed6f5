"""The finder behind the ``import streaming`` startup hook (see `data_prep.streaming_compat.write_startup_hook`).

The ``.pth`` line imports this module in every interpreter of the project's virtualenv, so it imports nothing at
module level: the work (`ensure_streaming_importable`) is imported only when a script imports ``streaming``.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
"""True for type checkers only (mypy reads any name ``TYPE_CHECKING`` so); importing ``typing`` for it would cost
every interpreter start."""
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType


class PrepareBeforeStreaming:
    """A ``sys.meta_path`` finder that runs `ensure_streaming_importable` just before ``streaming`` is imported; it
    finds no module itself (``find_spec`` is the whole finder protocol)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname == "streaming":
            from data_prep.streaming_compat import ensure_streaming_importable

            ensure_streaming_importable()
        return None


def install() -> None:
    """Register the finder first in ``sys.meta_path``, once per interpreter; what the startup hook runs."""
    if not any(isinstance(finder, PrepareBeforeStreaming) for finder in sys.meta_path):
        sys.meta_path.insert(0, PrepareBeforeStreaming())
