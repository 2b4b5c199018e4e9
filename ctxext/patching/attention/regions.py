"""A remapping method's regions inside one layer's forward: which keys each query sees per region
(`region_plans`), each region's queries and keys rotated by its own rules (`region_queries_and_keys`), and the
keys a cache layer keeps rotated between forwards so that a decode step rotates only its new ones (`KeptKeys`)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ...methods.attention import AttentionSettings
from ..remap_kernel import RegionPlan
from .layout import TokenLayout, key_index
from .memo import ForwardPlan
from .rotation import PlanRotary, RotaryIdentity, is_dynamic_rotary, rotary_tables, undo_rotation
from .state import AttentionState


def region_plans(regions, layout: TokenLayout, q_len: int, query_block: int):
    """[(rows, RegionPlan)]: one plan for the whole batch when every row's bounds agree, else one per row.

    Each query's bounds stay inside its own document (a packed row's documents never see one another)."""
    positions, key_allowed = layout.positions, layout.key_allowed
    total = positions.shape[1]
    search, low, width = layout.search_keys()
    documents = layout.documents.expand_as(search)
    bounds = []
    for keys, row, document in zip(search, positions.expand_as(search), documents[:, total - q_len :]):
        query_positions = row[total - q_len :]
        lows, highs = [], []
        for region in regions:
            lo, hi = region.key_range(query_positions)
            lows.append(key_index(keys, low, width, document, lo))
            highs.append(key_index(keys, low, width, document, hi))
        bounds.append((torch.stack(lows), torch.stack(highs)))
    if all(torch.equal(lo, bounds[0][0]) and torch.equal(hi, bounds[0][1]) for lo, hi in bounds):
        return [(None, RegionPlan(*bounds[0], total, key_allowed, query_block))]
    return [
        (
            slice(b, b + 1),
            RegionPlan(lo, hi, total, None if key_allowed is None else key_allowed[b : b + 1], query_block),
        )
        for b, (lo, hi) in enumerate(bounds)
    ]


def region_queries_and_keys(
    module, state: AttentionState, plan: ForwardPlan, query, key, layout: TokenLayout, regions: list
):
    """([queries], [keys]), one of each per region: rotated by the region's rules (the model's own rotation where
    a region keeps it), from the rotated query and keys, turned back with the model's (cos, sin) at the positions
    it rotated them at. Keys that a cache layer kept from the previous forward (`KeptKeys`) are not rotated
    again: only the new ones are."""
    q_len, total = query.shape[2], key.shape[2]
    positions = layout.positions
    layer = _cache_layer_keeping_keys(module, state, query, key)
    region_names = tuple(region.name for region in regions)
    kept = KeptKeys.reusable(layer, state, key, positions, q_len, region_names)
    start = 0 if kept is None else kept.length  # keys [start, total) are rotated by this forward
    new_positions = positions[:, start:]
    rotated_at = layout.rotated_at[:, start:]
    cos_k, sin_k = rotary_tables(plan, state.host, query, ("keys", start), lambda: rotated_at, state.layer_type)
    rotary = PlanRotary(plan, state.host, state.layer_type, module.layer_idx, n_pairs=cos_k.shape[-1] // 2)
    plain_query = undo_rotation(query, cos_k[:, -q_len:], sin_k[:, -q_len:])
    queries = _rotated_queries(rotary, regions, query, plain_query, positions[:, total - q_len :])
    # The new keys turned back once, and only where a region rotates keys by a rule of its own (not STRING).
    plain_keys = functools.cache(lambda: undo_rotation(key[:, :, start:], cos_k, sin_k))
    key_slots, new_keys = _rotated_new_keys(rotary, regions, plain_keys, start, new_positions, key.dtype)
    if kept is not None:
        rotated_keys = kept.extend(new_keys, positions, key)
    else:
        rotated_keys = new_keys
        if layer is not None and new_keys:
            KeptKeys.keep(layer, state, new_keys, positions, key, region_names)
    keys = [key if slot is None else rotated_keys[slot] for slot in key_slots]
    return queries, keys


def _rotated_queries(
    rotary: PlanRotary, regions: list, query: torch.Tensor, plain_query: torch.Tensor, query_positions: torch.Tensor
) -> list[torch.Tensor]:
    """Each region's queries: the model's own where the region keeps its rotation, else turned by its rule."""
    return [
        query
        if region.query_position is None
        else region.rotation.rotate_queries(
            rotary, plain_query, ("query", index), region.query_position, query_positions
        ).to(query.dtype)
        for index, region in enumerate(regions)
    ]


def _rotated_new_keys(
    rotary: PlanRotary,
    regions: list,
    plain_keys: Callable[[], torch.Tensor],
    start: int,
    new_positions: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[list, dict]:
    """Each region's key slot (None where the region keeps the model's own rotation, else the index of the first
    region with its key rule: regions that share a key rule share the rotated keys), and {slot: the new keys
    rotated by that slot's rule}."""
    slots, rotated = [], {}  # rotated: key rule -> (slot, the new keys rotated by it)
    for index, region in enumerate(regions):
        rule = region.key_position
        if rule is not None and rule not in rotated:
            new = region.rotation.rotate_keys(rotary, plain_keys(), ("key", index, start), rule, new_positions)
            rotated[rule] = (index, new.to(dtype))
        slots.append(None if rule is None else rotated[rule][0])
    return slots, dict(rotated.values())


def _cache_layer_keeping_keys(module, state: AttentionState, query: torch.Tensor, key: torch.Tensor):
    """The cache layer that holds `key` and may keep its keys rotated (`KeptKeys`), or None; a layer that may
    not (keeping turned off, training, a dynamic rotary type) drops what it kept."""
    layer = state.memo.cache_layer(module.layer_idx, key)
    if layer is not None and not (state.keep_keys and _may_keep_keys(state.host, query, key)):
        layer.__dict__.pop(KeptKeys.ATTRIBUTE, None)
        return None
    return layer


def _may_keep_keys(host: nn.Module, query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether rotated keys may be kept for later forwards: not while training (in-place growth would break
    autograd) nor under a dynamic rotary type (its frequencies, and so every key's rotation, follow the length)."""
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        return False
    return not is_dynamic_rotary(host.rotary_emb)


@dataclass(frozen=True)
class KeySignature:
    """What kept keys were made under; a forward that differs in any of these rotates every key afresh."""

    rotary: RotaryIdentity
    dtype: torch.dtype
    device: torch.device
    batch: int
    kv_heads: int
    head_dim: int
    regions: tuple[str, ...]  # the region names: GALI adds a region each time the length passes a group boundary

    @classmethod
    def of(cls, host: nn.Module, key: torch.Tensor, regions: tuple[str, ...]) -> KeySignature:
        batch, kv_heads, _, head_dim = key.shape
        return cls(RotaryIdentity.of(host.rotary_emb), key.dtype, key.device, batch, kv_heads, head_dim, regions)


class KeptKeys:
    """One cache layer's keys as each key rule of a remapping method rotates them, kept on the cache layer
    between forwards, so that a decode step rotates only its new keys instead of turning every cached key
    back and rotating it again per region (at 64k tokens, most of a SmolLM2 decode step).

    A key's rotation depends on its own position only (`Region`: the key at k(j)), so kept keys stay right while
    the cache only grows. They are used only when all of these hold (else every key is rotated afresh and kept):
    - the layer held, when this forward began, the very keys tensor they were made with (`check`, run by the
      model's pre-forward hook; DynamicCache replaces that tensor on every update, crop, reorder and batch
      change, so keys changed in place behind the cache's back are not noticed);
    - this forward adds its q_len keys right after the kept ones, which sit at the same positions as before;
    - the same method settings and the same `KeySignature` (rotary frequencies, dtype, device, shape, regions:
      GALI's keys are all rotated afresh once each time it adds a region).
    They go with the cache. Memory: one more copy of the layer's keys per key rule, plus an eighth to grow into.
    """

    ATTRIBUTE = "_ctxext_kept_keys"

    def __init__(self, settings: AttentionSettings, signature: KeySignature, rotated: dict):
        self.settings = settings
        self.signature = signature
        self.rotated = rotated  # slot -> (batch, kv heads, capacity, head_dim); the first `length` are valid
        self.positions: torch.Tensor | None = None  # (batch or 1, length) int64 on the CPU
        self.length = 0
        self.source: weakref.ref | None = None  # the layer's keys tensor they were made with
        self.usable = False  # set before each forward by `check`, spent by the forward's first use

    @classmethod
    def keep(cls, layer, state: AttentionState, rotated: dict, positions: torch.Tensor, key: torch.Tensor, regions):
        kept = cls(state.settings, KeySignature.of(state.host, key, regions), rotated)
        kept._made_with(positions, key)
        layer.__dict__[cls.ATTRIBUTE] = kept

    @classmethod
    def reusable(cls, layer, state: AttentionState, key: torch.Tensor, positions: torch.Tensor, q_len: int, regions):
        """The layer's kept keys if this forward may extend them, else None."""
        kept = None if layer is None else layer.__dict__.get(cls.ATTRIBUTE)
        if kept is None:
            return None
        usable, kept.usable = kept.usable, False
        done = key.shape[2] - q_len
        if not usable or kept.length != done or done == 0 or kept.settings is not state.settings:
            return None
        if kept.signature != KeySignature.of(state.host, key, regions):  # GALI's regions follow the length
            return None
        if kept.positions.shape[0] != positions.shape[0] or not torch.equal(kept.positions, positions[:, :done]):
            return None
        return kept

    def check(self, layer) -> None:
        """Before a forward: usable only if the layer still holds the very keys tensor these were made with."""
        source = None if self.source is None else self.source()
        self.usable = source is not None and getattr(layer, "keys", None) is source

    def extend(self, new: dict, positions: torch.Tensor, key: torch.Tensor) -> dict:
        """Append each rule's newly rotated keys (in place, growing by an eighth when full); all of them, as views."""
        length = positions.shape[1]
        for slot, fresh in new.items():
            buffer = self.rotated[slot]
            if buffer.shape[2] < length:
                grown = buffer.new_empty(*buffer.shape[:2], length + length // 8, buffer.shape[3])
                grown[:, :, : self.length] = buffer[:, :, : self.length]
                buffer = self.rotated[slot] = grown
            buffer[:, :, self.length : length] = fresh
        self._made_with(positions, key)
        return {slot: buffer[:, :, :length] for slot, buffer in self.rotated.items()}

    def _made_with(self, positions: torch.Tensor, key: torch.Tensor) -> None:
        self.positions, self.length, self.source = positions, positions.shape[1], weakref.ref(key)


def kept_keys_bytes(cache) -> int:
    """The memory a cache's layers hold in keys kept by `KeptKeys`, beyond the cache itself (0 when none)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        kept = layer.__dict__.get(KeptKeys.ATTRIBUTE)
        if kept is not None:
            total += sum(buffer.nbytes for buffer in kept.rotated.values())
    return total
