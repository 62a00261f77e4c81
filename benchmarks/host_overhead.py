"""Host time of the ring op per attention call, with its kernels and transfers stubbed.

On a GPU the ring op's kernels run asynchronously: what the host spends per call (planning,
slicing, launching) is hidden behind them only if it is shorter. Here the attention
kernels are stubs that allocate their outputs: FA2's ATen kernels under ringify's own FA2
wrappers, which run for real as bf16 on a GPU runs them (``flash.py``: their views and
dense copies are host work too), and the biased blocks' kernels, ``merge_block`` and
``additive_mask`` (on this CPU, writing a block-sized bias evicts the host's caches, which
a GPU's kernels never touch); ``start_exchange`` is one that moves nothing (it counts the
bytes a real exchange would send: ``kernel_stubs.py``). So a call's time under
``torch.profiler`` is its host work alone; open pairs run as FA2 varlen calls, as bf16 on a
GPU does; each call is measured replayed on its own too (``op_replay.py``): the
criterion's figure.

PyTorch's own ring (``_templated_ring_attention``, causal, load-balanced) runs under the same
stubs (``torch_ring_times``). Tiles are sized, and a step's masks laid out, as on a GPU
(``tiles.on_accelerator``, patched for these CPU tensors): what a GPU run's host would do.

Cases: HF Llama (4 layers, hidden 128, 4 heads on 2 kv heads, float32, batch 1) causal (a
mask program: HF always builds one under export), right-padded (10%), packed (4 documents
of 10/20/30/40%), Mistral with a 256-token window; and ``is_causal``: the op called with
``is_causal=True`` and no mask on the same shapes, laid out as a model's (``model_layout``;
PyTorch's ring gets the same layout). Per case, host µs per call, forward and backward, two
ways:
- profiled (``_host_cost``): the op's own time under ``torch.profiler`` plus ``LAUNCH_US``
  per kernel it launches, and its views' own time (``--views-as-launches``: at
  ``LAUNCH_US`` too); each replay timed as the second of two passes under its profiler,
  whose first recorded calls carry its start (``op_replay.profiled_events``);
- "wall+launch", the forward's: the same replayed calls timed with no profiler, plus
  ``LAUNCH_US`` per kernel. It is host work only where the call's "data µs" are nil: the
  kernels this CPU ran for real (copies, adds, fills), which a GPU's host only launches. So
  it holds at 8K, where no forward moves data; not at 128K (an accumulator's zero fill, a
  balanced plan's row moves, masks evaluated per call beyond the kept budget), in a
  backward (its adds and copies) or for PyTorch's ring (its copies).

Each is the mean over a step's calls replayed; in the step too, whose first forward is left
out. ``masks µs/step``: ``ringify::step_masks``, which makes the step's masks for every call
(its kernels counted as launches). Then the kernels per call, the
plan's µs per step, the K/V bytes one layer sends per step with HF's ``repeat_kv`` folded
and not, and a paper model of a GPU step (labelled so, ``paper_model``).

    python -m benchmarks.host_overhead --seqs 8192 --rings 2 4
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
from unittest import mock

import torch
from tabulate import tabulate

from benchmarks import kernel_stubs, op_replay
from ringify.testing import RankPool
from ringify.testing.ring_vs_sdpa import model_layout

CASES = ("is_causal", "causal", "padded", "packed", "swa")
LAYERS, WINDOW, REPEATS = 4, 256, 3
FORWARD = "ringify::ring_attention"
HEADERS = (
    *("ring", "S", "case", "fwd µs/call", "bwd µs/call", "fwd / is_causal", "bwd / is_causal"),
    *("wall+launch fwd µs", "wall fwd / is_causal", "fwd data µs"),
    *("in-step fwd µs", "in-step bwd µs", "fwd kernels", "bwd kernels", "masks µs/step"),
    *("plan µs/step", "KV MiB/layer-step repeated", "KV MiB/layer-step folded"),
)


def _model_and_inputs(case: str, seq: int):
    from ringify.testing import hf_models

    torch.manual_seed(0)
    shape = {"layers": LAYERS, "dim": 128, "heads": 4, "kv_heads": 2}
    if case == "swa":
        model = hf_models.mistral(WINDOW, **shape)
    else:
        model = hf_models.llama(**shape, max_len=seq)
    ids = torch.randint(1, 64, (1, seq))
    kwargs = {"input_ids": ids, "labels": ids}
    if case == "padded":
        mask = torch.ones(1, seq, dtype=torch.long)
        mask[:, seq - seq // 10 :] = 0
        kwargs["attention_mask"] = mask
    if case == "packed":
        sizes = [seq // 10, seq // 5, 3 * seq // 10]
        kwargs["position_ids"] = torch.cat(
            [torch.arange(n) for n in (*sizes, seq - sum(sizes))]
        ).view(1, -1)
    return model, kwargs


def _step(case: str, seq: int, fold: bool):
    """One step's function (forward and backward), after its warm-up step."""
    import torch.distributed as dist

    from ringify import ringify

    world = dist.get_world_size()
    if case == "is_causal":
        from ringify.runtime import ring_attention, shard

        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, h, seq, 32, generator=g) for h in (4, 2, 2)]
        # as ringify's, laid out as a model's: (B, H, S, D) views of (B, S, H, D)
        qkv = [model_layout(shard(t, 2, layout="zigzag")).requires_grad_() for t in full]

        def step():
            for _ in range(LAYERS):
                out = ring_attention(*qkv, is_causal=True, enable_gqa=True, layout="zigzag")
                out.sum().backward()

        return step
    model, kwargs = _model_and_inputs(case, seq)
    with (
        contextlib.nullcontext() if fold else mock.patch("ringify.passes.pipeline.fold_repeated_kv")
    ):
        ringified = ringify(model, ring_size=world)
        ringified(**kwargs).loss.backward()  # trace, plan

    def step():
        model.zero_grad(set_to_none=True)
        ringified(**kwargs).loss.backward()

    return step


