"""One rope record per model, read once: what it reads from a config (hand-built configs, against the published
values and transformers' own rotary modules), that nothing else reads the config's rope, that compare, search
and the serving forms use the full-attention base of a per-layer-type model (Gemma 3: 1e6, not its sliding 1e4),
that planning a patch probes the model once, and that the refusals are one ordered table of rules."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import ctxext
from ctxext.patching import attention, families
from ctxext.patching.attention import install as attention_install
from ctxext.patching.families import RopeLayout
from ctxext.patching.record import model_rope_record, rope_record
from ctxext.patching.refusals import RULES, AttentionRequest, first_refusal
from tests.family_models import build
from tests.helpers import save_tiny_checkpoint, tiny_model

ROOT = Path(__file__).resolve().parent.parent
patch = importlib.import_module("ctxext.patching.patch")  # the module (the package exports a function of its name)

# Modules that may read a config's rope parameters, and why: the record itself and the probe it builds on; the patch,
# which writes the config and puts it back; transformers' init hook for ctxext's rope types (it is the rope
# type); and the serving translators, which turn a written checkpoint's rope form into each engine's.
MAY_READ = {
    "ctxext/patching/record.py": "the rope record",
    "ctxext/patching/families.py": "the layout probe and the per-layer-type lookups the record builds on",
    "ctxext/patching/patch.py": "writes the patched config and restores it",
    "ctxext/patching/rope_types.py": "transformers' init hook for ctxext's rope types reads its own parameters",
    "ctxext/patching/forms.py": "decides the rope form: in memory from the unpatched config, written from the patched one",
    "ctxext/serving/engines.py": "translates a written checkpoint's rope form per engine",
    "ctxext/verification/engine_rope.py": "builds the engines' rotary modules from a written checkpoint",
    "ctxext/serving/lengths.py": "derives each engine's length from a written config.json, as the engine reads it",
    "ctxext/integrations/adapters.py": "compares a base's written rope parameters with an adapter's record, verbatim",
    "ctxext/compare/serving.py": "records a planned row's source rope as written, as ctxext.yaml's source_rope does",
    "ctxext/patching/rotary.py": "is_dynamic reads an unpatched model's own rope type (the record imports rotary)",
    "ctxext/methods/native.py": "builds transformers' own rope function from the parameters it is given",
    "ctxext/serving/forms.py": "writes config.json from the rope form it is given, in both spellings",
}


def config_rope_reads(tree: ast.AST) -> list[int]:
    """Lines that read `<...config>.rope_parameters`, getattr(x, 'rope_parameters' | 'rope_theta') or
    x.get('rope_theta')."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "rope_parameters" and isinstance(node.ctx, ast.Load):
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name.endswith("config"):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call):
            func, args = node.func, node.args
            named = [a.value for a in args[1:2] if isinstance(a, ast.Constant)]
            if getattr(func, "id", None) == "getattr" and named and named[0] in ("rope_parameters", "rope_theta"):
                lines.append(node.lineno)
            first = [a.value for a in args[:1] if isinstance(a, ast.Constant)]
            is_get = isinstance(func, ast.Attribute) and func.attr == "get" and bool(first)
            if is_get and (first == ["rope_theta"] or reads_rope_key(func.value, first[0])):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice.value if isinstance(node.slice, ast.Constant) else None
            if reads_rope_key(node.value, key):
                lines.append(node.lineno)
    return lines


ROPE_KEYS = ("rope_type", "rope_theta", "factor", "original_max_position_embeddings")


def reads_rope_key(owner: ast.AST, key) -> bool:
    """`rope_parameters.get(KEY)`, `rope_scaling[KEY]` or `rope_parameters_of(config)[KEY]`: a rope key read
    from a config's raw rope dict (what the record reads; its values are `record.full.parameters`)."""
    if isinstance(owner, ast.Call):
        return key in ROPE_KEYS and getattr(owner.func, "id", "") == "rope_parameters_of"
    return key in ROPE_KEYS and getattr(owner, "id", "") in ("rope_parameters", "rope_scaling")


