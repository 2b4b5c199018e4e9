"""The position-remapping methods (SelfExtend, Dual Chunk Attention, STRING, and ReRoPE on the same kernel)
against a naive per-cell reference.

The oracle (tests/helpers.py, `reference_model`): the relative-position matrix r'(i, j) from each method's formula
(docs/METHODS.md), then every score as (query rotated by r') . (unrotated key) in float64, scaled by the
attention factor squared, then one causal softmax (ctxext.patching.reference.per_cell_attention, held to
transformers' RoPE attention in tests/test_reference.py). It shares nothing with ctxext's regions or kernel.
"""

import copy
import gc
import json
import math
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import ctxext
from ctxext import compat
from ctxext.errors import CtxextError
from ctxext.methods import get_method
from ctxext.patching.attention import KeptKeys, installed_settings, kept_keys_bytes, set_attention_tuning
from ctxext.patching.attention import regions as attention_regions
from ctxext.verification.check import decoded_logits
from tests.helpers import (
    FAMILIES,
    RELATIVE,
    REMAP_L,
    REMAP_SEQ,
    decoded_and_full_logits,
    reference_model,
    save_tiny_checkpoint,
    self_extend_relative,
    tiny_model,
)

L = REMAP_L  # the tiny models' original length: log-n acts past it
SEQ = REMAP_SEQ


# ------------------------------------------------------------------------------------ model oracle
CASES = [
    ("self_extend", {"group_size": 4, "window": 8}),
    ("self_extend", {"group_size": 3, "window": 10}),  # w not a multiple of G: r' still >= w
    ("self_extend", {"group_size": 1, "window": 5}),
    ("dual_chunk", {"chunk_size": 24, "local_window": 4}),
    ("dual_chunk", {"chunk_size": 12, "local_window": 2}),  # several older chunks
    ("dual_chunk", {"chunk_size": 20, "local_window": 0}),
    ("string", {"shifted_offset": 12, "local_value": 4, "attention_factor": 1.0}),
    ("string", {"shifted_offset": 20, "local_value": 8, "attention_factor": 1.2}),
    ("leaky_rerope", {"window": 7, "k": 3.0}),
]
FAMILY_NAMES = list(FAMILIES)
RUNS = [
    (FAMILY_NAMES[n % 4], method, params, logn) for n, (method, params) in enumerate(CASES) for logn in (False, True)
]


@pytest.mark.parametrize("family,method,params,logn", RUNS)
def test_patched_model_matches_the_per_cell_formula(family, method, params, logn):
    tokens = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(3))
    expected_model = reference_model(family, method, params, logn)
    patched = ctxext.patch(tiny_model(family, max_position_embeddings=L), method, logn=logn, **params)
    set_attention_tuning(patched, query_block=5)
    with torch.no_grad():
        expected = expected_model(tokens, use_cache=False).logits
        got = patched(tokens).logits
        plain = tiny_model(family, max_position_embeddings=L)(tokens).logits
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    if params.get("group_size") == 1 and not logn:  # SelfExtend with G = 1 is plain RoPE, via the kernel
        assert torch.allclose(got, plain, atol=1e-5)
    else:
        assert (got - plain).abs().max() > 1e-4  # the method (or log-n) really acts on this input


@pytest.mark.parametrize("kernel", ["blockwise", "naive"])
def test_other_kernels_agree_on_cpu(kernel):
    """The training form (blockwise) and the O(T^2) reference, forced on CPU, give the fused kernel's logits."""
    tokens = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(4))
    model = ctxext.patch(
        tiny_model("qwen3", max_position_embeddings=L), "dual_chunk", chunk_size=16, local_window=3, logn=True
    )
    with torch.no_grad():
        set_attention_tuning(model, query_block=7, kernel="lse")
        fused = model(tokens).logits
        set_attention_tuning(model, kernel=kernel)
        other = model(tokens).logits
    assert torch.allclose(other, fused, atol=1e-5), (other - fused).abs().max()


