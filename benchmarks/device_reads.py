"""Device-to-host reads and host/device mixing per training step, by call site.

``DeviceReads`` (below) counts what a GPU would wait for (parameters, buffers and inputs
marked as device tensors): one step, after a warm-up step, on a ring of 2
gloo ranks, rank 0's counts by kind and site. Cases: HF Llama causal, padded (the last 10% of
S padding), packed (documents of 10, 20, 30 and 40% of S) and Mistral's sliding window (256),
4 layers at S = 2048; and one step of other families and attention forms: T5 (a learned
relative-position bias), GPT-2 with HF's eager attention, ViT, Whisper's encoder, wav2vec2, a
DiT block, FlexAttention with packed documents, HF Llama at a third length (the graph the
second length traced for every length), ``generate`` (a prefill and 6 decode steps), and
diffusers' SD3 and Flux (joint attention).

    OMP_NUM_THREADS=1 python -m benchmarks.device_reads [--cases causal packed ...]
"""

from __future__ import annotations

import argparse
import collections
import sys
import weakref

import torch
from tabulate import tabulate
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ringify.testing import RankPool

LLAMA_CASES = ("causal", "padded", "packed", "swa")
CASES = (*LLAMA_CASES, "generate", "lengths", "t5", "gpt2_eager", "vit", "whisper", "wav2vec2",
         "dit", "flex", "sd3", "flux", "qwenimage")  # fmt: skip
SEQ, LAYERS = 2048, 4


