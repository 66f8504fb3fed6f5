"""ATen operators and host synchronisations of one training step: CPU proxies of the GPU step's kernel launches.

On the H200 the step was host-bound (3,307 kernel launches, the GPU busy half the time). Each ATen operator that
computes something is a kernel launch on the GPU, so their count per step, measured on CPU, tracks the launch count
without a GPU; views and other metadata-only operators launch nothing and are counted apart. A host
synchronisation stalls the launch queue until the GPU has caught up: the operators that read a device value on the
host (``.item()``, ``int(t)``, ``bool(t)``), those whose output size depends on values (``nonzero``,
``masked_select``, indexing with a boolean mask) and ``.tolist()`` / ``.cpu()`` are counted one by one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]

SYNC_OPS = frozenset({"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique2"})
"""Operators that wait for the device: a value read on the host, or an output whose size depends on values."""
_INDEX_OPS = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})
_METADATA_OPS = frozenset(
    {
        "aten.detach",
        "aten.lift_fresh",
        "aten.alias",
        "aten._unsafe_view",
        "aten.promote_types",
        "aten.empty",
        "aten.empty_like",
        "aten.new_empty",
        "aten.empty_strided",
        "aten.new_empty_strided",
    }
)
"""Operators that launch no kernel although they are not views: allocations, type promotion, reshapes of fresh
tensors."""


def _name(func: torch._ops.OpOverload) -> str:
    return str(func.overloadpacket)


def _has_bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


@dataclass
class StepOps:
    """What ``count_ops`` saw: every operator by name, and the host synchronisations by cause."""

    ops: Counter = field(default_factory=Counter)
    """Operators that compute (each a kernel launch on a GPU), by ``aten.<name>``."""
    views: int = 0
    """Views, allocations and other metadata-only operators (no kernel)."""
    syncs: Counter = field(default_factory=Counter)
    """Host synchronisations by cause: an operator of ``SYNC_OPS``, ``boolean-mask index``, ``.tolist()``,
    ``.cpu()``."""

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def top(self, n: int = 8) -> str:
        return ", ".join(f"{name.removeprefix('aten.')} {k}" for name, k in self.ops.most_common(n))


class _Counting(TorchDispatchMode):
    def __init__(self, into: StepOps) -> None:
        super().__init__()
        self.into = into

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = _name(func)
        if name == "aten._local_scalar_dense":  # a copy to the host, not a kernel: counted as a sync only
            self.into.syncs[name] += 1
        elif func.is_view or name in _METADATA_OPS:
            self.into.views += 1
        else:
            self.into.ops[name] += 1
        if name in SYNC_OPS - {"aten._local_scalar_dense"}:
            self.into.syncs[name] += 1
        elif name in _INDEX_OPS and _has_bool_index(args):
            self.into.syncs["boolean-mask index"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _host_copies(into: StepOps) -> Iterator[None]:
    """Count ``Tensor.tolist`` and ``Tensor.cpu``: on a CPU tensor neither reaches the dispatcher, on a GPU tensor
    each waits for the device."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu")}

    def counted(name: str) -> Callable[..., Any]:
        def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            into.syncs[f".{name}()"] += 1
            return originals[name](self, *args, **kwargs)

        return call

    try:
        for name in originals:
            setattr(torch.Tensor, name, counted(name))
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def count_ops(fn: Callable[[], Any]) -> StepOps:
    """Run ``fn`` (on CPU tensors) and count the ATen operators and host synchronisations it dispatches, those of
    any ``backward()`` it runs included."""
    seen = StepOps()
    with _host_copies(seen), _Counting(seen):
        fn()
    return seen


