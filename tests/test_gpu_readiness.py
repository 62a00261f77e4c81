"""The ring loop on a device, held on CPU: the op's forward and backward bodies run on meta
tensors (which take the CUDA branches of every kernel call), their plan made by ``attention_plan`` from
host copies of the mask program's inputs. A meta tensor cannot be read, and an op mixing it with
a CPU tensor raises: so the loop reads nothing from the device and mixes no host tensor in,
for a causal, a packed-document, a sliding-window and a learned program; and every FlashAttention
call keeps its contracts (square when causal, a dense lse)."""

from __future__ import annotations

import pytest
import torch
from test_flash_contracts import FlashCalls, VarlenCalls
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ringify.runtime.attention.ops import ring_attention_backward_op, ring_attention_op
from ringify.runtime.attention.spec import AttentionSpec
from ringify.runtime.masks.program import MaskProgram
from ringify.runtime.tiling.tiles import MIN_TILE_ROWS
from ringify.testing.ring_vs_sdpa import document_causal_program, document_inputs, window_program

N = 3 * MIN_TILE_ROWS  # three tiles of one 1024-row block each (TILES)
TILES = 3  # forced: the CPU's own policy would cut these rows into one tile
CAUSAL = (("le.Tensor", ({"pos": "k"}, {"pos": "q"}), "bool"),)
KEYS = N - 7  # the last keys are padding


def _case(name: str):
    """(program text, its inputs on the host, whether they are learned)."""
    lengths = [700, 1500, N - 2200]
    if name == "causal":
        return MaskProgram((), CAUSAL).text(), [], False
    if name == "window":
        return window_program(MIN_TILE_ROWS + 100), [], False
    if name == "packed":
        return document_causal_program(), document_inputs(lengths), False
    bias = torch.randn(1, N, dtype=torch.float32)  # "learned": a per-key float input
    return document_causal_program(learned=True), [*document_inputs(lengths), bias], True


GEOMETRY = ("", "contiguous", KEYS)


def meta_tensors() -> tuple[torch.Tensor, ...]:
    """(q, k, v, dout) on meta in bfloat16: 4 query heads on 2 kv heads (GQA)."""
    meta = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16, device="meta")
    return meta(1, 4, N, 64), meta(1, 2, N, 64), meta(1, 2, N, 64), meta(1, 4, N, 64)


def layer_bodies(program: str, inputs, plan, q, k, v, dout, step_masks=None) -> None:
    """One layer's ring op bodies (not their fake kernels), forward then backward."""
    spec = AttentionSpec("", 0.125, mask_program=program)
    args = (None, inputs, KEYS, spec, plan, None, step_masks)
    out, lse = ring_attention_op._init_fn(q, k, v, *args)
    ring_attention_backward_op._init_fn(dout, q, k, v, out, lse, *args)


@pytest.mark.parametrize("name", ["causal", "packed", "window", "learned"])
def test_the_ring_loop_reads_nothing_and_mixes_nothing_on_a_device(name):
    program, host, learned = _case(name)
    scale = 0.125
    geometry = ("", "contiguous", KEYS)
    plan = torch.ops.ringify.attention_plan(program, host, N, False, *geometry, TILES)
    meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")
    q, dout = meta(1, 4, N, 64), meta(1, 4, N, 64)
    k, v = meta(1, 2, N, 64), meta(1, 2, N, 64)  # GQA: 2 kv heads
    inputs = [x.to("meta") for x in host]
    args = (None, inputs, KEYS, AttentionSpec("", scale, mask_program=program), plan)
    # The ops' bodies themselves: a meta tensor given to the op would dispatch to its fake kernel.
    with FlashCalls() as log:
        out, lse = ring_attention_op._init_fn(q, k, v, *args)
        wanted = [x.is_floating_point() for x in inputs]
        dq, dk, dv, _, dinputs, _ = ring_attention_backward_op._init_fn(
            dout, q, k, v, out, lse, *args, mask_grad=False, input_grads=wanted
        )
    assert plan.calls.total() == 2  # both ran on the plan given: nothing made, nothing read
    assert (out.shape, lse.shape) == (q.shape, q.shape[:3])
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert [d.shape for d in dinputs] == [x.shape for x in inputs if x.is_floating_point()]
    for direction, rows, keys, causal, dense in log.calls:
        assert not causal or rows == keys, log.calls
        assert direction == "forward" or dense, log.calls
    assert set(log.heads) <= {(4, 2)}  # GQA's K/V reach FA2 unexpanded
    # a masked block's bias has the program's own dims, broadcast over the heads (never a
    # dense (B, H, s, t) copy), its rows 16-byte aligned, in q's dtype
    assert log.biases or name == "causal"
    for strides, same_dtype in log.biases:
        assert strides[1] == 0 and strides[2] % 8 == 0 and same_dtype, log.biases
    if not learned:  # causal blocks on the diagonal reach FA2 (a learned one has a bias)
        assert any(causal for *_, causal, _ in log.calls), log.calls


