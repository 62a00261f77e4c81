"""``ringify::step_masks``: a step's masks on the device, made once, outside any CUDA graph.

A block that a program leaves partly visible runs with its mask as a bias: evaluated in each
call, that is a dozen kernel launches per block in every layer's forward, backward and
recompute, though every layer of the step asks for the same mask (one plan); and FA2 varlen
calls take their sequences (``cu_seqlens``) on the device, worked out on the host. The
graph pass emits this op once per plan, right after it, and gives its two tensors to every
ring call under the plan (``step_layout.py`` says where each block's bias and each step's
sequences lie): the step's masks are then evaluated once, and a call runs none of it.

They are values of the graph, not state of the plan: the graph frees them after the step's
backward, and under ``torch.compile(mode="reduce-overhead")`` the op runs every step outside
the CUDA graphs (``cudagraph_unsafe``, as the plan op: its host-to-device copy of the
sequences cannot be recorded) and the replayed ring calls read the step's own masks, their
FA2 varlen calls included, where they would otherwise evaluate masks inside the graph.
Their sizes are fixed by the rank's rows (``step_layout.Capacity``), so a traced graph knows them.
"""

from __future__ import annotations

import torch

from ringify.runtime.masks.call_plan import PLAN_TYPE, RingPlan
from ringify.runtime.masks.program import evaluate
from ringify.runtime.masks.step_layout import Capacity, GivenMasks

SCHEMA = (
    f"(Tensor[] mask_inputs, {PLAN_TYPE} plan, ScalarType dtype, bool varlen, Device device, "
    "SymInt rows) -> (Tensor, Tensor)"
)


def make_step_masks(
    mask_inputs: list[torch.Tensor], plan: RingPlan, dtype: torch.dtype, varlen: bool,
    device: torch.device, rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(biases, sequences)`` of this rank's ring calls under ``plan`` on ``device``, a rank of
    ``rows`` query rows (their sizes: ``Capacity``), their biases in ``dtype``, open pairs
    run as FA2 varlen calls where ``varlen`` (``RingPlan.step_layout``); the program's inputs
    as the calls hold them. What the layout leaves of them is never read."""
    capacity = Capacity.of(device.type, rows, dtype)
    layout = plan.step_layout(dtype, varlen, capacity)
    biases = torch.empty(capacity.biases, dtype=dtype, device=device)
    sequences = torch.empty(2, capacity.sequences, dtype=torch.int32, device=device)
    _copy_in(sequences, layout.host_sequences)
    given = GivenMasks(layout, biases, sequences)
    for key in layout.biases:
        mask = evaluate(plan.masks.program, mask_inputs, slice(*key[:2]), slice(*key[2:]), device)
        bias = given.bias(key).copy_(mask)
        if mask.dtype == torch.bool:  # log(1) = 0 and log(0) = -inf, exactly (IEEE)
            bias.log_()
    return biases, sequences


def _copy_in(sequences: torch.Tensor, host: torch.Tensor) -> None:
    """``host`` (the layout's, kept across steps) into the first columns of ``sequences``: no
    copy where it is empty; on a GPU from pinned memory, so that the copy waits for nothing
    (from pageable memory it would wait for the stream)."""
    if host.numel() == 0:
        return
    if sequences.device.type == "cuda":
        host = host.pin_memory()
    sequences[:, : host.shape[1]].copy_(host, non_blocking=True)


step_masks = torch.library.custom_op(
    "ringify::step_masks",
    make_step_masks,
    mutates_args=(),
    schema=SCHEMA,
    tags=(torch.Tag.cudagraph_unsafe,),
)


@step_masks.register_fake
def _(mask_inputs, plan, dtype, varlen, device, rows):
    capacity = Capacity.of(device.type, rows, dtype)
    biases = torch.empty(capacity.biases, dtype=dtype, device=device)
    return biases, torch.empty(2, capacity.sequences, dtype=torch.int32, device=device)


def _setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output)


def _backward(ctx, *grads):
    """No gradient: a learned program's inputs get theirs from the ring op's backward."""
    return None, None, None, None, None, None


step_masks.register_autograd(_backward, setup_context=_setup_context)
