"""Size a job before it runs: memory per GPU and a modelled step for every mesh.

    ringify.estimate(config, seq_len=262144, gpus=64, gpu="h100-80gb").table()
    python -m ringify.estimate --config config.json --seq 262144 --gpus 64 --gpu h100-80gb

Memory is read from the model's own graph, run on the meta device at a few small lengths
(``footprint.py``); time is a paper model of the hardware (``meshes.py``). Nothing of the
model's size is allocated and no GPU is needed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tabulate import tabulate
from torch import nn

from ringify.estimate.footprint import Footprint, causal_lm_inputs, footprint
from ringify.estimate.meshes import GIB, Row, meshes, row
from ringify.runtime.collectives.transport_costs import GPUS, Cluster

logger = logging.getLogger("ringify")

__all__ = ["Estimate", "NoMeshFits", "estimate"]


class NoMeshFits(ValueError):
    """No mesh of the GPUs given fits the length. ``gpus_needed``: the fewest GPUs that fit
    it (None past 65536); ``longest``: the longest length (a multiple of 1024) that fits
    the GPUs given (0 if none)."""

    def __init__(self, message: str, gpus_needed: int | None, longest: int):
        super().__init__(message)
        self.gpus_needed = gpus_needed
        self.longest = longest


@dataclass(frozen=True)
class Estimate:
    """Every mesh's figures for one job, the best first (those that fit, fastest first)."""

    seq_len: int
    gpus: int
    gpu: str
    headroom: float
    outputs: str
    rows: tuple[Row, ...]

    @property
    def usable(self) -> float:
        return GPUS[self.gpu].memory * (1 - self.headroom)

    def fits(self, r: Row) -> bool:
        return r.total <= self.usable

    def table(self, top: int = 10) -> str:
        """The best ``top`` rows as a table; time and tokens/s are a paper model."""
        rows = [
            {
                "#": i,
                "dp x tp x cp": f"{r.mesh.dp} x {r.mesh.tp} x {r.mesh.cp}",
                "strategy": r.mesh.strategy + (" (auto)" if r.auto else ""),
                "AC": "yes" if r.checkpointing else "no",
                "weights GiB": _gib(r.weights),
                "grads GiB": _gib(r.gradients),
                "AdamW GiB": _gib(r.optimizer),
                "act GiB (AC / no AC)": "{} / {}".format(
                    *map(_gib, _ordered(r.activations, r.activations_other, r.checkpointing))
                ),
                "buffers GiB": _gib(r.buffers),
                "total GiB": _gib(r.total),
                "fits": "yes" if self.fits(r) else "no",
                "step s (model)": f"{r.step:.3g}",
                "tokens/s/GPU (model)": f"{r.tokens_per_gpu:,.0f}",
                "comm exposed": f"{r.exposed / r.step:.0%}",
                "MFU (model)": f"{r.mfu:.0%}",
            }
            for i, r in enumerate(self.rows[:top])
        ]
        head = (
            f"{self.seq_len:,} positions on {self.gpus} x {self.gpu} "
            f"({self.usable / GIB:.1f} GiB usable each, {self.headroom:.0%} headroom), "
            f'outputs="{self.outputs}". '
            "Memory from the traced graph; time a paper model, not a measurement."
        )
        return head + "\n" + tabulate(rows, headers="keys", tablefmt="github")

    def why(self, index: int = 0) -> str:
        """Row ``index`` explained line by line."""
        r, m = self.rows[index], self.rows[index].mesh
        local = f"{self.seq_len // m.cp:,} positions per rank"
        return "\n".join([
            f"Row {index}: dp={m.dp} tp={m.tp} cp={m.cp}, {m.strategy}, {local}.",
            f"- weights {_gib(r.weights)} GiB: float32, FSDP2 over dp x cp = {m.dp * m.cp}, "
            "plus two blocks gathered in the compute dtype.",
            f"- gradients {_gib(r.gradients)} GiB and AdamW {_gib(r.optimizer)} GiB: float32, "
            "sharded the same way.",
            f"- activations {_gib(r.activations)} GiB "
            f"({'each block checkpointed' if r.checkpointing else 'no checkpointing'}; "
            f"{_gib(r.activations_other)} GiB the other way): the traced graph's peak at "
            "its positions per rank.",
            f"- attention buffers {_gib(r.buffers)} GiB: the transport's K/V in flight.",
            f"- total {_gib(r.total)} GiB of {self.usable / GIB:.1f} usable: "
            f"{'fits' if self.fits(r) else 'does not fit'}.",
            f"- step {r.step:.3g} s (model): compute {r.compute:.3g} s, communication "
            f"not hidden {r.exposed:.3g} s.",
            f"- {r.tokens_per_gpu:,.0f} tokens/s per GPU, MFU {r.mfu:.0%} (model)."
            + (" strategy='auto' picks this transport on this mesh." if r.auto else ""),
        ])  # fmt: skip