def torch_ring_times(seq: int, views_as_launches: bool = False) -> dict[str, float]:
    """On every rank: µs per call of PyTorch's ring attention forward and backward (causal,
    its round-robin load balance: our zigzag), kernels and rotations stubbed."""
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    from torch.profiler import ProfilerActivity, profile, record_function

    world = dist.get_world_size()
    rows = seq // world
    g = torch.Generator().manual_seed(0)
    q, k, v, dout, out = (model_layout(torch.randn(1, 4, rows, 32, generator=g)) for _ in range(5))
    lse = torch.zeros(1, 4, rows)  # its CP expands GQA's K/V before the ring: 4 heads each

    def forward_op(q, k, v, is_causal, **_):
        return torch.empty_like(q), q.new_empty(q.shape[:3])

    def backward_op(*, query, key, value, **_):
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)

    def forward():
        cp._templated_ring_attention(
            dist.group.WORLD, 2, forward_op, q, k, v, is_causal=True, scale=0.125
        )

    def backward():
        cp._templated_ring_attention_backward(
            dist.group.WORLD, 2, backward_op, dout, "grad_out", q, k, v, out, lse,
            is_causal=True, scale=0.125,
        )  # fmt: skip

    def step():
        for _ in range(LAYERS):
            with record_function("torch_ring_forward"):
                forward()
            with record_function("torch_ring_backward"):
                backward()

    calls = {"torch_ring_forward": [], "torch_ring_backward": []}
    wall: dict[str, float] = {}

    def steps():  # nothing moves between the ranks: one rank at a time, as ours replay
        step()
        wall["torch_ring_forward"] = op_replay.best_wall_us(forward)
        for _ in range(REPEATS):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
                step()  # timed: a profiler's first events carry its start (op_replay)
            for name in calls:
                timed = op_replay.profiled_events(prof, name)[LAYERS:]
                calls[name].append([_host_cost(e, views_as_launches) for e in timed])

    with kernel_stubs.torch_ring_stubs():
        op_replay.one_rank_at_a_time(steps)
    replayed = {
        name: [op_replay.median_cost(per_call) for per_call in zip(*calls[name], strict=True)]
        for name in calls
    }
    fwd, bwd = replayed.values()
    return {
        "fwd_us": _mean(fwd, 0),
        "bwd_us": _mean(bwd, 0),
        "fwd_wall_us": _wall_launch(wall, replayed, "torch_ring_forward"),
        "fwd_data_us": _data_us(replayed, "torch_ring_forward"),
        "fwd_launches": _mean(fwd, 1),
        "bwd_launches": _mean(bwd, 1),
    }


