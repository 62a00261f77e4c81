"""A region of the rewritten graph run under a non-reentrant ``torch.utils.checkpoint``,
as the module it came from was in the unmodified model.

A region of the rewritten graph run inside an FSDP2 unit's forward, as the block it came
from was in the unmodified model.

The unit's own FSDP pre-forward all-gathers its parameters (and arms the
post-backward reduce-scatter on the region's inputs); the region then reads them
from the unit, and the post-forward reshards them (arming the pre-backward
all-gather on the outputs). This is how torch's ``register_fsdp_forward_method``
runs a method other than ``forward`` under FSDP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from ringify.runtime.collectives.tp_ops import local_state


class Checkpointed(nn.Module):
    """Runs ``region`` saving only its inputs; it is recomputed in the backward."""

    def __init__(self, region: fx.GraphModule, preserve_rng_state: bool, context_fn: Any):
        super().__init__()
        self.region = region
        self.options = {"use_reentrant": False, "preserve_rng_state": preserve_rng_state}
        if context_fn not in (None, noop_context_fn):  # selective checkpointing's policy
            self.options["context_fn"] = context_fn

    def forward(self, *args):
        return checkpoint(self.region, *args, **self.options)


class FsdpUnitRegion(nn.Module):
    """Runs ``region`` between the FSDP pre-forward of a unit's first module and the
    post-forward of its last (one module, or those ``fully_shard([...])`` grouped);
    ``parameters`` maps a position of the region's inputs to the name, in ``model``, of the
    unit parameter read there."""

    def __init__(
        self,
        region: fx.GraphModule,
        modules: tuple[nn.Module, ...],
        model: nn.Module,
        parameters: dict[int, str],
    ):
        super().__init__()
        self.region = region
        self.parameters_at = parameters
        # the user's modules: used, not owned (not submodules)
        self.__dict__["modules_of_unit"] = modules
        self.__dict__["model"] = model

    def forward(self, *args):
        args, inputs = self._unsharded(args)
        return self._resharded(args, self.region(*inputs))

    # FSDP's own hooks run eagerly, as torch.compile runs them around a compiled block
    # (Dynamo skips FSDP's hooks): the region between them is what a compiler sees.
    @torch.compiler.disable
    def _unsharded(self, args: tuple) -> tuple[tuple, list]:
        """FSDP's pre-forward (its all-gather), then the region's inputs with the unit's
        parameters (each TP weight as its local shard)."""
        first = self.modules_of_unit[0]
        armed, _ = first._get_fsdp_state()._pre_forward(first, args, {})
        # Mixed precision casts every floating input; the graph already casts the block's
        # own inputs (the trace saw the cast), and any other value keeps its traced dtype.
        args = tuple(
            a if isinstance(a, torch.Tensor) and a.dtype != b.dtype else b
            for a, b in zip(args, armed, strict=True)
        )
        inputs = list(args)
        for position, name in sorted(self.parameters_at.items()):
            inputs.insert(position, local_state(self.model.get_parameter(name)))
        return args, inputs

    @torch.compiler.disable
    def _resharded(self, args: tuple, outputs):
        last = self.modules_of_unit[-1]
        return last._get_fsdp_state()._post_forward(last, args, outputs)
