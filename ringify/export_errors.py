"""What to tell a user whose model ``torch.export`` could not trace: the cause where known,
the cache ringify cannot return, and the line of the model's own code where it failed."""

from __future__ import annotations

import linecache
import os
import sysconfig
import traceback

import torch

from ringify.caches import cache_hint


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
    ours = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    if filename.startswith("<") or filename.startswith(tuple(p + os.sep for p in ours)):
        return False  # "<string>": generated code
    return filename.startswith(libraries) or not filename.startswith(paths["stdlib"])


def _known_cause(error: Exception) -> str:
    frames = {frame.f_code.co_name for frame, _ in traceback.walk_tb(error.__traceback__)}
    return "".join(f" Here: {fix}." for name, fix in _KNOWN_CAUSES.items() if name in frames)
