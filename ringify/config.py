"""``Config``: what ``ringify()`` was asked for, validated once."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ringify.runtime.attention.dilation import Dilation
from ringify.runtime.collectives.heads import Transport
from ringify.runtime.collectives.layout import check_layout
from ringify.runtime.collectives.ring import Ring, ranks_per_host, resolve_ring

MODES = ("full", "sharded")
# K/V round the ring; heads by all-to-all (DeepSpeed-Ulysses); or chosen per attention
STRATEGIES = ("ring", "ulysses", "auto")


@dataclass(frozen=True)
class Hybrid:
    """USP's hybrid of the two: an all-to-all onto heads inside groups of ``u`` consecutive
    ranks (a node's, say), K/V round the ring of the ring_size / ``u`` groups."""

    u: int

    def __post_init__(self) -> None:
        if not isinstance(self.u, int) or self.u < 1:
            raise ValueError(f"Hybrid(u=...) takes a positive int, got {self.u!r}")


@dataclass(frozen=True)
class Auto:
    """``strategy="auto"`` as the pass takes it: the ring, and how many consecutive ranks of
    it share a host, asked once, where a GPU attention first needs it (a collective: every
    rank runs the same pass on the same graph, so every rank asks)."""

    ring: Ring
    _asked: dict = field(default_factory=dict, compare=False, repr=False)

    def per_host(self, device: torch.device) -> int:
        if "per_host" not in self._asked:
            self._asked["per_host"] = ranks_per_host(self.ring, device)
        return self._asked["per_host"]


@dataclass(frozen=True)
class Config:
    ring_size: int
    group: dist.ProcessGroup | None = None
    layout: str | None = None  # zigzag (balanced causal work); contiguous with a dilation
    inputs: str = "full"
    outputs: str = "full"
    dilation: Dilation | None = None
    check_inputs: bool = True  # compare a fingerprint of the shared inputs at every call
    mesh: DeviceMesh | None = None  # one dim of a mesh: its group becomes ``group``
    strategy: str | Hybrid = "auto"

    def __post_init__(self) -> None:
        if self.mesh is not None:
            object.__setattr__(self, "group", _mesh_group(self.mesh, self.group))
        if not isinstance(self.ring_size, int) or self.ring_size < 1:
            raise ValueError(f"ring_size must be a positive int, got {self.ring_size!r}")
        if self.dilation is not None and not isinstance(self.dilation, Dilation):
            raise ValueError(f"dilation must be a ringify.Dilation, got {self.dilation!r}")
        if self.layout is None:
            object.__setattr__(self, "layout", "zigzag" if self.dilation is None else "contiguous")
        check_layout(self.layout)
        if self.dilation is not None:
            self.dilation.check_layout(self.layout)
        if not isinstance(self.check_inputs, bool):
            raise ValueError(f"check_inputs must be True or False, got {self.check_inputs!r}")
        if isinstance(self.strategy, Hybrid) and self.ring_size % self.strategy.u:
            raise ValueError(
                f"Hybrid(u={self.strategy.u}) needs groups that divide the ring of "
                f"{self.ring_size}: pass a u that divides ring_size"
            )
        if not isinstance(self.strategy, Hybrid) and self.strategy not in STRATEGIES:
            raise ValueError(
                f"strategy must be one of {STRATEGIES} or ringify.Hybrid(u=...), got "
                f"{self.strategy!r}"
            )
        if self.strategy not in ("ring", "auto") and self.dilation is not None:
            raise ValueError("dilated attention runs on the ring: pass strategy='ring' with it")
        for name in ("inputs", "outputs"):
            if getattr(self, name) not in MODES:
                raise ValueError(f"{name} must be one of {MODES}, got {getattr(self, name)!r}")
        size = self.ring().size
        if size != self.ring_size:
            if self.group is None and not dist.is_initialized():
                hint = (
                    "torch.distributed is not initialised: launch with torchrun and call "
                    "torch.distributed.init_process_group() before ringify()"
                )
            else:
                hint = (
                    "pass group=torch.distributed.new_group(ranks) with ring_size ranks, "
                    "or ring_size=" + str(size)
                )
            raise ValueError(
                f"ring_size={self.ring_size} but the {'given' if self.group else 'default'} "
                f"process group has {size} rank(s); {hint}"
            )

    def ring(self) -> Ring:
        return resolve_ring(self.group)

    @functools.cached_property
    def transports(self) -> Transport | Auto:
        """The strategy as the pass takes it: every attention's transport, or ``Auto`` with the
        ring, one value for every trace (its hosts are asked once)."""
        if self.strategy == "auto":
            return Auto(self.ring())
        if isinstance(self.strategy, Hybrid):
            return Transport(self.ring_size, self.strategy.u)
        return Transport(self.ring_size, self.ring_size if self.strategy == "ulysses" else 1)


def _mesh_group(mesh, group) -> dist.ProcessGroup:
    """The process group of a 1-D ``DeviceMesh`` (one dim of a larger mesh: ``mesh["cp"]``)."""
    if group is not None:
        raise ValueError("pass the ring as group= or as mesh=, not both")
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names or ()
        example = f'mesh["{names[-1]}"]' if names else "mesh[dim_name]"
        raise ValueError(
            f"mesh has {mesh.ndim} dims {names}: pass the ring's own dim, e.g. mesh={example} "
            "(the context-parallel dim of a (dp, cp) mesh)"
        )
    return mesh.get_group()
