"""Make ``import streaming`` work without a usable torchvision.

mosaicml-streaming 0.13.0 imports ``streaming.vision`` (and through it torchvision) from its package
``__init__``. We do not install torchvision: the only wheel on PyPI is the CUDA build, which fails to load
beside the CPU torch with ``operator torchvision::nms does not exist``. Nothing we use from
streaming (MDSWriter, StreamingDataset) touches torchvision, so a minimal stub is enough.
"""

import importlib.machinery
import logging
import sys
import types

logger = logging.getLogger(__name__)

__all__ = ["ensure_streaming_importable"]


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
