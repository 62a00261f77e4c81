"""One rank's training step read from the model's own graph on the meta device.

The model (a copy on the meta device: nothing allocated) runs forward and backward at a few
small numbers of positions per rank. Every tensor an op makes is followed from its creation
to its last reference, so the peak of live bytes is the step's peak beyond the parameters and
their gradients, whatever the model is (MoE, MLA, hybrids, DiTs): no formula per family.
Each attention runs as ringify's op keeps it (q, k, v, out and a float32 log-sum-exp; a mask
becomes an O(S) program, so its tensor is not counted). The peaks at two sizes give bytes per
position, which scale to the target length because ringify shards every tensor on the
sequence. FLOPs of everything but attention are counted the same way; attention's time is
the transport model's.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

# Styles of transformers' TP plans that split a weight's output rows (dim -2) or its input
# columns (dim -1), so that the rank's activations are narrower; every other style but the
# replicated ones splits the parameters alone.
_COLWISE = ("colwise", "packed_colwise", "local_colwise")
_ROWWISE = ("rowwise", "packed_rowwise", "local_rowwise")
_WHOLE = ("replicated_with_grad_allreduce", "moe_tp_experts", "sequence_parallel")


@dataclass(frozen=True)
class Attention:
    """One attention call as one rank runs it: its heads (after TP), K/V heads, head dims of
    q/k and of v, and whether it is causal."""

    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    causal: bool


@dataclass(frozen=True)
class Affine:
    """``fixed + per_position * positions``: bytes or FLOPs of one rank at a length."""

    fixed: float
    per_position: float

    def at(self, positions: float) -> float:
        return self.fixed + self.per_position * positions


@dataclass(frozen=True)
class Footprint:
    """What one rank's step holds and computes, as functions of its positions.

    ``parameters``: elements of the whole model; ``tp_split``: those TP splits (one TP rank
    holds ``tp_split / tp`` of them); ``largest_block``: elements of the largest repeated
    block (what FSDP2 gathers at a time). ``activations``/``checkpointed``: peak live bytes
    of forward and backward beyond parameters and gradients, without and with each block
    checkpointed; ``forward``/``forward_checkpointed``: the same over the forward alone
    (where the outputs are whole beside it). ``flops``: forward FLOPs of everything but
    attention; ``outputs``: bytes of the model's outputs (what ``outputs="full"``
    gathers). ``bend``: how far the smallest probe lies off the line through the others
    (relative): memory growing faster than the sequence shows here."""

    parameters: int
    tp_split: int
    largest_block: int
    blocks: int
    hidden: int
    element: int
    activations: Affine
    checkpointed: Affine
    forward: Affine
    forward_checkpointed: Affine
    flops: Affine
    outputs: Affine
    attentions: tuple[Attention, ...]
    bend: float


class _Live(TorchDispatchMode):
    """Every storage an op creates, from its first tensor to its last: a list of
    ``(serial, +bytes)`` and ``(serial, -bytes)`` events."""

    def __init__(self, fixed: set[int]):
        super().__init__()
        self.fixed = fixed
        self.live: dict[int, list] = {}  # storage address -> [serial, bytes, references]
        self.events: list[tuple[int, int]] = []
        self.serials = 0

    def _follow(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.fixed:
            return
        if key not in self.live:
            self.serials += 1
            self.live[key] = [self.serials, storage.nbytes(), 0]
            self.events.append((self.serials, storage.nbytes()))
        self.live[key][2] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key: int) -> None:
        entry = self.live[key]
        entry[2] -= 1
        if entry[2] == 0:
            self.events.append((entry[0], -entry[1]))
            del self.live[key]

    def serial(self, t: torch.Tensor) -> int | None:
        entry = self.live.get(t.untyped_storage()._cdata)
        return entry[0] if entry else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._follow(t)
        return out


def _peak(events: list[tuple[int, int]], leave_out: set[int]) -> int:
    now = peak = 0
    for serial, change in events:
        if serial not in leave_out:
            now += change
            peak = max(peak, now)
    return peak


class _AttentionKept(torch.autograd.Function):
    """What ringify's attention op keeps for the backward: q, k, v, out and a float32
    log-sum-exp per query row and head."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _Attentions(TorchFunctionMode):
    """Runs each ``scaled_dot_product_attention`` as ``_AttentionKept``, noting its shape and
    its mask (left out of the peak: ringify keeps a mask as an O(S) program)."""

    def __init__(self, live: _Live):
        super().__init__()
        self.live = live
        self.calls: list[Attention] = []
        self.masks: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if isinstance(mask, torch.Tensor) and (serial := self.live.serial(mask)) is not None:
            self.masks.add(serial)
        causal = bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False))
        self.calls.append(Attention(q.shape[-3], k.shape[-3], q.shape[-1], v.shape[-1], causal))
        return _AttentionKept.apply(q, k, v)


