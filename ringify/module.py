"""``ringify()`` and the module it returns.

The returned module traces the model on its first call for each input signature
(``trace.py``) and caches the rewritten graph (the last ``TRACE_CACHE_SIZE``
signatures). A signature that differs from a traced one in its sequence length alone
is traced once for every length (``lengths.py``): one graph that reads the length at
run time serves all later lengths. ``forward`` takes the model's own arguments, so the
module's hooks (and global module hooks) see what the user passed and what the model
returned. Dynamo skips ``forward``'s own frame: it picks the call's graph eagerly
(``_prepare``, which torch.compile does not trace), flattens the call's inputs, and calls
the graph's code with the model's current parameters and buffers. Each traced graph is a
frame of its own, so ``torch.compile(ringified, fullgraph=True)`` sees a plain graph of ATen
and ringify ops per signature, however many signatures (lengths) there are, and nothing of
the user's other compiled code is touched. ``_prepare`` also makes the ranks agree on each
call (``consistency.py``) before any of them enters the ring.

The module is transparent to checkpoints: its ``state_dict`` keys and parameter
names are the model's own, and it loads the model's checkpoints.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import logging
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.fx._pytree import tree_flatten_spec
from torch.utils import _pytree as pytree

from ringify.config import Config, Hybrid
from ringify.generation import Generation, generate
from ringify.passes.graph.report import Report
from ringify.runtime.attention.dilation import Dilation
from ringify.runtime.collectives.agreement import digest
from ringify.runtime.collectives.tp_ops import local_state
from ringify.stacks.block_masks import with_flat_block_masks
from ringify.stacks.tp_layers import tp_layers
from ringify.tracing.caches import cache_kwargs
from ringify.tracing.consistency import check_call, check_trace
from ringify.tracing.lengths import (
    Lengths,
    NotLiftable,
    family,
    lift_from_small,
    lift_lengths,
    sequence_dims,
    signature,
)
from ringify.tracing.observers import run_observers
from ringify.tracing.trace import (
    Rewritten,
    Traced,
    dump,
    finish,
    holds_the_models_state,
    state_of,
    still_fits,
    trace,
)

log = logging.getLogger("ringify")
TRACE_CACHE_SIZE = 8  # input signatures whose graphs are kept (least recently used dropped)


def ringify(
    model: nn.Module,
    *,
    ring_size: int,
    group: dist.ProcessGroup | None = None,
    layout: str | None = None,
    inputs: str = "full",
    outputs: str = "full",
    dilation: Dilation | None = None,
    check_inputs: bool = True,
    mesh: DeviceMesh | None = None,
    strategy: str | Hybrid = "auto",
) -> RingifiedModule:
    """``model``, sequence-parallel over a ring of ``ring_size`` ranks; same outputs and gradients.

    - ``group``: the ring's process group (``None``: the default group, whose size
      must be ``ring_size``); or ``mesh``: a 1-D DeviceMesh, e.g. the ``"cp"`` dim of
      a ``(dp, cp)`` mesh (``mesh["cp"]``).
    - ``inputs="full"``: every rank passes the same full inputs. ``"sharded"``: the
      inputs whose sequence reaches attention are passed as this rank's part
      (``ringify.runtime.shard(x, dim, layout=layout)``); all others (labels,
      padding masks) full.
    - ``outputs="full"``: outputs gathered; ``"sharded"``: this rank's part.
    - ``layout``: ``"zigzag"`` (balanced causal work) by default, ``"contiguous"``
      with a ``dilation``.
    - ``dilation``: every attention becomes LongNet dilated attention with this
      pattern (an opt-in change of the model; the report says so).
    - ``check_inputs``: at every call, compare a fingerprint of the inputs every
      rank passes whole across the ring (one small collective), so that ranks given
      different batches, or one call apart, raise instead of training wrongly.
    - ``strategy``: ``"ring"``, K/V travel round the ring; ``"ulysses"``, an all-to-all gives
      each rank every row of its share of the heads (DeepSpeed-Ulysses), for each attention
      whose heads the ring divides and whose mask is the same for every head (the others
      keep the ring; the report says which and why, and the bytes of each);
      ``ringify.Hybrid(u=...)``, the all-to-all inside groups of u consecutive ranks and K/V
      round the ring of the groups (USP); ``"auto"`` (the default), per attention, the one
      a paper model of a GPU cluster makes fastest (the ring on CPU ranks).

    The model itself is left untouched and its parameters are shared.
    """
    return RingifiedModule(
        model,
        Config(ring_size, group, layout, inputs, outputs, dilation, check_inputs, mesh, strategy),
    )


class RingifiedModule(nn.Module):
    """The ringified model. It holds the model's own parameters, buffers and submodules (the
    same dicts, not copies), so its names, ``state_dict`` keys and attribute paths are the
    model's: ``torch.distributed.checkpoint`` walks ``model.embed_tokens.weight`` through it
    as through the model. Other attributes it does not hold are the model's (an HF model's
    ``config``, ``loss_type``, ``main_input_name``), so that code written for the model (HF
    Trainer, accelerate) finds them; ringify's own configuration is ``ringify_config``."""

    def __init__(self, model: nn.Module, config: Config):
        super().__init__()
        holds_the_models_state(self, model)  # the model is no submodule: its children are ours
        self.ringify_config = config
        self._ring = config.ring()
        self._traced: OrderedDict[tuple, Traced] = OrderedDict()
        self._families: dict[tuple, Traced] = {}  # one graph for many lengths (lengths.py)
        self._per_length: dict[tuple, str] = {}  # families traced per length, and why
        self.traces = 0  # graphs traced (a lifted graph counts once)
        self._active: Traced | None = None
        self._warned: set[str] = set()  # warnings given once per module
        self._generation: Generation | None = None  # generate's state, made on its first call
        signature = _signature_of(model.forward)
        self._takes_use_cache = signature is not None and "use_cache" in signature.parameters
        # Code that picks inputs by the forward's parameters (HF Trainer keeps the dataset
        # columns named there) sees the model's.
        self.forward = functools.partial(RingifiedModule.forward, self)
        self.forward.__signature__ = signature

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules
        except AttributeError:
            if name == "_model":
                raise
            return getattr(self._model, name)

    def train(self, mode: bool = True) -> RingifiedModule:
        """Train or eval mode, for the model itself too (not a submodule of this one)."""
        self._model.train(mode)
        self.training = mode
        return self

    # Dynamo skips this frame and compiles the graph it calls, a frame of its own per traced
    # graph: a model traced per length never reaches the recompile limit of one frame.
    @torch.compiler.disable(recursive=False)
    def forward(self, *args, **kwargs):
        """The model's forward on the ring: the graph traced for this call's signature, run on
        the model's current parameters and buffers. The graph's code is called directly, not
        as a module, so that global module hooks see this module's call alone."""
        traced, flat = _prepare(self, args, kwargs)
        state = _current_state(self._model, traced.state_names)
        out = traced.module.forward(*state, *flat)
        if traced.observed:  # the model's outputs, then what its observing hooks were given
            n = traced.out_spec.num_leaves
            out, observed = out[:n], out[n:]
            run_observers(self._model, traced.observed, observed)
        return pytree.tree_unflatten(out, traced.out_spec)

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
    ):
        """Greedy or sampled generation on the ring, HF ``generate``-compatible: the prompt's KV
        cache stays split across the ranks and each new token is one traced decode step
        (``ringify/generation/``). Returns what HF's ``generate`` returns."""
        if self._generation is None:
            if tp_layers(self._model):
                raise ValueError(
                    "generate on a model parallelized for tensor parallelism is not supported: "
                    "its decode step traces the model's DTensor weights, which torch.export "
                    "cannot take. Generate with the model's own generate (TP alone), or with "
                    "a copy of the model that is not split over TP."
                )
            config = dataclasses.replace(self.ringify_config, inputs="full", outputs="sharded")
            prefill = RingifiedModule(self._model, config)
            self._generation = Generation(self._model, self._ring, config.layout, prefill)
        return generate(self._generation, input_ids, attention_mask, **kwargs)

    def _last(self) -> Traced:
        if self._active is None:
            raise RuntimeError("the model is traced on its first call: call it once first")
        return self._active

    def report(self) -> Report:
        """What the pass did to the graph of the last call's signature."""
        return self._last().report

    def graph_diff(self) -> str:
        """Unified diff of the graph code before and after the pass (last call's signature),
        after a header that says where each attention, region and gather runs."""
        traced = self._last()
        header = "".join(f"# {line}\n" for line in traced.report.placements())
        return header + "".join(
            difflib.unified_diff(
                traced.before.splitlines(keepends=True),
                traced.module.code.splitlines(keepends=True),
                "before",
                "after",
            )
        )


