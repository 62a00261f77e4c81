"""The ring-attention custom ops: exact SDPA over a sequence sharded across the ranks of a ring.

``torch.ops.ringify.ring_attention(q, k, v, attn_mask, mask_inputs, key_len, spec, plan=None,
sinks=None, step_masks=None) -> (out, lse)`` and its backward follow the attention ops'
protocol (``protocol.py``): ``spec`` an ``AttentionSpec``, ``plan`` a ``RingPlan`` from
``ringify::attention_plan`` (the graph's one plan per program and step, ``masks/call_plan.py``)
or None: made here; ``step_masks`` the plan's masks from ``ringify::step_masks``
(``masks/step_masks.py``) or None: each masked block's mask evaluated in the call.

Shapes: q_BHSD is this rank's query shard (S = local rows), k_BKSD / v_BKSD its
key/value shard with K kv heads (H % K == 0: GQA/MQA travel unexpanded).
``key_len``: keys at global positions >= key_len are padding and are cut off.
``spec.mask_program`` / ``mask_inputs``: a mask as a program (``masks/program.py``, its
text, or "" for none) and its O(S) inputs; the op bounds it per tile pair
(``masks/tile_masks.py``). ``spec.tiles_per_chunk``: 0 lets the op choose
(``tiling/tiles.py``); tests and benchmarks force a tiling with it.

Forward, P ranks: the K/V tiles of each sub-ring (see ``tiling/tiles.py``) travel round
the ring for P-1 steps; at step i this rank holds the tiles of rank
(rank - i) mod P, attends to them from each of its query tiles with a fused
kernel while the next tiles are already in flight, and merges the results into
float32 accumulators by log-sum-exp.
Backward: K/V tiles travel again; the dK/dV accumulator of each tile travels
with it, every rank adds its contribution, and after P steps it arrives home
(``attention/transport.py``).
Under a mask program whose work zigzag leaves unequal (packed documents of uneven
length), both run on a balanced plan (``masks/balance.py``): some query tiles change rank,
their rows move there first and their results move back (``attention/transport.py``), while
K/V tiles travel from home as ever; ``spec.balance=False`` keeps the shard's own tiling
(tests and benchmarks compare the two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringify.runtime.attention.blocks import (
    QueryNaNs,
    bias_backward,
    block_backward,
    block_forward,
    mark_nan_rows,
    runs_varlen,
)
from ringify.runtime.attention.flash import varlen_backward, varlen_forward
from ringify.runtime.attention.protocol import (
    Accumulator,
    RowSum,
    accumulation_dtype,
    attention_ops,
    bias_dtype,
    gradients_of,
    in_dim_order_of,
    unit_last_stride,
)
from ringify.runtime.attention.sinks import sink_grad, with_sinks
from ringify.runtime.attention.spec import AttentionSpec
from ringify.runtime.attention.transport import GradSlots, narrow_rows, transport_for
from ringify.runtime.collectives.ring import Ring, ring_by_name
from ringify.runtime.masks.call_plan import CallGeometry, RingPlan, plan_for
from ringify.runtime.masks.captures import note_captured
from ringify.runtime.masks.program import add_program_grads, sum_to
from ringify.runtime.masks.tile_masks import tile_of
from ringify.runtime.tiling.tiles import Visibility, capturing


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    mask_inputs: list[torch.Tensor],
    key_len: int,
    spec: AttentionSpec,
    plan: RingPlan | None = None,
    sinks: torch.Tensor | None = None,
    step_masks: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    ring = ring_by_name(spec.group_name)
    acc = accumulation_dtype(q.dtype)
    scale, softcap = spec.scale, spec.softcap
    if _local(ring, q, attn_mask, key_len, spec):
        out, lse = block_forward(q, k, v, is_causal=spec.is_causal, scale=scale, softcap=softcap)
        out, lse = out.to(acc), lse.to(acc).contiguous()
        if sinks is not None:
            out, lse = with_sinks(out, lse, sinks)
        return in_dim_order_of(q, out.to(q.dtype)), lse

    transport, masks = _planned(ring, q, k, attn_mask, mask_inputs, key_len, spec, plan, step_masks)
    (q_at,) = transport.queries_in([q])
    mine = transport.mine
    merged = Accumulator(q_at.tensor, acc)
    nans = QueryNaNs(q_at) if q.device.type == "cpu" else None  # the CPU kernel's NaN check
    kernel = BlockKernel(scale, softcap, nans)
    # Each sub-ring's K/V tiles make their own trip round the ring (as far as they are
    # seen); at each step this rank attends to the tiles it holds from its query tiles.
    for own, _, _, held, kv in transport.visits(*transport.keys_in(k, v)):
        if held is None:  # no query here sees them: they were not sent
            masks.skip(mine, len(own.tiles))
            continue
        for b in masks.pairs(mine, held, count=True, joinable=kv.joined):
            merged.merge(b.rows, *kernel.forward(q_at, kv, b))
    out_acc, lse_acc = merged.results()
    if nans is not None and nans.asked:  # the CPU kernel's NaN rows, marked in lse alone
        mark_nan_rows(out_acc, lse_acc)
    del q_at  # free the moved-in rows before the results move home
    # float32 (no launch); with sinks the results move home in the accumulation dtype first
    out = out_acc if sinks is not None or out_acc.dtype == q.dtype else out_acc.to(q.dtype)
    out, lse = transport.queries_home([out, lse_acc])
    if sinks is not None:
        out, lse = with_sinks(out, lse, sinks)
        out = out if out.dtype == q.dtype else out.to(q.dtype)
    return in_dim_order_of(q, out), lse


def _backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: torch.Tensor | None,
    mask_inputs: list[torch.Tensor],
    key_len: int,
    spec: AttentionSpec,
    plan: RingPlan | None = None,
    sinks: torch.Tensor | None = None,
    step_masks: list[torch.Tensor] | None = None,
    mask_grad: bool = False,
    input_grads: list[bool] | None = None,
) -> tuple:
    """``out`` and ``lse`` are the op's, sinks included: the blocks' probabilities are the
    final ones."""
    ring = ring_by_name(spec.group_name)
    grad_out = unit_last_stride(grad_out)[0]  # the kernels read D as contiguous memory
    no_mask_grad = q.new_empty(0)
    dsinks = q.new_empty(0) if sinks is None else sink_grad(grad_out, out, lse, sinks)
    wanted = input_grads or [False] * len(mask_inputs)
    if _local(ring, q, attn_mask, key_len, spec):
        dq, dk, dv = block_backward(
            grad_out, q, k, v, out, lse, is_causal=spec.is_causal, scale=spec.scale,
            softcap=spec.softcap,
        )  # fmt: skip
        return *gradients_of((q, k, v), (dq, dk, dv)), no_mask_grad, [], dsinks

    acc = accumulation_dtype(q.dtype)
    transport, masks = _planned(ring, q, k, attn_mask, mask_inputs, key_len, spec, plan, step_masks)
    saved = transport.queries_in([grad_out, q, out, lse])
    k_at, v_at = transport.keys_in(k, v)
    mine = transport.mine
    q_at = saved[1].tensor
    dq_sum = RowSum(q_at.shape, acc, q.device, like=q_at)  # the kernels' dQ: q's dim order
    # dK/dV come home in the accumulation dtype: each is converted once, into its input's order
    dk_sum, dv_sum = (RowSum(t.shape, t.dtype, t.device, like=t) for t in (k_at, v_at))
    dmask = torch.zeros(attn_mask.shape, dtype=acc, device=q.device) if mask_grad else None
    dinputs = [
        torch.zeros(x.shape, dtype=acc, device=x.device) if want else None
        for x, want in zip(mask_inputs, wanted, strict=True)
    ]
    learned = (masks.program, mask_inputs, dinputs) if any(wanted) else None
    for own, step, src, held, kv in transport.visits(k_at, v_at):
        if step == 0:  # a sub-ring's trip begins
            trip = transport.grad_trip(own, k_at, v_at, dk_sum, dv_sum, acc)
        here = None
        if held is not None:  # computed before waiting: the dK/dV in flight stay off the path
            here = _tiles_backward(
                held, kv, trip.slots, mine, masks, saved, dq_sum, dmask, learned, spec, acc
            )
        dkv = trip.arrived(step)
        if held is not None:
            dkv = _added(dkv, here, trip.slots, acc, q.device)
        trip.go_on(step, src, dkv if held is not None else None)
    dmask = no_mask_grad if dmask is None else dmask.to(attn_mask.dtype)
    dinputs = [d.to(x.dtype) for d, x in zip(dinputs, mask_inputs, strict=True) if d is not None]
    dq = in_dim_order_of(q_at, dq_sum.result(), q.dtype)  # itself where it is (no launch)
    del saved, q_at  # free the moved-in rows before dq moves home (dK/dV arrived there)
    (dq,) = transport.queries_home([dq])
    dk, dv = transport.keys_home(dk_sum.result(), dv_sum.result())
    return *gradients_of((q, k, v), (dq, dk, dv)), dmask, dinputs, dsinks


ring_attention_op, ring_attention_backward_op = attention_ops("ring_attention", _forward, _backward)


def _local(ring: Ring, q, attn_mask, key_len, spec: AttentionSpec) -> bool:
    """One rank, nothing masked but causality: one block kernel, no plan."""
    return ring.size == 1 and attn_mask is None and not spec.mask_program and key_len >= q.shape[2]


def _planned(ring: Ring, q, k, attn_mask, inputs, key_len, spec: AttentionSpec, plan, given):
    """``(transport, CallMasks)`` of this call from its plan (``masks/call_plan.py``): the step's,
    which the graph made once, else one made here (on the ring); ``given``: the step's
    masks (``ringify::step_masks``) or None."""
    call = (ring.name, ring.size, q.shape[2], spec.is_causal, spec.layout, key_len)
    if plan is None:
        geometry = CallGeometry(*call, spec.tiles_per_chunk, spec.balance, q.device.type)
        plan = plan_for(ring, geometry, attn_mask, spec.mask_program, inputs)
    elif plan.geometry.call() != call:
        raise ValueError(
            f"the plan given was made for another call ({plan!r}, {plan.geometry}); make it "
            "with attention_plan for this call's ring, rows, causality, layout and key length"
        )
    recording = capturing(q.device)  # a CUDA graph will replay this plan's blocks
    if recording:
        note_captured(plan.key)
    plan.count_call()
    transport = transport_for(ring, plan, q, k)
    varlen, heads = runs_varlen(q, spec.softcap), transport.head_share
    masks = plan.bound_masks(inputs, q.device, bias_dtype(q), varlen, given, recording, heads)
    return transport, masks


def _tiles_backward(held, kv, slots, mine, masks, saved, dq_sum, dmask, learned, spec, acc):
    """This rank's share of the held tiles' dK/dV: per slot of ``slots``, its blocks'
    ``(key rows, grad)`` (none where no query here sees it), added up by ``_added``. Its
    queries' share is added into ``dq_sum`` (a ``RowSum``), the mask's into ``dmask`` (a
    learned bias) or, with ``learned`` = (program, inputs, their gradients), into the
    program's."""
    kernel = BlockKernel(spec.scale, spec.softcap)
    here: list[list] = [[] for _ in slots.shapes]
    biased = learned is not None
    for b in masks.pairs(mine, held, biased=biased, joinable=kv.joined):
        r = b.rows
        dq_blk, dk_blk, dv_blk, dbias = kernel.backward(saved, kv, b, dmask is not None or biased)
        if dbias is not None and dmask is not None:
            tile = tile_of(dmask, r, held[b.held], b.cols.stop)
            tile += sum_to(dbias, tile.shape)
        if dbias is not None and learned is not None:
            add_program_grads(*learned, *b.at, masks.every_head(dbias))
        dq_sum.add(r, dq_blk)
        for which, grad in enumerate((dk_blk, dv_blk)):
            for slot, rows, part in slots.parts(which, b):
                here[slot].append((rows, narrow_rows(grad, part) if part else grad))
    return here


