"""`ctxext check`: do the attention-level methods run, and run exactly, on this machine?

Two parts, on a random model of the user's architecture (its config only; no weights are needed):

1. **Agreement.** For each attention implementation available on the device (eager, SDPA, flex_attention,
   FlashAttention where installed) and each attention-level method (the five position-remapping methods and
   log-n), the patched model's logits and weight gradients against a per-cell reference: every (query, key)
   score computed directly from its remapped relative position r'(i, j), in float64, one softmax. The input
   (AGREEMENT_TOKENS tokens, methods set up for L = AGREEMENT_L) crosses every region boundary. The reference
   takes r' from the methods' region rules; the test suite checks those rules against the formulas in
   docs/METHODS.md. The last DECODE_STEPS tokens are also fed one at a time through the KV cache (the path of
   generation: passkey, serving), and those logits are held to the same reference.
2. **Cost.** Time and peak memory of one prefill (optionally forward + backward) at each length, every method
   against the model's native attention (FlashAttention where installed, else SDPA), each method extending
   L = length / 4 by 4x.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

from .. import compat
from ..errors import CtxextError
from ..loading import load_config
from ..memory import PeakMemory
from ..methods.attention import logn_scale
from ..methods.remapping import BlendedKeyRotation, PerPairRotation
from ..patching import reference
from ..patching.attention import installed_settings, undo_rotation
from ..patching.families import check_supported, module_frequencies, rotary_host
from ..patching.patch import patch
from ..patching.record import rope_record
from ..patching.remap_kernel import pick_backend
from ..runtime import attention_implementation, machine_description, resolve_device, resolve_dtype

AGREEMENT_L = 64
AGREEMENT_TOKENS = 160
AGREEMENT_MLP = 256  # the agreement model's MLP width
DECODE_STEPS = 16  # tokens decoded one at a time through the cache after a prefill of the rest
# Parameters at L = 64 that put every region boundary inside 160 tokens (Dual Chunk: four 40-token chunks).
AGREEMENT_CASES: dict[str, tuple[str, dict]] = {
    "rerope": ("rerope", {"window": 16}),
    "leaky_rerope": ("leaky_rerope", {"window": 16, "k": 4.0}),
    "self_extend": ("self_extend", {"group_size": 4, "window": 16}),
    "dual_chunk": ("dual_chunk", {"chunk_size": 48, "local_window": 8}),
    "string": ("string", {"shifted_offset": 40, "local_value": 8}),
    "dpe": ("dpe", {"window": 16, "group_scales": [2, 4, 8, 16]}),
    "gali": ("gali", {"local_window": 8}),  # 160 tokens over 64 positions: far keys 1/2 and 1/3 apart
    "logn": ("none", {"logn": True}),
}
# At the cost lengths: each method's defaults for L = length / 4, log-n with the two that use it.
COST_CASES: dict[str, tuple[str, dict]] = {
    "rerope": ("rerope", {"logn": True}),
    "leaky_rerope": ("leaky_rerope", {"logn": True}),
    "self_extend": ("self_extend", {"group_size": 8}),
    "dual_chunk": ("dual_chunk", {}),
    "string": ("string", {}),
    "dpe": ("dpe", {}),
    "gali": ("gali", {}),
    "logn": ("none", {"logn": True}),
}
MIN_MEMORY_MB = 16  # below this native peak, memory ratios are not reported
REFERENCE_IMPLEMENTATION = "ctxext_per_cell_reference"
_REFERENCE = "_ctxext_reference"


@dataclass
class CheckOptions:
    device: str = "auto"
    model: str | None = None  # a config (directory, config.json or hub id); None: DEFAULT_SHAPE
    methods: list[str] = field(default_factory=lambda: list(AGREEMENT_CASES))
    implementations: list[str] | None = None  # None: every one available on the device
    lengths: list[int] = field(default_factory=lambda: [8192, 32768])
    layers: int = 1  # decoder layers of the cost model
    dtype: str = "auto"  # of the cost model; agreement runs in float32
    backward: bool = False  # cost: forward + backward instead of a prefill
    repeats: int = 3  # cost: timed runs per method (the median is reported)
    tolerance: float = 1e-4
    seed: int = 0


# A 1B-class LLaMA attention shape (head_dim 128, 32 heads, 8 KV heads).
DEFAULT_SHAPE = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)


# ----------------------------------------------------------------------------------------------- models
def load_shape(model: str | None):
    """The architecture to check: a transformers config (weights are never loaded)."""
    if model is None:
        values = dict(DEFAULT_SHAPE)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    elif Path(model).is_file():
        try:
            values = json.loads(Path(model).read_text())
            config = AutoConfig.for_model(values.pop("model_type"), **values)
        except (ValueError, KeyError) as error:
            raise CtxextError(f"'{model}' is not a transformers config.json ({error})") from None
    else:
        config = load_config(model)
    check_supported(config, f"model '{model}'" if model else None)
    return config


def random_model(
    shape,
    layers: int,
    implementation: str,
    device,
    dtype,
    seed: int,
    vocab: int = 1024,
    max_length: int | None = None,
    mlp: int | None = None,
):
    """A randomly initialised model of `shape`'s architecture with `layers` layers and a small vocabulary
    (and an MLP of width `mlp` where given: the attention is what is checked)."""
    config = type(shape).from_dict(shape.to_dict())
    config.num_hidden_layers = layers
    config.vocab_size = vocab
    _drop_special_tokens_outside(config, vocab)
    config.tie_word_embeddings = False
    config.attention_dropout = 0.0
    if mlp is not None:
        config.intermediate_size = min(config.intermediate_size, mlp)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"] * layers  # every layer sees every key (its window goes unused)
    elif getattr(config, "sliding_window", None) is not None:
        config.sliding_window = None  # remapping methods need every key; ctxext patch refuses short windows
    if max_length is not None:
        config.max_position_embeddings = max_length
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=implementation)
    return model.eval()


def _drop_special_tokens_outside(config, vocab: int) -> None:
    """Set to None the special token ids (pad/bos/eos, ...; an int or a list, as eos may be) that the shrunk
    vocabulary no longer holds: e.g. Qwen2.5's pad_token_id 151643 would make the embedding's padding_idx
    fail ("Padding_idx must be within num_embeddings"). None rather than mapping them inside the vocabulary:
    the check feeds unpadded random ids and never looks at bos/eos, and a pad id mapped inside would zero one
    of the fed tokens' embeddings (nn.Embedding's padding row), making those tokens' queries and keys zero
    and the attention being checked less exercised. Ids inside the vocabulary are kept; in a list, only the
    entries inside are kept (None if none is)."""
    for name, value in config.to_dict().items():
        if not name.endswith(("_token_id", "_token_ids")) or value is None:
            continue
        if isinstance(value, int):
            if not 0 <= value < vocab:
                setattr(config, name, None)
        elif isinstance(value, (list, tuple)):
            inside = [v for v in value if isinstance(v, int) and 0 <= v < vocab]
            if len(inside) != len(value):
                setattr(config, name, inside or None)


def available_implementations(device: torch.device) -> list[str]:
    implementations = ["eager", "sdpa", "flex_attention"]
    if device.type == "cuda":
        implementations += [
            name
            for name, available in (
                ("flash_attention_2", is_flash_attn_2_available()),
                ("flash_attention_3", is_flash_attn_3_available()),
            )
            if available
        ]
    return implementations


# -------------------------------------------------------------------------------------- the reference
def per_cell_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention function of the reference model: undo the model's rotation, read each cell's relative
    position r'(i, j) from the method's regions (`relative_positions`) and score every cell by it
    (ctxext.patching.reference.per_cell_attention, float64), one causal softmax. Full T x T matrices: small
    inputs only (unpadded, from position 0: what `check_one` feeds it)."""
    settings, host = module.__dict__[_REFERENCE]
    q_len, total = query.shape[2], key.shape[2]
    positions = torch.arange(total)
    rotary, layer_type = host.rotary_emb, _rotary_layer_type(host, module)
    at = positions[None].float().to(query.device)
    cos, sin = rotary(query, at) if layer_type is None else rotary(query, at, layer_type)
    q = undo_rotation(query, cos[:, -q_len:], sin[:, -q_len:]).double()
    k = undo_rotation(key, cos, sin).double()
    if settings.logn:
        n_scale = logn_scale(positions[-q_len:], settings.original_max_position_embeddings).double()
        q = q * n_scale.to(q.device)[None, None, :, None]
    inv_freq, factor = module_frequencies(rotary, layer_type)  # per-type rotary (Gemma 3): the set it applies
    i, j = positions[-q_len:], positions
    regions = settings.remap.regions_for(i) if settings.remap is not None else []
    relative, interpolated = relative_positions(regions, i, j, module.layer_idx, len(inv_freq))
    causal = j[None] <= i[:, None]
    out = reference.per_cell_attention(
        q, k, value, relative, inv_freq, module.scaling, factor, visible=causal, interpolated=interpolated
    )
    return out.to(value.dtype).transpose(1, 2).contiguous(), None


