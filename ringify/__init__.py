"""ringify: sequence parallelism for an unmodified PyTorch model, through a graph pass.

``ringify(model, ring_size=P)`` traces the model, shards the sequence dimension
of its whole graph over a ring of P ranks, and replaces every
``scaled_dot_product_attention`` with ring attention (``ringify.runtime``);
with ``dilation=Dilation(...)``, with LongNet's dilated attention on the ring.
Ranks that disagree raise together: ``ValueError`` naming what differs, or
``RankFailed`` on the ranks whose peer raised. ``estimate`` sizes a job before it runs:
memory per GPU and a modelled step for every mesh. ``check`` runs the model ringified on
a few forked CPU ranks against the unmodified model before a cluster is spent on it.
"""

from ringify import runtime
from ringify.check import Checked, check
from ringify.config import Hybrid
from ringify.estimate import estimate
from ringify.module import RingifiedModule, ringify
from ringify.passes.graph.report import Report
from ringify.runtime.attention.dilation import Dilation
from ringify.runtime.collectives.agreement import RankFailed
from ringify.stacks.samplers import RingSampler

__all__ = [
    "Checked",
    "Dilation",
    "Hybrid",
    "RankFailed",
    "Report",
    "RingSampler",
    "RingifiedModule",
    "check",
    "estimate",
    "ringify",
    "runtime",
]
