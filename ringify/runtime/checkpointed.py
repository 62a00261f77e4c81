"""A region of the rewritten graph run under a non-reentrant ``torch.utils.checkpoint``,
as the module it came from was in the unmodified model."""

from __future__ import annotations

from typing import Any

from torch import fx, nn
from torch.utils.checkpoint import checkpoint, noop_context_fn


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
