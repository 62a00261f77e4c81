"""Every causal LM of the installed transformers on the ring: exact, refused, or what is gathered.

Each ``model_type`` that ``AutoModelForCausalLM`` maps is built and compared with the unmodified
model as ``moe_families`` does (tiny config, float64, training mode), with every dropout at 0:
ringify's dropout draws per rank, equal in distribution to the model's, not bit for bit. A row
holds the differences and the gathers; or "unmodified: ..." where the model itself does not run
on the tiny config (a field the shrinking misses, no SDPA path); or ringify's error. Multimodal
models are left to their text models. A family that computes a part in float32 inside the
float64 model (a router, a delta rule) differs at float32's rounding, which "own reordering"
need not show: ``tests/test_hybrid.py`` measures that rounding for such families.

    python -m benchmarks.causal_lm_families --ranks 2
"""

from __future__ import annotations

import argparse
import inspect

from tabulate import tabulate

from benchmarks import moe_families
from ringify.testing import RankPool

DROPOUTS = (
    "dropout", "attention_dropout", "hidden_dropout", "hidden_dropout_prob", "activation_dropout",
    "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop", "embed_dropout",
    "attn_dropout", "resid_dropout", "residual_dropout", "embedding_dropout", "emb_dropout",
    "layerdrop", "decoder_layerdrop", "encoder_layerdrop", "mlp_dropout",
)  # fmt: skip
NO_DROPOUT = dict.fromkeys(DROPOUTS, 0.0)
MULTIMODAL = {"vision_config", "audio_config", "vq_config"}


def row(kind: str, world: int) -> dict:
    """On every rank: ``kind``'s row (its differences, or why there are none)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if MULTIMODAL & set(inspect.signature(CONFIG_MAPPING[kind].__init__).parameters):
        return {"family": kind, "error": "multimodal: see its text model"}
    try:
        return moe_families.compare(kind, world, **NO_DROPOUT)
    except Exception as e:  # whose failure it is: the model's own, or ringify's
        where = "ringify" if _runs_unmodified(kind, world) else "unmodified"
        return {"family": kind, "error": f"{where}: {type(e).__name__}: {str(e)[:160]}"}


def _runs_unmodified(kind: str, world: int) -> bool:
    """Whether the unmodified tiny model runs a forward and backward."""
    import torch

    try:
        torch.manual_seed(0)
        model = moe_families.build(kind, **NO_DROPOUT)
        model(input_ids=torch.ones(1, 8 * world, dtype=torch.long)).logits.sum().backward()
    except Exception:
        return False
    return True


def main() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--families", nargs="*", default=sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    parser.add_argument("--timeout", type=float, default=150, help="seconds per family")
    args = parser.parse_args()
    pool, rows = RankPool(args.ranks), []
    try:
        for kind in args.families:
            try:
                rows.append(pool.run(row, kind, args.ranks, timeout=args.timeout)[0])
            except TimeoutError:  # a config the shrinking misses builds a large model
                rows.append({"family": kind, "error": f"timed out after {args.timeout:.0f} s"})
                pool.close()
                pool = RankPool(args.ranks)
            print(rows[-1], flush=True)
    finally:
        pool.close()
    print(tabulate(rows, headers="keys", floatfmt=".1e"))


if __name__ == "__main__":
    main()