@torch.compiler.disable
def _prepare(module: RingifiedModule, args, kwargs) -> tuple[Traced, list]:
    """The graph for this call (traced now if new), after the ranks agreed on the call, and
    the call's inputs flattened as the graph takes them."""
    kwargs = cache_kwargs(module._model, kwargs, module._takes_use_cache, module._warned)
    args, kwargs = with_flat_block_masks((args, kwargs))
    flat, spec = pytree.tree_flatten((args, kwargs))
    key = signature(module._model, flat, spec)
    traced = module._traced.get(key) or _for_any_length(module, key)
    state = None if traced is None else state_of(module._model, traced.state_names)
    if traced is not None and not still_fits(traced, module._model, state):
        _forget(module, key, traced)  # the model's parameters changed dtype, device, shape or ties
        traced = state = None
    config, ring = module.ringify_config, module._ring
    if ring.size > 1 and (traced is None or config.check_inputs):
        shared = None
        if traced is not None:
            shared = [flat[i] for i in traced.shared_inputs]
        elif config.inputs == "full":
            shared = [x for x in flat if isinstance(x, torch.Tensor)]
        check_call(
            ring,
            signature=_described(key),
            config=config,
            retraced=traced is None,
            shared=shared if config.check_inputs else None,
            state=None if state is None or not config.check_inputs else _locals(state),
            args=args,
            kwargs=kwargs,
        )
    if traced is None:
        traced = _trace_on_every_rank(module, args, kwargs, _another_length(module, key))
        module.traces += 1
        dump(traced, key)
    if traced.lengths is not None:
        module._families[family(key, traced.lengths.dims)] = traced
    else:
        module._traced[key] = traced
        if len(module._traced) > TRACE_CACHE_SIZE:
            module._traced.popitem(last=False)
        module._traced.move_to_end(key)
    module._active = traced
    if traced.lengths is not None:  # one graph for every length: compiled for any at once
        for i, dim in traced.lengths.dims:
            torch._dynamo.maybe_mark_dynamic(flat[i], dim)
    return traced, tree_flatten_spec((args, kwargs), traced.in_spec)


