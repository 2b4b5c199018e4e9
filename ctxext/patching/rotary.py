"""The scaled rotary embedding that replaces a model's `rotary_emb`.

Threads: one patched model may run forwards in several threads at once. The module's only state that changes
during a forward is a dynamic method's last (length, frequencies) pair per layer type, kept in a dict that is
replaced whole and read once per forward, so a thread never computes with the frequencies of another thread's
length.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from ..methods import Method, MethodParams, compute_inv_freq
from ..methods.frequency import on_rotated_pairs
from .families import SECTIONS, module_frequencies, ntk_alpha, rope_parameters_of, rotary_host

_NONE = object()  # a config without the attribute (`PatchUndo.original_max_position_embeddings`)


@dataclasses.dataclass
class PatchUndo:
    """What `patch` changed on a model, kept on its `ScaledRotaryEmbedding` so that `unpatch` puts it back bit for
    bit: the config's rope parameters, lengths and attention record as they were, the per-base rotary modules it
    replaced (Granite SWA), the rotary modules inside the layers it replaced (DeepSeek V4's compressors and
    indexers) and the MLA softmax scales it rescaled ([(module, scale)])."""

    rope_parameters: dict
    max_position_embeddings: int
    attention: dict | None  # the config's `ctxext_attention` before the patch
    original_max_position_embeddings: object = _NONE  # Phi-3's top-level L, where its config has one
    per_base_rotaries: list = dataclasses.field(default_factory=list)
    layer_rotaries: list = dataclasses.field(default_factory=list)  # [(parent, name, module)]: DeepSeek V4's
    latent_attention_scales: list = dataclasses.field(default_factory=list)
    source_rope: dict | None = None  # the config's `ctxext_source_rope` before the patch (record.SOURCE_KEY)

    @property
    def has_top_level_original_length(self) -> bool:
        return self.original_max_position_embeddings is not _NONE


class ScaledRotaryEmbedding(nn.Module):
    """Drop-in `rotary_emb`: forward(x, position_ids[, layer_type]) -> (cos, sin), computed in float32, cast to
    x.dtype; or, for the "complex" layout (Llama 4, DeepSeek V2), one complex64 tensor polar(scaling, angles), as
    their own modules return whatever x.dtype (the attention factor is its magnitude, as transformers' yarn puts it).

    `scaled` maps each scaled layer type to its (rotary_dim, base); the key None is the one set of frequencies
    a model without per-type rotary shares among its layers. A layer type not in `scaled` (Gemma 3's sliding
    layers under `--layer-types full`) is answered by the model's own module, untouched. `angles` lays the angles
    out as the model's own module does (`RopeLayout.angles`). Attributes the model's code reads from its rotary
    module beyond these (e.g. `layer_types`) are the original's.

    Dynamic methods recompute their frequencies from the current length l = max(position_ids) + 1,
    statelessly: the same positions always give the same (cos, sin).

    Multimodal RoPE (`sections`, from `RopeLayout.sections`: Qwen3.5): position ids may come as (3, batch, seq), one
    row per section (temporal, height, width), or (batch, seq), every section the same, as the family takes them;
    rotary pair i turns by the positions of its section sections[i] times its scaled frequency, as the family does
    with its own. For text alone the sections are equal and this is plain RoPE.

    `rotated_pairs` ({layer type: n}) names the layer types that rotate with p-RoPE (Gemma 4's full layers:
    transformers' `proportional`): the method's frequencies there turn the first n pairs, the others keep frequency 0.

    `shipped` names the layer types whose frequencies stay the model's own (a remapping method on a model that
    shipped a static scaling, e.g. Llama 3.1's llama3 or Gemma 3's linear: `patch`): those are answered by the
    model's own module, whatever the positions, and `inv_freq` reads its frequencies. `composed_keys` names those
    answered by `composed`, a rotary module of the model's own class built from the patched config (a frequency
    method composed with a shipped scaling: ctxext.patching.compose), so that memory and a reload compute alike.

    Mixed window (LongRoPE2): while `original_within` is a length N > 0, a forward whose positions all lie below
    N is answered by the model's own module, unscaled; see `original_rotary_within`.

    Sequence parallelism: while `split_length` is a length l > 0, that is the length every length-dependent rule
    reads (dynamic frequencies, longrope's short or long factors, the mixed window), not this process's slice
    of the positions; see `whole_sequence_length`.
    """

    original_within: int = 0  # 0: every forward is scaled
    split_length: int = 0  # 0: the length is read from the positions of each forward
    undo: PatchUndo | None = None  # set by `patch`

    def __init__(
        self,
        method: Method,
        params: MethodParams,
        scaled: dict,
        original_max_position_embeddings: int,
        original: nn.Module | None = None,
        angles: str = "halves",
        sections: tuple[int, ...] | None = None,
        shipped: tuple = (),
        composed: nn.Module | None = None,
        composed_keys: tuple = (),
        rotated_pairs: dict | None = None,
    ):
        super().__init__()
        self.method = method
        self.params = params
        self.scaled = dict(scaled)
        self.original_max_position_embeddings = original_max_position_embeddings
        self.angles = angles
        self.sections = None if sections is None else tuple(sections)
        self.dynamic = method.is_dynamic(params)
        # The module we replaced, kept so that `unpatch` can put it back (it follows .to() with the model).
        self.original = original
        self.shipped = tuple(shipped)
        self.composed = composed
        self.composed_keys = tuple(composed_keys)
        # p-RoPE layer types ({key: pairs}, Gemma 4's full layers): the method's frequencies on the pairs that turn
        self.rotated_pairs = dict(rotated_pairs or {})
        # float32 always: a model cast to bf16 must not round the frequencies.
        self._static = {key: self._own_frequencies(key) for key in self.scaled}
        # A dynamic method's last (length, inv_freq, attention scaling) per layer type: the dict is replaced whole,
        # never updated in place, so that threads sharing the model each read a consistent triple.
        self._dynamic_cache: dict = {}

    def _own_frequencies(self, key) -> tuple[torch.Tensor, float]:
        if key in self.shipped:
            return module_frequencies(self.original, key)
        if key in self.composed_keys:
            return module_frequencies(self.composed, key)
        return self.frequencies(None, key)

    @property
    def first_key(self):
        return next(iter(self.scaled))

    @property
    def rotary_dim(self) -> int:
        return self.scaled[self.first_key][0]

    @property
    def base(self) -> float:
        return self.scaled[self.first_key][1]

    @property
    def inv_freq(self) -> torch.Tensor:
        return self._static[self.first_key][0]

    @property
    def attention_scaling(self) -> float:
        return self._static[self.first_key][1]

    def frequencies(self, seq_len: int | None, key=None) -> tuple[torch.Tensor, float]:
        key = key if key in self.scaled else self.first_key
        rotary_dim, base = self.scaled[key]
        inv_freq, scaling = compute_inv_freq(
            self.method, self.params, rotary_dim, base, self.original_max_position_embeddings, seq_len
        )
        return on_rotated_pairs(inv_freq, self.rotated_pairs.get(key)), scaling

    def _inv_freq_for(self, key, position_ids: torch.Tensor, device) -> tuple[torch.Tensor, float]:
        if not self.dynamic:
            inv_freq, scaling = self._static[key]
        else:
            length = self.length_of(position_ids)
            cached = self._dynamic_cache.get(key)
            if cached is None or cached[0] != length:
                cached = (length, *self.frequencies(length, key))
                self._dynamic_cache = {**self._dynamic_cache, key: cached}
            _, inv_freq, scaling = cached
        return inv_freq.to(device), scaling

    def length_of(self, position_ids: torch.Tensor) -> int:
        """The sequence length the length-dependent rules read: max(position_ids) + 1, or the whole sequence's
        length while a split sequence's slice runs (`whole_sequence_length`)."""
        return self.split_length or int(position_ids.max()) + 1

    @torch.no_grad()
    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        if self.original_within and self.original is not None and self.length_of(position_ids) <= self.original_within:
            return self.original(x, position_ids) if layer_type is None else self.original(x, position_ids, layer_type)
        key = layer_type if layer_type in self.scaled else None
        if key not in self.scaled:  # a layer type this patch leaves alone
            return self.original(x, position_ids, layer_type)
        if key in self.shipped:  # frequencies the model shipped, kept: its own module computes them
            return self.original(x, position_ids) if layer_type is None else self.original(x, position_ids, layer_type)
        if key in self.composed_keys:  # a composition: the family's module built from the patched config
            return self.composed(x, position_ids) if layer_type is None else self.composed(x, position_ids, layer_type)
        inv_freq, scaling = self._inv_freq_for(key, position_ids, x.device)
        freqs = angles_at(position_ids, inv_freq, self.sections)
        if self.angles == "complex":
            return complex_angles(freqs, scaling)
        if self.angles == "interleaved":
            angles = freqs.repeat_interleave(2, dim=-1)
        elif self.angles == "once":
            angles = freqs
        else:
            angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos() * scaling
        sin = angles.sin() * scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            applied = self._applied_attribute(name)
            if applied is not None:
                return applied
            original = self._modules.get("original")
            if original is None:
                raise
            return getattr(original, name)

    def _applied_attribute(self, name: str):
        """`{layer_type}_inv_freq` / `{layer_type}_attention_scaling` of a layer type this module scales: what its
        forward applies (not the unpatched module's, which the other attributes fall through to); else None."""
        static = self.__dict__.get("_static", {})
        for suffix, index in (("_inv_freq", 0), ("_attention_scaling", 1)):
            if name.endswith(suffix) and name[: -len(suffix)] in static:
                return static[name[: -len(suffix)]][index]
        return None

    def extra_repr(self) -> str:
        types = "" if list(self.scaled) == [None] else f", layer_types={list(self.scaled)}"
        sections = "" if self.sections is None else f", sections={list(self.sections)}"
        shipped = "" if not self.shipped else f", shipped frequencies kept={list(self.shipped)}"
        shipped += "" if not self.composed_keys else f", composed with the shipped scaling={list(self.composed_keys)}"
        return (
            f"method={self.method.name}, params={self.params.to_dict()}, L={self.original_max_position_embeddings}"
            f"{types}{sections}{shipped}"
        )


def angles_at(position_ids: torch.Tensor, inv_freq: torch.Tensor, sections: tuple[int, ...] | None) -> torch.Tensor:
    """position x inv_freq, one angle per rotary pair: (..., seq, pairs). With `sections` (multimodal RoPE), pair i
    takes its positions from row sections[i] of position ids (3, batch, seq); ids (batch, seq) serve every row, as
    the family broadcasts them."""
    if sections is None:
        return position_ids[..., None].float() * inv_freq
    rows = position_ids.expand(SECTIONS, *position_ids.shape[-2:])
    index = torch.tensor(sections, device=position_ids.device)
    return rows[index].movedim(0, -1).float() * inv_freq


def complex_angles(freqs: torch.Tensor, scaling: float) -> torch.Tensor:
    """The angles as the "complex" layout carries them: polar(scaling, freqs), complex64 from float32 angles."""
    return torch.polar(torch.full_like(freqs, scaling), freqs)


def original_rotary_within(model: nn.Module, length: int):
    """Mixed window (LongRoPE2): inside the block, a forward of the patched `model` whose positions all lie below
    `length` (normally the original length L) uses the model's original rotary module, bit for bit as if unpatched;
    longer ones use the patched rotary. No-op on an unpatched model. The setting is on the module, so it holds for
    every thread using the model while the block runs."""
    return _rotary_setting(model, "original_within", length)


def whole_sequence_length(model: nn.Module, length: int):
    """Sequence parallelism: inside the block, the patched `model`'s rotary reads `length` (the whole sequence's)
    wherever a rule depends on the length, while each process runs the positions of its own slice; without it,
    the process holding the first slice of a long sequence would rotate as for a short one (dynamic NTK's base,
    longrope's short factors, the mixed window's original rotary). No-op on an unpatched model. Like
    `original_rotary_within`, the setting is on the module."""
    return _rotary_setting(model, "split_length", length)


@contextlib.contextmanager
def _rotary_setting(model: nn.Module, name: str, length: int):
    """Inside the block, ctxext's rotary module of `model` has `name` set to `length`; as it was after. No-op on
    an unpatched model."""
    rotary = rotary_host(model).rotary_emb
    if not isinstance(rotary, ScaledRotaryEmbedding):
        yield model
        return
    before = getattr(rotary, name)
    setattr(rotary, name, int(length))
    try:
        yield model
    finally:
        setattr(rotary, name, before)


def is_dynamic(model: nn.Module) -> bool:
    """Whether the model's rotary embedding follows the current length, so that no longest length applies: a
    dynamic (or length-dependent) ctxext method, or a rope type transformers rescales with the length."""
    host = rotary_host(model)
    if isinstance(host.rotary_emb, ScaledRotaryEmbedding):
        return host.rotary_emb.dynamic
    rope_parameters = rope_parameters_of(host.config)
    return "dynamic" in rope_parameters.get("rope_type", "default") and ntk_alpha(rope_parameters) is None
