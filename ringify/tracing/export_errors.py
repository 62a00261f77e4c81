"""What to tell a user whose model ``torch.export`` could not trace: the cause where known,
the cache ringify cannot return, and the line of the model's own code where it failed; and
one whose model ``torch.export`` traces wrongly for training: a custom autograd Function,
whose backward the graph does not keep."""

from __future__ import annotations

import linecache
import logging
import os
import sysconfig
import traceback

import torch
from torch.utils import _pytree as pytree

from ringify.tracing.caches import cache_hint

log = logging.getLogger("ringify")


def export_failure(model, error: Exception) -> str:
    """The message of the error ringify raises (the export's error chained to it)."""
    return (
        f"ringify could not trace {type(model).__name__} with torch.export ({type(error).__name__}: "
        f"{str(error).splitlines()[0] if str(error) else ''}). The model must be traceable with "
        "torch.export.export(model, args, kwargs, strict=False): avoid data-dependent "
        "Python control flow in forward (a branch on a tensor's value, a size read with "
        "tolist() or item()), and return plain tensors, tuples, dicts or HF outputs."
        f"{_known_cause(error)}{cache_hint(' '.join(map(str, _chain(error))))}"
        f"{_model_line(error)} The full error is chained above."
    )


# functions whose data-dependent checks export cannot trace -> what the caller can pass instead
_KNOWN_CAUSES = {
    "_detect_is_causal_mask": (
        "nn.Transformer / TransformerDecoder(Layer) / TransformerEncoder inspect a tgt_mask or "
        "mask's values to detect a causal mask: pass tgt_is_causal=True (or is_causal=True) "
        "with a causal mask, or tgt_is_causal=False otherwise"
    ),
}


def _model_line(error: Exception) -> str:
    """Where in the model's own code export failed: the innermost frame outside torch,
    ringify and Python's standard library (a data-dependent ``tolist()``, a branch on a
    value)."""
    frames = [
        frame
        for e in reversed(_chain(error))  # the innermost error's frames reach deepest in
        for frame, _ in traceback.walk_tb(e.__traceback__)
        if _in_model(frame.f_code.co_filename)
    ]
    if not frames:
        return ""
    frame = frames[-1]
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    where = f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
    return f" It failed in the model at {where}: {code}."


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the errors it was raised from, outermost first."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _in_model(filename: str) -> bool:
    """Whether a frame's file is the model's (or a library's it uses, e.g. transformers)."""
    paths = sysconfig.get_paths()
    libraries = (paths["purelib"], paths["platlib"])
    ringify = os.path.dirname(os.path.dirname(__file__))
    ours = (os.path.dirname(torch.__file__), ringify)
    if filename.startswith("<") or filename.startswith(tuple(p + os.sep for p in ours)):
        return False  # "<string>": generated code
    return filename.startswith(libraries) or not filename.startswith(paths["stdlib"])


def _known_cause(error: Exception) -> str:
    frames = {frame.f_code.co_name for frame, _ in traceback.walk_tb(error.__traceback__)}
    return "".join(f" Here: {fix}." for name, fix in _KNOWN_CAUSES.items() if name in frames)


# Functions whose backward is their forward's derivative: the gradient of export's trace of
# the forward is the model's (where not quite, the line says where) -> why
DERIVATIVE_BACKWARDS = {
    "transformers.models.bloom.modeling_bloom.GeLUFunction": "tanh GELU's derivative",
    "transformers.models.recurrent_gemma.modeling_recurrent_gemma.SqrtBoundDerivative": (
        "sqrt's derivative, which the model caps at 1000 (where x < 2.5e-7) and the graph does not"
    ),
}


def custom_backwards(outputs) -> list[str]:
    """The ``torch.autograd.Function`` classes, other than torch's and ringify's own and those
    of ``DERIVATIVE_BACKWARDS``, whose backward the gradient of ``outputs`` would run.
    ``torch.export`` traces a Function's forward only: the graph's gradient would be its
    forward's, not its backward's."""
    found: dict[str, None] = {}
    leaves = pytree.tree_leaves(outputs)
    seen, stack = set(), [t.grad_fn for t in leaves if isinstance(t, torch.Tensor)]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        cls = getattr(fn, "_forward_cls", None)
        if cls is not None and not cls.__module__.startswith(("torch.", "ringify.")):
            found[f"{cls.__module__}.{cls.__qualname__}"] = None
        stack.extend(f for f, _ in fn.next_functions)
    for name in [n for n in found if n in DERIVATIVE_BACKWARDS]:
        log.info("ringify: %s traced as its forward: its backward is %s", name,
                 DERIVATIVE_BACKWARDS[name])  # fmt: skip
        del found[name]
    return list(found)


def custom_backward_error(names: list[str]) -> str:
    return (
        f"the model's gradient runs the backward of {', '.join(names)}, a torch.autograd."
        "Function: torch.export traces a Function's forward only, so the ringified model's "
        "gradients would not be the model's. Run that part without gradients (model.eval(), "
        "torch.no_grad()), or write it as a custom op (torch.library.custom_op with "
        "register_autograd), whose backward the graph keeps."
    )
