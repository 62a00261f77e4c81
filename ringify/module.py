"""``ringify()`` and the module it returns.

The returned module traces the model on its first call for each input signature
(``torch.export``, training IR, on fake tensors at global shapes), runs the pass,
and caches the rewritten graph. Tracing happens in a forward pre-hook that
torch.compile does not trace (``torch.compiler.disable``): the hook runs eagerly
before Dynamo compiles ``forward``, which only calls the cached graph. So
``torch.compile(ringified, fullgraph=True)`` sees a plain graph of ATen and
ringify ops, and a new signature swaps the graph, which Dynamo guards on.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from ringify.config import Config
from ringify.passes.plan import plan_sequence, sequence_input_dims
from ringify.passes.report import Report
from ringify.passes.shard_sequence import shard_sequence
from ringify.runtime.dilation import Dilation

log = logging.getLogger("ringify")


@dataclass
class _Traced:
    """One input signature's rewritten graph (a plain object: not a submodule)."""

    module: fx.GraphModule
    before: str
    report: Report


def ringify(
    model: nn.Module,
    *,
    ring_size: int,
    group: dist.ProcessGroup | None = None,
    layout: str | None = None,
    inputs: str = "full",
    outputs: str = "full",
    dilation: Dilation | None = None,
) -> RingifiedModule:
    """``model``, sequence-parallel over a ring of ``ring_size`` ranks; same outputs and gradients.

    - ``group``: the ring's process group (``None``: the default group, whose size
      must be ``ring_size``).
    - ``inputs="full"``: every rank passes the same full inputs. ``"sharded"``: the
      inputs whose sequence reaches attention are passed as this rank's part
      (``ringify.runtime.shard(x, dim, layout=layout)``); all others (labels,
      padding masks) full.
    - ``outputs="full"``: outputs gathered; ``"sharded"``: this rank's part.
    - ``layout``: ``"zigzag"`` (balanced causal work) by default, ``"contiguous"``
      with a ``dilation``.
    - ``dilation``: every attention becomes LongNet dilated attention with this
      pattern (an opt-in change of the model; the report says so).

    The model itself is left untouched and its parameters are shared.
    """
    return RingifiedModule(model, Config(ring_size, group, layout, inputs, outputs, dilation))


class RingifiedModule(nn.Module):
    def __init__(self, model: nn.Module, config: Config):
        super().__init__()
        self.model = model
        self.config = config
        self._traced: dict[tuple, _Traced] = {}
        self._active: _Traced | None = None
        self.register_forward_pre_hook(_prepare, with_kwargs=True)

    def forward(self, *args, **kwargs):
        return self._active.module(*args, **kwargs)

    def _last(self) -> _Traced:
        if self._active is None:
            raise RuntimeError("the model is traced on its first call: call it once first")
        return self._active

    def report(self) -> Report:
        """What the pass did to the graph of the last call's signature."""
        return self._last().report

    def graph_diff(self) -> str:
        """Unified diff of the graph code before and after the pass (last call's signature)."""
        traced = self._last()
        return "".join(
            difflib.unified_diff(
                traced.before.splitlines(keepends=True),
                traced.module.code.splitlines(keepends=True),
                "before",
                "after",
            )
        )


@torch.compiler.disable
def _prepare(module: RingifiedModule, args, kwargs) -> None:
    key = _signature(module, args, kwargs)
    if key not in module._traced:
        module._traced[key] = _trace(module.model, module.config, args, kwargs)
        _dump(module._traced[key], key)
    module._active = module._traced[key]


def _signature(module: RingifiedModule, args, kwargs) -> tuple:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    described = tuple(
        (tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in leaves
    )
    modes = tuple(m.training for m in module.model.modules())
    return (str(spec), described, modes)


def _trace(model: nn.Module, config: Config, args, kwargs) -> _Traced:
    ring = config.ring()
    flat, spec = pytree.tree_flatten((args, kwargs))
    dims = None
    if config.inputs == "sharded":
        # The global shapes are not known before the sequence inputs are: find them on
        # a trace at the local shapes, then trace again at the global ones.
        structure = _export(model, spec, _fakes(flat, {}))
        dims = sequence_input_dims(structure, config, companions=True)
        gm = _export(model, spec, _fakes(flat, {i: (d, ring.size) for i, d in dims.items()}))
    else:
        gm = _export(model, spec, _fakes(flat, {}))
    plan = plan_sequence(gm, config, dims)
    before = gm.code
    report = shard_sequence(
        gm.graph,
        plan=plan,
        group_name=ring.name,
        inputs_full=config.inputs == "full",
        outputs_full=config.outputs == "full",
        dilation=config.dilation,
    )
    module = fx.GraphModule(gm, gm.graph)
    for gather in report.gathers:
        log.warning(
            "ringify: gathered the sequence for %s (%s): %s %s",
            gather.node,
            gather.op,
            gather.reason.value,
            gather.detail,
        )
    log.info("ringify: traced a new input signature\n%s", report)
    return _Traced(module, before, report)


def _fakes(flat: list, scale: dict[int, tuple[int, int]]) -> list:
    """Fake tensors like ``flat``'s, with dim ``d`` of input ``i`` multiplied as ``scale[i]``."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = []
    for i, x in enumerate(flat):
        if not isinstance(x, torch.Tensor):
            fakes.append(x)
            continue
        shape = list(x.shape)
        if i in scale:
            dim, factor = scale[i]
            shape[dim] *= factor
        with mode:
            fake = torch.empty(shape, dtype=x.dtype, device=x.device)
        fakes.append(fake.requires_grad_(x.requires_grad))
    return fakes


def _export(model: nn.Module, spec, flat: list) -> fx.GraphModule:
    args, kwargs = pytree.tree_unflatten(flat, spec)
    try:
        exported = torch.export.export(model, tuple(args), kwargs, strict=False)
    except Exception as e:
        raise RuntimeError(
            f"ringify could not trace {type(model).__name__} with torch.export ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). The model must be traceable with "
            "torch.export.export(model, args, kwargs, strict=False): avoid data-dependent "
            "Python control flow in forward, and return plain tensors/tuples/dicts (for HF "
            "models, build them with use_cache=False). The full error is chained above."
        ) from e
    gm = exported.module()
    # export's input-shape guards check global shapes; the signature key already pins them.
    for node in [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
        gm.graph.erase_node(node)
    return gm


def _dump(traced: _Traced, key: tuple) -> None:
    """With RINGIFY_DUMP_DIR set: the graph before and after the pass, and the report."""
    root = os.environ.get("RINGIFY_DUMP_DIR")
    if not root:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    name = hashlib.sha1(repr(key).encode()).hexdigest()[:10]
    folder = Path(root) / f"{name}-rank{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "before.py").write_text(traced.before)
    (folder / "after.py").write_text(traced.module.code)
    (folder / "report.txt").write_text(str(traced.report))
    log.info("ringify: wrote the graphs and report to %s", folder)