# ------------------------------------------------------------------------------ decode = full forward
DECODE = [
    ("llama", "self_extend", {"group_size": 3, "window": 6}, False),
    ("mistral", "dual_chunk", {"chunk_size": 14, "local_window": 3}, True),
    ("qwen2", "string", {"shifted_offset": 10, "local_value": 3}, True),
    ("qwen3", "self_extend", {"group_size": 2, "window": 16}, True),  # prompt inside w, decoding crosses it
    ("llama", "dual_chunk", {"chunk_size": 18, "local_window": 4}, False),
    ("llama", "dpe", {"window": 6, "group_scales": [2, 4, 8, 16]}, False),
    ("qwen3", "dpe", {"window": 5, "group_scales": [3, 9], "selected_pairs": [[0, 1, 6], [2, 3, 4, 7]]}, True),
]


@pytest.mark.parametrize("family,method,params,logn", DECODE)
def test_cached_decoding_equals_full_forward(family, method, params, logn):
    model = ctxext.patch(tiny_model(family, max_position_embeddings=L), method, logn=logn, **params)
    decoded, full = decoded_and_full_logits(model, 32)
    assert decoded.shape[1] == 32
    assert torch.allclose(decoded, full, atol=1e-4), (decoded - full).abs().max()


@pytest.mark.parametrize("tuned", [False, True])
def test_the_layers_of_a_forward_share_one_rotary_computation(tuned):
    """Every layer asks for the same (cos, sin), so the rotary embedding runs once per forward and set of positions
    however deep the model is, in a prefill and in each decode step (per layer, it was a fifth of a decode step);
    also after `set_attention_tuning`, which rebuilds each layer's state."""

    def rotary_calls(layers: int) -> list[int]:
        model = ctxext.patch(
            tiny_model("llama", max_position_embeddings=L, num_hidden_layers=layers),
            "dual_chunk",
            chunk_size=18,
            local_window=4,
        )
        if tuned:
            set_attention_tuning(model, query_block=16)
        calls = []
        model.model.rotary_emb.register_forward_hook(lambda *_: calls.append(1))
        tokens = torch.randint(0, 256, (1, 41), generator=torch.Generator().manual_seed(8))
        counts = []
        with torch.no_grad():
            cache = model(tokens[:, :40], use_cache=True).past_key_values
            counts.append(len(calls))
            model(tokens[:, 40:], **compat.cache_kwargs(model, cache), use_cache=True)
            counts.append(len(calls) - counts[0])
        return counts

    assert rotary_calls(2) == rotary_calls(5)
    assert rotary_calls(2)[1] > 1  # the step did remap (the model's own call is the first)


# ---------------------------------------------------------------------- keys kept between decode steps
KEPT = [*DECODE, ("qwen2", "rerope", {"window": 5}, True), ("mistral", "leaky_rerope", {"window": 6, "k": 2.0}, False)]


def forget_kept_keys(model):
    """A pre-forward hook (after ctxext's) that drops every cache layer's kept keys: each step rotates all keys
    afresh, as decoding did before keys were kept."""

    def drop(_module, _args, kwargs):
        for layer in getattr(kwargs.get("past_key_values", kwargs.get("cache")), "layers", []):
            layer.__dict__.pop(KeptKeys.ATTRIBUTE, None)

    return model.model.register_forward_pre_hook(drop, with_kwargs=True)


@pytest.mark.parametrize("family,method,params,logn", KEPT)
def test_kept_keys_decode_bit_for_bit_like_keys_rotated_afresh(family, method, params, logn, monkeypatch):
    """A decode step rotates only its new key (the earlier ones were kept on the cache layer), and its logits are
    exactly those of a step that turns every cached key back and rotates it again."""
    model = ctxext.patch(tiny_model(family, max_position_embeddings=L), method, logn=logn, **params)
    tokens = torch.randint(0, 256, (1, 44), generator=torch.Generator().manual_seed(9))
    unrotated_lengths = []
    undo = attention_regions.undo_rotation
    monkeypatch.setattr(
        attention_regions, "undo_rotation", lambda x, *a: unrotated_lengths.append(x.shape[2]) or undo(x, *a)
    )
    with torch.no_grad():
        kept = decoded_logits(model, tokens, steps=16)
        lengths_kept = set(unrotated_lengths)
        unrotated_lengths.clear()
        handle = forget_kept_keys(model)
        afresh = decoded_logits(model, tokens, steps=16)
        handle.remove()
    assert torch.equal(kept, afresh)
    prompt = tokens.shape[1] - 16
    # the prefill turned back its queries and keys; each step one query and, but for STRING, one key
    assert lengths_kept == {prompt, 1}
    if method != "string":  # STRING keeps every key's own rotation: it never turns keys back
        assert max(unrotated_lengths) == tokens.shape[1]  # afresh: every cached key, every step