_PROFILER_NON_KERNELS = frozenset(
    {
        *(name.replace("aten.", "aten::") for name in _METADATA_OPS),
        *(
            f"aten::{name}"
            for name in (
                "view as_strided transpose t expand expand_as reshape _reshape_alias permute unsqueeze squeeze slice "
                "select narrow unflatten flatten unbind split chunk view_as resolve_conj resolve_neg result_type "
                "detach_ contiguous to type_as linear matmul einsum _local_scalar_dense item is_nonzero"
            ).split()
        ),
    }
)
"""ATen events of the profiler that launch nothing themselves: views, allocations, and composites whose parts
are recorded as their own events."""


def profiled_kernels(fn: Callable[[], Any]) -> int:
    """Kernels of ``fn`` as ``torch.profiler`` records them: the innermost ATen events that compute (an operator
    built of others counts as its parts) plus every kernel inductor generated (``cpp_fused_*`` on CPU, recorded
    when compiled with ``cpp.enable_kernel_profile``; ``triton_*`` on a GPU).

    The count for compiled code: under a ``TorchDispatchMode`` (``count_ops``) the compiled blocks did not run
    their inductor kernels here, the counts were the eager ones; the profiler sees them.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.events()
    computing = [e for e in events if e.name.startswith("aten::") and e.name not in _PROFILER_NON_KERNELS]
    outer = set()
    for event in computing:
        parent = event.cpu_parent
        while parent is not None:
            outer.add(id(parent))
            parent = parent.cpu_parent
    generated = sum(1 for e in events if "cpp_fused" in e.name or e.name.startswith("triton_"))
    return sum(1 for e in computing if id(e) not in outer) + generated


TINY_CONFIG = "configs/train/tiny.yaml"
"""The model whose step is counted: the tiny run's (d_model 128, 2 lower + 2 upper + 1 encoder layers)."""


def step_ops(arch: str, seq_len: int = 256, batch: int = 1, compiled: bool = False) -> dict[str, Any]:
    """Operators of one training step of ``configs/train/tiny.yaml``'s model as ``model.arch=arch`` on random
    tokens, after one warm-up step: forward + backward (the trainer's chunked loss), then the trainer's AdamW step
    in its multi-tensor form (what torch picks for CUDA parameters), each counted on its own; and the profiler's
    kernel count of forward + backward (``profiled_kernels``).

    ``compiled``: the blocks compiled as ``train.compile=blocks`` does (inductor; minutes on CPU), and only the
    profiler's count, the one that sees compiled code."""
    from model import build_model
    from pipeline.train.config import load_config
    from pipeline.train.optim import build_optimizer

    cfg = load_config(ROOT / TINY_CONFIG, [f"model.arch={arch}", "data.path=unused"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.optim)
    for group in opt.param_groups:  # torch's choice for CUDA parameters; on CPU it loops over them one by one
        group["foreach"] = True
    ids = torch.randint(0, cfg.model.vocab_size, (batch, seq_len))

    def forward_backward() -> None:
        model(ids, labels=ids, return_logits=False).loss.backward()

    def optimizer_step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    if compiled:
        import torch._inductor.config as inductor_config

        from pipeline.train.parallel import compile_blocks

        compile_blocks(model)
        with inductor_config.patch({"cpp.enable_kernel_profile": True}):
            forward_backward()  # compiles
        optimizer_step()
        kernels = profiled_kernels(forward_backward)
        return {"arch": arch, "seq_len": seq_len, "compiled": True, "forward_backward_kernels": kernels}
    forward_backward()
    optimizer_step()
    kernels = profiled_kernels(forward_backward)
    optimizer_step()
    fb, op = count_ops(forward_backward), count_ops(optimizer_step)
    return {
        "arch": arch,
        "seq_len": seq_len,
        "compiled": False,
        "forward_backward_kernels": kernels,
        "forward_backward_ops": fb.total,
        "optimizer_ops": op.total,
        "step_ops": fb.total + op.total,
        "views": fb.views + op.views,
        "host_syncs": dict(fb.syncs),
        "optimizer_host_syncs": dict(op.syncs),
        "top": fb.top(),
    }
