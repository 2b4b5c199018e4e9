"""What one forward shares across its patched layers (`ForwardPlan`: positions, region plans, (cos, sin)), kept
per thread (`ForwardMemo`), so that two threads running one model never see each other's."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch


def _identity(obj) -> Callable[[object], bool]:
    """A test of whether a later call passes the very same object (held weakly where possible: an object that
    has died matches nothing, not even None)."""
    if obj is None:
        return lambda other: other is None
    try:
        ref = weakref.ref(obj)
    except TypeError:
        return lambda other: other is obj
    return lambda other: other is not None and ref() is other


class ForwardPlan:
    """What every layer of one forward shares: positions, region plans, log-n factors, (cos, sin).

    Built by the forward's first patched layer from position_ids and the attention mask, both of which the
    model passes unchanged to every layer; positions and region bounds live on the CPU, so a forward waits for
    the device a few times (reading positions and the mask), not once per layer and query block.
    """

    def __init__(self, position_ids, attention_mask, total: int, q_len: int, cu_seq_lens=None):
        self._same_position_ids = _identity(position_ids)
        self._same_mask = _identity(attention_mask)
        self._same_documents = _identity(cu_seq_lens)
        self.shape = (total, q_len)
        self.values: dict = {}

    def serves(self, position_ids, attention_mask, total: int, q_len: int, cu_seq_lens=None) -> bool:
        """Whether a layer called with these arguments is still in the forward this plan was built for."""
        return (
            self.shape == (total, q_len)
            and self._same_position_ids(position_ids)
            and self._same_mask(attention_mask)
            and self._same_documents(cu_seq_lens)
        )

    def remember(self, name, compute: Callable):
        """The value kept under `name`, computed by `compute()` the first time this forward asks."""
        if name not in self.values:
            self.values[name] = compute()
        return self.values[name]


class ForwardMemo:
    """The current forward's `ForwardPlan`, one per thread (two threads running one model do not mix plans)."""

    def __init__(self):
        self._local = threading.local()

    def note_cache(self, cache) -> None:
        """The cache this thread's next forward was given (None without one): its layers keep `KeptKeys`."""
        try:
            self._local.cache = None if cache is None else weakref.ref(cache)
        except TypeError:  # an object that cannot be referred to weakly keeps nothing
            self._local.cache = None

    def cache_layer(self, layer_idx: int, key: torch.Tensor):
        """The layer of this forward's cache that holds exactly `key` (the tensor the model's attention passed),
        or None (no cache, another kind of cache, or keys that are a copy)."""
        ref = getattr(self._local, "cache", None)
        cache = ref() if ref is not None else None
        layers = getattr(cache, "layers", None)
        if layers is None or not 0 <= layer_idx < len(layers):
            return None
        layer = layers[layer_idx]
        return layer if getattr(layer, "keys", None) is key else None

    def plan_for(self, position_ids, attention_mask, total: int, q_len: int, cu_seq_lens=None) -> ForwardPlan:
        """This thread's plan for the forward these arguments belong to (a new one when a new forward began);
        `cu_seq_lens`: a packed row's document boundaries, where the collator passed them."""
        plan = getattr(self._local, "plan", None)
        if plan is None or not plan.serves(position_ids, attention_mask, total, q_len, cu_seq_lens):
            plan = ForwardPlan(position_ids, attention_mask, total, q_len, cu_seq_lens)
            self._local.plan = plan
        return plan
