"""Every RoPE causal-LM family of the installed transformers, patched by capability (ctxext.patching.families).

Oracles: transformers' own rotary module built from the config ctxext writes (linear, yarn, llama3); plain
transformers reloading a saved checkpoint; the unpatched model for unpatch; and, for a remapping method, a
per-cell reference attention function written here (undo the model's rotation, rotate each query by r'(i, j)
per cell, in float64). Each family's tiny model is built once (tests/family_models.py); a family that cannot
be built or is refused is listed in docs/guides/families.md with its reason, and the table is checked here.
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

import ctxext
from ctxext import compat
from ctxext.errors import CtxextError
from ctxext.patching import rope_layout
from ctxext.patching.families import attention_of, has_attention_sinks, rope_parameters_of, value_head_dim
from ctxext.patching.reference import per_cell_attention
from tests.family_models import SHIPPED, L, build, rebuilt_with, rope_families, shipped_model
from tests.helpers import requires_transformers, transformers_at_least

FAMILIES = rope_families()
# Defects found by this matrix and not fixed yet: each test below is expected to fail on them (strict, so a fix
# shows up as an unexpected pass), and docs/guides/families.md lists them.
KNOWN_DEFECTS = {}


def expect_known_defect(request, test: str, family: str) -> None:
    reason = KNOWN_DEFECTS.get((test, family))
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"known defect: {reason}"))


TABLE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "families.md"
SEQ = 3 * L


def status(model_type: str) -> tuple[str, str]:
    """('patched', layout) / ('refused', ctxext's one line) / ('not built', why) for one family."""
    model, why = build(model_type)
    if model is None:
        return "not built", why
    try:
        layout = rope_layout(model)
    except CtxextError as error:
        return "refused", str(error)
    try:
        with torch.no_grad():
            model(_tokens())
    except Exception as error:  # noqa: BLE001
        return "not built", f"its own forward fails on the tiny model ({type(error).__name__})"
    types = ", ".join(layout.types)
    record = ctxext.patching.record.model_rope_record(model)
    partial = any(rope.partial_rotary_factor not in (None, 1, 1.0) for rope in record.types.values())
    partial = partial or any(dim < 16 for dim in layout.rotary_dims.values())  # MLA's rope slice, odd sizes
    notes = [f"layer types: {types}", f"angles: {layout.angles}"]
    if layout.per_type_rotary:
        notes.append("frequencies per layer type")
    if not all(layout.uses_rope[i] for i in range(len(layout.uses_rope)) if layout.attention[i]):
        notes.append("NoPE layers")
    modules = [attention_of(layer) for layer in ctxext.patching.rotary_host(model).layers]
    if any(layout.interface_bypasses):
        notes.append("its attention never calls transformers' attention interface (no attention-level methods)")
    if any(has_attention_sinks(module) for module in modules):
        notes.append("attention sinks (no remapping)")
    if any(value_head_dim(module) for module in modules) and not layout.latent_attention:
        notes.append("values of another head size (no remapping)")
    if records_yarn_as_longrope(model):
        notes.append(
            "its config refuses scaled types as ctxext writes them: static methods recorded as longrope with equal "
            "factor sets, remapping methods with its 'default' type, dynamic methods refused"
        )
    p_rope = {key: rope for key, rope in record.types.items() if rope.rotated_pairs is not None}
    for key, rope in p_rope.items():
        notes.append(
            f"p-RoPE on {key or 'every layer'} ({rope.rotated_pairs} of {rope.rotary_dim // 2} pairs turn, kept so)"
        )
    if len(set(layout.rotary_dims.values())) > 1:
        notes.append("rotated channels per layer type: " + ", ".join(f"{k} {d}" for k, d in layout.rotary_dims.items()))
    if layout.angles == "complex":
        notes.append("complex freqs_cis, multiplied with interleaved pairs (no remapping)")
    if layout.sections is not None:
        notes.append("multimodal RoPE, each pair reading one of 3 position sections (no remapping)")
    if layout.latent_attention:
        notes.append("multi-head latent attention (RoPE on its qk_rope_head_dim slice; no remapping)")
    elif partial:
        notes.append("partial rotary")
    return "patched", "; ".join(notes)


def records_yarn_as_longrope(model) -> bool:
    """Whether `patch` would record yarn as longrope on `model` (asked of `plan_patch`, which changes nothing), in
    place of whatever the family ships: composed with a shipped scaling, every static method is longrope."""
    from ctxext.patching.patch import plan_patch

    written = plan_patch(model, "yarn", 4.0, layer_types="all", replace_shipped=True).written
    return all(values["rope_type"] == "longrope" for values in written.values())


def _tokens(n: int = SEQ) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(1))


def patched_families() -> list[str]:
    return [f for f in FAMILIES if status(f)[0] == "patched"]