def host_times(
    case: str, seq: int, fold: bool, repeats: int = REPEATS, views_as_launches: bool = False
) -> dict[str, float]:
    """On every rank: µs per ring op call (forward, backward), attention_plan µs per step,
    K/V bytes sent per layer and step (stubbed exchanges count them)."""
    from torch.profiler import ProfilerActivity, profile

    sent = [0, 0.0]
    calls = {"ringify::ring_attention": [], "ringify::ring_attention_backward": []}
    plan_us, masks_us = [], []
    with kernel_stubs.ringify_stubs(sent):
        step = _step(case, seq, fold)
        step()  # a warm step: plans kept, caches filled
        cost = functools.partial(_host_cost, views_as_launches=views_as_launches)
        captured = op_replay.captured_calls(step)
        replayed = op_replay.replayed_costs(captured, repeats, cost)
        wall = op_replay.replayed_wall_us({FORWARD: captured[FORWARD]})
        for _ in range(repeats):  # this machine's noise: each call's median over the steps
            sent[:] = [0, 0.0]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            got = {name: [] for name in calls}
            plan_us.append(0.0)
            masks_us.append(0.0)
            for event in prof.events():
                if event.name in calls:
                    got[event.name].append(cost(event))
                elif event.name == "ringify::attention_plan":
                    plan_us[-1] += event.cpu_time_total
                elif event.name == "ringify::step_masks":  # its kernels: launches on a GPU
                    masks_us[-1] += cost(event)[0]
            for name in calls:
                calls[name].append(got[name])
    calls = {
        name: [op_replay.median_cost(per_call) for per_call in zip(*steps, strict=True)]
        for name, steps in calls.items()
    }
    plan_us, masks_us = statistics.median(plan_us), statistics.median(masks_us)

    # ``ringify::step_masks`` makes the masks every call of the step reads, once per step
    # (``masks/step_masks.py``): a per-step cost, as the plan's, reported apart from the calls.
    # The step's first forward is left out, as when it evaluated the step's masks itself.
    forward, backward = calls["ringify::ring_attention"], calls["ringify::ring_attention_backward"]
    later = forward[1:] or forward
    return {
        "fwd_us": _mean(replayed[FORWARD], 0),
        "bwd_us": _mean(replayed["ringify::ring_attention_backward"], 0),
        "fwd_wall_us": _wall_launch(wall, replayed, FORWARD),
        "fwd_data_us": _data_us(replayed, FORWARD),
        "step_fwd_us": _mean(later, 0),
        "step_bwd_us": _mean(backward, 0),
        "fwd_launches": _mean(later, 1),
        "bwd_launches": _mean(backward, 1),
        "masks_us": masks_us,
        "plan_us": plan_us,
        "bytes": sent[0] / LAYERS,
        "flops": sent[1] / LAYERS,  # one layer's, forward and backward, on this rank
    }


def _wall_launch(wall: dict[str, float], replayed: dict[str, list], name: str) -> float:
    """An op's wall+launch µs per call: its replayed wall time with no profiler (whose
    bookkeeping weighs on a call by its number of ATen ops) plus ``LAUNCH_US`` per kernel a
    GPU launches (the stubs launch nothing). Faithful where the call's data µs are nil."""
    return wall[name] + LAUNCH_US * _mean(replayed[name], 1)