def test_kept_keys_go_with_their_cache():
    model = ctxext.patch(tiny_model("llama", max_position_embeddings=L), "dual_chunk", chunk_size=14, local_window=3)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 40)), **compat.cache_kwargs(model, cache), use_cache=True)
    kept = weakref.ref(cache.layers[0].__dict__[KeptKeys.ATTRIBUTE])
    del cache
    gc.collect()
    assert kept() is None


def filled_cache(model, tokens):
    """A DynamicCache after a 30-token prefill and 10 decode steps of `tokens`."""
    cache = DynamicCache(config=model.config)
    model(tokens[:, :30], **compat.cache_kwargs(model, cache), use_cache=True)
    for t in range(30, 40):
        model(tokens[:, t : t + 1], **compat.cache_kwargs(model, cache), use_cache=True)
    return cache


def decode_steps(model, cache, tail):
    return torch.cat(
        [
            model(tail[:, s : s + 1], **compat.cache_kwargs(model, cache), use_cache=True).logits
            for s in range(tail.shape[1])
        ],
        1,
    )


@pytest.mark.parametrize("change", ["crop", "reorder", "copy"])
def test_a_cache_changed_between_steps_decodes_like_a_full_forward(change):
    """Cropping, reordering (beam search) or copying the cache between steps: the kept keys no longer fit and are
    rotated afresh, so decoding still equals a full forward of what the cache holds."""
    model = ctxext.patch(tiny_model("qwen3", max_position_embeddings=L), "self_extend", group_size=3, window=6)
    tokens = torch.randint(0, 256, (2, 44), generator=torch.Generator().manual_seed(11))
    tail = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        cache = filled_cache(model, tokens)
        if change == "crop":
            cache.crop(-4)  # drop the last 4 tokens
            assert cache.get_seq_length() == 36
            tokens = tokens[:, :36]
        elif change == "reorder":
            cache.reorder_cache(torch.tensor([1, 0]))
            tokens = tokens.flip(0)[:, :40]
        else:
            cache = copy.deepcopy(cache)
            tokens = tokens[:, :40]
        decoded = decode_steps(model, cache, tail)
        full = model(torch.cat([tokens, tail], dim=1)).logits[:, -4:]
    assert torch.allclose(decoded, full, atol=1e-4), (decoded - full).abs().max()


def test_a_method_changed_between_steps_rotates_the_kept_keys_afresh():
    """Re-patched with other parameters, the next steps use none of the keys kept under the old ones: their logits
    are exactly those of steps that rotate every key afresh. (The cache was filled under the old method, so no
    full forward under the new one is a reference.)"""
    model = ctxext.patch(tiny_model("qwen3", max_position_embeddings=L), "self_extend", group_size=3, window=6)
    tokens = torch.randint(0, 256, (2, 44), generator=torch.Generator().manual_seed(11))
    tail = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        cache = filled_cache(model, tokens)
        ctxext.unpatch(model)
        ctxext.patch(model, "self_extend", group_size=2, window=9)
        handle = forget_kept_keys(model)
        afresh = decode_steps(model, copy.deepcopy(cache), tail)
        handle.remove()
        decoded = decode_steps(model, cache, tail)
    assert torch.equal(decoded, afresh)


