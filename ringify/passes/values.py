"""Every node's value as a rank computes it, recorded once the rewrite is done.

While it rewrites, the pass reads each node's ``meta["val"]`` at the *global* shapes
export gave it, and the nodes it inserts stand for global tensors too (``nodes.call``).
That convention serves the rewrite, but a rank's graph computes local tensors, and some
inserted nodes (a reshape to a rank's rows, the halves of a gather) have no global value
at all. So after the rewrite ``record_local_values`` runs the graph once on fake tensors
shaped like this rank's inputs: every node, the model's and each one the pass inserted,
then carries the value it has on a rank (shape, dtype, device), which the structural
checks and any later FX pass read. The convention of the rewritten graph is therefore
*local*: ``meta["val"]`` is what one rank holds.
"""

from __future__ import annotations

import logging

import torch
from torch import fx
from torch._guards import detect_fake_mode

from ringify.passes.graph.nodes import val
from ringify.passes.graph.report import strict

log = logging.getLogger("ringify")


def record_local_values(gm: fx.GraphModule, inputs: list) -> None:
    """Set ``meta["val"]`` of every node of ``gm`` to its value on a rank whose call passes
    ``inputs`` (one per placeholder, in order; tensors or other values)."""
    mode = detect_fake_mode([val(n) for n in gm.graph.nodes if n.op == "placeholder"])
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = [_fake(mode, x, val(p)) for x, p in zip(inputs, placeholders, strict=True)]
    try:
        with mode:
            _Recorder(gm).run(*fakes)
    except Exception as e:  # the graph still runs: only its metadata is incomplete
        if strict():  # the suite and ringify.check: a rank's graph that fails
            raise  # on fake tensors is a defect of the rewrite until shown otherwise
        log.warning(
            "ringify: could not record every node's value on a rank (%s: %s); later FX "
            "passes may find nodes without meta['val']",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )


def _fake(mode, x, traced):
    """This rank's input as a fake tensor (the traced value where the input is whole)."""
    if not isinstance(x, torch.Tensor):
        return traced if traced is not None else x
    if isinstance(traced, torch.Tensor) and traced.shape == x.shape:
        return traced
    return mode.from_tensor(x)


class _Recorder(fx.Interpreter):
    """Runs the graph on fake tensors and records each node's result as its value; reads of
    the model's state give the values export recorded."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self._state = {n.target: n for n in gm.graph.nodes if n.op == "get_attr"}

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        if n.op != "output" and _a_value(result):  # not a HOP's body, nor an autocast state
            n.meta["val"] = result
        return result

    def get_attr(self, target, args, kwargs):
        recorded = self._state[target].meta.get("val")
        return recorded if recorded is not None else super().get_attr(target, args, kwargs)


def _a_value(x) -> bool:
    """A tensor, number or sequence of them: a node's value (not an object of the runtime)."""
    if isinstance(x, (list, tuple)):
        return all(_a_value(y) for y in x)
    return x is None or isinstance(x, (torch.Tensor, int, float, bool, torch.SymInt))