def _locals(state: list[torch.Tensor]) -> list[torch.Tensor]:
    """The state as a traced graph reads it: each tensor-parallel weight as its local shard."""
    return [local_state(t) for t in state]


def _local_state(model: nn.Module, names: tuple[str, ...]) -> list[torch.Tensor]:
    return _locals(state_of(model, names))


# Read eagerly: under torch.compile, reading the state is Python bookkeeping, not graph work.
_current_state = torch.compiler.disable(_local_state)


def _forget(module: RingifiedModule, key: tuple, traced: Traced) -> None:
    if traced.lengths is not None:
        del module._families[family(key, traced.lengths.dims)]
    else:
        del module._traced[key]


def _for_any_length(module: RingifiedModule, key: tuple) -> Traced | None:
    """The graph that serves this call's length among the graphs traced for many lengths."""
    for traced in module._families.values():
        lengths = traced.lengths
        if family(key, lengths.dims) in module._families and lengths.holds(key):
            return traced
    return None


def _another_length(module: RingifiedModule, key: tuple):
    """The sequence dims, where a signature traced already differs from ``key`` in its length
    alone (a second length: trace once for all lengths); else ``None``."""
    for before in module._traced:
        dims = sequence_dims(before, key)
        sliced = set(module._traced[before].sequence_inputs)
        if dims and sliced and sliced <= set(dims):
            return dims  # the dims that changed include every input the pass sliced
    return None