def test_keys_kept_cost_one_copy_per_key_rule_and_go_when_turned_off():
    """`kept_keys_bytes` counts one copy of the cache's keys per distinct key rule of the method, plus at most an
    eighth to grow into; after `set_attention_tuning(keep_keys=False)` the next step drops them and decodes the
    same logits, and later steps keep none."""
    model = ctxext.patch(tiny_model("mistral", max_position_embeddings=L), "leaky_rerope", window=6, k=2.0)
    rules = {region.key_position for region in installed_settings(model.model).remap.regions()} - {None}
    tokens = torch.randint(0, 256, (2, 44), generator=torch.Generator().manual_seed(13))
    tail = torch.randint(0, 256, (2, 3), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        cache = filled_cache(model, tokens)
        cached = sum(layer.keys.numel() * layer.keys.element_size() for layer in cache.layers)
        assert len(rules) * cached <= kept_keys_bytes(cache) <= len(rules) * cached * 9 / 8
        spare = copy.deepcopy(cache)
        kept = decode_steps(model, spare, tail)
        set_attention_tuning(model, keep_keys=False)
        not_kept = decode_steps(model, cache, tail)
    assert kept_keys_bytes(cache) == 0 and kept_keys_bytes(spare) > 0
    assert torch.equal(kept, not_kept)
    with pytest.raises(CtxextError, match="keep_keys"):
        set_attention_tuning(model, keep_keys="no")


@pytest.mark.parametrize("command", ["passkey", "tasks"])
def test_no_kept_keys_on_the_command_line_reaches_every_row(command, tmp_path):
    """`--no-kept-keys` (the commands that generate) -> RuntimeOptions -> the rows `EvalSession.open` builds on a
    checkpoint on disk: that row patches its method in with no kept keys and decodes the same logits as the row
    built without the flag, which keeps them; `ctxext eval` (no decoding) has no such flag."""
    from ctxext.cli import parse_args
    from ctxext.cli.evaluation import method_selection, runtime_options
    from ctxext.eval.session import EvalSession

    checkpoint = str(save_tiny_checkpoint(tmp_path / "tiny", tiny_model("llama", max_position_embeddings=L)))
    flags = [command, checkpoint, "-o", str(tmp_path / "out"), "--method", "self_extend", "--no-baseline"]
    flags += ["--group-size", "3", "--window", "6", "--device", "cpu", "--dtype", "fp32"]
    flags += ["--tasks", "niah_single_1"] if command == "tasks" else []
    with pytest.raises(SystemExit):
        parse_args(["eval", checkpoint, "-o", str(tmp_path / "out"), "--no-kept-keys"])

    tokens = torch.randint(0, 256, (1, 44), generator=torch.Generator().manual_seed(21))
    tail = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(22))
    logits, kept = [], []
    for extra in ([], ["--no-kept-keys"]):
        args = parse_args(flags + extra)
        session = EvalSession.open(checkpoint, method_selection(args), runtime_options(args))
        (row,) = session.methods
        row.apply(session.model)
        with torch.no_grad():
            cache = filled_cache(session.model, tokens)
            logits.append(decode_steps(session.model, cache, tail))
        kept.append(kept_keys_bytes(cache))
    assert kept[0] > 0 and kept[1] == 0
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ where nothing changes
@pytest.mark.parametrize(
    "family,method,params",
    [
        ("llama", "self_extend", {"group_size": 4, "window": 30}),
        ("mistral", "dual_chunk", {"chunk_size": 40, "local_window": 10}),  # chunks of 30
        ("qwen2", "string", {"shifted_offset": 30, "local_value": 4, "attention_factor": 1.0}),
        ("qwen3", "dual_chunk", {"chunk_size": 34, "local_window": 4}),
    ],
)
def test_first_region_covering_the_sequence_is_bit_identical(family, method, params):
    tokens = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(6))
    model = tiny_model(family)
    with torch.no_grad():
        plain = model(tokens).logits
        ctxext.patch(model, method, **params)
        assert torch.equal(model(tokens).logits, plain)
        longer = torch.randint(0, 256, (1, 45), generator=torch.Generator().manual_seed(6))
        patched_longer = model(longer).logits
        ctxext.unpatch(model)
        assert torch.equal(model(tokens).logits, plain)
        assert not torch.allclose(patched_longer, model(longer).logits, atol=1e-5)  # past it, it acts


