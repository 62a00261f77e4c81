"""Activation checkpointing in a traced graph: found, and refused with an error that says so.

``torch.export`` inlines a non-reentrant checkpoint (HF's default
``gradient_checkpointing_enable()``) and nothing in the graph marks its regions, so the
rewritten graph would save every activation, silently: an HF model in training with
checkpointing enabled (its ``gradient_checkpointing`` flags) is refused before the
trace. A reentrant checkpoint's regions become ``wrap_with_set_grad_enabled``
submodules, which the pass does not enter: an attention inside one is refused. Until
the pass keeps checkpointed regions, a checkpointed model is refused, naming the fix.
"""

from __future__ import annotations

from torch import fx, nn
from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled

from ringify.passes.attention import find_attention

_FIX = (
    "ringify cannot keep activation checkpointing yet, and would drop it silently (every "
    "activation saved). Turn it off for the ringified model (HF: "
    "model.gradient_checkpointing_disable(); your code: call the module without "
    "torch.utils.checkpoint.checkpoint)."
)


def check_not_checkpointed(model: nn.Module) -> None:
    """Raise if ``model`` is an HF model in training with gradient checkpointing enabled."""
    flagged = [
        name or type(model).__name__
        for name, m in model.named_modules()
        if getattr(m, "gradient_checkpointing", False) is True and m.training
    ]
    if flagged:
        raise ValueError(
            f"the model checkpoints activations (gradient checkpointing is enabled on "
            f"{flagged[0]}). {_FIX}"
        )


def check_no_checkpointed_regions(gm: fx.GraphModule) -> None:
    """Raise if an attention of the traced graph is inside a reentrant checkpoint's region."""
    for node in gm.graph.nodes:
        if node.target is not wrap_with_set_grad_enabled:
            continue
        region = getattr(gm, node.args[1].target)
        if find_attention(region.graph):
            raise ValueError(
                f"an attention runs inside {node.name}: a region with gradients switched off "
                "or on again, which torch.export makes of a reentrant "
                f"torch.utils.checkpoint (use_reentrant=True) or of torch.no_grad(). {_FIX}"
            )
