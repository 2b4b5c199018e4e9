"""Families whose shipped config and whose model card count a scaling from different lengths.

Stock Qwen3 (and Qwen3 MoE) ships max_position_embeddings 40960 with plain RoPE, and its card's long-context
recipe is yarn x4 over original_max_position_embeddings 32768 (131072). ctxext counts from the trained context C,
which for a model without a shipped scaling is max_position_embeddings: `--factor 4` on stock Qwen3 is yarn x4 over
40960 (163840), not the card's. `--original-max-position-embeddings 32768 --factor 4` reproduces the card. The
lengths are from the families' published config.json files and model cards (Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B).
Stock Qwen2.5 needs no note: its config's 32768 is what its card's yarn x4 counts from.
"""

from __future__ import annotations

from .record import rope_record

# model_type: (max_position_embeddings as shipped, the length the card's recipe counts from, the card's yarn factor)
CARD_LENGTHS = {
    "qwen3": (40960, 32768, 4.0),
    "qwen3_moe": (40960, 32768, 4.0),
}


def card_length_note(config, original_max_position_embeddings: int | None = None) -> str | None:
    """One line where `config` is a stock config of a family in CARD_LENGTHS (plain RoPE, the shipped
    max_position_embeddings) and no L was given: the length ctxext counts from, the card's, and the flag that
    reproduces the card. None otherwise."""
    entry = CARD_LENGTHS.get(getattr(config, "model_type", None))
    if entry is None or original_max_position_embeddings is not None:
        return None
    shipped_length, card_length, factor = entry
    record = rope_record(config)
    if set(record.types) != {None} or record.full.rope_type != "default":
        return None  # a scaling is already written: its own L0 is recorded
    if record.max_position_embeddings != shipped_length:
        return None
    return (
        f"{config.model_type}'s config counts from its max_position_embeddings {shipped_length}, its model card's "
        f"yarn recipe from {card_length} (x{factor:g}: {int(card_length * factor)}); --factor counts from "
        f"{shipped_length} here, and --original-max-position-embeddings {card_length} --factor {factor:g} "
        f"reproduces the card"
    )
