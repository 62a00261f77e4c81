"""What the pass did to one traced graph: its report, and the rows the pass fills in.

Mask kinds and gather reasons are enums, so that code and tests compare them;
their values are the prose the tables print.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, fields

from tabulate import tabulate

from ringify.runtime.attention.dilation import Dilation
from ringify.runtime.collectives.heads import Transport

STRICT = "RINGIFY_STRICT"  # =1: the test suite and ringify.check


def strict() -> bool:
    """Whether a defect of ringify's own (a rule that raised, a rewritten graph that fails on
    fake tensors) raises, as the suite and ``ringify.check`` ask, instead of being gathered
    (exact) and reported as a defect."""
    return os.environ.get(STRICT) == "1"


class MaskKind(enum.Enum):
    NONE = "none"
    CAUSAL = "causal"
    PROGRAM = "program: O(S) inputs, evaluated tile by tile"
    KEPT = "mask kept"


class AttentionRun(enum.Enum):
    RING = "ring attention"
    ALL_TO_ALL = "all-to-all over heads, then every row of this rank's (Ulysses, USP's hybrid)"
    LOCAL = "local: this rank's queries, the whole replicated memory"
    MEMORY = "memory: every query, this rank's keys, merged over the ring"
    GATHERED = "gathered: runs on the full sequence (see gathers)"
    REPLICATED = "replicated: none of its inputs carries the sequence"


class GatherReason(enum.Enum):
    NO_RULE = "no sequence-sharding rule"
    UNREADABLE = "could not read its arguments"
    RULE_FAILED = (
        "ringify's rule for this op raised: a defect in ringify, not in the model (exact, "
        "gathered); please report it with the op and the error"
    )
    FEATURE_DIM = "the sequence is a feature dim"
    PRODUCT = "a product over the sequence"
    WHOLE_FACTOR = "a product's second factor, sharded along its columns: used whole"
    MIXED_DIMS = "its inputs are sharded along different dims"
    MISALIGNED = "a replicated input does not line up with the sequence"
    REPLICATED_FIRST = "its first input is replicated but another is sharded"
    SHARDED_TABLE = "the embedding table is sharded"
    VIEW_SPLITS = "the view splits the sequence across dims"
    ALONG_SEQUENCE = "it indexes or splits along the sequence"
    CAT_ALONG_SEQUENCE = "it concatenates along the sequence"
    QKV_NOT_SHARDED = "q, k and v are not all sharded along their sequence dim (-2)"
    CROSS_ATTENTION = "cross-attention to a sharded memory of another length"
    CAUSAL_MEMORY = "causal attention to a replicated k and v"
    LOSS_LAYOUT = "only (N, C) inputs sharded along N are reduced locally"
    LOSS_TARGET = "its input and target are sharded differently"
    WEIGHTED_MEAN = "a class-weighted mean"
    REDUCED_SEQUENCE = "a reduction over the sequence that has no ring form"


@dataclass(frozen=True)
class ReportedAttention:
    """One attention of the graph and how it runs (shapes are q's; bytes are k/v's per step)."""

    node: str
    run: AttentionRun
    form: str  # how the model wrote it: "sdpa", a fused kernel's name, "by hand", ...
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    mask: MaskKind
    mask_shape: tuple[int, ...] | None  # of a kept mask
    mask_detail: str  # what the mask's program holds, or why it is kept whole
    layout: str
    dilation: Dilation | None
    bytes_per_step: int
    # the transport it runs on (None: not sharded); bytes one rank sends a step (forward,
    # and backward in training) on the ring and on the all-to-all (``strategy.step_bytes``);
    # and why the ring was kept where the all-to-all was asked for
    transport: Transport | None = None
    ring_bytes: int = 0
    all_to_all_bytes: int = 0
    strategy_note: str = ""
    flops: int = 0  # of its forward on the whole sequence: 2 x (q @ k^T and p @ v)


@dataclass(frozen=True)
class InsertedGather:
    node: str
    op: str
    reason: GatherReason
    detail: str = ""  # e.g. the op with no rule, or the error that made its arguments unreadable


@dataclass(frozen=True)
class ReshardedRegion:
    """A region that needs the whole sequence, run on every position of a share of another
    dim: its inputs moved there by one all-to-all each (``entered``: name and dim), those
    with no such dim gathered (``gathered``)."""

    node: str  # its first node
    nodes: int
    entered: tuple[tuple[str, int], ...]
    gathered: tuple[str, ...]
    moved_bytes: int  # of the inputs that entered on a dim (global sizes)


@dataclass(frozen=True)
class TpCollective:
    """One tensor-parallel collective the pass wrote (``passes/tp_collectives.py``)."""

    node: str
    layers: str  # the TP layers it serves
    forward: str  # the collective in the forward ("" for none)
    backward: str
    sent_bytes: int  # per rank and step, at this rank's shapes (ring algorithms)


@dataclass(frozen=True)
class Report:
    ring_size: int
    layout: str
    length: int
    padded: int
    births: tuple[str, ...]  # nodes where the sequence is born inside the graph, sliced there
    attentions: tuple[ReportedAttention, ...]  # every attention of the graph, in order
    gathers: tuple[InsertedGather, ...]
    checkpointed: tuple[str, ...] = ()  # modules whose span runs under a checkpoint
    fsdp_units: tuple[str, ...] = ()  # FSDP2 units whose span runs inside their hooks
    # the lengths this graph serves: "this length", or the range one graph holds for; where
    # a second length was traced anew, why (``ringify/tracing/lengths.py``)
    lengths: str = "this length"
    # regions run on a share of another dim instead of gathered (``passes/sharding/resharded.py``)
    resharded: tuple[ReshardedRegion, ...] = ()
    # tensor parallelism's collectives, beside the ring (``passes/tp_collectives.py``)
    tensor_parallel: tuple[TpCollective, ...] = ()

    @property
    def run_whole(self) -> tuple[ReportedAttention, ...]:
        """The attentions every rank runs on the whole sequence, replicated (a second tower
        none of whose inputs carries the sequence) or gathered: a cost like a gather's."""
        return tuple(
            a for a in self.attentions if a.run in (AttentionRun.REPLICATED, AttentionRun.GATHERED)
        )

    @property
    def whole_flops_share(self) -> float:
        """The share of the attention FLOPs that ``run_whole`` holds: each is run P times."""
        total = sum(a.flops for a in self.attentions)
        return sum(a.flops for a in self.run_whole) / total if total else 0.0

    @property
    def run_whole_note(self) -> str:
        """The summary line for ``run_whole`` (empty where there is none)."""
        if not self.run_whole:
            return ""
        names = ", ".join(f"{a.node} ({a.run.name.lower()})" for a in self.run_whole)
        return (
            f"attentions run whole on every rank: {len(self.run_whole)} of "
            f"{len(self.attentions)}, {self.whole_flops_share:.0%} of the attention FLOPs: {names}"
        )

    @property
    def rewritten(self) -> tuple[ReportedAttention, ...]:
        """The attentions rewritten into ring (or dilated ring, or all-to-all) attention."""
        sharded = (AttentionRun.RING, AttentionRun.ALL_TO_ALL)
        return tuple(a for a in self.attentions if a.run in sharded)

    def __str__(self) -> str:
        head = (
            f"ringify: ring of {self.ring_size}, layout {self.layout}, sequence {self.length}"
            + (f" (padded to {self.padded})" if self.padded != self.length else "")
            + (f", born inside the model at {', '.join(self.births)}" if self.births else "")
            + (f", checkpointed: {', '.join(self.checkpointed)}" if self.checkpointed else "")
            + (f", FSDP2 units: {', '.join(self.fsdp_units)}" if self.fsdp_units else "")
            + f"; lengths: {self.lengths}"
        )
        attn = _table(self.attentions) or "(none)"
        gathers = _table(self.gathers) or "(none)"
        if self.run_whole:
            gathers += f"\n{self.run_whole_note}"
        resharded = _table(self.resharded)
        tp = _table(self.tensor_parallel)
        return (
            f"{head}\n\nattention:\n{attn}\n\n"
            f"gathers inserted (ops run on the full sequence):\n{gathers}\n"
            + (
                f"\nregions on a share of another dim (all-to-all):\n{resharded}\n"
                if resharded
                else ""
            )
            + (f"\ntensor-parallel collectives (over TP, beside the ring):\n{tp}\n" if tp else "")
        )

    def placements(self) -> list[str]:
        """One line per attention, region on a share and gather: where each runs."""
        lines = [
            f"{a.node}: {a.transport or a.run.value}"
            + (f" (the ring kept: {a.strategy_note})" if a.strategy_note else "")
            for a in self.attentions
        ]
        for r in self.resharded:
            entered = ", ".join(f"{name} on dim {dim}" for name, dim in r.entered)
            whole = f"; whole: {', '.join(r.gathered)}" if r.gathered else ""
            lines.append(f"{r.node} and {r.nodes - 1} more: on a share, {entered}{whole}")
        lines += [f"{g.node}: gathered, {g.reason.value}" for g in self.gathers]
        return lines


def _table(rows) -> str:
    def cell(x):
        if isinstance(x, enum.Enum):
            return x.value
        if isinstance(x, Dilation):
            return f"{x.segment_lengths} x {x.dilation_rates}"
        if isinstance(x, Transport):
            return str(x)
        return "" if x is None else x

    return tabulate(
        [{f.name: cell(getattr(r, f.name)) for f in fields(r)} for r in rows], headers="keys"
    )