# ------------------------------------------------------------------------- how far past L a setting reaches
def largest_relative_brute_force(method, params, length):
    i, j = torch.tril_indices(length, length)  # every query i and key j <= i
    return RELATIVE[method](i, j, **params).max().item()


@pytest.mark.parametrize(
    "method, params",
    [
        ("self_extend", {"group_size": 4, "window": 16}),
        ("self_extend", {"group_size": 3, "window": 10}),
        ("self_extend", {"group_size": 5, "window": 40}),
        ("rerope", {"window": 20}),
        ("rerope", {"window": 70}),
        ("leaky_rerope", {"window": 12, "k": 4.0}),
        ("leaky_rerope", {"window": 31, "k": 16.0}),
    ],
)
def test_largest_relative_position_and_the_setting_within_l(method, params):
    """Against every (i, j) pair through the formulas above; the setting offered is the smallest that keeps
    r' <= L - 1 (for a group size and a leak k; the one below it does not)."""
    spec = get_method(method)
    for length in (8, 33, 64, 97, 200):
        largest = spec.make_params(**params).largest_relative_position(length)
        assert largest == pytest.approx(largest_relative_brute_force(method, params, length))
    length = 200
    if largest_relative_brute_force(method, params, length) <= L - 1:
        return  # ReRoPE with w < L: nothing to change (a setting is asked for only past L)
    within = spec.make_params(**params).setting_within(length, L)
    key, _, bound = within.partition(" >= ")
    if key in ("group_size", "k"):
        fits = lambda value: largest_relative_brute_force(method, {**params, key: value}, length) <= L - 1
        assert fits(int(bound)) and not fits(int(bound) - 1)
    else:  # no group size or k does: the window itself is too wide, and one below the bound leaves a choice
        bound = L - (method == "leaky_rerope")
        assert within == f"a window below {bound}" and params["window"] >= bound
        narrower = spec.make_params(**{**params, "window": bound - 1})
        assert narrower.largest_relative_position(length) <= L - 1 or " >= " in narrower.setting_within(length, L)


def dpe_largest_brute_force(params, pairs, n_pairs, length):
    """The largest r' on `pairs` over every (i, j) and layer: SelfExtend's r' at each pair's own scale (which is
    r itself for G 1 and for a pair not selected)."""
    dpe = get_method("dpe").make_params(**params)
    layers = params.get("selected_pairs") or [None]
    layers = layers if isinstance(layers[0], list) else [layers]
    i, j = torch.tril_indices(length, length)
    return max(
        self_extend_relative(i, j, int(G), dpe.window).max().item()
        for layer in range(len(layers))
        for G in dpe.pair_scales(n_pairs, layer)[pairs]
    )


@pytest.mark.parametrize(
    "params",
    [
        {"window": 16, "group_scales": [2, 1, 4, 8]},
        {"window": 9, "group_scales": [1, 3, 2, 1]},
        {"window": 40, "group_scales": [1, 1, 1, 16]},
        {"window": 10, "group_scales": [3, 5, 1, 2], "selected_pairs": [[0, 5, 6, 7], [7, 2]]},
    ],
)
def test_dpe_reach_on_the_slow_pairs_and_the_scales_within_l(params):
    """DPE's largest r' on the slow pairs (those whose wavelength exceeds L, here 5-7 of 8) against every (i, j)
    through the per-pair formula; the scales offered keep them below L and are the smallest that do: one lower
    on any raised group and they do not. A slow pair left out of selected_pairs keeps r' = r: no scale helps."""
    n_pairs, slow, length = 8, [5, 6, 7], 200
    dpe = get_method("dpe").make_params(**params)
    for n in (8, 33, 97, length):
        assert dpe.largest_relative_position_on(n, slow, n_pairs) == dpe_largest_brute_force(params, slow, n_pairs, n)
    within = dpe.setting_within_on(length, slow, n_pairs, L)
    if params["window"] >= L:
        assert within == f"a window below {L}"
        return
    if "selected_pairs" in params:
        assert within == "" and dpe.largest_relative_position_on(length, slow, n_pairs) == length - 1
        return
    assert dpe_largest_brute_force(params, slow, n_pairs, length) > L - 1
    assert within.startswith("group_scales [")
    scales = json.loads(within.removeprefix("group_scales "))
    assert dpe_largest_brute_force({**params, "group_scales": scales}, slow, n_pairs, length) <= L - 1
    for group, (old, new) in enumerate(zip(params["group_scales"], scales)):
        assert new >= old and (new == old or group in (2, 3))  # only the groups that hold pairs 5-7 change
        if new > old:
            lower = [G - (g == group) for g, G in enumerate(scales)]
            assert dpe_largest_brute_force({**params, "group_scales": lower}, slow, n_pairs, length) > L - 1


