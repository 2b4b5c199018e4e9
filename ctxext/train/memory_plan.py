"""A memory plan for a fine-tuning recipe: the estimated per-device memory of `ctxext finetune`, piece by piece,
from the model's shape alone (its config.json; no weights are loaded). `ctxext finetune --plan` prints it.

Notation: h hidden size, L layers, a attention heads, k key/value heads, d head_dim, f intermediate (MLP) size,
V vocabulary, P all parameters, T trainable parameters (LoRA adapters, plus the input embedding and every norm
when lora.train_embeddings_and_norms), r LoRA rank, b micro batch, s training sequence length, sp the sequence
parallel degree (DeepSpeed Ulysses), tp the tensor-parallel degree, z the ZeRO stage. Per device, t = b s / sp
tokens. w is the bytes of a frozen weight (4 in fp32; 2 in bf16, and in bf16-mixed under DeepSpeed, which casts
the module), e the bytes of an activation (4 in fp32, 2 under bf16 autocast). ZeRO shards over the sp ranks
(one data-parallel replica: sp x tp devices in all).

    P          = V h (embedding) + V h (LM head, unless tied) + h (final norm)
                 + L [h a d + 2 h k d + a d h (+ a d + 2 k d biases) + 3 h f + 2 h (+ 2 d q/k norms)]
    LoRA       = L sum over targets of r (in + out)            (q: h->a d, k/v: h->k d, o: a d->h,
                                                                  gate/up: h->f, down: f->h)
    T          = LoRA (+ V h + every norm's h, trained in full, in fp32)
    weights    = P w / tp                                       (/ sp as well under ZeRO-3)
                 (+ 2 (L linear weights + V h) / tp: autocast's bf16 copies, bf16-mixed without ZeRO)
    trainable  = T 4 / tp (+ T 2: DeepSpeed's bf16 copy)        (/ sp under ZeRO-3)
    gradients  = T 4 / tp                                       (/ sp under ZeRO-2 and 3)
    optimizer  = T 8 / tp: AdamW's two fp32 moments             (/ sp under ZeRO-2 and 3)
    per layer and token, saved for backward (bytes):
        norms      2 (8 h, or 12 h when e = 2)                  RMSNorm in fp32: input, normalised (, output)
        LoRA       sum over targets of e in + in (dropout mask, if dropout > 0) + e r
        attention  e (a d + 2 k d) / tp + e 2 a d / tp + 4 a / tp   q and k after rotary, v; output, o_proj input;
                                                                     logsumexp
        MLP        4 e f / tp                                   gate, up, silu(gate), their product
    activations = L t (per layer)                               without gradient checkpointing
                = L t h w + t (per layer)                       with it: every layer's input (the residual
                                                                  stream has the weights' dtype) + one layer
                                                                  recomputed
    attention working set (one layer, in backward)
        flash/SDPA (no s x s matrix): e t (2 a d + 2 k d) / tp (+ 4 t a d / tp fp32 dq when e = 2)
                                    (+ e t (2 a d + 2 k d) / tp when sp > 1: Ulysses' all-to-all buffers)
        math (eager): 8 b (a / (sp tp)) s^2, plus e b (a / (sp tp)) s^2 saved per layer (every layer without
                      checkpointing, one with it)
    logits + loss = t V (12 + [e < 4] 2)                        transformers' ForCausalLMLoss upcasts the full
                                                                  s x V logits to fp32: the fp32 logits or
                                                                  log-softmax, its gradient and the gradient of the
                                                                  NLL (+ the bf16 logits' gradient)
    peak = weights + trainable + gradients + optimizer
           + max(saved at the loss + logits + loss, activations + attention working set)
           (saved at the loss: the activations without checkpointing, L t h w with it)

The logits are freed before the last layer's backward starts (and, with checkpointing, before its recomputation),
so the peak is the larger of the two moments. Not counted: the CUDA context, NCCL buffers and the allocator's
fragmentation (a setting "fits" a GPU when the peak is at most FIT_FRACTION of its memory), ZeRO-3's gathered
layer, the data and the tokenizer. Measured against real CPU fine-tunes: benchmarks/memory_plan.py, BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import CtxextError
from ..loading import load_config
from .pretrain_tiny import TINY_MODEL_PREFIX, TINY_PRESETS, tiny_llama_config
from .recipe import Recipe

GIB = 2**30
# Memory as the driver reports it (nvidia-smi's total, MiB): what a process could hold at most.
GPUS = {"80 GB (A100/H100)": 81559 * 2**20, "141 GB (H200)": 143771 * 2**20}
FIT_FRACTION = 0.9  # headroom for the CUDA context, NCCL buffers and fragmentation
PARALLEL_DEGREES = (1, 2, 4, 8)
ZERO_STAGES = (0, 2, 3)
ADAMW_MOMENTS = 2
# LoRA target -> (input width, output width) as functions of the shape (Llama / Mistral / Qwen2 names).
TARGET_WIDTHS = {
    "q_proj": lambda m: (m.hidden, m.heads * m.head_dim),
    "k_proj": lambda m: (m.hidden, m.kv_heads * m.head_dim),
    "v_proj": lambda m: (m.hidden, m.kv_heads * m.head_dim),
    "o_proj": lambda m: (m.heads * m.head_dim, m.hidden),
    "gate_proj": lambda m: (m.hidden, m.intermediate),
    "up_proj": lambda m: (m.hidden, m.intermediate),
    "down_proj": lambda m: (m.intermediate, m.hidden),
}
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    attention_bias: bool = False  # Qwen2: biases on q, k, v
    qk_norm: bool = False  # Qwen3 / Gemma 3: an RMSNorm over each head's q and k


@dataclass(frozen=True)
class PlanSettings:
    micro_batch: int
    seq_len: int
    precision: str  # fp32 | bf16 | bf16-mixed (resolved, as on a GPU)
    gradient_checkpointing: bool
    lora_r: int
    lora_targets: tuple[str, ...]
    train_embeddings_and_norms: bool = True
    lora_dropout: bool = True
    attention: str = "flash"  # flash (no s x s matrix) | math (eager: the scores materialised)
    sp: int = 1
    tp: int = 1
    zero: int = 0


# ------------------------------------------------------------------------------------------ the shape
def shape_from_config(config) -> ModelShape:
    """The shape of a transformers config (its text part for a multimodal one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    model_type = str(getattr(text, "model_type", ""))
    return ModelShape(
        hidden=int(text.hidden_size),
        layers=int(text.num_hidden_layers),
        heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        intermediate=int(getattr(text, "intermediate_size", None) or 4 * text.hidden_size),  # none named: GPT-2's 4h
        vocab=int(text.vocab_size),
        tied=bool(getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(text, "attention_bias", False) or model_type == "qwen2"),
        qk_norm=model_type.startswith(("qwen3", "gemma3")),
    )


def read_model_shape(model: str) -> ModelShape:
    """The recipe's model shape from its config.json alone; ctxext:tiny-shakespeare from its preset (not built)."""
    if model.startswith(TINY_MODEL_PREFIX):
        preset = TINY_PRESETS.get(model.removeprefix(TINY_MODEL_PREFIX))
        if preset is None:
            raise CtxextError(f"unknown built-in model '{model}'; built-in: {', '.join(TINY_PRESETS)}")
        return shape_from_config(tiny_llama_config(preset, eos_token_id=0))
    return shape_from_config(load_config(model))


# ------------------------------------------------------------------------------------------ parameters
def projection_weights(m: ModelShape) -> int:
    """One layer's matrix weights: q, k, v, o and the gated MLP's gate, up and down (what a token multiplies)."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return m.hidden * q + 2 * m.hidden * kv + q * m.hidden + 3 * m.hidden * m.intermediate


def layer_parameters(m: ModelShape) -> int:
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return projection_weights(m) + ((q + 2 * kv) if m.attention_bias else 0) + norm_parameters_per_layer(m)


def norm_parameters_per_layer(m: ModelShape) -> int:
    return 2 * m.hidden + (2 * m.head_dim if m.qk_norm else 0)


def model_parameters(m: ModelShape) -> int:
    """P: every parameter of the causal LM (embedding, layers, final norm, LM head unless tied)."""
    head = 0 if m.tied else m.vocab * m.hidden
    return m.vocab * m.hidden + head + m.hidden + m.layers * layer_parameters(m)


def lora_parameters(m: ModelShape, r: int, targets) -> int:
    """The adapters' parameters: r (in + out) per target module and layer."""
    total = 0
    for target in targets:
        width = TARGET_WIDTHS.get(target)
        if width is None:
            raise CtxextError(
                f"--plan: no width known for the LoRA target '{target}'; known: {', '.join(TARGET_WIDTHS)}"
            )
        fan_in, fan_out = width(m)
        total += r * (fan_in + fan_out)
    return m.layers * total


def trainable_parameters(m: ModelShape, r: int, targets, embeddings_and_norms: bool) -> int:
    """T: the adapters, plus the input embedding and every norm when they train in full (PEFT modules_to_save)."""
    full = m.vocab * m.hidden + m.hidden + m.layers * norm_parameters_per_layer(m) if embeddings_and_norms else 0
    return lora_parameters(m, r, targets) + full


# ------------------------------------------------------------------------------------------ bytes
def activation_bytes(precision: str) -> int:
    """e: an activation's bytes (bf16 autocast or bf16 weights: 2; fp32: 4)."""
    return 4 if precision == "fp32" else 2


def frozen_weight_bytes(s: PlanSettings) -> int:
    """w: a frozen weight's bytes; DeepSpeed (ZeRO) casts the whole module to bf16 under bf16-mixed."""
    if s.precision == "bf16" or (s.precision == "bf16-mixed" and s.zero):
        return 2
    return 4


def zero_shards(s: PlanSettings, stage: int) -> int:
    """How many ways ZeRO splits a state that it shards from `stage` on (over the sp ranks)."""
    return s.sp if s.zero >= stage else 1


def static_bytes(m: ModelShape, s: PlanSettings) -> dict[str, float]:
    """Weights, trainable parameters, gradients and optimizer state per device."""
    trainable = trainable_parameters(m, s.lora_r, s.lora_targets, s.train_embeddings_and_norms)
    deepspeed_copy = 2 if s.zero and s.precision != "fp32" else 0
    weights = model_parameters(m) * frozen_weight_bytes(s) + autocast_weight_copies(m, s)
    return {
        "weights": weights / s.tp / zero_shards(s, 3),
        "trainable": trainable * (4 + deepspeed_copy) / s.tp / zero_shards(s, 3),
        "gradients": trainable * 4 / s.tp / zero_shards(s, 2),
        "optimizer": trainable * 4 * ADAMW_MOMENTS / s.tp / zero_shards(s, 2),
    }


def autocast_weight_copies(m: ModelShape, s: PlanSettings) -> int:
    """bf16-mixed without DeepSpeed: autocast keeps a bf16 copy of every fp32 weight a matmul reads (the layers'
    linear weights and the LM head) from the forward to the backward."""
    if s.precision != "bf16-mixed" or s.zero:
        return 0
    linear = layer_parameters(m) - norm_parameters_per_layer(m)
    return 2 * (m.layers * linear + m.vocab * m.hidden)


def layer_bytes_per_token(m: ModelShape, s: PlanSettings) -> float:
    """What one decoder layer saves for backward, per token (see the module docstring)."""
    e = activation_bytes(s.precision)
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    norms = 2 * (8 if e == 4 else 12) * m.hidden
    lora = 0.0
    for target in s.lora_targets:
        fan_in = TARGET_WIDTHS[target](m)[0]
        lora += e * fan_in + (fan_in if s.lora_dropout else 0) + e * s.lora_r
    attention = (e * (q + 2 * kv) + e * 2 * q + 4 * m.heads) / s.tp
    mlp = 4 * e * m.intermediate / s.tp
    return norms + lora + attention + mlp


def tokens_per_device(s: PlanSettings) -> float:
    return s.micro_batch * s.seq_len / s.sp


def activations(m: ModelShape, s: PlanSettings, checkpointing: bool) -> float:
    """Saved activations of all layers per device, with or without gradient checkpointing."""
    tokens, per_layer = tokens_per_device(s), layer_bytes_per_token(m, s)
    if not checkpointing:
        return m.layers * tokens * per_layer
    residual = frozen_weight_bytes(s)  # the residual stream has the weights' dtype (autocast leaves adds alone)
    return m.layers * tokens * m.hidden * residual + tokens * per_layer


def attention_working_set(m: ModelShape, s: PlanSettings) -> float:
    """One layer's attention in backward: gradients of q, k, v and the output, the all-to-all under Ulysses;
    with math attention the s x s scores (and, saved for backward, the probabilities)."""
    e, tokens = activation_bytes(s.precision), tokens_per_device(s)
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    working = e * tokens * (2 * q + 2 * kv) / s.tp
    if e < 4:
        working += 4 * tokens * q / s.tp  # flash attention's fp32 dq accumulator
    if s.sp > 1:
        working += e * tokens * (2 * q + 2 * kv) / s.tp
    if s.attention == "math":
        scores = s.micro_batch * (m.heads / (s.sp * s.tp)) * s.seq_len**2
        saved_layers = 1 if s.gradient_checkpointing else m.layers
        working += 8 * scores + e * scores * saved_layers
    return working


def logits_and_loss(m: ModelShape, s: PlanSettings) -> float:
    """The full-vocabulary logits upcast to fp32 for the loss (transformers' ForCausalLMLoss), with gradients."""
    per_entry = 12 + (2 if activation_bytes(s.precision) < 4 else 0)
    return tokens_per_device(s) * m.vocab * per_entry


# ------------------------------------------------------------------------------------------ the estimate
def check_parallel(m: ModelShape, s: PlanSettings) -> None:
    """Ulysses and tensor parallelism split the attention heads: sp x tp must divide them."""
    if s.sp < 1 or s.tp < 1:
        raise CtxextError(f"--plan: sp ({s.sp}) and tp ({s.tp}) must be at least 1")
    if m.heads % (s.sp * s.tp):
        raise CtxextError(
            f"--plan: sp x tp = {s.sp} x {s.tp} does not divide the model's {m.heads} attention heads "
            "(Ulysses and tensor parallelism split them)"
        )
    if s.seq_len % s.sp:
        raise CtxextError(f"--plan: sp={s.sp} does not divide the sequence length {s.seq_len}")
    if s.zero not in ZERO_STAGES:
        raise CtxextError(f"--zero must be one of {', '.join(map(str, ZERO_STAGES))}, got {s.zero}")


def estimate(m: ModelShape, s: PlanSettings) -> dict[str, float]:
    """Every piece in bytes per device, and the peak (see the module docstring for the formula)."""
    check_parallel(m, s)
    pieces = static_bytes(m, s)
    pieces["activations"] = activations(m, s, s.gradient_checkpointing)
    pieces["activations_other"] = activations(m, s, not s.gradient_checkpointing)  # the other choice, for show
    pieces["attention_working_set"] = attention_working_set(m, s)
    pieces["logits_and_loss"] = logits_and_loss(m, s)
    static = sum(pieces[key] for key in ("weights", "trainable", "gradients", "optimizer"))
    at_loss = saved_at_the_loss(m, s) + pieces["logits_and_loss"]
    in_layers = pieces["activations"] + pieces["attention_working_set"]
    pieces["peak"] = static + max(at_loss, in_layers)
    return pieces


def saved_at_the_loss(m: ModelShape, s: PlanSettings) -> float:
    """What is saved when the loss's backward starts: every layer's activations, or with checkpointing only
    every layer's input (the recomputed layer comes after the logits are freed)."""
    if not s.gradient_checkpointing:
        return activations(m, s, False)
    return m.layers * tokens_per_device(s) * m.hidden * frozen_weight_bytes(s)


def fits(peak: float) -> dict[str, bool]:
    """Whether a peak fits each named GPU, with FIT_FRACTION of its memory usable."""
    return {name: peak <= FIT_FRACTION * capacity for name, capacity in GPUS.items()}


def parallel_table(m: ModelShape, s: PlanSettings) -> list[dict]:
    """The peak for every sp x tp in PARALLEL_DEGREES (None where sp x tp does not divide the heads)."""
    rows = []
    for tp in PARALLEL_DEGREES:
        for sp in PARALLEL_DEGREES:
            cell = dataclasses.replace(s, sp=sp, tp=tp)
            try:
                peak = estimate(m, cell)["peak"]
            except CtxextError:
                rows.append({"sp": sp, "tp": tp, "peak_bytes": None, "fits": None})
                continue
            rows.append({"sp": sp, "tp": tp, "peak_bytes": peak, "fits": fits(peak)})
    return rows


def plan_precision(precision: str, zero: int) -> str:
    """The precision ctxext would train in on a GPU with bf16 (ctxext.runtime.training_precision)."""
    if precision != "auto":
        return precision
    return "bf16-mixed" if zero else "bf16"


def settings_from_recipe(recipe: Recipe, tp: int = 1, zero: int = 0) -> PlanSettings:
    """The plan's settings: the recipe's, with the tensor-parallel degree and ZeRO stage of the command line."""
    train, lora = recipe.train, recipe.lora
    return PlanSettings(
        micro_batch=train.micro_batch_size,
        seq_len=recipe.train_sequence_length,
        precision=plan_precision(train.precision, zero),
        gradient_checkpointing=bool(train.gradient_checkpointing),
        lora_r=lora.r,
        lora_targets=tuple(lora.target_modules),
        train_embeddings_and_norms=bool(lora.train_embeddings_and_norms),
        lora_dropout=lora.dropout > 0,
        attention="math" if train.attn_implementation == "eager" else "flash",
        sp=recipe.parallel.sp_size,
        tp=tp,
        zero=zero,
    )


def memory_plan(m: ModelShape, s: PlanSettings, model: str = "") -> dict:
    """The whole plan as one JSON-ready mapping: shape, settings, parameter counts, pieces, fits, the table."""
    pieces = estimate(m, s)
    return {
        "model": model,
        "shape": dataclasses.asdict(m),
        "settings": dataclasses.asdict(s),
        "parameters": {
            "total": model_parameters(m),
            "lora": lora_parameters(m, s.lora_r, s.lora_targets),
            "trainable": trainable_parameters(m, s.lora_r, s.lora_targets, s.train_embeddings_and_norms),
        },
        "bytes": pieces,
        "fits": fits(pieces["peak"]),
        "fit_fraction": FIT_FRACTION,
        "gpus_bytes": GPUS,
        "table": parallel_table(m, s),
    }


# ------------------------------------------------------------------------------------------ the text
def gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def describe_settings(plan: dict) -> list[str]:
    """The plan's first lines: the model's shape and the recipe's settings."""
    m, s, p = plan["shape"], plan["settings"], plan["parameters"]
    full = " + embeddings and norms" if s["train_embeddings_and_norms"] else ""
    attention = "flash/SDPA (no s x s matrix)" if s["attention"] == "flash" else "math (s x s scores materialised)"
    return [
        f"memory plan for {plan['model'] or 'the model'}: h={m['hidden']} L={m['layers']} heads={m['heads']} "
        f"kv={m['kv_heads']} head_dim={m['head_dim']} ffn={m['intermediate']} vocab={m['vocab']}, "
        f"{p['total'] / 1e9:.3f}B parameters",
        f"  {s['micro_batch']} x {s['seq_len']} tokens, {s['precision']}, gradient checkpointing "
        f"{'on' if s['gradient_checkpointing'] else 'off'}, attention {attention}",
        f"  LoRA r={s['lora_r']} on {','.join(s['lora_targets'])}{full}: {p['trainable'] / 1e6:.2f}M trainable "
        f"({p['lora'] / 1e6:.2f}M in adapters)",
        f"  per device with sp={s['sp']} tp={s['tp']} zero={s['zero']}:",
    ]


def describe_pieces(plan: dict) -> list[str]:
    b, checkpointing = plan["bytes"], plan["settings"]["gradient_checkpointing"]
    other = "without" if checkpointing else "with"
    rows = [
        ("weights (frozen)", b["weights"], ""),
        ("LoRA + trainable params", b["trainable"], "fp32"),
        ("gradients", b["gradients"], "fp32"),
        ("optimizer state", b["optimizer"], "AdamW: 2 fp32 moments"),
        ("activations", b["activations"], f"{other} checkpointing: {gib(b['activations_other'])}"),
        ("attention working set", b["attention_working_set"], "one layer, in backward"),
        ("logits + loss", b["logits_and_loss"], "s x vocab in fp32"),
        ("peak (estimate)", b["peak"], "static + the larger of: at the loss, in the layers' backward"),
    ]
    return [f"    {name:<25}{gib(value):>12}   {note}".rstrip() for name, value, note in rows]


def describe_table(plan: dict) -> list[str]:
    """The sp x tp table: the peak in GiB and the GPUs it fits."""
    short = {name: name.split()[0] for name in GPUS}  # '80', '141'
    verdicts = "; ".join(f"{name}: {'yes' if ok else 'no'}" for name, ok in plan["fits"].items())
    lines = [
        f"  fits: {verdicts} (at most {FIT_FRACTION:.0%} of the GPU's memory)",
        f"  peak per device (GiB) over sp x tp, zero={plan['settings']['zero']}; [GB of the GPUs it fits]:",
        "        " + "".join(f"{'sp=' + str(sp):>16}" for sp in PARALLEL_DEGREES),
    ]
    for tp in PARALLEL_DEGREES:
        cells = []
        for row in (r for r in plan["table"] if r["tp"] == tp):
            if row["peak_bytes"] is None:
                cells.append(f"{'n/a':>16}")
                continue
            names = [short[n] for n, ok in row["fits"].items() if ok] or ["-"]
            cells.append(f"{row['peak_bytes'] / GIB:.1f} [{','.join(names)}]".rjust(16))
        lines.append(f"  tp={tp:<4}" + "".join(cells))
    lines.append("  n/a: sp x tp does not divide the attention heads")
    return lines


def render_plan(plan: dict) -> str:
    return "\n".join(describe_settings(plan) + describe_pieces(plan) + describe_table(plan))