def _data_us(replayed: dict[str, list], name: str) -> float:
    """The µs per call of the kernels this CPU ran for real in ``name``'s calls (profiled):
    work a GPU's host does not do, which the wall+launch figure would count."""
    return _mean(replayed[name], 2)


def _mean(costs: list[tuple], i: int) -> float:
    """The mean of item ``i`` (µs, kernels or data µs) over calls' costs (0 with none)."""
    return sum(c[i] for c in costs) / max(1, len(costs))


# On a GPU each kernel an op launches costs the host about this much (CUDA launch, ATen
# dispatch); the kernels' own work, done here on the CPU, is left out. An allocation counts
# as one too (the caching allocator's host work).
LAUNCH_US = 5.0


def _host_cost(event, views_as_launches: bool = False) -> tuple[float, int, float]:
    """(µs, kernels, data µs) of one op call on a GPU host: its own Python time (the op's time
    less that of the outermost ATen ops under it: an autograd ``Function``'s event between
    them is the op's own Python) plus, per ATen op that calls no other, ``LAUNCH_US`` if it
    launches a kernel or allocates (so that a mask evaluated on this CPU counts as the
    launches it would be), else its own time here: a view (``narrow``, ``permute``,
    ``as_strided``, a dense tensor's ``contiguous``) launches nothing, and makes the same
    tensor metadata on any device (``views_as_launches``: as launches too, the model of
    RESULTS' earlier sections). Data µs: the time of the kernels this CPU ran for real
    (every such op but an allocation: a copy, an add, a fill): nil where a wall time of the
    call is its host work."""
    kernels, aten_us, views_us, data_us = 0, 0.0, 0.0, 0.0
    stack = [(child, False) for child in event.cpu_children]
    while stack:
        e, inside_aten = stack.pop()
        is_aten = e.name.startswith("aten::")
        if is_aten and not inside_aten:
            aten_us += e.cpu_time_total
        if is_aten and not any(c.name.startswith("aten::") for c in e.cpu_children):
            if _is_view(e.name) and not views_as_launches:
                views_us += e.cpu_time_total
            else:
                kernels += 1
                data_us += 0.0 if e.name in ALLOCATIONS or _is_view(e.name) else e.cpu_time_total
        stack.extend((c, inside_aten or is_aten) for c in e.cpu_children)
    return event.cpu_time_total - aten_us + views_us + LAUNCH_US * kernels, kernels, data_us


# Leaf ATen ops that only allocate (a GPU's caching allocator: host work, no kernel).
ALLOCATIONS = frozenset(
    f"aten::{name}" for name in ("empty", "empty_like", "empty_strided", "new_empty")
)


@functools.cache
def _is_view(name: str) -> bool:
    """Whether an ATen op's schema returns only aliases of its inputs and writes none."""
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    if packet is None:
        return False
    returns = getattr(packet, "default", getattr(packet, packet.overloads()[0]))._schema.returns
    return bool(returns) and all(r.alias_info and not r.alias_info.is_write for r in returns)


# A Llama-3-8B attention layer on H100s: the paper model's constants (the per-step plan and
# masks are shared by its 32 layers).
H, K, D, MODEL_LAYERS = 32, 8, 128, 32
BENCH_HEADS, BENCH_HEAD_DIM = 4, 32  # the benchmark's model: hidden 128 in 4 heads
BF16_FLOPS = 400e12  # attention kernels achieved on an H100 in bf16 (FA2-class), not the peak
NVLINK_BYTES_S = 450e9  # one direction of an H100's NVLink 4