def test_the_dpe_note_names_the_slow_pairs_from_the_models_own_frequencies():
    """The wavelengths come from transformers' own inv_freq (the unpatched model's); the note's numbers from the
    formula above."""
    from ctxext.config import MethodConfig
    from ctxext.eval.rows import EvalMethod, beyond_training_notes
    from ctxext.patching.families import rotary_wavelengths

    model = tiny_model("llama", rope_theta=50.0)  # 8 pairs; wavelengths 2*pi*50^(p/8), past L = 32 from pair 4
    inv_freq = model.model.rotary_emb.inv_freq
    wavelengths = rotary_wavelengths(model)
    assert wavelengths == pytest.approx((2 * math.pi / inv_freq.double()).tolist(), rel=1e-6)
    slow = [p for p, wavelength in enumerate(wavelengths) if wavelength > L]
    assert slow == [4, 5, 6, 7]
    params = {"window": 8, "group_scales": [1, 2, 2, 4]}
    row = EvalMethod("dpe", MethodConfig("dpe", params=params), {})
    reach = dpe_largest_brute_force(params, slow, 8, 200)
    notes = beyond_training_notes([row], [32, 100, 200], L, wavelengths)
    assert notes == [
        f"note: dpe uses relative positions up to {reach:g} at 200 tokens on rotary pairs 4-7, whose wavelengths "
        f"exceed the 32 the model was trained on (at {', '.join(str(n) for n in (100, 200) if dpe_largest_brute_force(params, slow, 8, n) > L - 1)}); "
        f"group_scales [1, 2, 8, 8] keeps them below 32"
    ]
    assert dpe_largest_brute_force({**params, "group_scales": [1, 2, 8, 8]}, slow, 8, 200) <= L - 1
    assert dpe_largest_brute_force({**params, "group_scales": [1, 2, 7, 8]}, slow, 8, 200) > L - 1
    assert beyond_training_notes([row], [32], L, wavelengths) == []  # within L: no note
    three_groups = EvalMethod("dpe", MethodConfig("dpe", params={"window": 8, "group_scales": [1, 2, 2]}), {})
    assert beyond_training_notes([three_groups], [200], L, wavelengths) == []  # left to the patch's own error


def test_methods_that_do_not_promise_to_stay_below_l_have_no_bound():
    for method in ("dual_chunk", "string", "dpe"):
        assert get_method(method).make_params().largest_relative_position(10_000) is None


# ------------------------------------------------------------------------------------ defaults, round trip
def test_defaults_follow_the_original_length():
    model = ctxext.patch(tiny_model("llama", max_position_embeddings=4096), "dual_chunk", factor=2)
    assert ctxext.applied_method(model)["attention"] == {
        "logn": False,
        "method": "dual_chunk",
        "chunk_size": 3 * 4096 // 4,
        "local_window": 4096 // 16,
    }
    model = ctxext.patch(model, "string", factor=2)
    attention = ctxext.applied_method(model)["attention"]
    assert attention["shifted_offset"] == int(0.33 * 4096) and attention["local_value"] == 128
    assert attention["attention_factor"] == pytest.approx(0.1 * math.log(2) + 1)


def test_saved_checkpoint_reloads_patched_after_import_ctxext(tmp_path):
    tokens = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(7))
    model = ctxext.patch(
        tiny_model("qwen2", max_position_embeddings=L), "self_extend", factor=2, group_size=2, window=8, logn=True
    )
    save_tiny_checkpoint(tmp_path / "ckpt", model)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    assert reloaded.config.ctxext_attention["method"] == "self_extend"
    with torch.no_grad():
        assert torch.allclose(reloaded(tokens).logits, model(tokens).logits, atol=1e-6)