def relative_positions(regions, i: torch.Tensor, j: torch.Tensor, layer: int, pairs: int):
    """(r'(i, j), interpolated): each cell's relative position q(i) - k(j) under the region it lies in (i - j
    outside every region), (q_len, k_len) or (q_len, k_len, pairs) where a region turns pair by pair (DPE); and the
    cells GALI scores by interpolation (a key at a fractional position: `BlendedKeyRotation`)."""
    per_pair = any(isinstance(region.rotation, PerPairRotation) for region in regions)
    relative = (i[:, None] - j[None]).double()
    if per_pair:
        relative = relative[..., None].expand(-1, -1, pairs)
    interpolated = torch.zeros(len(i), len(j), dtype=torch.bool)
    for region in regions:
        lo, hi = region.key_range(i)
        inside = (j[None] >= lo[:, None]) & (j[None] < hi[:, None])
        q_at = _positions(region, region.query_position, i, layer, pairs).double()
        k_at = _positions(region, region.key_position, j, layer, pairs).double()
        region_relative = q_at[:, None] - k_at[None]
        if per_pair and region_relative.dim() == 2:
            region_relative = region_relative[..., None].expand(-1, -1, pairs)
        relative = torch.where(inside[..., None] if per_pair else inside, region_relative, relative)
        if isinstance(region.rotation, BlendedKeyRotation):
            interpolated = interpolated | inside
    return relative, interpolated


