"""Hooks on the model's modules that only observe (activation logging, feature extraction):
kept, and run at every call on this rank's shard.

While tracing, each forward hook and forward pre-hook of the model's modules that the
model's user registered (not one of torch's or transformers' own machinery: FSDP2's, a
tensor-parallel style's, HF's output capturing, whose work is inside the traced forward) is
stood in for by ``Observers``. The stand-in calls the hook
on the trace's fake tensors:
- a hook that returns a value changes the module's inputs or output: the graph computes
  that change, at every call;
- a hook that returns ``None`` (or fails on fake tensors, as one that reads a value with
  ``.item()`` does) only observes: the tensors it was given become extra outputs of the
  graph, left on this rank's shard, and after each call ``run_observers`` calls the hook
  with them, in the order the model called its modules. Such a hook that returns a value at
  run time raises: it returned nothing while tracing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree

_LIBRARIES = ("torch.", "transformers.", "accelerate.", "diffusers.", "peft.")
_TENSOR = object()  # where a tensor stands among the leaves an observer was given


def is_library_hook(hook: Callable) -> bool:
    """Whether ``hook`` is a library's own machinery rather than the user's."""
    fn = getattr(hook, "func", hook)  # a functools.partial's function
    return (getattr(fn, "__module__", None) or "").startswith(_LIBRARIES)


@dataclass(frozen=True)
class Observed:
    """One observing hook's call: on which module, whether a pre-hook, and what it was given
    (a spec, and its non-tensor leaves with ``_TENSOR`` where the graph's outputs go)."""

    path: str
    hook: Callable
    pre: bool
    spec: pytree.TreeSpec
    constants: tuple


class Observers:
    """While tracing, the stand-ins for the user's hooks on ``model``'s modules; what the
    observing ones were given (``calls``, ``tensors``)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.calls: list[Observed] = []
        self.tensors: list[torch.Tensor] = []
        self._saved: list = []

    def __enter__(self) -> Observers:
        for path, module in self.model.named_modules():
            for pre, table in ((True, module._forward_pre_hooks), (False, module._forward_hooks)):
                for key, hook in list(table.items()):
                    if not is_library_hook(hook):
                        self._saved.append((table, key, hook))
                        table[key] = self._stand_in(path, hook, pre)
        return self

    def __exit__(self, *exc) -> None:
        for table, key, hook in self._saved:
            table[key] = hook

    def _stand_in(self, path: str, hook: Callable, pre: bool):
        def stand_in(module, *given):
            try:
                result = hook(module, *given)
            except Exception:  # it reads values (.item(), .tolist()): it observes
                result = None
            if result is not None:
                return result
            leaves, spec = pytree.tree_flatten(given)
            tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
            constants = tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
            self.calls.append(Observed(path, hook, pre, spec, constants))
            self.tensors.extend(tensors)
            return None

        return stand_in


def hooked(model: nn.Module) -> list[str]:
    """The paths of ``model``'s modules with forward hooks or pre-hooks of the user's."""
    return [
        path or type(model).__name__
        for path, m in model.named_modules()
        if any(
            not is_library_hook(h)
            for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
        )
    ]


@torch.compiler.disable
def run_observers(model: nn.Module, calls: tuple[Observed, ...], tensors: list) -> None:
    """Each observing hook, called with this call's tensors (this rank's shards)."""
    given = iter(tensors)
    for call in calls:
        leaves = [next(given) if c is _TENSOR else c for c in call.constants]
        module = model.get_submodule(call.path)
        result = call.hook(module, *pytree.tree_unflatten(leaves, call.spec))
        if result is not None:
            kind = "pre-hook" if call.pre else "hook"
            raise RuntimeError(
                f"ringify: a forward {kind} on {call.path or 'the model'} returned a value at "
                "run time but nothing while tracing, so ringify ran it as an observer and "
                "cannot apply what it returned. Make the hook return its change whatever the "
                "tensors' values (it is then part of the graph), or return None."
            )