def _gib(b: float) -> str:
    return f"{b / GIB:.1f}"


def _ordered(kept: float, other: float, checkpointing: bool) -> tuple[float, float]:
    return (kept, other) if checkpointing else (other, kept)


def estimate(
    model: nn.Module | object | str,
    seq_len: int,
    gpus: int,
    *,
    gpu: str = "h100-80gb",
    batch: int = 1,
    headroom: float = 0.1,
    dtype: torch.dtype = torch.bfloat16,
    inputs: Callable[[int], dict] | None = None,
    outputs: str = "sharded",
) -> Estimate:
    """Memory per GPU and a modelled step of every ``dp x tp x cp`` mesh of ``gpus`` GPUs
    for training on ``batch`` sequences of ``seq_len`` per replica.

    ``model``: a module (any device: a meta copy is traced), a transformers config (or its
    dict), or a config's path or a model id in the local Hugging Face cache. ``inputs(n)``: the
    module's keyword inputs at n positions on the meta device (a causal LM's ids and labels
    by default). ``outputs``: ringify's, ``"sharded"`` (memory-optimal training) or
    ``"full"`` (every rank holds the whole outputs, a causal LM's logits). Raises
    ``NoMeshFits`` where no mesh fits, naming what would."""
    if outputs not in ("sharded", "full"):
        raise ValueError(f'outputs={outputs!r}: give "sharded" or "full", as to ringify().')
    if gpu not in GPUS:
        raise ValueError(f"Unknown GPU {gpu!r}: ringify.estimate knows {', '.join(GPUS)}.")
    cluster = GPUS[gpu]
    _check_gpus(gpus, cluster)
    module = _module(model, dtype)
    inputs = inputs or causal_lm_inputs(batch)
    usable = cluster.memory * (1 - headroom)
    first = footprint(module, inputs, dtype=dtype)
    footprints: dict[int, Footprint | None] = {1: first}
    heads, kv = _heads(first)

    def rows_for(n: int, seq: int) -> list[Row]:
        out = []
        for mesh in meshes(n, cluster, heads, kv, seq):
            if mesh.tp > 1 and not _plan(module):
                continue
            if mesh.tp not in footprints:
                try:
                    footprints[mesh.tp] = footprint(module, inputs, tp=mesh.tp, dtype=dtype)
                except (ValueError, RuntimeError) as e:  # the plan does not split over tp
                    logger.info("ringify.estimate: no tp=%d: %s", mesh.tp, e)
                    footprints[mesh.tp] = None
            fp = footprints[mesh.tp]
            if fp is None:
                continue
            plain = row(fp, mesh, seq, batch, cluster, False, outputs=outputs)
            out.append(
                plain
                if plain.total <= usable
                else row(fp, mesh, seq, batch, cluster, True, outputs=outputs)
            )
        return sorted(out, key=lambda r: (r.total > usable, -r.tokens_per_gpu, r.total))

    rows = rows_for(gpus, seq_len)
    result = Estimate(seq_len, gpus, gpu, headroom, outputs, tuple(rows))
    if first.bend > 0.02:
        logger.warning(
            "ringify.estimate: memory grows faster than the sequence (%.0f%% off a line "
            "between the probes): something keeps more than O(S) per rank.",
            100 * first.bend,
        )
    if not rows or not result.fits(rows[0]):
        raise _none_fits(result, rows, cluster, rows_for)
    return result


