"""What a GPU would wait for, counted on the CPU: device-to-host reads and host/device mixing.

On a GPU, reading a device tensor on the host (``item``, ``tolist``, ``bool``, ``numpy``, a
data-dependent shape such as ``nonzero``) waits for the device, and an op mixing a device
tensor with a host tensor fails. A CPU run has no devices, so ``DeviceReads`` models them:
the tensors it is given (parameters, buffers, inputs) are device tensors, and so is every
result of an op with a device tensor argument or an explicit ``device=``. Inside the block it
records, by call site (the innermost frame in ``ringify/``, the testing helpers left out):

- ``read``: a host read of a device tensor;
- ``h2d``: a host tensor copied to the device (``.to(device)``, ``copy_`` into a device
  tensor, ``torch.tensor(data, device=...)``): a blocking copy from pageable memory;
- ``mix``: any other op given a device tensor and a host tensor of one or more dims.

ringify's custom ops are run op body and all under the instrument (their bodies run below
``__torch_function__``, where a mode alone would not see them), so what the ring op does in
its loop is counted, forward and backward. Usage, on one rank::

    with DeviceReads([*model.parameters(), *model.buffers(), *inputs]) as reads:
        model(**inputs).loss.backward()
    reads.counts  # Counter of (kind, site)
"""

from __future__ import annotations

import collections
import sys
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_READS = frozenset({
    "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
    "cpu", "equal", "is_nonzero",
})  # fmt: skip
_SHAPES_FROM_DATA = frozenset({"nonzero", "masked_select", "_unique2", "unique_consecutive"})


class DeviceReads:
    """Counts reads, host-to-device copies and mixes in a block (see the module docstring)."""

    def __init__(self, device_tensors):
        self.counts: collections.Counter = collections.Counter()
        self.reading = 0  # inside a read already counted
        self._device: dict[int, weakref.ref] = {}
        for t in device_tensors:
            self.mark(t)
        self._functions = _Functions(self)
        self._dispatch = _Dispatch(self)

    def mark(self, t) -> None:
        if isinstance(t, torch.Tensor) and not self.on_device(t):
            key = id(t)
            self._device[key] = weakref.ref(t, lambda _, key=key: self._device.pop(key, None))

    def on_device(self, t) -> bool:
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def record(self, kind: str) -> None:
        self.counts[(kind, _site())] += 1

    def __enter__(self) -> DeviceReads:
        self._dispatch.__enter__()
        self._functions.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._functions.__exit__(*exc)
        self._dispatch.__exit__(*exc)


class _Functions(TorchFunctionMode):
    """Every torch call of Python code: reads, copies and mixes; device results marked."""

    def __init__(self, reads: DeviceReads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads, name = self.reads, getattr(func, "__name__", "")
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        device = [x for x in tensors if reads.on_device(x)]
        host = [x for x in tensors if not reads.on_device(x) and x.dim() > 0]
        to_device = kwargs.get("device") is not None or (
            name == "to" and any(isinstance(a, (torch.device, str)) for a in args[1:])
        )
        reading = name in _READS and bool(device)
        if reading:
            reads.record("read")
        elif _copies_to_device(name, tensors, to_device, reads):
            reads.record("h2d")
        elif device and host:
            reads.record("mix")
        reads.reading += reading  # the scalar read below it in ATen is this one
        try:
            out = func(*args, **kwargs)
        finally:
            reads.reading -= reading
        if device or to_device:
            for x in tree_leaves(out):
                reads.mark(x)
        return out


def _copies_to_device(name: str, tensors: list, to_device: bool, reads: DeviceReads) -> bool:
    """Whether the call copies a host tensor (or Python data) to the device."""
    if name in ("tensor", "as_tensor"):
        return to_device and not any(reads.on_device(x) for x in tensors)
    if name == "to":
        return to_device and bool(tensors) and not reads.on_device(tensors[0])
    if name == "copy_":
        return len(tensors) > 1 and reads.on_device(tensors[0]) and not reads.on_device(tensors[1])
    return False


class _Dispatch(TorchDispatchMode):
    """ATen calls: scalar reads from C++ and data-dependent shapes; ringify's ops run whole."""

    def __init__(self, reads: DeviceReads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads = self.reads
        if func.namespace == "ringify":
            return self._run_body(func, args, kwargs)
        name = func.overloadpacket.__name__
        on_device = any(
            reads.on_device(x) for x in tree_leaves(args) if isinstance(x, torch.Tensor)
        )
        read = name == "_local_scalar_dense" or name in _SHAPES_FROM_DATA
        if on_device and read and not reads.reading:
            reads.record("read")
        out = func(*args, **kwargs)
        if on_device:
            for x in tree_leaves(out):
                reads.mark(x)
        return out

    def _run_body(self, func, args, kwargs):
        """A ringify op's own body, under both modes: a dispatcher would call it here."""
        from torch._library.custom_ops import OPDEFS

        body = OPDEFS[f"ringify::{func.overloadpacket.__name__}"]._init_fn
        for x in tree_leaves((args, kwargs)):
            self.reads.mark(x)  # what a ring op is given lives where the model does
        with self.reads._functions:
            out = body(*args, **kwargs)
        for x in tree_leaves(out):
            self.reads.mark(x)
        return out


def _site() -> str:
    """The innermost frame in ringify (the instrument and the testing helpers left out)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/ringify/" in name and "/ringify/testing/" not in name:
            return f"ringify/{name.split('/ringify/', 1)[1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "(outside ringify)"
