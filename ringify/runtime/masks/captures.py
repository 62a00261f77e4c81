"""What a CUDA graph's replay of a ringified step needs from the plans: one place.

A replay (``torch.compile(mode="reduce-overhead")``) runs the recorded ring calls' kernels and
none of ringify's code, so the blocks it runs are those of the plan it was recorded with.
The plan op runs every step, outside the graphs (``cudagraph_unsafe``): it is where a step
whose mask differs from the recorded one is caught. A ring call being recorded notes its
plan's site (geometry and program) and content here; a later plan of that site with other
content raises on every rank. Process-wide, because the replay that would go wrong runs
none of ringify's code; a site is a geometry and a program: a few per model.
"""

from __future__ import annotations

import torch

# The fix the errors about CUDA graphs name.
NO_GRAPHS = "compile without CUDA graphs (torch.compile(..., mode='max-autotune-no-cudagraphs'))"

# Per site, the content of the plan that CUDA graphs recorded ring calls with.
_captured: dict[tuple, object] = {}


def capturing(device: torch.device) -> bool:
    """Whether work on ``device`` is being recorded into a CUDA graph now."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def note_captured(key: tuple | None) -> None:
    """A ring call on a plan of ``key`` (its site and content; None: it read no tensor's
    values) is being recorded into a CUDA graph: every later plan of its site must have its
    content (``check_captured``). Two attentions of one site with other contents are
    refused: a later step could bring each the other's mask, and both would pass."""
    if key is None:
        return
    site, content = key
    if _captured.setdefault(site, content) != content:
        raise RuntimeError(
            "two attentions with one mask program and geometry but masks of other values "
            f"({_where(site)}) are being recorded into CUDA graphs, whose replays cannot tell "
            f"which mask a step brings each; {NO_GRAPHS}"
        )


def check_captured(site: tuple, content) -> None:
    """Raise where CUDA graphs recorded ring calls of ``site`` with another content."""
    if _captured.get(site, content) != content:
        raise RuntimeError(
            "this step's attention mask differs from the one a CUDA graph recorded its ring "
            f"calls with ({_where(site)}): replayed, they would run the recorded mask's "
            "blocks. Where masks change from step to step (padding, packed documents), "
            f"{NO_GRAPHS}, or keep the mask the same every step (pad every batch to the "
            "same lengths)"
        )


def _where(site: tuple) -> str:
    geometry = site[0]  # (ring name, ring size, rows, ...)
    return f"rows {geometry[2]} per rank, ring of {geometry[1]}"