def test_nothing_outside_the_record_reads_the_configs_rope():
    found = {}
    for path in sorted((ROOT / "ctxext").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        lines = config_rope_reads(ast.parse(path.read_text(encoding="utf-8")))
        if lines and name not in MAY_READ:
            found[name] = lines
    assert not found, f"read the rope record (ctxext.patching.record) instead: {found}"
    tree = ast.parse(
        "b = model.config.rope_parameters['rope_theta']\nc = getattr(cfg, 'rope_parameters', None)\n"
        "d = rope_parameters.get('original_max_position_embeddings')\ne = rope_parameters_of(cfg)['factor']\n"
        "f = mapping.get('factor')"
    )
    assert sorted(config_rope_reads(tree)) == [1, 2, 3, 4]  # the scan sees what it looks for, and only that


# ------------------------------------------------------------------------------------------ the record
def llama_config(rope_parameters: dict, max_position_embeddings: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        num_hidden_layers=2,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_theta": 500000.0, **rope_parameters},
    )


@pytest.mark.parametrize(
    ("rope_parameters", "max_length", "L0", "C"),
    [
        ({"rope_type": "default"}, 4096, 4096, 4096),
        # Llama 3.1 and 3.2: llama3 x8 / x32 over 8192, both served at 131072 (the factor states no reach)
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, 131072, 8192, 131072),
        (
            {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
            131072,
            8192,
            131072,
        ),
        # Qwen2.5's and Qwen3's card recipe: yarn x4 over 32768 reaches 131072 past max_position_embeddings
        ({"rope_type": "yarn", "factor": 4.0}, 32768, 32768, 131072),
        ({"rope_type": "yarn", "factor": 4.0}, 40960, 32768, 131072),
        ({"rope_type": "linear", "factor": 4.0}, 4096, 4096, 4096),  # no L0 recorded: no reach to count
    ],
)
def test_the_trained_context_is_what_the_model_serves(rope_parameters, max_length, L0, C):
    if rope_parameters["rope_type"] in ("llama3", "yarn"):
        rope_parameters = {**rope_parameters, "original_max_position_embeddings": L0}
    record = rope_record(llama_config(rope_parameters, max_length))
    assert (record.pretraining_length, record.trained_context) == (L0, C)
    assert record.base == 500000.0 and record.rotary_dim == 16


def test_the_record_keeps_each_layer_types_base_and_hunyuans_alpha():
    model, _ = build("gemma3_text")
    rope = model.config.rope_parameters
    record = rope_record(model.config)
    assert record.of("sliding_attention").base == rope["sliding_attention"]["rope_theta"]
    assert record.base == rope["full_attention"]["rope_theta"] != rope["sliding_attention"]["rope_theta"]
    hunyuan, _ = build("hunyuan_v1_dense")
    config = hunyuan.config
    config.rope_parameters = {**config.rope_parameters, "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0}
    dim = rope_record(config).rotary_dim
    expected = config.rope_parameters["rope_theta"] * 1000.0 ** (dim / (dim - 2))  # HunYuan's NTK alpha
    assert rope_record(config).base == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------- Gemma 3: the full-attention base everywhere
@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny Gemma-3-shaped checkpoint (full layers base 1e6 with linear x8, sliding layers 1e4) and documents."""
    import random

    model, _ = build("gemma3_text")
    values = model.config.to_dict()
    full = values["rope_parameters"]["full_attention"]
    values["rope_parameters"]["full_attention"] = {**full, "rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    values["rope_parameters"]["sliding_attention"]["rope_theta"] = 1e4
    values["max_position_embeddings"] = 128
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    rebuilt = AutoModelForCausalLM.from_config(config).eval()
    rebuilt.load_state_dict(model.state_dict())
    root = tmp_path_factory.mktemp("gemma3")
    save_tiny_checkpoint(root / "model", rebuilt)
    docs = root / "docs"
    docs.mkdir()
    rng = random.Random(0)
    for name in "abcdef":
        (docs / f"{name}.txt").write_text(" ".join(f"w{rng.randint(1, 127)}" for _ in range(1500)))
    return root


def test_compare_plans_with_the_full_attention_base(gemma3, tmp_path):
    from ctxext.compare.plan import plan_compare
    from ctxext.compare.request import CompareRequest
    from ctxext.run_options import DataOptions, RuntimeOptions

    request = CompareRequest(
        model=str(gemma3 / "model"),
        lengths=[256],
        output=tmp_path / "out",
        data=DataOptions(text_files=[str(gemma3 / "docs")]),
        methods=["yarn", "theta"],
        held_out_docs=2,
        trials=2,
        runtime=RuntimeOptions(device="cpu", dtype="fp32", progress=False),
    )
    plan = plan_compare(request)
    assert plan.base == 1e6 and plan.L == 128  # the full layers' base; L the trained context C
    assert "theta" in plan.methods


def test_search_spaces_use_the_full_attention_base(gemma3, tmp_path):
    pytest.importorskip("optuna")
    from ctxext.run_options import DataOptions
    from ctxext.search import SearchRequest, plan_search

    request = SearchRequest(
        str(gemma3 / "model"),
        {"method": "theta", "new_base": 4e6},
        256,
        tmp_path / "o",
        data=DataOptions(text_files=[str(gemma3 / "docs")]),
    )
    space = {r.name: r for r in plan_search(request).settings.space}
    new_base = space["new_base"]
    assert new_base.low >= 1e6, new_base  # a range of multiples of the base: of 1e6, not the sliding 1e4


def test_the_serving_form_compare_recommends_uses_the_full_attention_base(gemma3):
    from ctxext.compare.serving import compare_form
    from ctxext.loading import load_config

    form = compare_form({"method": "yarn", "factor": 2.0}, load_config(str(gemma3 / "model")), 128)
    written = form.rope_parameters  # nested by layer type where the method composes with Gemma 3's shipped linear
    assert written.get("full_attention", written)["rope_theta"] == 1e6


# ----------------------------------------------------------------------------- planning reads the model once
def test_planning_a_patch_probes_the_model_once(monkeypatch):
    """One `rope_layout`, the host looked up twice (by plan_patch and by the layout it asks for), each attention
    module read once per layer: planning ReRoPE on a 2-layer Llama."""
    calls = {"rope_layout": 0, "rotary_host": 0, "attention_of": 0}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    wrappers = {name: counted(name, getattr(families, name)) for name in calls}
    for module in (families, patch, attention_install):
        for name in calls:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, wrappers[name])
    model = tiny_model("llama")
    plan = patch.plan_patch(model, "rerope", 2.0)
    assert plan.layers == (0, 1)
    assert calls == {"rope_layout": 1, "rotary_host": 2, "attention_of": 2}, calls


# --------------------------------------------------------------------------------------- the refusal table
def refused_settings(model):
    from ctxext.methods import get_method
    from ctxext.methods.attention import AttentionSettings

    params = get_method("self_extend").make_params(factor=2.0)
    return AttentionSettings.for_method("self_extend", params, False, model.config.max_position_embeddings)


def layout(**changes) -> RopeLayout:
    values = dict(
        model_type="hand-built",
        layer_types=("full_attention", "full_attention"),
        per_type_rotary=False,
        angles="halves",
        uses_rope=(True, True),
        windows=(None, None),
        attention=(True, True),
        rotary_dims={None: 16},
        bases={None: 1e4},
        attention_classes=("Attention", "Attention"),
        sinks=(False, False),
        value_head_dims=(None, None),
    )
    return RopeLayout(**{**values, **changes})


def request(**changes) -> AttentionRequest:
    values = dict(
        method="self_extend",
        remaps=True,
        layout=layout(),
        layers=(0, 1),
        implementation="sdpa",
        length=256,
        config_window=None,
    )
    return AttentionRequest(**{**values, **changes})


def test_the_refusal_rules_are_ordered_and_the_first_match_wins():
    assert first_refusal(request()) is None
    assert [rule.__name__ for rule in RULES] == [
        "attention_interface_bypassed",
        "multimodal_sections",
        "complex_angles",
        "implementation",
        "every_layer_slides_within_L",
        "no_layer",
        "latent_attention",
        "other_angle_layout",
        "config_extras",
        "short_sliding_window",
        "attention_sinks",
        "value_head_size",
    ]
    sinks_and_values = layout(sinks=(False, True), value_head_dims=((32, 16), None))
    assert "attention sinks (Attention.sinks, layer 1)" in first_refusal(request(layout=sinks_and_values))
    assert "v_head_dim 32 and head_dim 16 (layer 0)" in first_refusal(
        request(layout=layout(value_head_dims=((32, 16), None)))
    )
    windows = layout(windows=(64, None))
    assert "sliding-window attention (64 tokens, shorter than the model's 256)" in first_refusal(
        request(layout=windows)
    )
    # several reasons at once: the earlier rule speaks (complex angles before the implementation and the sinks)
    everything = request(layout=layout(angles="complex", sinks=(True, True)), implementation="paged_attention")
    assert "complex multiplication" in first_refusal(everything)
    assert "attn_implementation='paged_attention'" in first_refusal(dataclasses.replace(everything, layout=windows))
    # log-n alone only scales queries: nothing but 'no layer' refuses it
    logn = request(method="", remaps=False, layout=layout(angles="complex", sinks=(True, True)))
    assert first_refusal(logn) is None
    assert "log-n scaling has no layer to act on" in first_refusal(dataclasses.replace(logn, layers=()))
    # a layer whose forward never calls the attention interface: before every other reason, for log-n too
    bypassed = layout(angles="complex", interface_bypasses=(None, "fast_forward from module 'unsloth.models.llama'"))
    for refused in (dataclasses.replace(everything, layout=bypassed), dataclasses.replace(logn, layout=bypassed)):
        assert "Attention (layer 1) runs fast_forward from module 'unsloth.models.llama'" in first_refusal(refused)
    assert first_refusal(dataclasses.replace(logn, layout=bypassed, layers=(0,))) is None  # not on that layer


def test_the_table_is_what_patch_asks():
    """The real model's refusal is the table's first match: gpt-oss lays its angles out once (and has sinks, a later
    rule), as plan_patch words it."""
    model, _ = build("gpt_oss")
    with pytest.raises(ctxext.CtxextError, match="lays its rotary angles out once") as refused:
        patch.plan_patch(model, "self_extend", 2.0)
    layout = families.rope_layout(model)
    assert any(layout.sinks)
    request = attention.attention_request(families.rotary_host(model), refused_settings(model), layout, (0, 1), 64)
    assert first_refusal(request) == str(refused.value)
    rope = model_rope_record(model)  # the default gpt-oss config's yarn x32 over 4096 reaches 131072
    assert (rope.pretraining_length, rope.trained_context) == (4096, 32 * 4096)


def test_the_rope_record_is_public_where_the_docs_import_it():
    """`ctxext.rope_record` and `ctxext.RopeRecord` are the record module's own (ctxext's __all__ and patching's)."""
    import ctxext.patching.record as record_module

    assert ctxext.rope_record is record_module.rope_record and ctxext.RopeRecord is record_module.RopeRecord
    assert {"RopeRecord", "rope_record"} <= set(ctxext.__all__) & set(ctxext.patching.__all__)
    shipped = ctxext.rope_record(tiny_model("llama").config)
    assert (
        isinstance(shipped, ctxext.RopeRecord)
        and shipped.trained_context == tiny_model("llama").config.max_position_embeddings
    )


LOOKS_THROUGH = {("ctxext/patching/record.py", "as_shipped"), ("ctxext/patching/patch.py", "unpatch")}
SHIPPED_FIELDS = ("rope_parameters", "max_position_embeddings", "original_max_position_embeddings")


def reads_through_a_patch(tree: ast.AST) -> list[tuple[str, int]]:
    """(function, line) for every read of what an in-memory patch saved (`<...>.undo.rope_parameters`, or
    `undo.max_position_embeddings` on a local named undo)."""
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Attribute) and node.attr in SHIPPED_FIELDS and isinstance(node.ctx, ast.Load):
                owner = node.value
                if getattr(owner, "attr", None) == "undo" or getattr(owner, "id", None) == "undo":
                    found.append((function.name, node.lineno))
    return found


def test_one_function_looks_through_an_in_memory_patch():
    """The rope a model shipped, under an in-memory patch, is read in `record.as_shipped` alone (`unpatch` puts it
    back): the record, the source rope ctxext.yaml keeps and the form's unpatched parameters all come from it."""
    found = sorted(
        f"{name}:{function}:{line}"
        for path in (ROOT / "ctxext").rglob("*.py")
        for name in [path.relative_to(ROOT).as_posix()]
        for function, line in reads_through_a_patch(ast.parse(path.read_text(encoding="utf-8")))
        if (name, function) not in LOOKS_THROUGH
    )
    assert not found, f"read the shipped rope through record.as_shipped instead: {found}"
    probe = ast.parse("def f(s):\n    return s.undo.rope_parameters, undo.max_position_embeddings")
    assert [line for _, line in reads_through_a_patch(probe)] == [2, 2]  # the scan sees what it looks for
