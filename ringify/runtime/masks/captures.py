"""A plan's host side: its one device-to-host read, and what a CUDA graph's replay needs of it.

``ringify::host_inputs`` copies a plan's mask-program inputs to the host in one copy, as a
graph op of its own before ``attention_plan`` (``call_plan.py``), so that the plan op takes host
tensors only. Inductor gives an op's opaque output (the plan) the device of the op's tensor
arguments, and on a GPU its check of a compiled graph's outputs
(``_check_triton_bf16_support``) asks each GPU output its dtype, which an opaque output has
none of: a plan made from GPU tensors failed every compiled training step whose graph had
no bf16 input.

A replay (``torch.compile(mode="reduce-overhead")``) runs the recorded ring calls' kernels and
none of ringify's code, so the blocks it runs are those of the plan it was recorded with.
The plan op runs every step, outside the graphs (``cudagraph_unsafe``): it is where a step
whose mask differs from the recorded one is caught. A ring call being recorded notes its
plan's site (geometry and program) and content in ``_captured``; a later plan of that site
with other content raises on every rank. Process-wide, because the replay that would go
wrong runs none of ringify's code; a site is a geometry and a program: a few per model.
"""

from __future__ import annotations

import torch

from ringify.runtime.tiling.tiles import capturing

# The fix the errors about CUDA graphs name.
NO_GRAPHS = "compile without CUDA graphs (torch.compile(..., mode='max-autotune-no-cudagraphs'))"

# Per site, the content of the plan that CUDA graphs recorded ring calls with.
_captured: dict[tuple, object] = {}


def note_captured(key: tuple | None) -> None:
    """A ring call on a plan of ``key`` (its site and content; None: it read no tensor's
    values) is being recorded into a CUDA graph: every later plan of its site must have its
    content (``check_captured``). Two attentions of one site with other contents are
    refused: a later step could bring each the other's mask, and both would pass."""
    if key is None:
        return
    site, content = key
    if _captured.setdefault(site, content) != content:
        raise RuntimeError(
            "two attentions with one mask program and geometry but masks of other values "
            f"({_where(site)}) are being recorded into CUDA graphs, whose replays cannot tell "
            f"which mask a step brings each; {NO_GRAPHS}"
        )


def check_captured(site: tuple, content) -> None:
    """Raise where CUDA graphs recorded ring calls of ``site`` with another content."""
    if _captured.get(site, content) != content:
        raise RuntimeError(
            "this step's attention mask differs from the one a CUDA graph recorded its ring "
            f"calls with ({_where(site)}): replayed, they would run the recorded mask's "
            "blocks. Where masks change from step to step (padding, packed documents), "
            f"{NO_GRAPHS}, or keep the mask the same every step (pad every batch to the "
            "same lengths)"
        )


def _where(site: tuple) -> str:
    geometry = site[0]  # a ``CallGeometry``
    return f"rows {geometry.rows} per rank, ring of {geometry.ring_size}"


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
