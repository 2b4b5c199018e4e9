"""Every causal-LM model type of the installed transformers (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, 196 in 5.24)
through `ctxext methods --model DIR` and `ctxext patch DIR`: each gives a patch or one line of CtxextError (exit 2),
never a traceback. DIR holds the family's tiny model (tests/family_models.py) where it builds; else its config
alone, as small as transformers takes it (or as it ships by default), for the refusals that come from a config."""

import json
import warnings

import pytest
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from ctxext.cli import main
from tests.family_models import _values, build
from tests.helpers import VLM_TEXT_ROPE, save_tiny_checkpoint, tiny_vlm

EVERY = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _checkpoint(model_type: str, folder) -> str:
    """'model' (weights and config), 'config' (a config.json transformers built) or 'bare' ({"model_type": ...})."""
    model, _ = build(model_type) if model_type in CONFIG_MAPPING else (None, None)
    if model is not None:
        model.save_pretrained(folder)
        return "model"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for values in (lambda default: _values(model_type, default), lambda default: {}):
            try:
                default = CONFIG_MAPPING[model_type]()
                CONFIG_MAPPING[model_type](**values(default)).save_pretrained(folder)
                return "config"
            except Exception:  # noqa: BLE001, S112 - the next, plainer config is tried
                continue
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return "bare"


def _one_line_or_success(argv: list, capsys) -> tuple[int, str]:
    """(exit code, its stdout, or the one error line where it failed); a traceback fails the test."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    except Exception as error:  # noqa: BLE001 - the finding: a traceback where a one-line error belongs
        pytest.fail(f"ctxext {argv[0]} raised {type(error).__name__}: {error}")
    captured = capsys.readouterr()
    err = captured.err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    if code != 0:
        assert code == 2 and lines and "Traceback" not in err, err
        assert lines[-1].startswith(f"ctxext {argv[0]}: error: "), lines[-1]
        return code, lines[-1]
    return code, captured.out


@pytest.mark.slow  # `make test-slow`: 196 families, each built, saved, described and patched (about 5 minutes)
@pytest.mark.parametrize("model_type", EVERY)
def test_methods_and_patch_give_a_patch_or_one_line(model_type, tmp_path, capsys):
    kind = _checkpoint(model_type, tmp_path / "in")
    _, described = _one_line_or_success(["methods", "--model", tmp_path / "in"], capsys)
    code, told = _one_line_or_success(
        ["patch", tmp_path / "in", "--method", "yarn", "--factor", "2", "-o", tmp_path / "out"], capsys
    )
    if kind == "model" and "yarn          applies" in described:  # what methods says applies, patch writes
        assert code == 0 and (tmp_path / "out" / "config.json").is_file(), told


# Image-text-to-text types that are not causal LMs (the vision-language models): the same promise. The four MRoPE
# families tests/helpers.py builds small are written with weights; the others as their config alone.
EVERY_IMAGE_TEXT = sorted(set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


def _vlm_checkpoint(model_type: str, folder) -> str:
    if model_type in VLM_TEXT_ROPE:
        save_tiny_checkpoint(folder, tiny_vlm(model_type))
        return "model"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            CONFIG_MAPPING[model_type]().save_pretrained(folder)
            return "config"
        except Exception:  # noqa: BLE001 - a type whose default config does not build: its bare type
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
            return "bare"


@pytest.mark.slow  # `make test-slow`: every image-text-to-text type, described and patched
@pytest.mark.parametrize("model_type", EVERY_IMAGE_TEXT)
def test_vision_language_types_give_a_patch_or_one_line(model_type, tmp_path, capsys):
    kind = _vlm_checkpoint(model_type, tmp_path / "in")
    _one_line_or_success(["methods", "--model", tmp_path / "in"], capsys)
    code, told = _one_line_or_success(
        ["patch", tmp_path / "in", "--method", "yarn", "--factor", "2", "-o", tmp_path / "out"], capsys
    )
    if kind == "model":  # the MRoPE families ctxext patches: the checkpoint is written
        assert code == 0 and (tmp_path / "out" / "config.json").is_file(), told
