"""What an attention op computes besides its tensors: one frozen value, ``AttentionSpec``.

Every attention op (``ring_attention``, ``dilated_attention``, ``memory_attention``,
``joint_attention``) takes its flags as one ``AttentionSpec`` beside its tensors, the key
length (a ``SymInt``: a graph traced once for many lengths reads it at run time) and, for
the ring, a ``RingPlan``. The spec is a ``torch.library`` opaque *value* type: a graph holds
it as a constant, ``torch.compile`` guards on its equality, and its ``repr`` rebuilds it
in generated code. It is validated once, on construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch._library.opaque_object import get_opaque_type_name, register_opaque_type

from ringify.runtime.attention.dilation import Dilation
from ringify.runtime.collectives.layout import check_layout


def sdpa_scale(scale: float | None, head_dim: int) -> float:
    """SDPA's softmax scale: ``scale`` where given, else 1 / sqrt(head_dim)."""
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


@dataclass(frozen=True)
class AttentionSpec:
    """An attention call's flags: its ring (``group_name``), softmax ``scale``, causality,
    the sequence ``layout`` over the ring, a ``softcap`` (0: none), a mask program's text
    (``masks/program.py``; "" for none), a forced tiling (``tiles_per_chunk``, 0: the op's
    choice), whether a program's work may be balanced, and LongNet's pattern
    (``segment_lengths`` and ``dilation_rates``; none for dense attention). The pattern is
    held as plain tuples: Dynamo rebuilds no dataclass nested in a graph's constant."""

    group_name: str
    scale: float
    is_causal: bool = False
    layout: str = "contiguous"
    softcap: float = 0.0
    mask_program: str = ""
    tiles_per_chunk: int = 0
    balance: bool = True
    segment_lengths: tuple[int, ...] = ()
    dilation_rates: tuple[int, ...] = ()

    @classmethod
    def dilated(cls, group_name: str, scale: float, is_causal: bool, dilation: Dilation):
        """The spec of LongNet's dilated attention with ``dilation``'s pattern."""
        w, r = dilation.segment_lengths, dilation.dilation_rates
        return cls(group_name, scale, is_causal, segment_lengths=w, dilation_rates=r)

    @property
    def dilation(self) -> Dilation | None:
        if not self.segment_lengths:
            return None
        return Dilation(self.segment_lengths, self.dilation_rates)

    def __post_init__(self) -> None:
        object.__setattr__(self, "segment_lengths", tuple(self.segment_lengths))
        object.__setattr__(self, "dilation_rates", tuple(self.dilation_rates))
        dilation = self.dilation  # (validates the pattern)
        check_layout(self.layout)
        if not math.isfinite(self.scale):
            raise ValueError(f"the attention scale must be finite, got {self.scale}")
        if self.softcap < 0 or self.tiles_per_chunk < 0:
            raise ValueError(
                f"softcap and tiles_per_chunk must be >= 0 (0: none, the op's choice); got "
                f"{self.softcap} and {self.tiles_per_chunk}"
            )
        if dilation is not None and (self.mask_program or self.layout != "contiguous"):
            raise ValueError("dilated attention takes no mask program and the contiguous layout")

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        return repr(self), {"AttentionSpec": AttentionSpec}


register_opaque_type(AttentionSpec, typ="value")
SPEC_TYPE = get_opaque_type_name(AttentionSpec)  # its name in an op's schema