def _rotary_layer_type(host, module) -> str | None:
    """The layer type to ask `host.rotary_emb` for, where it keeps one set of frequencies per type; else None."""
    per_type = "layer_type" in inspect.signature(host.rotary_emb.forward).parameters
    if not per_type or None in rope_record(host.config).types:
        return None
    return host.config.layer_types[module.layer_idx]


def _positions(region, rule, at: torch.Tensor, layer: int, pairs: int) -> torch.Tensor:
    """A region's positions for `at`: (n,), or (n, pairs) for a rule per rotary pair (DPE)."""
    if rule is None:
        return at
    if not isinstance(region.rotation, PerPairRotation):
        return rule(at)
    return torch.stack([rule(at, int(G)) for G in region.rotation.pair_scales(pairs, layer).tolist()], dim=-1)


def reference_model(patched, host_settings, shape, device, seed):
    """An unpatched copy of `patched`'s weights whose attention is `per_cell_attention` under its settings."""
    if REFERENCE_IMPLEMENTATION not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(REFERENCE_IMPLEMENTATION, per_cell_attention)
    reference = random_model(
        shape, 1, "eager", device, torch.float32, seed, max_length=AGREEMENT_L, mlp=AGREEMENT_MLP
    )  # the same seed: the same weights
    if not torch.equal(reference.lm_head.weight, patched.lm_head.weight):
        raise CtxextError("internal: the reference model did not get the checked model's weights")
    reference.set_attn_implementation(REFERENCE_IMPLEMENTATION)
    patched_host = rotary_host(patched)
    reference_host = rotary_host(reference)
    reference_host.rotary_emb = patched_host.rotary_emb  # the method's frequencies and attention factor
    for layer in reference_host.layers:
        layer.self_attn.__dict__[_REFERENCE] = (host_settings, reference_host)
    return reference


# ------------------------------------------------------------------------------------------ agreement
@dataclass
class AgreementRow:
    implementation: str
    method: str
    backend: str
    forward_error: float
    backward_backend: str
    backward_error: float | None
    decode_backend: str
    decode_error: float
    ok: bool
    note: str = ""


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-30))