def table_text() -> str:
    lines = [
        "# Families",
        "",
        "Every causal-LM model type of the installed transformers (5.24 when this was written) whose config has "
        "RoPE parameters, as `tests/test_families.py` finds it on a tiny random model of the family (2 layers, "
        "hidden 64, a sliding and a full layer where the family mixes them). **patched**: every test of that "
        "file runs on it (transformers' own linear/yarn/llama3 frequencies, a saved checkpoint reloaded by plain "
        "transformers with the same logits, unpatch bit for bit, and a remapping method against a per-cell "
        "reference where the family's attention allows one). **refused**: ctxext's own one-line reason. "
        "**not built**: the tiny model could not be made with small sizes; nothing about ctxext is known there.",
        "",
        "Regenerate: `CTXEXT_WRITE_FAMILIES=1 .venv/bin/pytest tests/test_families.py -k table`.",
        "",
        "| family | status | what the probe found |",
        "|---|---|---|",
    ]
    for family in FAMILIES:
        state, note = status(family)
        defects = [f"{test}: {why}" for (test, name), why in KNOWN_DEFECTS.items() if name == family]
        if defects:
            state, note = f"{state}, with known defects", f"{note}. Known defects: {'; '.join(defects)}"
        lines.append(f"| {family} | {state} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


@requires_transformers("5.24", "the table lists the families of the transformers it was written with")
def test_the_families_table_is_what_the_probe_finds():
    text = table_text()
    if os.environ.get("CTXEXT_WRITE_FAMILIES"):
        TABLE.write_text(text)
    assert TABLE.read_text() == text, "docs/guides/families.md is stale: regenerate it (see its header)"
    assert len(patched_families()) >= 60


# ------------------------------------------------------------------- frequencies against transformers
def _transformers_rotary(model, config):
    """transformers' own rotary module of this family, built from `config` (as ctxext wrote it), or from the text
    model's config where the rotary module reads that one (Fuyu's in transformers 5.16, which builds there)."""
    host = ctxext.patching.rotary_host(model)
    original = getattr(host.rotary_emb, "original", None) or host.rotary_emb
    return type(original)(getattr(host, "config", None) or config)


def _rotary_outputs(rotary, *args) -> tuple:
    """What a rotary module returns, as a tuple: (cos, sin), or (freqs_cis,) where it returns one complex tensor."""
    out = rotary(*args)
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_configs_rope_record_and_the_modules_layout_agree_per_layer_type(family):
    """The two routes to a model's rope agree: the record (patching/record.py, read from the config: the base with
    HunYuan's alpha applied, head_dim x the partial factor) and the layout (patching/families.py, probed from the
    modules: each rotary's inv_freq, 2 x its length), on the base and rotated width of every layer type."""
    if status(family)[0] != "patched":
        pytest.skip(f"{family}: {status(family)[0]} (listed in docs/guides/families.md)")
    model, _ = build(family)
    layout = rope_layout(model)
    record = ctxext.patching.record.model_rope_record(model)
    assert set(layout.bases) <= set(record.types), (layout.bases, list(record.types))
    for key, base in layout.bases.items():
        shipped = record.types[key]
        assert base == pytest.approx(shipped.base, rel=1e-6), key
        assert layout.rotary_dims[key] == shipped.rotary_dim, key


@pytest.mark.parametrize("family", FAMILIES)
def test_static_methods_equal_transformers_rope_types(family, request):
    expect_known_defect(request, "static", family)
    if status(family)[0] != "patched":
        pytest.skip(f"{family}: {status(family)[0]} (listed in docs/guides/families.md)")
    model, _ = build(family)
    layout = rope_layout(model)
    positions = torch.arange(SEQ)[None]
    x = torch.zeros(1, dtype=torch.float32)
    keys = layout.types if layout.per_type_rotary else [None]
    for method, params in (("linear", {}), ("yarn", {"beta_fast": 16.0}), ("llama3", {})):
        ctxext.patch(model, method, factor=4.0, layer_types="all", **params)
        try:
            ours = ctxext.patching.rotary_host(model).rotary_emb
            theirs = _transformers_rotary(model, model.config)
            for key in keys:
                args = (x, positions) if key is None else (x, positions, key)
                expected = _rotary_outputs(theirs, *args)
                assert len(_rotary_outputs(ours, *args)) == len(expected), f"{family}: another form than its own"
                for a, b in zip(_rotary_outputs(ours, *args), expected):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{family} {method} {key}")
        finally:
            ctxext.unpatch(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_reloads_in_plain_transformers_and_unpatch_is_exact(family, tmp_path, request):
    expect_known_defect(request, "reload", family)
    if status(family)[0] != "patched":
        pytest.skip(f"{family}: {status(family)[0]} (listed in docs/guides/families.md)")
    model, _ = build(family)
    tokens = _tokens()
    with torch.no_grad():
        before = model(tokens).logits
        ctxext.patch(model, "yarn", factor=4.0)
        patched = model(tokens).logits
        model.save_pretrained(tmp_path)
        ctxext.unpatch(model)
        after = model(tokens).logits
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()(tokens).logits
    assert torch.equal(before, after), f"{family}: unpatch is not bit for bit"
    assert not torch.allclose(before, patched), f"{family}: yarn x4 changed nothing past L"
    torch.testing.assert_close(reloaded, patched, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ a remapping method, per cell
G, W = 3, 8  # SelfExtend: group size and neighbour window


def self_extend_relative(i, j):
    r = i - j
    return torch.where(r < W, r, i // G - j // G + W - W // G)


def _reference_attention(inner, touched, own_rotary_at, method_frequencies_of):
    """An attention function: the family's own `inner` on untouched layers; on touched ones, every score from
    the unrotated query turned by r'(i, j) per cell, dotted with the unrotated key, in float64.

    The model's own rotation is undone with its own (cos, sin) (`own_rotary_at(layer, n)`, whatever its rope type
    and attention factor); the turn uses `method_frequencies_of(layer)`, the (inv_freq, attention factor) a
    remapping method rotates with: the model's own where it shipped a static scaling (Apertus' llama3 x8, Ministral
    3's yarn x16: remapping moves positions, not frequencies), else plain RoPE at the layer's base."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if module.layer_idx not in touched:
            function = ALL_ATTENTION_FUNCTIONS.get_interface(inner, compat.family_eager_attention(module))
            return function(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        inv_freq, factor = method_frequencies_of(module.layer_idx)
        rotary = 2 * inv_freq.shape[0]
        half = rotary // 2
        n = query.shape[2]
        cos, sin = own_rotary_at(module.layer_idx, n)  # (n, rotary): the model's own rotation at position i

        def undo(x):
            turned, kept = x[..., :rotary].double(), x[..., rotary:].double()
            rotated_half = torch.cat((-turned[..., half:], turned[..., :half]), -1)
            return (turned * cos - rotated_half * sin) / (cos * cos + sin * sin), kept

        (q, q_pass), (k, k_pass) = undo(query), undo(key)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None]
        out = per_cell_attention(
            torch.cat((q, q_pass), -1),
            torch.cat((k, k_pass), -1),
            value,
            self_extend_relative(i, j),
            inv_freq,
            module.scaling if scaling is None else scaling,
            factor,
            visible=j <= i,
        )
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    return attention


def _remappable(family) -> bool:
    if status(family)[0] != "patched":
        return False
    model, _ = build(family)
    try:
        ctxext.patch(model, "self_extend", group_size=G, window=W)
    except CtxextError:
        return False
    ctxext.unpatch(model)
    return True


@pytest.mark.parametrize("family", FAMILIES)
def test_a_remapping_method_equals_the_per_cell_reference_on_the_layers_it_touches(family, request):
    expect_known_defect(request, "remap", family)
    if family == "doge" and not transformers_at_least("5.18"):
        pytest.skip("Doge before transformers 5.18 adds its dynamic mask to no causal mask (sdpa): not causal")
    if not _remappable(family):
        pytest.skip(f"{family}: no remapping here (see docs/guides/families.md and the refusal tests)")
    assert_self_extend_matches_the_per_cell_reference(build(family)[0], family)


def assert_self_extend_matches_the_per_cell_reference(model, name: str) -> None:
    """SelfExtend (G, W) patched on `model` gives the per-cell reference's logits on `_tokens()` (1e-4); the model
    is unpatched again."""
    layout = rope_layout(model)
    host = ctxext.patching.rotary_host(model)
    tokens = _tokens()
    inner = model.config._attn_implementation
    # The layers SelfExtend must touch, from the config alone: RoPE layers that see past L.
    config = model.config
    touched = {
        i
        for i, layer_type in enumerate(layout.layer_types)
        if layout.attention[i]
        and (getattr(config, "no_rope_layers", None) or [1] * 99)[i]
        and not ("sliding" in layer_type and (config.sliding_window or math.inf) <= L)  # Zaya's hybrid_sliding too
    }
    with torch.no_grad():
        ctxext.patch(model, "self_extend", group_size=G, window=W)
        assert set(ctxext.patching.attention.installed_layers(host)) == touched
        patched = model(tokens).logits
        ctxext.unpatch(model)

        rotary = host.rotary_emb

        def key_of(layer):
            return layout.layer_types[layer] if layout.per_type_rotary else None

        def own_rotary_at(layer, n):
            x, positions = torch.zeros(1, dtype=torch.float32), torch.arange(n)[None]
            args = (x, positions) if key_of(layer) is None else (x, positions, key_of(layer))
            return tuple(t[0].double() for t in rotary(*args))

        def method_frequencies_of(layer):
            rope_type = rope_parameters_of(config, key_of(layer)).get("rope_type", "default")
            if rope_type not in ("default", "longrope") and "dynamic" not in rope_type:  # a static scaling, kept
                prefix = "" if key_of(layer) is None else f"{key_of(layer)}_"
                own = getattr(rotary, f"{prefix}inv_freq").double()
                return own, float(getattr(rotary, f"{prefix}attention_scaling", 1.0))
            dim, base = layout.rotary_dims[key_of(layer)], layout.bases[key_of(layer)]
            return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim), 1.0

        name = f"ctxext_test_reference_{name}"
        AttentionInterface.register(name, _reference_attention(inner, touched, own_rotary_at, method_frequencies_of))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
        model.set_attn_implementation(name)
        try:
            reference = model(tokens).logits
        finally:
            model.set_attn_implementation(inner)
    torch.testing.assert_close(patched, reference, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ one rotary module per base (Granite SWA)
def granite_swa_with(layer_rope_theta):
    """The tiny granite_swa model rebuilt with a base per layer (0: NoPE), its weights kept."""
    return rebuilt_with(
        "granite_swa", lambda values: values.update(layer_rope_theta=layer_rope_theta), attn_implementation="eager"
    )


def test_granite_swa_nope_layer_stays_untouched_and_its_checkpoint_reloads(tmp_path):
    """Granite SWA's layers read `rotary_embs` (one module per layer_rope_theta), never `rotary_emb`: yarn must
    reach them (a reload by plain transformers is the oracle), and a layer of base 0 is NoPE."""
    base = build("granite_swa")[0].config.rope_parameters["rope_theta"]
    model = granite_swa_with([0, base])
    assert rope_layout(model).uses_rope == (False, True)
    tokens = _tokens()
    with torch.no_grad():
        before = model(tokens).logits
        ctxext.patch(model, "yarn", factor=4.0)
        patched = model(tokens).logits
        model.save_pretrained(tmp_path)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()(tokens).logits
        ctxext.unpatch(model)
        assert torch.equal(model(tokens).logits, before)
    assert not torch.allclose(before, patched)
    torch.testing.assert_close(reloaded, patched, atol=1e-5, rtol=1e-5)
    with pytest.raises(CtxextError, match="attention sinks") as error:  # a remapping method would drop them
        ctxext.patch(model, "self_extend", group_size=G, window=W)
    assert "\n" not in str(error.value)


def test_granite_swa_with_several_bases_is_one_line():
    base = build("granite_swa")[0].config.rope_parameters["rope_theta"]
    model = granite_swa_with([base, 10 * base])
    with pytest.raises(CtxextError, match="several bases") as error:
        ctxext.patch(model, "yarn", factor=4.0)
    assert "\n" not in str(error.value)


# ---------------------------------------------------- configs that take no scaled type but longrope (Phi-3, PhiMoE)
LONGROPE_ONLY = ("phi3", "phimoe")


@pytest.mark.parametrize("family", LONGROPE_ONLY)
@pytest.mark.parametrize(
    ("method", "params"),
    [("linear", {}), ("ntk", {}), ("ntk_by_parts", {}), ("yarn", {}), ("llama3", {}), ("longrope", {})],
)
def test_a_static_method_is_written_as_longrope_that_plain_transformers_reloads(family, method, params, tmp_path):
    """Phi-3's config takes only 'default' and 'longrope'; PhiMoE's rotary multiplies cos/sin by short_mscale or
    long_mscale, which its config requires, whatever the type. A static method is written as longrope with
    short_factor = long_factor; the oracle is plain transformers' reload of the saved checkpoint, at a length below
    L (short factors, short_mscale) and past it (long ones), and, for linear and yarn, their published numbers."""
    model, _ = build(family)
    if method == "longrope" and family == "phimoe":
        pytest.skip("PhiMoE's rotary reads the short factors at every length: refused (the refusal test)")
    short, long = _tokens(L // 2), _tokens()
    with torch.no_grad():
        before = model(long).logits
        ctxext.patch(model, method, factor=4.0, **params)
        written = dict(model.config.rope_parameters)
        patched = [model(tokens).logits for tokens in (short, long)]
        model.save_pretrained(tmp_path)
        ctxext.unpatch(model)
        assert torch.equal(model(long).logits, before)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        for tokens, expected in zip((short, long), patched):
            torch.testing.assert_close(reloaded(tokens).logits, expected, atol=1e-5, rtol=1e-5)
    assert written["rope_type"] == "longrope"
    if method != "longrope":
        assert written["short_factor"] == written["long_factor"]
    pairs = rope_layout(model).rotary_dims[None] // 2
    if method == "linear":  # every pair's frequency divided by s
        assert written["short_factor"] == pytest.approx([4.0] * pairs, rel=1e-12)
    if method == "yarn":  # YaRN's temperature, 0.1 ln s + 1
        assert written["attention_factor"] == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-12)
    if family == "phimoe":
        assert written["short_mscale"] == written["long_mscale"] == written["attention_factor"]


@pytest.mark.parametrize("family", LONGROPE_ONLY)
@pytest.mark.parametrize(
    ("method", "params", "why"),
    [
        ("dynamic_ntk", {}, "its frequencies change with the length"),
        ("dynamic_yarn", {}, "its frequencies change with the length"),
        ("longrope", {}, "its frequencies change with the length"),  # short != long factors
    ],
)
def test_what_a_longrope_only_config_cannot_record_is_refused_in_one_line_before_any_change(
    family, method, params, why
):
    model, _ = build(family)
    if method == "longrope" and family == "phi3":
        pytest.skip("Phi-3 reads longrope as it is (the reload test)")
    host = ctxext.patching.rotary_host(model)
    rotary, rope_parameters = host.rotary_emb, json.dumps(model.config.rope_parameters, sort_keys=True)
    with pytest.raises(CtxextError, match="cannot be recorded in this model's config") as error:
        ctxext.patch(model, method, factor=4.0, **params)
    assert why in str(error.value) and "\n" not in str(error.value)
    assert host.rotary_emb is rotary and json.dumps(model.config.rope_parameters, sort_keys=True) == rope_parameters
    assert ctxext.patching.attention.installed_layers(host) == ()


@pytest.mark.parametrize("family", LONGROPE_ONLY)
def test_a_remapping_method_is_recorded_with_the_familys_default_type_and_reloads_patched(family, tmp_path):
    """A remapping method keeps plain frequencies, which the config's own 'default' type records; the attention
    setting goes beside it, and the checkpoint reloads (after `import ctxext`) with the patched logits."""
    model, _ = build(family)  # shared with other tests: unpatched again at the end
    tokens = _tokens()
    try:
        with torch.no_grad():
            ctxext.patch(model, "self_extend", factor=4.0, group_size=G, window=W)
            patched = model(tokens).logits
            model.save_pretrained(tmp_path)
            reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
            torch.testing.assert_close(reloaded(tokens).logits, patched, atol=1e-5, rtol=1e-5)
        assert model.config.rope_parameters["rope_type"] == "default"
    finally:
        ctxext.unpatch(model)


@pytest.mark.parametrize("family", LONGROPE_ONLY)
def test_ctxext_patch_writes_the_form_the_family_reloads(family, tmp_path, capsys):
    """The command line rewrites config.json for serving; for these families it keeps what `patch` recorded."""
    from ctxext.cli import main
    from tests.helpers import save_tiny_checkpoint

    model, _ = build(family)  # shared with other tests: unpatched again at the end
    save_tiny_checkpoint(tmp_path / "in", model)
    tokens = _tokens()
    assert main(["patch", str(tmp_path / "in"), "--method", "yarn", "--factor", "4", "-o", str(tmp_path / "out")]) == 0
    assert "loads in plain transformers: yes" in capsys.readouterr().out
    try:
        with torch.no_grad():
            ctxext.patch(model, "yarn", factor=4.0)
            expected = model(tokens).logits
            reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
            torch.testing.assert_close(reloaded(tokens).logits, expected, atol=1e-5, rtol=1e-5)
    finally:
        ctxext.unpatch(model)


def test_an_odd_number_of_rotated_channels_is_refused_in_one_line():
    """head_dim 16 x MiMo V2 Flash's 0.334 rotates 5 channels: transformers takes exponents 2i/5 for its 3
    frequencies, which no whole-pair method reproduces; refused rather than patched with other frequencies."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from tests.family_models import _values

    default = CONFIG_MAPPING["mimo_v2_flash"]()
    config = CONFIG_MAPPING["mimo_v2_flash"](**{**_values("mimo_v2_flash", default), "head_dim": 16})
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(CtxextError, match="odd number of channels per head \\(5") as error:
        ctxext.patch(model, "linear", factor=2.0)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------- complex freqs_cis (Llama 4, DeepSeek V2)
COMPLEX = ("llama4_text", "deepseek_v2")


@pytest.mark.parametrize("family", COMPLEX)
def test_complex_freqs_cis_keep_their_form_and_carry_the_attention_factor_as_magnitude(family):
    """Their rotary modules return freqs_cis = polar(attention factor, p * inv_freq), complex64 whatever the dtype
    of x, which their attention multiplies with interleaved channel pairs. Patched, the module returns that form
    (transformers' own yarn module of the family, built from the written config, is the oracle, at bf16 x too),
    with YaRN's 0.1 ln s + 1 as its magnitude."""
    model, _ = build(family)
    assert rope_layout(model).angles == "complex"
    positions = torch.arange(SEQ)[None]
    ctxext.patch(model, "yarn", factor=4.0)
    try:
        ours = ctxext.patching.rotary_host(model).rotary_emb
        theirs = _transformers_rotary(model, model.config)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.zeros(1, dtype=dtype)
            expected = theirs(x, positions)
            assert expected.dtype == torch.complex64
            torch.testing.assert_close(ours(x, positions), expected, atol=1e-5, rtol=1e-5)
        magnitude = ours(torch.zeros(1), positions).abs()
    finally:
        ctxext.unpatch(model)
    torch.testing.assert_close(magnitude, torch.full_like(magnitude, 0.1 * math.log(4.0) + 1.0))


class _RotaryOfItsOwnKind(torch.nn.Module):
    """A rotary module with an inv_freq that returns complex angles at twice those frequencies, or (`real`) the
    angles alone: neither is what ctxext would put in its place."""

    def __init__(self, inv_freq, real: bool):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.clone(), persistent=False)
        self.real = real

    def forward(self, x, position_ids):
        angles = position_ids[..., None].float() * self.inv_freq
        return angles if self.real else torch.polar(torch.ones_like(angles), 2 * angles)


@pytest.mark.parametrize(
    ("real", "why"),
    [(False, "its complex output is not polar"), (True, "it returns neither \\(cos, sin\\) nor one complex tensor")],
)
def test_a_rotary_module_of_its_own_kind_is_refused_in_one_line_before_any_change(real, why):
    model, _ = build("llama4_text")
    host = ctxext.patching.rotary_host(model)
    rotary = host.rotary_emb
    own_kind = host.rotary_emb = _RotaryOfItsOwnKind(rotary.inv_freq, real)
    try:
        with pytest.raises(
            CtxextError, match=f"computes positions in its own way: _RotaryOfItsOwnKind \\({why}"
        ) as error:
            ctxext.patch(model, "yarn", factor=4.0)
        assert host.rotary_emb is own_kind
    finally:
        host.rotary_emb = rotary
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("family", "angles"),
    [("llama4_text", "complex"), ("deepseek_v2", "complex"), ("llama", "halves"), ("qwen3_5_text", "halves")],
)
def test_a_model_on_the_meta_device_is_probed_by_the_form_of_its_rotary_output(family, angles):
    """A model being loaded has no frequencies yet: its layout is read from what its rotary module returns there
    (and, for multimodal RoPE, which section each pair reads, from a CPU copy with made-up frequencies)."""
    model, _ = build(family)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model.config)
    assert ctxext.patching.rotary_host(skeleton).rotary_emb.inv_freq.is_meta
    layout, loaded = rope_layout(skeleton), rope_layout(model)
    assert (layout.angles, layout.rotary_dims, layout.sections) == (angles, loaded.rotary_dims, loaded.sections)


# ------------------------------------------------------------------- multimodal RoPE (Qwen3.5's mrope_section)
MROPE = ("qwen3_5_text", "qwen3_5_moe_text")


def interleaved_sections(mrope_section, pairs: int) -> tuple:
    """The section each pair reads under Qwen3.5's interleaving, from its published description: pair 3j + 1 reads
    height and 3j + 2 width while j < that section's size, every other pair temporal."""
    return tuple(index % 3 if index % 3 and index // 3 < mrope_section[index % 3] else 0 for index in range(pairs))


def multimodal_positions(n: int = SEQ, batch: int = 2) -> torch.Tensor:
    """(3, batch, n) position ids whose temporal, height and width rows all differ, some past L (as an image's
    grid and the text after it give them): what the family's rotary module takes."""
    steps = torch.arange(n)
    rows = torch.stack((steps, steps // 4 + 3 * (steps % 4), 2 * steps + 1))
    return torch.stack([rows + b for b in range(batch)], dim=1)


@pytest.mark.parametrize("family", MROPE)
def test_multimodal_rope_pairs_read_the_sections_the_family_interleaves(family):
    model, _ = build(family)
    layout = rope_layout(model)
    rope_parameters = model.config.rope_parameters
    assert layout.sections == interleaved_sections(rope_parameters["mrope_section"], layout.rotary_dims[None] // 2)
    assert set(layout.sections) == {0, 1, 2}


@pytest.mark.parametrize("family", MROPE)
@pytest.mark.parametrize(
    ("method", "params"),
    [("linear", {}), ("yarn", {"beta_fast": 16.0}), ("llama3", {}), ("ntk", {}), ("dynamic_ntk", {})],
)
def test_multimodal_rope_with_sections_that_differ_equals_the_familys_own_rotary(family, method, params):
    """Oracle: the family's own rotary module built from the config ctxext writes (transformers' yarn, linear,
    llama3, dynamic; ctxext_ntk through transformers' rope registry), at 3-section position ids that differ, and
    at 2-D ones, which it broadcasts to every section; the config keeps mrope_section and mrope_interleaved."""
    model, _ = build(family)
    shipped = dict(model.config.rope_parameters)
    ctxext.patch(model, method, factor=4.0, **params)
    try:
        written = dict(model.config.rope_parameters)
        ours = ctxext.patching.rotary_host(model).rotary_emb
        for positions in (multimodal_positions(), torch.arange(SEQ)[None]):
            theirs = _transformers_rotary(model, model.config)  # fresh: transformers' dynamic type keeps a state
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.zeros(1, dtype=dtype)
                for a, b in zip(ours(x, positions), theirs(x, positions)):
                    assert a.dtype == dtype
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{family} {method}")
    finally:
        ctxext.unpatch(model)
    assert {k: written[k] for k in ("mrope_section", "mrope_interleaved")} == {
        k: shipped[k] for k in ("mrope_section", "mrope_interleaved")
    }
    assert written["rope_type"] != "default"


@pytest.mark.parametrize("family", MROPE)
@pytest.mark.parametrize("method", ["yarn", "ntk"])
def test_multimodal_positions_reload_in_plain_transformers_and_unpatch_is_exact(family, method, tmp_path):
    """The whole model, fed (4, batch, n) position ids (text row, then temporal/height/width rows that differ):
    a saved checkpoint reloaded by plain transformers gives the patched logits (yarn, transformers' own type;
    ntk, ctxext's, read back with the family's mrope keys beside it), and unpatch gives the first ones bit for bit."""
    model, _ = build(family)
    sections = multimodal_positions()
    positions = torch.cat((torch.arange(SEQ).expand(1, 2, SEQ), sections))
    tokens = torch.cat((_tokens(), _tokens().flip(-1)))
    with torch.no_grad():
        before = model(tokens, position_ids=positions).logits
        ctxext.patch(model, method, factor=4.0)
        patched = model(tokens, position_ids=positions).logits
        text_only = model(tokens).logits
        model.save_pretrained(tmp_path)
        ctxext.unpatch(model)
        after = model(tokens, position_ids=positions).logits
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        assert torch.equal(before, after), f"{family}: unpatch is not bit for bit"
        torch.testing.assert_close(reloaded(tokens, position_ids=positions).logits, patched, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(reloaded(tokens).logits, text_only, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(before, patched), f"{family}: {method} x4 changed nothing"


class _SectionedRotaryOfItsOwnKind(torch.nn.Module):
    """A multimodal rotary module (it has `mrope_section`), plain RoPE where the sections are equal, that is not
    ctxext's kind: every pair turns by the largest of the three positions (`largest`), or by its section's position
    plus a term that is 0 unless all three positions differ."""

    mrope_section = [1, 1, 1]

    def __init__(self, inv_freq, largest: bool):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.clone(), persistent=False)
        self.largest = largest

    def forward(self, x, position_ids):
        rows = position_ids.expand(3, *position_ids.shape[-2:]).float()
        pairs = self.inv_freq.shape[0]
        if self.largest:
            positions = rows.max(0).values[..., None].expand(*rows.shape[1:], pairs)
        else:
            all_differ = (rows[1] - rows[0]) * (rows[2] - rows[0]) * (rows[2] - rows[1])
            positions = rows[torch.arange(pairs) % 3].movedim(0, -1) + all_differ[..., None]
        angles = torch.cat((positions * self.inv_freq,) * 2, -1)
        return angles.cos(), angles.sin()


@pytest.mark.parametrize(
    ("largest", "why"),
    [(True, "do not each read one section"), (False, "not cos/sin of each pair's section position")],
)
def test_a_multimodal_rotary_of_its_own_kind_is_refused_in_one_line(largest, why):
    model, _ = build("llama")
    host = ctxext.patching.rotary_host(model)
    rotary = host.rotary_emb
    host.rotary_emb = _SectionedRotaryOfItsOwnKind(rotary.inv_freq, largest)
    try:
        with pytest.raises(CtxextError, match=why) as error:
            ctxext.patch(model, "yarn", factor=4.0)
    finally:
        host.rotary_emb = rotary
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "family,reason",
    [
        ("llama4_text", "complex multiplication of interleaved channel pairs"),
        *((family, "multimodal RoPE, whose rotary pairs read 3 position sections") for family in MROPE),
    ],
)
def test_a_remapping_method_on_complex_or_multimodal_rope_is_one_line_before_any_change(family, reason):
    from ctxext.patching.applicable import why_not

    model, _ = build(family)
    host = ctxext.patching.rotary_host(model)
    rotary, rope_parameters = host.rotary_emb, json.dumps(model.config.rope_parameters, sort_keys=True)
    for method, params in (("self_extend", {"group_size": G, "window": W}), ("rerope", {"window": W})):
        with pytest.raises(CtxextError, match=reason) as error:
            ctxext.patch(model, method, factor=4.0, **params)
        assert "\n" not in str(error.value)
        assert why_not(model, method, 4.0, **params) == str(error.value)
    assert host.rotary_emb is rotary and json.dumps(model.config.rope_parameters, sort_keys=True) == rope_parameters
    assert ctxext.patching.attention.installed_layers(host) == ()


# ------------------------------------------------------------------------- layer types, recipes
def test_gemma3_recipe_linear_x8_on_the_full_layers_only(tmp_path):
    """Gemma 3's published rope: linear x8 (base 1e6) on full_attention, default base 1e4 on sliding."""
    from transformers import Gemma3TextConfig

    model, _ = build("gemma3_text")
    published = Gemma3TextConfig(
        **{**model.config.to_dict(), "max_position_embeddings": 8 * L},
    )
    published.rope_parameters = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
    }
    reference = AutoModelForCausalLM.from_config(published).eval()
    reference.load_state_dict(model.state_dict())
    tokens = _tokens(4 * L)
    with torch.no_grad():
        ctxext.patch(model, "linear", factor=8.0, layer_types="full")
        try:
            ours = model(tokens).logits
            written = model.config.rope_parameters
        finally:
            ctxext.unpatch(model)
        theirs = reference(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert written["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert written["full_attention"]["rope_type"] == "linear"


def test_layer_types_bad_input_is_one_line():
    gemma, _ = build("gemma3_text")
    with pytest.raises(CtxextError, match="unknown layer type 'global'"):
        ctxext.patch(gemma, "yarn", factor=2.0, layer_types="global")
    llama, _ = build("llama")
    with pytest.raises(CtxextError, match="one set of frequencies"):
        ctxext.patch(llama, "yarn", factor=2.0, layer_types="sliding_attention")
    ctxext.patch(llama, "yarn", factor=2.0, layer_types="all")  # accepted on a one-type model
    ctxext.unpatch(llama)
    cohere, _ = build("cohere")
    with pytest.raises(CtxextError, match="interleaved"):
        ctxext.patch(cohere, "rerope", factor=2.0, window=8)


def test_a_model_without_rope_is_one_line():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    with pytest.raises(CtxextError, match="no rotary position embedding") as error:
        ctxext.patch(gpt2, "yarn", factor=2.0)
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------------ what models ship
@pytest.mark.parametrize("family", sorted(SHIPPED))
def test_a_shipped_scaling_is_read_and_replaced_when_asked_counting_from_its_L_and_base(family, request):
    """The old behaviour, asked for with replace_shipped: the method replaces the shipped scaling, from L0."""
    expect_known_defect(request, "shipped", family)
    from transformers import AutoConfig

    shipped, original = SHIPPED[family]
    model, _ = build(family)
    values = model.config.to_dict()
    base = float(values["rope_parameters"]["rope_theta"])
    values["rope_parameters"] = {**shipped, "rope_theta": base}
    values["max_position_embeddings"] = 4 * L
    if "original_max_position_embeddings" in values:  # Phi-3 ships L at the top level too, and transformers reads it
        values["original_max_position_embeddings"] = original
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    scaled = AutoModelForCausalLM.from_config(config).eval()
    scaled.load_state_dict(model.state_dict())
    tokens = _tokens()
    with torch.no_grad():
        before = scaled(tokens).logits
        layout = rope_layout(scaled)  # reading it changes nothing
        assert torch.equal(before, scaled(tokens).logits)
        assert ctxext.patching.record.model_rope_record(scaled).pretraining_length == original
        assert layout.bases[None] == base
        ctxext.patch(scaled, "yarn", factor=8.0, replace_shipped=True)
        inv_freq = ctxext.patching.rotary_host(scaled).rotary_emb.inv_freq
    # yarn x8 from L and the base (docs/METHODS.md): NTK-by-parts ramp between beta_fast 32 and beta_slow 1
    dim = layout.rotary_dims[None]
    plain = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    low = max(math.floor(dim * math.log(original / (32 * 2 * math.pi)) / (2 * math.log(base))), 0)
    high = min(math.ceil(dim * math.log(original / (1 * 2 * math.pi)) / (2 * math.log(base))), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    expected = plain / 8 * ramp + plain * (1 - ramp)
    torch.testing.assert_close(inv_freq.double(), expected, atol=1e-6, rtol=1e-5)


def gemma3_with_linear_global_layers():
    """The tiny gemma3_text model with Gemma 3's shipped form: linear x8 on the full-attention layers only."""

    def change(values):
        linear = {"rope_type": "linear", "factor": 8.0, "original_max_position_embeddings": L}  # L as ctxext records it
        values["rope_parameters"]["full_attention"] = {**values["rope_parameters"]["full_attention"], **linear}
        values["max_position_embeddings"] = 4 * L

    return rebuilt_with("gemma3_text", change)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_a_remapping_method_keeps_the_static_scaling_the_model_shipped(family, tmp_path, capsys):
    """Llama 3.1's llama3 x8, a yarn x4 and Gemma 3's linear x8 on its global layers stay the frequencies a remapping
    method rotates with, and it remaps past the trained context C: within C, GALI leaves
    the model's logits as they were; SelfExtend equals the per-cell reference turned by the model's own frequencies
    and attention factor; the config keeps the shipped rope parameters (ctxext_attention beside them), the checkpoint
    saved from Python and the one `ctxext patch` writes reload with the patched logits, and unpatch restores the
    model."""
    from ctxext.cli import main
    from tests.helpers import save_tiny_checkpoint

    model = gemma3_with_linear_global_layers() if family == "gemma3_text" else shipped_model(family)
    shipped = json.dumps(model.config.rope_parameters, sort_keys=True)
    C = ctxext.patching.record.model_rope_record(model).trained_context  # 4L, or 8L where the linear x8 reaches it
    assert (8 * L if family == "gemma3_text" else 4 * L) == C
    assert_self_extend_matches_the_per_cell_reference(model, f"shipped_{family}")
    within, past = _tokens(C), _tokens(2 * C)
    with torch.no_grad():
        before, before_past = model(within).logits, model(past).logits
        ctxext.patch(model, "gali", factor=2.0)
        torch.testing.assert_close(model(within).logits, before, atol=1e-6, rtol=1e-6)  # GALI remaps past C only
        assert json.dumps(model.config.rope_parameters, sort_keys=True) == shipped
        assert model.config.ctxext_attention["method"] == "gali"
        assert model.config.max_position_embeddings == 2 * C  # twice what the model serves, not L x 2
        patched = model(past).logits
        assert not torch.allclose(patched, before_past, atol=1e-3)
        model.save_pretrained(tmp_path / "saved")
        ctxext.unpatch(model)
        save_tiny_checkpoint(tmp_path / "in", model)
        assert (
            main(["patch", str(tmp_path / "in"), "--method", "gali", "--factor", "2", "-o", str(tmp_path / "cli")]) == 0
        )
        told = capsys.readouterr().out  # what the patch keeps, and from where it remaps
        assert "gali x2 keeps the shipped" in told and f"remaps past C = {C}: {C} -> {2 * C}" in told, told
        for folder in ("saved", "cli"):  # the API's save_pretrained, and ctxext patch's rewrite for serving
            reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / folder, dtype=torch.float32).eval()
            assert json.dumps(reloaded.config.rope_parameters, sort_keys=True) == shipped, folder
            torch.testing.assert_close(reloaded(past).logits, patched, atol=1e-5, rtol=1e-5)
        assert torch.equal(model(past).logits, before_past)
        assert json.dumps(model.config.rope_parameters, sort_keys=True) == shipped


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize(
    ("method", "params", "m_all"),
    [("linear", {}, None), ("yarn", {"mscale": 1.0, "mscale_all_dim": 1.0}, 1.0), ("yarn", {}, None)],
)
def test_mla_softmax_scale_follows_the_written_rope_parameters(tmp_path, family, method, params, m_all):
    """DeepSeek V3 shipped with yarn x40 (mscale = mscale_all_dim = 1; V2's: 0.707) builds its attention's softmax
    scale from them; patched again, the model in memory has the scale a reload of the saved checkpoint builds (the
    oracle: plain transformers), qk_head_dim^-1/2 (0.1 m_all ln s + 1)^2, and unpatch restores it."""
    model = shipped_model(family)
    attention = ctxext.patching.rotary_host(model).layers[0].self_attn
    shipped_scale = attention.scaling
    shipped_m_all = SHIPPED[family][0]["mscale_all_dim"]
    assert shipped_scale == pytest.approx(attention.qk_head_dim**-0.5 * (0.1 * shipped_m_all * math.log(40) + 1) ** 2)
    tokens = _tokens()
    with torch.no_grad():
        before = model(tokens).logits
        ctxext.patch(model, method, factor=8.0, replace_shipped=True, **params)
        expected = attention.qk_head_dim**-0.5 * ((0.1 * m_all * math.log(8) + 1) ** 2 if m_all else 1.0)
        assert attention.scaling == pytest.approx(expected, rel=1e-12)
        patched = model(tokens).logits
        model.save_pretrained(tmp_path / "again")
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32).eval()
        torch.testing.assert_close(reloaded(tokens).logits, patched, atol=1e-5, rtol=1e-5)
        ctxext.unpatch(model)
        assert attention.scaling == shipped_scale
        assert torch.equal(model(tokens).logits, before)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_a_remapping_method_on_mla_is_one_line(family):
    model = shipped_model(family)
    with pytest.raises(CtxextError, match="multi-head latent attention") as error:
        ctxext.patch(model, "self_extend", factor=4.0)
    assert "\n" not in str(error.value)


def test_cli_layer_types_writes_nested_rope_parameters_and_refuses_unknown_types(tmp_path, capsys):
    from ctxext.cli import main

    model, _ = build("gemma3_text")
    source = tmp_path / "gemma3"
    model.save_pretrained(source)  # weights and config only: patch needs no tokenizer
    code = main(
        [
            "patch",
            str(source),
            "--method",
            "linear",
            "--factor",
            "8",
            "--layer-types",
            "full",
            "-o",
            str(tmp_path / "out"),
        ]
    )
    assert code in (0, None)
    written = json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]
    assert written["full_attention"]["rope_type"] == "linear" and written["full_attention"]["factor"] == 8.0
    assert written["sliding_attention"]["rope_type"] == "default"
    capsys.readouterr()
    code = main(
        [
            "patch",
            str(source),
            "--method",
            "yarn",
            "--factor",
            "2",
            "--layer-types",
            "global",
            "-o",
            str(tmp_path / "bad"),
        ]
    )
    err = capsys.readouterr().err
    # one line (after the weights' progress bar: the layer types are known once the model is built), no traceback
    assert code == 2 and "unknown layer type 'global'" in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not (tmp_path / "bad").exists()