class _ProgramOps(TorchDispatchMode):
    """How many times each of ``names`` (ATen ops of a mask program) ran."""

    def __init__(self, names):
        super().__init__()
        self.names, self.count = names, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += str(func.overloadpacket.__name__) + "." + func._overloadname in self.names
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["packed", "window"])
def test_a_steps_masks_are_evaluated_once_for_every_layer(name):
    """``ringify::step_masks`` evaluates each masked block's mask on the device once per step,
    as the kernel's bias, and the sequences of its FA2 varlen calls: every layer's forward
    and backward given them evaluate nothing and make no bias. A call given none (outside a
    ringified graph) evaluates its own."""
    from ringify.runtime.masks.step_masks import make_step_masks

    program, host, _ = _case(name)
    ops = {"packed": {"eq.Tensor"}, "window": {"lt.Scalar"}}[name]  # the program's own ops
    ops |= {"log_.default"}  # a bool mask made a bias (``additive_mask``)
    q, k, v, dout = meta_tensors()
    inputs = [x.to("meta") for x in host]
    plan = torch.ops.ringify.attention_plan(
        program, host, N, False, *GEOMETRY, TILES, device_type="cuda"
    )
    with _ProgramOps(ops) as made:
        step_masks = list(make_step_masks(inputs, plan, q.dtype, True, q.device, N))
    with _ProgramOps(ops) as layers:
        for _ in range(2):
            layer_bodies(program, inputs, plan, q, k, v, dout, step_masks)
    small = [torch.zeros(*x.shape[:3], 2) for x in (q, k, v, dout)]  # no plan: on the host
    with _ProgramOps(ops) as unplanned:
        layer_bodies(program, host, None, *small[:3], small[3])
    assert made.count > 0 and layers.count == 0
    assert unplanned.count > 0


class _RingifyBodies(TorchDispatchMode):
    """Runs every ringify op's own body on meta tensors, where the dispatcher would run its
    fake kernel (a fake kernel serves the Meta key): so a whole graph on meta executes the ring
    loop itself, as on a device. Autograd sits above the mode: the ops' backward runs too."""

    def __init__(self):
        from torch._library.custom_ops import OPDEFS

        super().__init__()
        self.bodies = {
            d._opoverload: d._init_fn for name, d in OPDEFS.items() if name.startswith("ringify::")
        }
        self.ran: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = self.bodies.get(func)
        if body is None:
            return func(*args, **(kwargs or {}))
        self.ran.append(func.name())
        return body(*args, **(kwargs or {}))


def _llama_case(case: str, seq: int):
    """(an HF Llama, or Mistral with a window shorter than ``seq``, and its inputs)."""
    from ringify.testing import hf_models

    torch.manual_seed(0)
    shape = {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2}
    if case == "window":
        model = hf_models.mistral(MIN_TILE_ROWS + 100, **shape)
    else:
        model = hf_models.llama(**shape, max_len=seq)
    ids = torch.randint(1, 64, (1, seq))
    inputs = {"input_ids": ids, "labels": ids}
    if case == "padded":
        inputs["attention_mask"] = torch.ones(1, seq, dtype=torch.long)
        inputs["attention_mask"][:, -300:] = 0
    if case == "packed":
        lengths = (700, 1500, seq - 2200)
        inputs["position_ids"] = torch.cat([torch.arange(n) for n in lengths]).view(1, -1)
    return model, inputs


@pytest.mark.parametrize("case", ["causal", "padded", "packed", "window"])
def test_a_whole_ringified_llama_runs_on_a_device(case):
    """A whole ringified HF model, forward and backward, on meta tensors in bfloat16: every op
    of its graph and every ring op body takes its CUDA branch, and a meta tensor can neither be
    read nor mixed with a host tensor. Its plan's one host copy (the only read a GPU run makes)
    is replayed from a CPU run on the same inputs. Every flash call keeps its contracts, GQA's
    K/V reach it unexpanded, packed documents and a window run as FA2 varlen calls, and every
    ring call runs on the graph's plan."""
    from unittest import mock

    from plans_made import made_plans

    from ringify import ringify
    from ringify.runtime.masks import captures

    model, inputs = _llama_case(case, N)
    ringified = ringify(model, ring_size=1)
    copies, copy = [], captures.host_copy
    with mock.patch.object(captures, "host_copy", lambda x: copies.append(copy(x)) or copies[-1]):
        ringified(**inputs).loss.backward()  # on the host: the plans' inputs, recorded
    ringified.to(device="meta", dtype=torch.bfloat16)
    on_meta = {k: v.to("meta") for k, v in inputs.items()}
    ringified(**on_meta)  # traced for meta inputs (the ops' fake kernels run)
    replayed = iter(copies)
    with (
        made_plans() as made,
        mock.patch.object(captures, "host_copy", lambda x: next(replayed)),
        FlashCalls() as log,
        VarlenCalls() as varlen,
        _RingifyBodies() as bodies,
    ):
        loss = ringified(**on_meta).loss
        loss.backward()
    assert loss.device.type == "meta"
    assert bodies.ran.count("ringify::ring_attention_backward") == 2, bodies.ran
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters())
    assert made.calls() == 2 * 2 and not made.by_calls  # 2 layers, each on the graph's plan
    assert len(made.by_graph) <= 1  # one plan (one host copy), or none without a program
    assert log.calls or log.biases or varlen.calls  # the CUDA kernels were reached
    varlen.check_contracts(heads=(4, 2))
    if case in ("packed", "window"):  # open pairs as FA2 varlen calls, no bias
        assert varlen.calls and not log.biases
    for direction, rows, keys, causal, dense in log.calls:
        assert not causal or rows == keys, log.calls
        assert direction == "forward" or dense, log.calls
    assert set(log.heads) <= {(4, 2)}
    for strides, same_dtype in log.biases:
        assert strides[1] == 0 and strides[2] % 8 == 0 and same_dtype, log.biases
    assert _plan_arguments(ringified) == ({"cpu"}, {"meta"})