def check_one(shape, implementation: str, name: str, device, options: CheckOptions) -> AgreementRow:
    """One implementation and method: forward logits and weight gradients against the per-cell reference."""
    method, params = AGREEMENT_CASES[name]
    model = random_model(
        shape, 1, implementation, device, torch.float32, options.seed, max_length=AGREEMENT_L, mlp=AGREEMENT_MLP
    )
    patch(model, method, factor=AGREEMENT_TOKENS / AGREEMENT_L, **params)
    settings = installed_settings(rotary_host(model))
    reference = reference_model(model, settings, shape, device, options.seed)
    tokens = torch.randint(0, 1024, (1, AGREEMENT_TOKENS), generator=torch.Generator().manual_seed(options.seed))
    tokens = tokens.to(device)
    remaps = settings.remap is not None
    forward_backend = pick_backend("auto", device, False, AGREEMENT_TOKENS) if remaps else implementation
    backward_backend = pick_backend("auto", device, True, AGREEMENT_TOKENS) if remaps else implementation
    decode_backend = pick_backend("auto", device, False, 1) if remaps else implementation
    with torch.no_grad():
        want = reference(tokens).logits
        forward_error = _relative_error(model(tokens).logits, want)
        decode_error = _relative_error(decoded_logits(model, tokens, DECODE_STEPS), want[:, -DECODE_STEPS:])
    backward_error, note = None, ""
    try:
        grads = []
        for candidate in (model, reference):
            candidate.train()
            weights = torch.linspace(-1, 1, 1024, device=device)
            (candidate(tokens).logits * weights).mean().backward()
            attention = rotary_host(candidate).layers[0].self_attn
            grads.append([p.grad for p in (attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight)])
        backward_error = max(_relative_error(g, w) for g, w in zip(*grads))
    except (NotImplementedError, RuntimeError) as error:  # e.g. an implementation with no backward here
        note = f"backward not run: {str(error).splitlines()[0][:120]}"
    errors = [forward_error, decode_error] + ([backward_error] if backward_error is not None else [])
    ok = all(math.isfinite(e) and e <= options.tolerance for e in errors)
    return AgreementRow(
        implementation,
        name,
        forward_backend,
        forward_error,
        backward_backend,
        backward_error,
        decode_backend,
        decode_error,
        ok,
        note,
    )


def decoded_logits(model, tokens: torch.Tensor, steps: int) -> torch.Tensor:
    """The logits of the last `steps` tokens fed one at a time through the KV cache after a prefill of the rest."""
    cache = DynamicCache(config=model.config)  # filled in place by each forward
    passed = compat.cache_kwargs(model, cache)  # `cache` from transformers 5.24, `past_key_values` before
    model(tokens[:, :-steps], use_cache=True, **passed)
    steps_logits = [
        model(tokens[:, t : t + 1], use_cache=True, **passed).logits
        for t in range(tokens.shape[1] - steps, tokens.shape[1])
    ]
    return torch.cat(steps_logits, dim=1)


# ----------------------------------------------------------------------------------------------- cost
@dataclass
class CostRow:
    length: int
    method: str
    implementation: str
    backend: str
    seconds: float
    peak_mb: float
    x_native_time: float | None = None
    x_native_memory: float | None = None


def measure_cost(model, tokens, device, backward: bool, repeats: int = 1) -> tuple[float, float]:
    """(seconds, peak MB) of one prefill (logits of the last token), or of one forward + backward: the median
    time and the largest peak over `repeats` runs."""
    runs = [_measure_once(model, tokens, device, backward) for _ in range(repeats)]
    return statistics.median(t for t, _ in runs), max(m for _, m in runs)


