"""Make ``import streaming`` work without a usable torchvision.

mosaicml-streaming 0.13.0 imports ``streaming.vision`` (and through it torchvision) from its package
``__init__``. We do not install torchvision: the only wheel on PyPI is the CUDA build, which fails to load
beside the CPU torch with ``operator torchvision::nms does not exist``. Nothing we use from
streaming (MDSWriter, StreamingDataset) touches torchvision, so a minimal stub is enough.

Our own modules call `ensure_streaming_importable` before they import streaming. So that any script in the
project's environment can ``import streaming`` first, ``make install`` also writes a startup hook
(`write_startup_hook`): a ``.pth`` file in the venv's site-packages that registers a meta-path finder
(`data_prep.streaming_hook`) which runs `ensure_streaming_importable` the moment ``streaming`` is imported, and
does nothing else. Why a hook: no CPU
build of torchvision matching torch 2.13 exists on the package registries (the 0.28.0 wheel there is linked
against CUDA and fails to load, ``libc10_cuda.so`` missing), and 0.13.0 is the newest mosaicml-streaming, still
importing vision at package import. Until ``streaming`` is imported nothing changes: ``find_spec("torchvision")``
stays None, so libraries that probe for torchvision are not misled.
"""

import importlib.machinery
import logging
import sys
import sysconfig
import types
from pathlib import Path

from data_prep.safe_write import write_text

logger = logging.getLogger(__name__)

__all__ = ["STARTUP_HOOK_FILE", "ensure_streaming_importable", "write_startup_hook"]

STARTUP_HOOK_FILE = "gca_pretrain_streaming_compat.pth"
"""Sorts after setuptools' ``__editable__.*.pth``, which puts this repository on ``sys.path`` first."""


def ensure_streaming_importable() -> bool:
    """Install a torchvision stub if the real torchvision cannot be imported. Call before ``import streaming``.

    Safe to call many times and from any process (the pipeline's data-loader workers included). When a
    working torchvision is installed it is left alone.

    Returns:
        True if the stub was installed by this call, False if a real (or an already stubbed) torchvision
        is importable.
    """
    try:
        import torchvision  # noqa: F401

        return False
    except Exception:  # a broken CUDA torchvision raises RuntimeError, a missing one ImportError
        pass
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    tv = types.ModuleType("torchvision")
    tv.__path__ = []
    datasets = types.ModuleType("torchvision.datasets")
    datasets.VisionDataset = type("VisionDataset", (), {})  # type: ignore[attr-defined]
    transforms = types.ModuleType("torchvision.transforms")
    transforms.__path__ = []
    functional = types.ModuleType("torchvision.transforms.functional")
    functional.to_tensor = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional  # type: ignore[attr-defined]
    for module in (tv, datasets, transforms, functional):
        # transformers calls importlib.util.find_spec("torchvision"), which raises ValueError on a module
        # without __spec__, so each stub gets a real ModuleSpec.
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None, is_package=hasattr(module, "__path__"))
        sys.modules[module.__name__] = module
    logger.debug("torchvision is not importable; installed a stub so that `import streaming` works")
    return True


def write_startup_hook(site_packages: str | Path | None = None) -> Path:
    """Write the ``.pth`` startup hook into ``site_packages`` (default: this interpreter's purelib directory).

    The line imports `data_prep.streaming_hook` (which imports nothing more at start-up) only when ``data_prep`` is
    importable, so an environment where the project was uninstalled starts without an error.
    """
    directory = Path(site_packages or sysconfig.get_paths()["purelib"])
    line = (
        "import importlib.util; importlib.util.find_spec('data_prep') is not None and "
        "__import__('data_prep.streaming_hook').streaming_hook.install()\n"
    )
    path = directory / STARTUP_HOOK_FILE
    write_text(path, line)
    return path