def _trace_on_every_rank(module: RingifiedModule, args, kwargs, dims=None) -> Traced:
    """Trace (with ``dims``, once for every length); then every rank raises if any rank's
    trace failed or the graphs differ.

    The inputs of ``inputs="sharded"`` mode that every rank passes whole, and the model
    state, are known only now: compared here on the first call of a signature.
    """
    traced, error = None, None
    try:
        traced = _trace(module, args, kwargs, dims)
    except Exception as e:
        error = e
    if module._ring.size == 1:
        if error is not None:
            raise error
        return traced
    shared = state = None
    if traced is not None and module.ringify_config.check_inputs:
        state = _local_state(module._model, traced.state_names)
        if module.ringify_config.inputs == "sharded":
            flat = pytree.tree_leaves((args, kwargs))
            shared = [flat[i] for i in traced.shared_inputs]
    check_trace(
        module._ring,
        graph=None if traced is None else traced.module,
        shared=shared,
        state=state,
        error=error,
        args=args,
        kwargs=kwargs,
    )
    return traced


def _trace(module: RingifiedModule, args, kwargs, dims) -> Traced:
    model, config = module._model, module.ringify_config
    if dims is None:  # a first call: traced small where export unrolls a long length
        small = lift_from_small(model, config, args, kwargs)
        if small is None:
            return trace(model, config, args, kwargs, outer=module)
        return _lifted(module, *small)
    flat, spec = pytree.tree_flatten((args, kwargs))
    kin = family(signature(model, flat, spec), dims)
    if kin in module._families:  # a graph for many lengths, not this one: this one alone
        traced = trace(model, config, args, kwargs, outer=module)
        outside = f"this length, outside those of the graph for {module._families[kin].lengths}"
        return dataclasses.replace(
            traced, report=dataclasses.replace(traced.report, lengths=outside)
        )
    if kin not in module._per_length:
        try:
            done, lengths = lift_lengths(model, config, args, kwargs, dims)
        except NotLiftable as e:
            module._per_length[kin] = f"per length: {e}"
            log.warning("ringify: each new sequence length is traced anew: %s", e)
    if kin in module._per_length:
        traced = trace(model, config, args, kwargs, outer=module)
        report = dataclasses.replace(traced.report, lengths=module._per_length[kin])
        return dataclasses.replace(traced, report=report)
    return _lifted(module, done, lengths)


def _lifted(module: RingifiedModule, done: Rewritten, lengths: Lengths) -> Traced:
    done.report = dataclasses.replace(done.report, lengths=str(lengths))
    log.info("ringify: one graph for %s", lengths)
    traced = finish(done, module._model, module.ringify_config, module)
    return dataclasses.replace(traced, lengths=lengths)


def _signature_of(forward) -> inspect.Signature | None:
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):  # a forward with no readable signature: ours
        return None


def _described(key: tuple) -> dict[str, str]:
    """A signature as readable fields, the same on every rank that makes the same call."""
    spec, inputs, modes = key
    shapes = ", ".join(
        f"{list(x[0])} {str(x[1]).removeprefix('torch.')}" if isinstance(x, tuple) else repr(x)
        for x in inputs
    )
    training = sum(t for t, _ in modes)
    hooks = sum(h for _, h in modes)
    return {
        "input structure": spec,
        "input shapes": shapes,
        "modes": f"{training} of {len(modes)} modules training, {hooks} forward hooks "
        f"(#{int(digest(modes)) % 10000:04d})",
    }
