"""Diffusion transformers of diffusers on the ring: exact, and what is still gathered.

Each family of ``ringify/testing/diffusers_models.py`` (tiny configs, float64), ringified on
``--ranks`` gloo ranks, against the unmodified model: the largest difference of the output
and of every parameter gradient (the loss: the output times fixed random weights), the
attentions' runs, and the gathers left with their reasons. Beside them, "own reordering":
the unmodified model's gradients with its output's halves (along dim 2) back-propagated
apart and summed, the kind of reordering the ring makes; a family that computes in float32
inside a float64 model (Wan) shows it there. Counted, not timed.

    python -m benchmarks.dit_families --ranks 2
"""

from __future__ import annotations

from benchmarks.families import compared, main

FAMILIES = (
    "sd3", "flux", "cogvideox", "qwenimage", "hunyuan_video", "cogview4", "auraflow", "chroma",
    "dit", "pixart", "wan", "ltx_video", "allegro",
)  # fmt: skip


def _grads(model, out, weights, halves: bool) -> dict:

    model.zero_grad(set_to_none=True)
    if halves:
        cut = out.shape[2] // 2
        for part in (slice(None, cut), slice(cut, None)):
            (out[:, :, part] * weights[:, :, part]).sum().backward(retain_graph=True)
    else:
        (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def compare(name: str, world: int) -> dict:
    import torch

    from ringify import ringify
    from ringify.testing import diffusers_models

    torch.manual_seed(0)
    model, kwargs = getattr(diffusers_models, name)()
    out = model(**kwargs)[0]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    want = _grads(model, out, weights, halves=False)
    own = _grads(model, model(**kwargs)[0], weights, halves=True)
    ringified = ringify(model, ring_size=world)
    got_out = ringified(**kwargs)[0]
    got = _grads(model, got_out, weights, halves=False)
    report = ringified.report()
    return {
        "family": name,
        "output": (got_out - out).abs().max().item(),
        "attentions": ", ".join(sorted({a.run.name.lower() for a in report.attentions})),
        **compared(want, got, own, report),
    }


if __name__ == "__main__":
    main(__doc__, FAMILIES, compare)
