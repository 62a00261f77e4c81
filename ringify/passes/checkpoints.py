"""Activation checkpointing: found while the model is traced, kept in the rewritten graph.

``torch.export`` inlines a non-reentrant ``torch.utils.checkpoint`` (HF's
``gradient_checkpointing_enable()``) and leaves no mark of it in the graph. So the
checkpoints are found while export runs the model: a global module pre-hook notes each
module called under a ``checkpoint`` frame while no other module of that frame is
running (the frame's *root*: HF's decoder layer, or ``self.block`` in
``checkpoint(self.block, x, use_reentrant=False)``). After the pass, each root's span of
the rewritten graph is outlined and run under a non-reentrant checkpoint with the
user's ``preserve_rng_state`` and ``context_fn`` (``keep_checkpoints``): the ring op's
communication is recomputed in the backward, as the unmodified model's attention is.

Refused with an error that names the fix, because the region cannot be kept exactly:
a reentrant checkpoint (export runs it under ``no_grad``, so the traced graph loses the
region's gradients) and a checkpointed function that runs operations outside any module.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from ringify.passes.module_regions import module_span, outline
from ringify.runtime.region_runs import Checkpointed

_CHECKPOINT = inspect.unwrap(checkpoint).__code__


@dataclass(frozen=True)
class CheckpointRegion:
    """A module whose call ran under ``torch.utils.checkpoint``, and how it was checkpointed."""

    path: str
    preserve_rng_state: bool
    context_fn: Any


@dataclass
class CheckpointRecorder:
    """Notes the checkpointed modules of one export (``with recorder: export(...)``)."""

    model: nn.Module
    regions: dict[str, CheckpointRegion] = field(default_factory=dict)
    error: str | None = None
    _names: dict[int, str] = field(default_factory=dict)
    _running: list[tuple[nn.Module, Any]] = field(default_factory=list)
    _handles: list = field(default_factory=list)
    _mode: TorchFunctionMode | None = None

    def __enter__(self) -> CheckpointRecorder:
        self._names = {id(m): n for n, m in self.model.named_modules(remove_duplicate=False)}
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._entered),
            nn.modules.module.register_module_forward_hook(self._left, always_call=True),
        ]
        self._mode = _OutsideModules(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._running.clear()

    def check(self) -> None:
        """Raise if a checkpoint seen while tracing cannot be kept."""
        if self.error:
            raise ValueError(self.error)

    def _entered(self, module: nn.Module, args) -> None:
        frame = checkpoint_frame()
        self._running.append((module, frame))
        if frame is None or not self._keepable(frame) or self._owner(frame) is not None:
            return
        if id(module) in self._names and not any(f is frame for _, f in self._running[:-1]):
            self._record(frame, self._names[id(module)])  # the frame's outermost module

    def _left(self, module: nn.Module, args, output) -> None:
        if self._running and self._running[-1][0] is module:
            self._running.pop()

    def operation(self, func) -> None:
        """A torch function ran: refuse it if a checkpointed function runs it outside modules."""
        frame = checkpoint_frame()
        if frame is None or not self._keepable(frame) or self._owner(frame) is not None:
            return
        if not any(f is frame for _, f in self._running):
            self.error = (
                f"a function checkpointed with torch.utils.checkpoint runs {_name(func)} outside "
                "any module: ringify keeps a checkpoint by the module it covers, so this part "
                "would silently lose its checkpoint. Checkpoint a module "
                "(checkpoint(self.block, x, use_reentrant=False)), or, inside a module's own "
                "forward, a method of that module (checkpoint(self._forward, x, ...))."
            )

    def _keepable(self, frame) -> bool:
        """Whether ``frame`` can be kept; if not, note why. (False once an error is noted.)"""
        if self.error is None and frame.f_locals.get("use_reentrant"):
            self.error = (
                "the model runs a reentrant torch.utils.checkpoint (use_reentrant=True), which "
                "torch.export traces under no_grad, so ringify cannot keep it. Use the "
                "non-reentrant form, which ringify keeps: checkpoint(..., use_reentrant=False); "
                "HF: model.activation_checkpointing_enable({'use_reentrant': False}) (before "
                "transformers 5.24: gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False}))."
            )
        return self.error is None

    def _owner(self, frame) -> str | None:
        """The running module whose method the frame checkpoints, from inside its own call
        (HF checkpoints a layer's ``forward``: ``partial(forward, layer)``), recorded as the
        region; else ``None``."""
        function = frame.f_locals.get("function")
        while isinstance(function, functools.partial):
            owner = function.args[0] if function.args else None
            if isinstance(owner, nn.Module) and not isinstance(function.func, nn.Module):
                function = types.MethodType(function.func, owner)
                break
            function = function.func
        owner = getattr(function, "__self__", None)
        if id(owner) not in self._names or not any(m is owner for m, _ in self._running):
            return None  # not a module's, or not called from its own call: not on the nodes
        self._record(frame, self._names[id(owner)])
        return self._names[id(owner)]

    def _record(self, frame, path: str) -> None:
        self.regions.setdefault(
            path,
            CheckpointRegion(
                path, frame.f_locals.get("preserve", True), frame.f_locals.get("context_fn")
            ),
        )


class _OutsideModules(TorchFunctionMode):
    """Hands every torch function run while tracing to the recorder."""

    def __init__(self, recorder: CheckpointRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # what Dynamo compiles inside the model (flex_attention's wrapper) runs no module:
        # nothing to note, and Dynamo cannot trace the recorder's frame walk
        if not torch.compiler.is_dynamo_compiling():
            self.recorder.operation(func)
        return func(*args, **(kwargs or {}))


def _name(func) -> str:
    return getattr(func, "__name__", repr(func))


def checkpoint_frame():
    """The innermost running ``torch.utils.checkpoint.checkpoint`` frame, or ``None``."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _CHECKPOINT:
            return frame
        frame = frame.f_back
    return None


def keep_checkpoints(gm: fx.GraphModule, regions: dict[str, CheckpointRegion]) -> tuple[str, ...]:
    """Outline each checkpointed module's span of the rewritten graph and run it under a
    non-reentrant checkpoint; the modules kept. A region inside another is kept by the
    outer one (its nodes are recomputed there)."""
    kept = []
    for path, region in regions.items():
        if any(path.startswith(other + ".") for other in regions if other != path):
            continue
        span = module_span(gm.graph, (path,))
        if not span:
            continue
        outline(
            gm,
            span,
            f"checkpointed_{len(kept)}",
            lambda g, _, r=region: Checkpointed(g, r.preserve_rng_state, r.context_fn),
        )
        kept.append(path)
    gm.graph.lint()
    return tuple(kept)
