"""A plan's mask-program inputs on the host: the one device-to-host read of a step's plan.

``ringify::host_inputs`` is that read as a graph op of its own, before ``attention_plan``
(``plan.py``), so that the plan op takes host tensors only. Inductor gives an op's opaque
output (the plan) the device of the op's tensor arguments, and on a GPU its check of a
compiled graph's outputs (``_check_triton_bf16_support``) asks each GPU output its dtype,
which an opaque output has none of: a plan made from GPU tensors failed every compiled
training step whose graph had no bf16 input (float32, float16, float64 models).
"""

from __future__ import annotations

import torch

from ringify.runtime.masks.captures import NO_GRAPHS, capturing


def host_copy(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``inputs`` on the host, in one device-to-host read (their bytes side by side); new
    tensors, so that a plan may keep them whatever later happens to the inputs."""
    if not inputs:
        return []
    if capturing(inputs[0].device):
        raise RuntimeError(
            "a ring attention plan reads its mask program's inputs on the host, which a CUDA "
            "graph cannot record; make the plan before the captured region "
            "(torch.ops.ringify.attention_plan, passed to the ring op as plan=), or "
            f"{NO_GRAPHS}"
        )
    inputs = [x.detach().contiguous() for x in inputs]
    raw = torch.cat([x.reshape(-1).view(torch.uint8) for x in inputs])
    raw = torch.from_numpy((raw if raw.device.type == "cpu" else raw.cpu()).numpy())
    host, start = [], 0
    for x in inputs:
        size = x.numel() * x.element_size()
        host.append(raw[start : start + size].clone().view(x.dtype).view(x.shape))  # aligned
        start += size
    return host


# It reads the host: Inductor runs it outside any CUDA graph.
@torch.library.custom_op(
    "ringify::host_inputs", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)
def host_inputs(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``host_copy`` as a graph op: the pass puts one before each ``attention_plan``."""
    return host_copy(inputs)


@host_inputs.register_fake
def _(inputs):
    return [torch.empty(x.shape, dtype=x.dtype, device="cpu") for x in inputs]