def _check_gpus(gpus: int, cluster: Cluster) -> None:
    if gpus < 1:
        raise ValueError(f"gpus={gpus}: give at least one GPU.")
    if gpus > cluster.per_host and gpus % cluster.per_host:
        raise ValueError(
            f"{gpus} GPUs do not make whole hosts of {cluster.per_host}: give a multiple "
            f"of {cluster.per_host}, or at most {cluster.per_host} GPUs."
        )


def _none_fits(result: Estimate, rows: list[Row], cluster: Cluster, rows_for) -> NoMeshFits:
    """What does fit: the fewest GPUs for this length, the longest length on these GPUs."""
    usable = result.usable
    smallest = min(rows, key=lambda r: r.total)
    counts = sorted({2**k for k in range(17)} | {cluster.per_host * k for k in range(1, 129)})
    enough = next(
        (n for n in counts if n > result.gpus and (r := rows_for(n, result.seq_len))
         and r[0].total <= usable),
        None,
    )  # fmt: skip
    low, high = 0, result.seq_len  # the longest multiple of 1024 that fits these GPUs
    while high - low > 1024:
        mid = (low + high) // 2 // 1024 * 1024 or 1024
        fitting = (r := rows_for(result.gpus, mid)) and r[0].total <= usable
        low, high = (mid, high) if fitting else (low, mid)
    m = smallest.mesh
    message = (
        f"No mesh of {result.gpus} x {result.gpu} fits {result.seq_len:,} positions in "
        f"{usable / GIB:.1f} GiB per GPU: the least needs {smallest.total / GIB:.1f} GiB "
        f"(dp={m.dp} tp={m.tp} cp={m.cp} {m.strategy}, checkpointed). "
        + (f"{enough} GPUs fit it. " if enough else "No count up to 65536 GPUs fits it. ")
        + (f"On {result.gpus}, up to {low:,} positions fit." if low else "")
    )
    return NoMeshFits(message, enough, low)


def _heads(fp: Footprint) -> tuple[int, int]:
    if not fp.attentions:
        return 1, 1
    return fp.attentions[0].heads, fp.attentions[0].kv_heads


def _plan(module: nn.Module) -> bool:
    return bool(getattr(module, "tp_plan", None))


def _module(model, dtype: torch.dtype) -> nn.Module:
    """A module from a module, a transformers config, or a config's path or model id; built
    on the meta device, attention through SDPA and (in bf16) experts through grouped GEMMs,
    as a GPU runs them."""
    if isinstance(model, nn.Module):
        return model
    import transformers

    config = model
    if isinstance(model, (str, os.PathLike)) and os.path.isfile(model):
        with open(model) as f:
            model = json.load(f)
    if isinstance(model, dict):
        config = transformers.AutoConfig.for_model(**model)
    elif isinstance(model, (str, os.PathLike)):  # a folder, or a cached model id
        try:
            config = transformers.AutoConfig.from_pretrained(model, local_files_only=True)
        except OSError as e:
            raise ValueError(
                f"No config at {os.fspath(model)!r}: give a config.json, a folder holding "
                "one, or a model id whose config is in the local Hugging Face cache."
            ) from e
    config.use_cache = False  # training: no KV cache (ringify leaves it out)
    experts = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    if dtype == torch.bfloat16 and any(getattr(config, k, None) for k in experts):
        config._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        for attention in ("sdpa", None):  # SDPA where the model has it
            if attention is not None:
                config._attn_implementation = attention
            for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
                try:
                    return auto.from_config(config)
                except ValueError:
                    continue
            config._attn_implementation = None
    raise ValueError(f"transformers builds no model from {type(config).__name__}.")