def _plan_arguments(ringified) -> tuple[set[str], set[str]]:
    """The devices of the plan ops' tensor arguments, and of the tensors they were copied
    from, in the graph traced for the device. Inductor gives the plan (an opaque output) the
    device of its op's tensors, and on a GPU a plan on the GPU fails its check of a compiled
    graph's outputs (``_check_triton_bf16_support`` asks each its dtype): host tensors only."""
    graph = list(ringified._traced.values())[-1].module.graph
    plans = [n for n in graph.nodes if n.target is torch.ops.ringify.attention_plan.default]
    assert plans
    args = [a for n in plans for a in n.all_input_nodes if isinstance(a.meta["val"], torch.Tensor)]
    copied = [
        x.meta["val"].device.type
        for n in graph.nodes
        if n.target is torch.ops.ringify.host_inputs.default
        for x in n.all_input_nodes
    ]
    return {a.meta["val"].device.type for a in args}, set(copied)


class _FromHostData(TorchFunctionMode):
    """The calls that build a tensor from host data (``torch.tensor``, ``torch.as_tensor``):
    a host-to-device copy each, on a GPU."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.tensor, torch.as_tensor) and not isinstance(args[0], torch.Tensor):
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_programs_literals_are_made_on_the_device():
    """A program's constants and cast literals (T5's relative-position bias has them) are
    filled in on the device, not copied from the host in every block of every layer."""
    from ringify.runtime.masks.program import evaluate, parse

    program = parse(
        MaskProgram(
            ("k",),
            (
                ("const", (0.5,), "float32"),
                ("cast", (3,), "float32"),
                ("mul.Tensor", ({"in": 0}, {"op": 0}), "float32"),
                ("add.Tensor", ({"op": 2}, {"op": 1}), "float32"),
            ),
        ).text()
    )
    keys = torch.arange(8.0).view(1, -1)
    got = evaluate(program, [keys], slice(0, 4), slice(0, 8), torch.device("cpu"))
    assert torch.equal(got.reshape(-1, 8)[0], keys[0] * 0.5 + 3)
    keys = keys.to("meta")
    with _FromHostData() as seen:
        on_meta = evaluate(program, [keys], slice(0, 4), slice(0, 8), "meta")
    assert on_meta.device.type == "meta" and not seen.calls, seen.calls


@pytest.mark.parametrize("name", ["causal", "packed"])
def test_capped_blocks_and_sinks_run_on_a_device(name):
    """A soft-capped ring with sinks, on meta tensors in bfloat16 (the CUDA branches): a capped
    block runs the math formulation (ATen's SDPA kernels take no cap), never FA2 or a varlen
    call; nothing is read or mixed with a host tensor (a meta tensor can be neither); every
    output, the sinks' gradient included, has its shape."""
    program, host, _ = _case(name)
    plan = torch.ops.ringify.attention_plan(program, host, N, False, *GEOMETRY, TILES)
    q, k, v, dout = meta_tensors()
    sinks = torch.empty(1, 4, 1, 1, dtype=torch.bfloat16, device="meta")
    inputs = [x.to("meta") for x in host]
    spec = AttentionSpec("", 0.125, softcap=30.0, mask_program=program)
    args = (None, inputs, KEYS, spec, plan, sinks)
    with FlashCalls() as log, VarlenCalls() as varlen:
        out, lse = ring_attention_op._init_fn(q, k, v, *args)
        dq, dk, dv, _, _, dsinks = ring_attention_backward_op._init_fn(
            dout, q, k, v, out, lse, *args, mask_grad=False
        )
    assert not log.calls and not varlen.calls, (log.calls, varlen.calls)
    assert (out.shape, lse.shape, dsinks.shape) == (q.shape, q.shape[:3], sinks.shape)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