def paper_model(seq: int, ring: int, host_us: float, flops: float) -> dict[str, float]:
    """A modelled GPU step of one attention layer, forward + backward, per rank: kernel time
    from the FLOPs its kernels run here (``flops``: the blocks each call computes, masked
    blocks whole), scaled to Llama-3-8B's heads, at ``BF16_FLOPS``; K/V bytes per ring step
    in bf16 (K heads), hidden behind a step's kernels if shorter; the host time measured
    here, hidden behind the kernels if shorter. Efficiency: kernel time over modelled time."""
    kernels = flops * (H * D) / (BENCH_HEADS * BENCH_HEAD_DIM) / BF16_FLOPS
    step_bytes = 2 * (seq // ring) * K * D * 2 * 2  # k and v forward, k/v + dk/dv backward
    step = max(kernels / ring, step_bytes / NVLINK_BYTES_S)
    modelled = max(step * ring, host_us * 1e-6)
    return {"kernel_ms": kernels * 1e3, "modelled_ms": modelled * 1e3, "eff": kernels / modelled}


def _wall(got: dict, base: dict) -> list[str]:
    """The forward's wall+launch µs, over ``is_causal``'s, and the data µs it holds."""
    wall = got["fwd_wall_us"]
    return [f"{wall:.0f}", f"{wall / base['fwd_wall_us']:.2f}", f"{got['fwd_data_us']:.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192])
    parser.add_argument("--rings", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--views-as-launches",
        action="store_true",
        help="count a view as a launch (RESULTS' earlier sections)",
    )
    args = parser.parse_args()
    rows, model_rows = [], []
    for ring in args.rings:
        pool = RankPool(ring)
        try:
            for seq in args.seqs:
                base = None
                for case in CASES:
                    views = args.views_as_launches
                    got = pool.run(host_times, case, seq, True, REPEATS, views, timeout=3600)[0]
                    unfolded = (
                        pool.run(host_times, case, seq, False, 1, timeout=3600)[0]
                        if case != "is_causal"
                        else got
                    )
                    base = base or got
                    rows.append([
                        ring, seq, case, f"{got['fwd_us']:.0f}", f"{got['bwd_us']:.0f}",
                        f"{got['fwd_us'] / base['fwd_us']:.2f}",
                        f"{got['bwd_us'] / base['bwd_us']:.2f}",
                        *_wall(got, base),
                        f"{got['step_fwd_us']:.0f}", f"{got['step_bwd_us']:.0f}",
                        f"{got['fwd_launches']:.0f}", f"{got['bwd_launches']:.0f}",
                        f"{got['masks_us']:.0f}", f"{got['plan_us']:.0f}",
                        f"{unfolded['bytes'] / 2**20:.2f}", f"{got['bytes'] / 2**20:.2f}",
                    ])  # fmt: skip
                    per_step = got["plan_us"] + got["masks_us"]
                    # in-step times: the larger, so the model errs against us
                    host = got["step_fwd_us"] + got["step_bwd_us"] + per_step / MODEL_LAYERS
                    m = paper_model(seq, ring, host, got["flops"])
                    model_rows.append([
                        ring, seq, case, f"{host:.0f}", f"{m['kernel_ms']:.2f}",
                        f"{m['modelled_ms']:.2f}", f"{m['eff']:.2f}",
                    ])  # fmt: skip
                    print(tabulate([rows[-1]]), flush=True)
                theirs = pool.run(torch_ring_times, seq, views, timeout=3600)[0]
                rows.append([
                    ring, seq, "PyTorch ring", f"{theirs['fwd_us']:.0f}",
                    f"{theirs['bwd_us']:.0f}", f"{theirs['fwd_us'] / base['fwd_us']:.2f}",
                    f"{theirs['bwd_us'] / base['bwd_us']:.2f}", *_wall(theirs, base), "-", "-",
                    f"{theirs['fwd_launches']:.0f}", f"{theirs['bwd_launches']:.0f}",
                    "-", "-", "-", "-",
                ])  # fmt: skip
                print(tabulate([rows[-1]]), flush=True)
        finally:
            pool.close()
    print(
        tabulate(
            rows,
            headers=HEADERS,
            tablefmt="github",
        )
    )
    print("\nPaper model (not a measurement): Llama-3-8B layer, H100 bf16")
    print(
        tabulate(
            model_rows,
            headers=["ring", "S", "case", "host µs/layer", "kernel ms", "modelled ms", "eff"],
            tablefmt="github",
        )
    )


if __name__ == "__main__":
    main()
