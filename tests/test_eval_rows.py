"""ctxext.eval.rows: method flags, YAML and sweeps -> the rows every evaluation uses, with labels that tell rows
apart by the settings that differ."""

import pytest
import yaml

from ctxext.errors import CtxextError
from ctxext.eval.rows import MethodSelection, method_rows
from tests.helpers import tiny_config

SEARCHED = {"method": "yarn", "factor": 4, "beta_fast": 16, "beta_slow": 2, "attention_factor": 0.9}


def sweep(tmp_path, *entries, **shared):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({**shared, "methods": list(entries)}))
    return MethodSelection(config=str(path))


def labels(selection, **config):
    return [row.label for row in method_rows(selection, tiny_config("llama", **config))]


def test_rows_of_one_method_show_the_settings_that_differ(tmp_path):
    # The searched row first, the defaults after: today's labels were 'yarn x4' and 'yarn x4 (2)'.
    assert labels(sweep(tmp_path, SEARCHED, {"method": "yarn", "factor": 4})) == [
        "none",
        "yarn x4 beta_fast=16 beta_slow=2 attention_factor=0.9",
        "yarn x4",
    ]
    # Only what differs between the rows is shown, on the rows that leave the default.
    assert labels(
        sweep(tmp_path, {"method": "yarn", "beta_fast": 16}, {"method": "yarn", "beta_slow": 2}, factor=4)
    ) == ["none", "yarn x4 beta_fast=16", "yarn x4 beta_slow=2"]
    assert labels(
        sweep(tmp_path, {"method": "yarn", "beta_fast": 16}, {"method": "yarn", "beta_fast": 8}, beta_slow=2, factor=4)
    ) == ["none", "yarn x4 beta_fast=16", "yarn x4 beta_fast=8"]
    # The same settings twice are numbered; rows of different labels stay short.
    assert labels(sweep(tmp_path, "linear", "linear", "ntk", factor=2)) == [
        "none",
        "linear x2",
        "linear x2 (2)",
        "ntk x2",
    ]
    assert labels(
        sweep(tmp_path, {"method": "linear", "original_max_position_embeddings": 32}, "linear", factor=2)
    ) == [
        "none",
        "linear x2 original_max_position_embeddings=32",
        "linear x2",
    ]


def test_flags_apply_to_every_method_that_has_them_and_a_flag_no_method_has_fails():
    rows = method_rows(
        MethodSelection(methods=["linear", "yarn"], overrides={"factor": 2, "beta_fast": 16}), tiny_config("llama")
    )
    assert [row.description for row in rows] == [
        {"method": "none", "as_loaded": True},
        {"method": "linear", "factor": 2},
        {"method": "yarn", "factor": 2, "beta_fast": 16},
    ]
    with pytest.raises(CtxextError, match="none of the methods .linear. has a parameter 'beta-fast'"):
        MethodSelection(methods=["linear"], overrides={"beta_fast": 16}).mappings()
    with pytest.raises(CtxextError, match="--factor needs a --method or --config"):
        MethodSelection(overrides={"factor": 2}).mappings()


def test_a_loaded_checkpoint_is_one_row_and_a_dynamic_one_is_computed_statelessly():
    plain = method_rows(MethodSelection(), tiny_config("llama"))
    assert [(r.label, r.config) for r in plain] == [("none", None)]
    dynamic = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    rows = method_rows(MethodSelection(), tiny_config("llama", rope_parameters=dynamic))
    assert [r.label for r in rows] == ["none", "as loaded (dynamic x4)"]
    assert rows[1].config.to_dict() == {"method": "dynamic_ntk", "factor": 4.0, "original_max_position_embeddings": 64}
    assert rows[0].config.method == "none" and rows[0].config.replace_shipped  # plain RoPE over the scaled checkpoint
    scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32}
    rows = method_rows(
        MethodSelection(methods=["yarn"], overrides={"factor": 4}), tiny_config("llama", rope_parameters=scaled)
    )
    # no L forced: the method extends from the checkpoint's trained context and composes with its linear x2
    assert rows[1].config.original_max_position_embeddings is None and not rows[1].config.replace_shipped


def test_a_rows_check_runs_before_its_method_is_patched_in():
    from ctxext.config import MethodConfig
    from ctxext.eval.rows import EvalMethod
    from tests.helpers import tiny_model

    model = tiny_model("llama")
    seen = []

    def refuse(model, config):
        seen.append(config.method)
        raise CtxextError("refused")

    row = EvalMethod("yarn x2", MethodConfig("yarn", factor=2.0), check=refuse)
    with pytest.raises(CtxextError, match="refused"):
        row.apply(model)
    assert seen == ["yarn"] and type(model.model.rotary_emb).__name__ != "ScaledRotaryEmbedding"  # not patched
    EvalMethod("none", None, check=refuse).apply(model)  # the model as loaded: nothing to check
    assert seen == ["yarn"]