def _llama_case(case: str):
    """(model, args, kwargs) of a float32 HF Llama (Mistral for ``swa``) training step."""
    import torch

    from ringify.testing import hf_models

    shape = {"layers": LAYERS, "dim": 128, "heads": 4, "kv_heads": 2}
    if case == "swa":
        model = hf_models.mistral(256, **shape)
    else:
        model = hf_models.llama(**shape, max_len=SEQ)
    ids = torch.randint(1, 64, (1, SEQ), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": ids}
    if case == "padded":
        mask = torch.ones_like(ids)
        mask[:, -SEQ // 10 :] = 0
        kwargs["attention_mask"] = mask
    if case == "packed":
        lengths = [SEQ // 10, SEQ // 5, 3 * SEQ // 10]
        lengths.append(SEQ - sum(lengths))
        kwargs["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    return model, (), kwargs


def _model(case: str):
    """(model, args, kwargs) of a training step of ``case``, float64."""
    import torch

    from ringify.testing import hf_models, models

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (2, 48), generator=g)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    if case == "t5":  # a learned relative-position bias: a program with literals
        return hf_models.t5(), (), {"input_ids": ids, "labels": ids[:, :24].clone()}
    if case == "gpt2_eager":  # attention written by hand (HF's eager)
        return hf_models.gpt2(attn_implementation="eager"), (), {"input_ids": ids, "labels": ids}
    if case == "vit":
        pixels = randn(2, 3, 32, 32)
        return hf_models.vit(image_size=32, patch_size=4), (), {"pixel_values": pixels}
    if case == "whisper":
        return hf_models.whisper_encoder(frames=96), (), {"input_features": randn(2, 8, 96)}
    if case == "wav2vec2":
        return hf_models.wav2vec2(), (), {"input_values": randn(2, 192)}
    if case == "dit":
        video, text = randn(2, 4, 2, 8, 8), randn(2, 5, 24)
        mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
        return models.DiTBlock(), (video, torch.tensor([3.0, 500.0]), text, mask), {}
    if case in ("sd3", "flux", "qwenimage"):  # joint attention (diffusers; a text mask)
        from ringify.testing import diffusers_models

        model, kwargs = getattr(diffusers_models, case)()
        return model, (), kwargs
    if case == "flex":  # FlexAttention with packed documents
        docs = torch.cumsum(torch.rand(2, 48, generator=g) < 0.15, 1)
        return models.FlexTransformer(), (ids, docs), {}
    raise ValueError(case)


def counted_step(case: str) -> list:
    """On a rank: one counted step of ``case``, its counts as sorted ((kind, site), count)."""
    import torch
    import torch.distributed as dist

    from ringify import ringify
    from ringify.testing import hf_models

    world = dist.get_world_size()
    torch.manual_seed(0)  # the same model and inputs on every rank
    if case == "generate":
        model = hf_models.llama(layers=2, max_len=256).eval()
        ids = torch.randint(1, 64, (1, 64))
        run = ringify(model, ring_size=world)
        run.generate(ids, max_new_tokens=2, do_sample=False)  # traces prefill and decode
        step, taint = lambda: run.generate(ids, max_new_tokens=6, do_sample=False), [ids]
    else:
        if case == "lengths":  # a third length: the graph the second one traced for all
            model = hf_models.llama(layers=2, max_len=256)
            inputs = [{"input_ids": x, "labels": x} for x in torch.randint(1, 64, (3, 1, 256))]
            args, kwargs = (), {k: v[:, :184] for k, v in inputs[0].items()}
            run = ringify(model, ring_size=world)
            for n, x in zip((256, 200), inputs[1:], strict=True):
                run(**{k: v[:, :n] for k, v in x.items()}).loss.backward()
        elif case in LLAMA_CASES:
            model, args, kwargs = _llama_case(case)
            run = ringify(model, ring_size=world)
        else:
            model, args, kwargs = _model(case)
            model = model.double()
            run = ringify(model, ring_size=world)
        tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]

        def step():
            out = run(*args, **kwargs)
            loss = getattr(out, "loss", None)
            if loss is None:
                first = out if isinstance(out, torch.Tensor) else out[0]
                loss = first.float().pow(2).mean()
            loss.backward()

        if case == "flex":  # traced without gradients: CPU flex has no backward
            model.requires_grad_(False)
            with torch.no_grad():
                run(*args, **kwargs)
            model.requires_grad_(True)
        taint = tensors
    step()  # warm-up, not counted
    with DeviceReads([*model.parameters(), *model.buffers(), *taint]) as reads:
        step()
    return sorted(reads.counts.items())


# ---- the instrument
# What a GPU would wait for, counted on the CPU: device-to-host reads and host/device mixing.
#
# On a GPU, reading a device tensor on the host (``item``, ``tolist``, ``bool``, ``numpy``, a
# data-dependent shape such as ``nonzero``) waits for the device, and an op mixing a device
# tensor with a host tensor fails. A CPU run has no devices, so ``DeviceReads`` models them:
# the tensors it is given (parameters, buffers, inputs) are device tensors, and so is every
# result of an op with a device tensor argument or an explicit ``device=``. Inside the block it
# records, by call site (the innermost frame in ``ringify/``, the testing helpers left out):
#
# - ``read``: a host read of a device tensor;
# - ``h2d``: a host tensor copied to the device (``.to(device)``, ``copy_`` into a device
#   tensor, ``torch.tensor(data, device=...)``): a blocking copy from pageable memory;
# - ``mix``: any other op given a device tensor and a host tensor of one or more dims.
#
# ringify's custom ops are run op body and all under the instrument (their bodies run below
# ``__torch_function__``, where a mode alone would not see them), so what the ring op does in
# its loop is counted, forward and backward. Usage, on one rank::
#
#     with DeviceReads([*model.parameters(), *model.buffers(), *inputs]) as reads:
#         model(**inputs).loss.backward()
#     reads.counts  # Counter of (kind, site)


_READS = frozenset({
    "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
    "cpu", "equal", "is_nonzero",
})  # fmt: skip
_SHAPES_FROM_DATA = frozenset({"nonzero", "masked_select", "_unique2", "unique_consecutive"})


class DeviceReads:
    """Counts reads, host-to-device copies and mixes in a block (see the module docstring)."""

    def __init__(self, device_tensors):
        self.counts: collections.Counter = collections.Counter()
        self.reading = 0  # inside a read already counted
        self._device: dict[int, weakref.ref] = {}
        for t in device_tensors:
            self.mark(t)
        self._functions = _Functions(self)
        self._dispatch = _Dispatch(self)

    def mark(self, t) -> None:
        if isinstance(t, torch.Tensor) and not self.on_device(t):
            key = id(t)
            self._device[key] = weakref.ref(t, lambda _, key=key: self._device.pop(key, None))

    def on_device(self, t) -> bool:
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def record(self, kind: str) -> None:
        self.counts[(kind, _site())] += 1

    def __enter__(self) -> DeviceReads:
        self._dispatch.__enter__()
        self._functions.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._functions.__exit__(*exc)
        self._dispatch.__exit__(*exc)


class _Functions(TorchFunctionMode):
    """Every torch call of Python code: reads, copies and mixes; device results marked."""

    def __init__(self, reads: DeviceReads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads, name = self.reads, getattr(func, "__name__", "")
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        device = [x for x in tensors if reads.on_device(x)]
        host = [x for x in tensors if not reads.on_device(x) and x.dim() > 0]
        to_device = kwargs.get("device") is not None or (
            name == "to" and any(isinstance(a, (torch.device, str)) for a in args[1:])
        )
        reading = name in _READS and bool(device)
        if reading:
            reads.record("read")
        elif _copies_to_device(name, tensors, to_device, reads):
            reads.record("h2d")
        elif device and host:
            reads.record("mix")
        reads.reading += reading  # the scalar read below it in ATen is this one
        try:
            out = func(*args, **kwargs)
        finally:
            reads.reading -= reading
        if device or to_device:
            for x in tree_leaves(out):
                reads.mark(x)
        return out


def _copies_to_device(name: str, tensors: list, to_device: bool, reads: DeviceReads) -> bool:
    """Whether the call copies a host tensor (or Python data) to the device."""
    if name in ("tensor", "as_tensor"):
        return to_device and not any(reads.on_device(x) for x in tensors)
    if name == "to":
        return to_device and bool(tensors) and not reads.on_device(tensors[0])
    if name == "copy_":
        return len(tensors) > 1 and reads.on_device(tensors[0]) and not reads.on_device(tensors[1])
    return False


class _Dispatch(TorchDispatchMode):
    """ATen calls: scalar reads from C++ and data-dependent shapes; ringify's ops run whole."""

    def __init__(self, reads: DeviceReads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads = self.reads
        if func.namespace == "ringify":
            return self._run_body(func, args, kwargs)
        name = func.overloadpacket.__name__
        on_device = any(
            reads.on_device(x) for x in tree_leaves(args) if isinstance(x, torch.Tensor)
        )
        read = name == "_local_scalar_dense" or name in _SHAPES_FROM_DATA
        if on_device and read and not reads.reading:
            reads.record("read")
        out = func(*args, **kwargs)
        if on_device:
            for x in tree_leaves(out):
                reads.mark(x)
        return out

    def _run_body(self, func, args, kwargs):
        """A ringify op's own body, under both modes: a dispatcher would call it here."""
        from torch._library.custom_ops import OPDEFS

        body = OPDEFS[f"ringify::{func.overloadpacket.__name__}"]._init_fn
        for x in tree_leaves((args, kwargs)):
            self.reads.mark(x)  # what a ring op is given lives where the model does
        with self.reads._functions:
            out = body(*args, **kwargs)
        for x in tree_leaves(out):
            self.reads.mark(x)
        return out


def _site() -> str:
    """The innermost frame in ringify (the instrument and the testing helpers left out)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/ringify/" in name and "/ringify/testing/" not in name:
            return f"ringify/{name.split('/ringify/', 1)[1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "(outside ringify)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    args = parser.parse_args()
    table = []
    pool = RankPool(2)
    try:
        for case in args.cases:
            for (kind, site), count in pool.run(counted_step, case, timeout=900)[0]:
                table.append([case, count, kind, site])
    finally:
        pool.close()
    print(tabulate(table, headers=["case", "per step", "kind", "site"], tablefmt="github"))


if __name__ == "__main__":
    main()