def _as_configured(model: nn.Module, calls: list[Attention], tp: int) -> list[Attention]:
    """Attention as a transformers model is configured, where its trace wrote it out:
    transformers before 5.2x repeats K/V to every head (``repeat_kv``) and, under fake
    tensors, passes a causal LM's causal mask as a tensor. ringify folds both back (the
    K/V heads round the ring, the mask a causal program); so does the estimate."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", 0)
    kv = getattr(config, "num_key_value_heads", None) or heads
    causal_lm = type(model).__name__.endswith("ForCausalLM")
    out = []
    for a in calls:
        kv_heads = a.kv_heads
        if a.kv_heads == a.heads and kv < heads and a.heads * tp == heads and kv % tp == 0:
            kv_heads = kv // tp
        out.append(Attention(a.heads, kv_heads, a.head_dim, a.v_head_dim, a.causal or causal_lm))
    return out


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the longest ``ModuleList`` of one class (a decoder's layers)."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len({type(m) for m in module}) == 1:
            best = list(module) if len(module) > len(best) else best
    return best


def meta_copy(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (floating ones
    in ``dtype``): the user's model is not touched and nothing of its size is allocated."""

    def moved(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to("meta")
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(moved(p), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = moved(b)
    return copy.deepcopy(model, memo)


def _plan_pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(key).replace(r"\*", r"\d+") + r"$")


def split_for_tp(model: nn.Module, tp: int) -> tuple[int, int]:
    """Narrow ``model``'s (meta) weights to one TP rank's shards as transformers' TP plan
    (``model.tp_plan``) splits them. Returns the parameter elements the plan splits, and
    those of linear weights it splits but leaves whole here (an output gathered after its
    matmul: each rank multiplies 1/tp of it)."""
    plan = getattr(model, "tp_plan", None) or {}
    if tp == 1:
        return 0, 0
    if not plan:
        raise ValueError(
            f"tp={tp}: {type(model).__name__} has no tensor-parallel plan (transformers' "
            "config.base_model_tp_plan); estimate with tp=1, or give a model that has one."
        )
    patterns = [(_plan_pattern(k), style) for k, style in plan.items()]
    split = whole = 0
    for name, p in list(model.named_parameters()):
        module_name, _, leaf = name.rpartition(".")
        style = next((s for pat, s in patterns if pat.match(name)), None)  # the parameter's
        if style is None:  # else its module's: a weight, and a colwise layer's bias
            style = next((s for pat, s in patterns if pat.match(module_name)), None)
            style = style if style in _COLWISE + _ROWWISE or leaf == "weight" else None
            if style in _ROWWISE and leaf != "weight":
                continue  # a row-parallel layer's bias is whole
        if style is None or style in _WHOLE:
            continue
        split += p.numel()
        dim = -2 if p.dim() > 1 else 0
        if style in _ROWWISE:
            dim = -1
        elif style not in _COLWISE:  # the parameters split, the activations whole
            owner = model.get_submodule(module_name)
            whole += p.numel() if isinstance(owner, nn.Linear) and leaf == "weight" else 0
            continue
        if p.shape[dim] % tp:
            raise ValueError(f"tp={tp} does not divide {name}'s {p.shape[dim]} (dim {dim}).")
        shape = list(p.shape)
        shape[dim] //= tp
        owner = model.get_submodule(module_name)
        setattr(owner, leaf, nn.Parameter(p.new_empty(shape), requires_grad=p.requires_grad))
    return split, whole


def causal_lm_inputs(batch: int = 1) -> Callable[[int], dict]:
    """A causal LM's inputs at n positions on the meta device: ids, labels, no KV cache (as
    in training: a cache would grow again in each recompute)."""

    def inputs(positions: int) -> dict:
        ids = torch.zeros(batch, positions // batch, dtype=torch.long, device="meta")
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    return inputs


def loss_of(output) -> torch.Tensor:
    """What a step trains: the model's ``loss``, else the sum of every output that
    requires grad."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise ValueError("The model's output has no tensor that requires grad: nothing to train.")
    return sum(t.float().sum() for t in leaves)


def _probe(model: nn.Module, inputs: dict, current: list) -> tuple[int, int, float, int, list]:
    """``(peak bytes, the forward's peak bytes, forward FLOPs, output bytes, attentions)`` of
    one forward and backward, beyond the parameters, buffers and inputs. ``current[0]`` is
    set to the attentions' mode, which a checkpoint's recompute enters again (function modes
    do not reach the backward)."""
    # fake tensors over the meta ones: models skip their data-dependent checks under them,
    # as under torch.export. Each meta tensor becomes one fake tensor, made here.
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    held = [*model.parameters(), *model.buffers(), *tree_leaves(inputs)]
    held = [fake.from_tensor(t) for t in held if isinstance(t, torch.Tensor)]
    live = _Live({t.untyped_storage()._cdata for t in held})
    attentions = current[0] = _Attentions(live)
    counter = FlopCounterMode(display=False)
    with fake, live, attentions:
        with counter:
            output = model(**inputs)
            loss = loss_of(output)
        leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        outputs = sum(t.numel() * t.element_size() for t in leaves)
        del output, leaves
        flops = counter.get_total_flops()
        calls = list(attentions.calls)
        forward = len(live.events)
        loss.backward()
    del loss
    grads = {live.serial(p.grad) for p in model.parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    left_out = grads | attentions.masks
    peak, forward_peak = _peak(live.events, left_out), _peak(live.events[:forward], left_out)
    return peak, forward_peak, flops, outputs, calls


def _fit(points: list[tuple[int, float]]) -> tuple[Affine, float]:
    """The line through the two largest probes, and how far the smallest lies off it."""
    (x0, y0), (x1, y1), (x2, y2) = points
    slope = (y2 - y1) / (x2 - x1)
    line = Affine(y1 - slope * x1, slope)
    return line, abs(y0 - line.at(x0)) / max(y0, 1.0)


def footprint(
    model: nn.Module,
    inputs: Callable[[int], dict],
    *,
    tp: int = 1,
    dtype: torch.dtype | None = torch.bfloat16,
    probes: tuple[int, int, int] = (256, 512, 768),
) -> Footprint:
    """Trace a meta copy of ``model`` at ``probes`` positions per rank (``inputs(n)``: the
    model's keyword inputs at n positions, on the meta device) and fit its footprint."""
    meta = meta_copy(model, dtype)
    parameters = sum(p.numel() for p in meta.parameters())
    tp_split, whole = split_for_tp(meta, tp)
    blocks = blocks_of(meta)
    widths: list[int] = []
    if blocks:
        blocks[0].register_forward_pre_hook(
            lambda m, args, kwargs: widths.append(
                next(
                    t.shape[-1] for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                )
            ),
            with_kwargs=True,
        )
    plain, forward, flops, outputs, calls, current = [], [], [], [], [], [None]
    for n in probes:
        peak, forward_peak, f, out, calls = _probe(meta, inputs(n), current)
        plain.append((n, peak))
        forward.append((n, forward_peak))
        flops.append((n, f))
        outputs.append((n, out))
    # each block checkpointed, as torchtitan's full AC does
    wrap = functools.partial(
        checkpoint_wrapper, context_fn=lambda: (contextlib.nullcontext(), current[0])
    )
    chosen = {id(b) for b in blocks}
    apply_activation_checkpointing(meta, wrap, check_fn=lambda m: id(m) in chosen)
    checkpointed = [(n, *_probe(meta, inputs(n), current)[:2]) for n in probes]
    activations, bend = _fit(plain)
    fit = _fit(flops)[0]  # less the rank's share of what the trace left whole
    element = next((p.element_size() for p in meta.parameters() if p.is_floating_point()), 4)
    return Footprint(
        parameters=parameters,
        tp_split=tp_split,
        largest_block=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
        blocks=len(blocks),
        hidden=widths[0] if widths else 0,
        element=element,
        activations=activations,
        checkpointed=_fit([(n, peak) for n, peak, _ in checkpointed])[0],
        forward=_fit(forward)[0],
        forward_checkpointed=_fit([(n, peak) for n, _, peak in checkpointed])[0],
        flops=Affine(fit.fixed, fit.per_position - 2 * whole * (1 - 1 / tp)),
        outputs=_fit(outputs)[0],
        attentions=tuple(_as_configured(meta, calls, tp)),
        bend=bend,
    )