@dataclass(frozen=True)
class BlockKernel:
    """The seam between the loops and the kernels: what runs one ``Block`` of a call (its
    ``scale`` and soft cap, chosen once per call; ``nans``: the CPU kernel's NaN check, for
    the forward). A block with sequences runs as FA2 varlen calls, viewed straight from the
    shard and the buffers; any other as one fused kernel (``blocks.py``: biased where masked,
    soft-capped, FA2 on fp16/bf16 CUDA). The loops ask it per block and branch on nothing."""

    scale: float
    softcap: float
    nans: QueryNaNs | None = None

    def forward(self, q, kv, b) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of block ``b``: queries ``q`` (``ShardRows``), held tiles ``kv``."""
        if b.varlen is not None:
            k_seq, v_seq = kv.sequences(b.held, b.tiles, b.cols)
            return varlen_forward(q.sequence(b.rows), k_seq, v_seq, b.varlen, scale=self.scale)
        k_blk, v_blk = kv.keys(b.held, b.tiles, b.cols)
        return block_forward(
            q[b.rows], k_blk, v_blk, is_causal=b.seen is Visibility.DIAGONAL, scale=self.scale,
            bias=b.bias, empty_rows=b.empty_rows, softcap=self.softcap,
            query_nans=None if self.nans is None else self.nans.of(b.rows), nan_out=False,
        )  # fmt: skip

    def backward(self, saved, kv, b, bias_grad: bool) -> tuple:
        """``(dq, dk, dv, dbias)`` of block ``b`` from ``saved`` (dout, q, out, lse as
        ``ShardRows``); ``dbias`` where the block is biased and ``bias_grad`` asks, else None."""
        grad_out, q, out, lse = saved
        r, scale = b.rows, self.scale
        if b.varlen is not None:
            rows = (grad_out.sequence(r), q.sequence(r), *kv.sequences(b.held, b.tiles, b.cols))
            grads = varlen_backward(*rows, out.sequence(r), lse[r], b.varlen, scale=scale)
            return *grads, None
        block = (grad_out[r], q[r], *kv.keys(b.held, b.tiles, b.cols), out[r], lse[r])
        causal, bias = b.seen is Visibility.DIAGONAL, b.bias
        grads = block_backward(
            *block, is_causal=causal, scale=scale, bias=bias, empty_rows=b.empty_rows,
            softcap=self.softcap,
        )  # fmt: skip
        if bias is None or not bias_grad:
            return *grads, None
        dbias = bias_backward(
            *block, is_causal=causal, scale=scale, bias=bias, softcap=self.softcap
        )
        return *grads, dbias


def _added(dkv, here: list[list], slots: GradSlots, acc, device) -> list[torch.Tensor]:
    """``here`` (this rank's share: per slot, its blocks' ``(key rows, grad)``; padding keys
    and keys no query of a block sees are left out) added into the arriving ``dkv``, each
    block into its rows in place; or, at the first step (``dkv`` None), the start of it
    (``RowSum``: zeros for a slot no query here sees)."""
    totals = []
    for i, (parts, shape) in enumerate(zip(here, slots.shapes, strict=True)):
        total = RowSum(shape, acc, device, start=None if dkv is None else dkv[i])
        for rows, grad in parts:
            total.add(rows, grad)
        totals.append(total.result())
    return totals
