"""A canonical digest of a rewritten graph, the thing the ranks of a ring compare after a trace.

Two ranks that trace the same computation may list its nodes in another order and
name them differently: a model that loops over a ``set`` of strings (HF's ModernBERT,
Gemma3 and a dozen more build one RoPE table per layer type that way) does so in
each process's own ``PYTHONHASHSEED`` order, and torchrun leaves that seed unset. The
graphs' code text then differs while their meaning does not.

The digest is a Merkle hash: each node hashes what it computes (its op, its target,
its constant arguments, the hashes of the nodes it reads, its value's shape and dtype),
never its name or place. The graph's digest is the multiset of its node hashes, plus
the sequence of the nodes whose order matters (anything impure or communicating: two
ranks must run their collectives in one order; a step's plans and masks, made on each rank
alone, do not count). Another op, shape, constant or collective order still changes it;
another order of independent pure nodes does not.
Nested graphs (checkpointed regions, FSDP units) are hashed by content, recursively.
"""

from __future__ import annotations

import hashlib

import torch
from torch import fx

from ringify.passes.graph.vocabulary import CHECKS
from ringify.runtime.collectives.reduce import copy_to_ring
from ringify.runtime.collectives.tp_ops import TP_FEATURE_OPS, TP_VOCAB_EMBEDDING
from ringify.runtime.masks.call_plan import attention_plan
from ringify.runtime.masks.captures import host_inputs
from ringify.runtime.masks.step_masks import step_masks

# Namespaces of ops that talk to other ranks (and ringify's own functions, which may):
# their order is part of the program.
_COMMUNICATING = ("ringify", "_c10d_functional", "c10d", "_dtensor")
_ON_TP_GROUP = frozenset({*TP_FEATURE_OPS, TP_VOCAB_EMBEDDING})
# ringify's ops that never talk to another rank: a step's plans and masks, made from host
# copies. A model that makes its masks in a set's order (HF's per layer type) has the pass
# emit them in each process's own PYTHONHASHSEED order, which is not a difference.
_RANK_LOCAL = frozenset(op._opoverload for op in (host_inputs, attention_plan, step_masks))


def graph_digest(gm: fx.GraphModule) -> str:
    """A hex digest equal on two ranks iff their graphs compute the same thing in the same
    collective order, whatever the order and names of their independent nodes."""
    hashes: dict[fx.Node, str] = {}
    ordered: list[str] = []
    placeholders = 0
    graded: set[fx.Node] = set()  # nodes a gradient can reach (from an input that needs one)
    for node in gm.graph.nodes:
        if _needs_grad(node) or any(a in graded for a in node.all_input_nodes):
            graded.add(node)
        if node.op == "placeholder":
            head = ("placeholder", placeholders, node.target)
            placeholders += 1
        elif node.op in ("get_attr", "call_module"):
            head = (node.op, _content(_attribute(gm, node.target)))
        else:
            head = (node.op, _target_name(node.target))
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: _Ref(hashes[n]))
        if node.target in _ON_TP_GROUP:  # each rank's own TP group: one name per TP rank
            args = tuple("<tp group>" if isinstance(a, str) else a for a in args[0]), args[1]
        key = (head, args, _shape(node.meta.get("val")))
        hashes[node] = _sha1(key)
        if _order_matters(node, graded):
            ordered.append(hashes[node])
    return _sha1((sorted(hashes.values()), ordered))


class _Ref(str):
    """A node argument by its hash (``repr`` without quotes, so no string constant equals it)."""

    def __repr__(self) -> str:
        return f"%{self}"


def _sha1(value: object) -> str:
    return hashlib.sha1(repr(value).encode()).hexdigest()


def _target_name(target: object) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or type(target).__module__
    return f"{module}.{getattr(target, '__qualname__', None) or str(target)}"


def _attribute(gm: torch.nn.Module, dotted: str) -> object:
    value: object = gm
    for name in dotted.split("."):
        value = getattr(value, name)
    return value


def _content(value: object) -> object:
    """What an attribute holds, without its name (names follow the order of creation)."""
    if isinstance(value, fx.GraphModule):
        return ("graph", graph_digest(value))
    if isinstance(value, torch.Tensor):
        data = value.detach()
        if data.device.type == "meta" or data.is_sparse:
            return ("tensor", tuple(data.shape), str(data.dtype))
        raw = data.contiguous().view(-1).view(torch.uint8) if data.numel() else data
        return ("tensor", tuple(data.shape), str(data.dtype), _sha1(raw.cpu().numpy().tobytes()))
    if isinstance(value, torch.nn.Module):  # a wrapper of nested graphs: its type and theirs
        children = [_content(child) for _, child in value.named_children()]
        return ("module", type(value).__qualname__, children)
    return ("object", type(value).__qualname__)


def _shape(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), str(value.dtype))
    if isinstance(value, list | tuple):
        return tuple(_shape(v) for v in value)
    return None if value is None else repr(value)


def _needs_grad(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return node.op == "placeholder" and getattr(value, "requires_grad", False)


def _order_matters(node: fx.Node, graded: set[fx.Node]) -> bool:
    if node.op in ("call_module", "output"):
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if target in CHECKS or target in _RANK_LOCAL:  # where it runs changes nothing computed
        return False
    if target is copy_to_ring and node not in graded:  # it talks only in a backward, never run
        return False
    ours = (getattr(target, "__module__", None) or "").startswith("ringify.")  # runtime calls
    return ours or getattr(target, "namespace", None) in _COMMUNICATING or node.is_impure()
