"""Checks for kernels that CUDA graphs must capture: no host-synchronising ATen op, a known number of launches.

:class:`ForbidHostSync` is a dispatch mode that fails on every ATen op that reads device memory on the host
(``.item()``, ``int(tensor)``) or sizes its output by data (``nonzero``, ``unique``), and on ops a captured
call must not make (``index_copy_``, sorts); it records every op it sees. :func:`count_triton_launches`
counts Triton launches; under the interpreter the launch itself copies its arguments on the host (standing
in for the device), so it runs with the mode paused.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ForbidHostSync", "VIEWS_AND_ALLOCATIONS", "count_triton_launches"]

#: op-name prefixes of views and empty allocations: all a kernel wrapper may dispatch on the CPU, where every
#: tensor is a CPU tensor and "no CPU tensor" cannot be checked
VIEWS_AND_ALLOCATIONS = (
    "aten.view.", "aten._reshape_alias.", "aten.as_strided.", "aten.alias.", "aten.select.int", "aten.slice.Tensor",
    "aten.expand.", "aten.unsqueeze.", "aten.squeeze.", "aten.transpose.int", "aten.permute.", "aten.t.",
    "aten.detach.", "aten.empty.", "aten.empty_strided.", "aten.new_empty.", "aten.new_empty_strided.",
)


class ForbidHostSync(TorchDispatchMode):
    """Fail on every host-synchronising ATen op dispatched while active (``with ForbidHostSync() as mode:``).

    Parameters
    ----------
    allowed : iterable of str, optional
        Op-name prefixes (``"aten.view."``); when given, every op outside them fails as well (e.g.
        :data:`VIEWS_AND_ALLOCATIONS` for a CPU check).
    forbid_cpu_tensors : bool
        Also fail on any op that receives a CPU tensor (for a call on CUDA: a CPU tensor there means a host copy).

    Attributes
    ----------
    FORBIDDEN : tuple of str
        Op-name prefixes that always fail.
    seen : list of str
        Name of every op dispatched while active and not :meth:`paused` (``"aten.view.default"``), in order.
    violations : list of str
        One line per op that failed (also raised, as ``AssertionError``, at the op).
    """

    FORBIDDEN: Tuple[str, ...] = (
        "aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero", "aten.unique", "aten._unique",
        "aten.index_copy", "aten.topk", "aten.sort", "aten.argsort", "aten.masked_select", "aten.equal",
    )

    def __init__(self, allowed: Optional[Iterable[str]] = None, forbid_cpu_tensors: bool = False):
        super().__init__()
        self.allowed = tuple(allowed) if allowed is not None else None
        self.forbid_cpu_tensors = forbid_cpu_tensors
        self.seen: List[str] = []
        self.violations: List[str] = []
        self._paused = 0

    @contextlib.contextmanager
    def paused(self):
        """Ops inside the block run unchecked and unrecorded (e.g. the interpreter's stand-in for the device)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        name = str(func)  # "aten.view.default"
        self.seen.append(name)
        why = None
        if name.startswith(self.FORBIDDEN):
            why = "a host-synchronising op"
        elif self.allowed is not None and not name.startswith(self.allowed):
            why = "not a view or allocation allowed here"
        elif self.forbid_cpu_tensors and any(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                                             for t in tree_leaves((args, kwargs))):
            why = "an op on a CPU tensor"
        if why is not None:
            self.violations.append(f"{name}: {why}")
            raise AssertionError(f"ForbidHostSync: {name} dispatched: {why}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_triton_launches(kernel, mode: Optional[ForbidHostSync] = None):
    """Record every Triton launch inside the block as ``(kernel name, grid)``, in a list yielded by the block.

    Parameters
    ----------
    kernel : triton JITFunction or InterpretedFunction
        Any kernel of the module under test: the ``run`` of its class (every kernel's launcher, compiled or
        interpreted; device functions called from a kernel do not go through it) is patched for the block.
    mode : ForbidHostSync, optional
        Paused during each launch.
    """
    cls = type(kernel)
    original = cls.run
    launches: List[Tuple[str, tuple]] = []

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            launches.append((self.fn.__name__, grid if callable(grid) else tuple(grid)))
        with (mode.paused() if mode is not None else contextlib.nullcontext()):
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    cls.run = run
    try:
        yield launches
    finally:
        cls.run = original
