"""Device-to-host reads and device/host mixing per step, for what the stock probe does not run.

``../shared/gpu_probe/count_syncs.py`` counts a training step of HF Llama and Mistral. This
runs the same instrument (``probe.Probe``: parameters, buffers and inputs marked as device
tensors) over a training step of other model families and attention forms, over a step
at a new length (the one graph every length shares), and over ``generate`` (a prefill and
6 decode steps). Per case, rank 0's events by kind and call site; reads of host tensors
(``numpy`` of the plan's own host copy) are left out.

    PYTHONPATH=.:../shared/gpu_probe OMP_NUM_THREADS=1 python benchmarks/probe_families.py
"""

from __future__ import annotations

import argparse
import collections

from common import spawn
from tabulate import tabulate

CASES = ("generate", "lengths", "t5", "gpt2_eager", "vit", "whisper", "wav2vec2", "dit", "flex")


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
    if case == "flex":  # FlexAttention with packed documents
        docs = torch.cumsum(torch.rand(2, 48, generator=g) < 0.15, 1)
        return models.FlexTransformer(), (ids, docs), {}
    raise ValueError(case)


def rank_fn(rank: int, world: int, case: str) -> list:
    import torch
    from probe import Probe

    from ringify import ringify
    from ringify.testing import hf_models

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
    with Probe(taint=[*model.parameters(), *model.buffers(), *taint]) as p:
        p.phase = "step"
        step()
    rows = collections.Counter()
    for e in p.summary()["events"]:
        if not (e.get("kind") == "numpy" and e.get("device") is False):
            rows[(e.get("kind"), e.get("site"))] += 1
    return sorted(rows.items(), key=str)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    args = parser.parse_args()
    table = []
    for case in args.cases:
        for (kind, site), count in spawn(rank_fn, 2, case, timeout=900)[0]:
            table.append([case, count, kind, site])
    print(tabulate(table, headers=["case", "per step", "kind", "site"], tablefmt="github"))


if __name__ == "__main__":
    main()
