"""Each strategy and family under Inductor, beside Inductor's own difference on the model.

For each case, ``ringify.check(..., compile="inductor")`` runs the ringified model on forked
gloo ranks, compiled with Inductor, against the unmodified model eager (float64, forward and
backward, every gradient); the control is the unmodified model compiled with Inductor, in
this process, against itself eager. Both are the worst difference over the outputs and
every gradient, relative to each one's largest value.

    python -m benchmarks.inductor_families            # CPU; a few minutes a case
"""

from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

import ringify
from ringify.testing import hf_models, hf_moe


def _ids(length: int) -> torch.Tensor:
    return torch.randint(1, 64, (2, length), generator=torch.Generator().manual_seed(1))


def _cases() -> dict:
    """name -> (model, args, kwargs, ringify options, ranks)."""
    torch.manual_seed(0)
    padded = torch.ones(2, 32, dtype=torch.long)
    padded[1, -5:] = 0
    return {
        "llama, ring": (hf_models.llama(), (_ids(32),), {}, {}, 2),
        "mistral, a window of 8": (hf_models.mistral(8), (_ids(32),), {}, {}, 2),
        "gemma2, soft caps": (hf_models.gemma2(), (_ids(32),), {}, {}, 2),
        "gpt2, padding": (hf_models.gpt2(), (_ids(32),), {"attention_mask": padded}, {}, 2),
        "mixtral, router logits": (hf_moe.mixtral(), (_ids(32),), {}, {}, 2),
        "jetmoe, router logits": (hf_moe.jetmoe(), (_ids(32),), {}, {}, 2),
        "llama, ulysses": (hf_models.llama(), (_ids(32),), {}, {"strategy": "ulysses"}, 2),
        "llama, hybrid (u=2)": (
            hf_models.llama(),
            (_ids(32),),
            {},
            {"strategy": ringify.Hybrid(u=2)},
            4,
        ),
    }


def _control(model, args, kwargs) -> float:
    """The unmodified model's worst relative difference under Inductor from itself eager."""
    model = model.double()

    def run(fn):
        model.zero_grad(set_to_none=True)
        out = fn(*args, **kwargs)
        out = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).double()
        (out * weights).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return [out.detach(), *grads]

    want = run(model)
    torch._dynamo.reset()
    got = run(torch.compile(model, backend="inductor"))
    return max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", help="a subset of the case names")
    chosen = parser.parse_args().cases
    rows = []
    for name, (model, args, kwargs, options, ranks) in _cases().items():
        if chosen and name not in chosen:
            continue
        checked = ringify.check(
            model, *args, kwargs=kwargs, ring_size=ranks, compile="inductor", **options
        )
        worst = max(r.max_diff / max(r.scale, 1e-300) for r in checked.rows)
        control = _control(model, args, kwargs)
        rows.append([name, ranks, f"{worst:.2g}", f"{control:.2g}", checked.passed])
        print(tabulate(rows[-1:], tablefmt="plain"), flush=True)
    headers = ["case", "ranks", "ringified (worst, relative)", "control", "check passed"]
    print(tabulate(rows, headers=headers, tablefmt="github"))


if __name__ == "__main__":
    main()