def _measure_once(model, tokens, device, backward: bool) -> tuple[float, float]:
    context = contextlib.nullcontext() if backward else torch.no_grad()
    with context, PeakMemory(device) as memory:
        start = time.perf_counter()
        if backward:
            model(tokens, labels=tokens, use_cache=False).loss.backward()
        else:
            model(tokens, logits_to_keep=1, use_cache=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds, memory.megabytes


def cost_rows(shape, length: int, native: str, device, dtype, options: CheckOptions) -> list[CostRow]:
    """Every method against the native attention at one length, one after another (load drifts hit all)."""
    tokens = torch.randint(0, 1024, (1, length), generator=torch.Generator().manual_seed(options.seed)).to(device)
    rows = []
    for name in ["native"] + [m for m in options.methods if m in COST_CASES]:
        model = random_model(shape, options.layers, native, device, dtype, options.seed, max_length=length // 4)
        backend = native
        if name != "native":
            method, params = COST_CASES[name]
            if method == "string":  # STRING's W = 128 needs S = 0.33 L above it
                params = {"local_value": min(128, length // 32), **params}
            patch(model, method, factor=4, **params)
            if method != "none":
                backend = pick_backend("auto", device, options.backward, length)
        if options.backward:
            model.train()
        measure_cost(model, tokens[:, :256], device, options.backward)  # warm-up (and compilation)
        seconds, megabytes = measure_cost(model, tokens, device, options.backward, options.repeats)
        rows.append(CostRow(length, name, native, backend, seconds, megabytes))
        del model
        gc.collect()
    base = rows[0]
    for row in rows:
        row.x_native_time = row.seconds / base.seconds
        # On the CPU a peak of a few MB is allocator noise, not the attention's memory: no ratio then.
        row.x_native_memory = row.peak_mb / base.peak_mb if base.peak_mb >= MIN_MEMORY_MB else None
    return rows


# ----------------------------------------------------------------------------------------------- the run
@dataclass
class CheckResult:
    device: str
    machine: str
    shape: dict
    agreement: list[AgreementRow]
    cost: list[CostRow]
    native: str
    dtype: str
    tolerance: float

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.agreement)

    def to_dict(self) -> dict:
        values = asdict(self)
        values["ok"] = self.ok
        return values


def run_check(options: CheckOptions, progress=None) -> CheckResult:
    unknown = [m for m in options.methods if m not in AGREEMENT_CASES]
    if unknown:
        raise CtxextError(
            f"unknown method(s) {', '.join(unknown)} for ctxext check; choose from {', '.join(AGREEMENT_CASES)}"
        )
    if any(length < 256 for length in options.lengths):
        raise CtxextError("--lengths must be at least 256 tokens each (the cost warm-up runs 256)")
    device = resolve_device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CtxextError("--device cuda was asked for but torch sees no CUDA device; use --device cpu or auto")
    shape = load_shape(options.model)
    available = available_implementations(device)
    implementations = options.implementations or available
    missing = [i for i in implementations if i not in available]
    if missing:
        raise CtxextError(
            f"attention implementation(s) {', '.join(missing)} are not available on {device}; "
            f"available: {', '.join(available)}"
        )
    dtype = resolve_dtype(options.dtype, device)
    native = attention_implementation("auto", device, dtype in (torch.float16, torch.bfloat16))
    steps = len(implementations) * len(options.methods) + len(options.lengths) * (len(options.methods) + 1)
    tick = progress(steps) if progress else None
    agreement = []
    for implementation in implementations:
        for name in options.methods:
            agreement.append(check_one(shape, implementation, name, device, options))
            if tick:
                tick.update(1)
    cost = []
    for length in options.lengths:
        cost += cost_rows(shape, length, native, device, dtype, options)
        if tick:
            tick.update(len(options.methods) + 1)
    if tick:
        tick.close()
    described = {k: getattr(shape, k, None) for k in DEFAULT_SHAPE if k != "rope_theta"}
    described["rope_theta"] = rope_record(shape).base  # the full-attention layers' (Gemma 3: 1e6, not 1e4)
    return CheckResult(
        str(device),
        machine_description(),
        described,
        agreement,
        cost,
        native,
        str(dtype).removeprefix("torch."),
        options.tolerance,
    )


# ----------------------------------------------------------------------------------------------- report
def agreement_table(result: CheckResult) -> str:
    lines = [
        f"{'implementation':<19}{'method':<14}{'backend':<19}{'forward err':>11}  {'train backend':<19}"
        f"{'backward err':>12}  {'decode backend':<19}{'decode err':>10}  result"
    ]
    for row in result.agreement:
        backward = "-" if row.backward_error is None else f"{row.backward_error:.1e}"
        lines.append(
            f"{row.implementation:<19}{row.method:<14}{row.backend:<19}{row.forward_error:>11.1e}  "
            f"{row.backward_backend:<19}{backward:>12}  {row.decode_backend:<19}{row.decode_error:>10.1e}  "
            f"{'ok' if row.ok else 'DISAGREES'}" + (f" ({row.note})" if row.note else "")
        )
    return "\n".join(lines)


def cost_table(result: CheckResult, backward: bool) -> str:
    what = "forward + backward" if backward else "prefill"
    lines = [
        f"{'tokens':>7}  {'method':<14}{'backend':<18}{what + ' s':>20}{'x native':>10}{'peak MB':>10}{'x native':>10}"
    ]
    for row in result.cost:
        memory = "-" if row.x_native_memory is None else f"{row.x_native_memory:.2f}"
        lines.append(
            f"{row.length:>7}  {row.method:<14}{row.backend:<18}{row.seconds:>20.2f}"
            f"{row.x_native_time:>10.2f}{row.peak_mb:>10.1f}{memory:>10}"
        )
    return "\n".join(lines)