@pytest.mark.parametrize(
    "method,params,message",
    [
        ("self_extend", {"group_size": 0}, "'group_size' must be >= 1"),
        ("self_extend", {"window": -8}, "'window' must be >= 1"),
        ("self_extend", {"group_size": 2.5}, "whole number"),
        ("dual_chunk", {"chunk_size": 8, "local_window": 8}, "must be larger than 'local_window'"),
        ("dual_chunk", {"local_window": -1}, "'local_window' must be >= 0"),
        ("string", {"shifted_offset": 8, "local_value": 8}, "must be larger than 'local_value'"),
        ("string", {"shifted_offset": 10, "local_value": 1.5}, "whole number"),
        ("string", {"local_value": 128}, "must be larger than 'local_value'"),  # default S = 0.33 * 32 = 10
    ],
)
def test_impossible_parameters_are_value_errors(method, params, message):
    with pytest.raises(CtxextError, match=message):
        ctxext.patch(tiny_model("llama", max_position_embeddings=L), method, **params)


@pytest.mark.parametrize(
    "method,params",
    [
        ("self_extend", {"group_size": 2, "window": 4}),
        ("dual_chunk", {"chunk_size": 9, "local_window": 2}),
        ("gali", {"local_window": 2, "position_range": 8}),
    ],
)
def test_left_padded_batch_decodes_like_each_row_alone(method, params):
    """Rules that are not shift-invariant see each row at its own positions (one region plan per row)."""
    model = ctxext.patch(tiny_model("llama", max_position_embeddings=L), method, **params)
    long_row, short_row = torch.randint(1, 256, (1, 14)), torch.randint(1, 256, (1, 9))
    batch = torch.cat([long_row, torch.cat([torch.zeros(1, 5, dtype=torch.long), short_row], dim=1)])
    mask = (torch.arange(14)[None] >= torch.tensor([[0], [5]])).long()
    settings = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        together = torch.stack(model.generate(batch, attention_mask=mask, **settings).logits, dim=1)
        alone = [torch.stack(model.generate(row, **settings).logits, dim=1) for row in (long_row, short_row)]
    assert torch.allclose(together[0], alone[0][0], atol=1e-5)
    assert torch.allclose(together[1], alone[1][0], atol=1e-5), (together[1] - alone[1][0]).abs().max()


def test_a_static_cache_is_refused_before_any_forward():
    model = ctxext.patch(tiny_model("llama", max_position_embeddings=L), "string", shifted_offset=6, local_value=2)
    embedded = []
    model.model.embed_tokens.register_forward_hook(lambda *_: embedded.append(1))
    with torch.no_grad(), pytest.raises(CtxextError, match="StaticCache"):
        model.generate(
            torch.randint(1, 256, (1, 10)),
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=0,
            cache_implementation="static",
        )
    assert embedded == []  # refused by the base model's pre-hook, before the first layer ran
    ctxext.unpatch(model)  # and the hook goes with the method
    with torch.no_grad():
        model.generate(
            torch.randint(1, 256, (1, 10)),
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=0,
            cache_implementation="static",
        )


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--method", "self_extend", "--group-size", "0"], "'group_size' must be >= 1"),
        (["--method", "self_extend", "--window", "1.5"], "whole number"),
        (["--method", "dual_chunk", "--chunk-size", "8", "--local-window", "8"], "larger than 'local_window'"),
        (["--method", "string", "--shifted-offset", "4", "--local-value", "8"], "larger than 'local_value'"),
        (["--method", "string", "--local-value", "-1"], "'local_value' must be >= 0"),
    ],
)
def test_cli_rejects_impossible_parameters_with_one_line_and_exit_2(tmp_path, capsys, flags, message):
    from ctxext.cli import main

    source = save_tiny_checkpoint(tmp_path / "model", tiny_model("llama", max_position_embeddings=L))
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["patch", str(source), "-o", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()
