"""Every private API that ctxext uses (ctxext/compat.py lists them) still exists in the installed versions and
behaves as ctxext relies on, each checked against what it is relied on for: an upgrade that drops or changes one
fails here instead of in a user's run."""

import argparse
import copy
import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

from ctxext import compat
from tests.helpers import FAMILIES, tiny_config, tiny_model

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- torch
def test_cpu_attention_with_lse_is_softmax_attention_and_its_log_sum_exp():
    assert compat.cpu_attention_with_lse_available()
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    bias = torch.randn(5, 7)
    out, lse = compat.cpu_attention_with_lse(q, k, v, bias, 0.5)
    scores = (q @ k.transpose(-1, -2)) * 0.5 + bias
    assert torch.allclose(out, torch.softmax(scores, -1) @ v, atol=1e-5)
    assert torch.allclose(lse.reshape(1, 2, 5), torch.logsumexp(scores, -1), atol=1e-5)


# --------------------------------------------------------------------------------------- transformers
def test_attention_implementation_reads_what_set_attn_implementation_sets():
    model = tiny_model("llama")
    assert compat.attention_implementation(model.config) == "sdpa"
    model.set_attn_implementation("eager")
    assert compat.attention_implementation(model.config) == "eager"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_eager_attention_is_softmax_attention(family):
    """The function each modeling file passes as the eager default, computing what eager attention computes."""
    model = tiny_model(family)
    attention = model.model.layers[0].self_attn
    function = compat.family_eager_attention(attention)
    assert function is sys.modules[type(attention).__module__].eager_attention_forward
    heads, kv_heads, d = model.config.num_attention_heads, model.config.num_key_value_heads, attention.head_dim
    q, k, v = torch.randn(1, heads, 5, d), torch.randn(1, kv_heads, 5, d), torch.randn(1, kv_heads, 5, d)
    out, _ = function(attention, q, k, v, None, scaling=0.25)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    expected = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-5)


def test_flash_attention_picks_its_kernel_from_the_config_the_view_replaces():
    """transformers' flash_attention_forward names the kernel from `module.config._attn_implementation`; the
    view answers that with the wrapped implementation and everything else with the module's own values (the
    path itself runs in tests/test_flash_inner.py)."""
    from transformers.integrations.flash_attention import flash_attention_forward

    assert "module.config._attn_implementation" in inspect.getsource(flash_attention_forward)
    attention = tiny_model("llama").model.layers[1].self_attn
    view = compat.module_with_attention_implementation(attention, "flash_attention_2")
    assert view.config._attn_implementation == "flash_attention_2"
    assert (view.layer_idx, view.scaling, view.is_causal) == (1, attention.scaling, attention.is_causal)
    assert view.config.hidden_size == attention.config.hidden_size


def test_rope_validators_are_looked_up_by_the_rope_types_name():
    from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin

    seen = []
    compat.add_rope_validator("ctxext_compat_probe", lambda self, params, ignore_keys=None: seen.append(dict(params)))
    try:
        tiny_config("llama", rope_parameters={"rope_type": "ctxext_compat_probe", "rope_theta": 1e4, "probe": 3})
    finally:
        delattr(RotaryEmbeddingConfigMixin, "_validate_ctxext_compat_probe_rope_parameters")
    assert seen and seen[0]["probe"] == 3 and seen[0]["rope_type"] == "ctxext_compat_probe"


def fake_hub_cache(cache: Path, repo: str, commits: list[str], main: str) -> None:
    """A huggingface_hub cache holding `repo` at each of `commits` (a tiny llama config), `main` at one of them."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(main)
    for commit in commits:
        tiny_config("llama").save_pretrained(folder / "snapshots" / commit)


def test_hub_commit_is_the_commit_a_hub_load_read(tmp_path):
    """transformers 5.24 no longer records `config._commit_hash`; the commit comes from the hub cache."""
    from transformers import AutoConfig

    old, new = "1" * 40, "2" * 40
    fake_hub_cache(tmp_path, "tiny-org/tiny-llama", [old, new], main=new)
    config = AutoConfig.from_pretrained("tiny-org/tiny-llama", cache_dir=tmp_path)
    assert compat.hub_commit("tiny-org/tiny-llama", config, cache_dir=tmp_path) == new
    (tmp_path / "models--tiny-org--tiny-llama" / "refs" / "main").write_text(old)
    assert compat.hub_commit("tiny-org/tiny-llama", cache_dir=tmp_path) == old
    config._commit_hash = "3" * 40  # transformers 4.x: what the load recorded wins
    assert compat.hub_commit("tiny-org/tiny-llama", config, cache_dir=tmp_path) == "3" * 40
    assert compat.hub_commit("tiny-org/not-cached", cache_dir=tmp_path) is None
    assert compat.hub_commit(str(tmp_path / "a" / "local" / "dir"), cache_dir=tmp_path) is None


# ----------------------------------------------------------------------------------------- accelerate
def test_resetting_accelerate_lets_a_second_accelerator_choose_other_settings():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    compat.reset_accelerate_state()
    try:
        Accelerator(cpu=True, mixed_precision="no")
        with pytest.raises(ValueError, match="already been initialized"):  # why the reset is needed
            Accelerator(cpu=True, mixed_precision="bf16")
        compat.reset_accelerate_state()
        assert AcceleratorState._shared_state == {} and GradientState._shared_state == {}
        assert Accelerator(cpu=True, mixed_precision="bf16").state.mixed_precision == "bf16"
    finally:
        compat.reset_accelerate_state()


# -------------------------------------------------------------------------------------------- importlib
def test_a_module_is_initializing_while_its_code_runs_and_not_after(tmp_path, monkeypatch):
    (tmp_path / "ctxext_compat_probe.py").write_text(
        "import sys\nfrom ctxext.compat import module_is_initializing\n"
        "DURING = module_is_initializing(sys.modules[__name__])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ctxext_compat_probe", raising=False)
    ctxext_compat_probe = importlib.import_module("ctxext_compat_probe")

    assert ctxext_compat_probe.DURING is True
    assert compat.module_is_initializing(ctxext_compat_probe) is False
    assert compat.module_is_initializing(compat) is False


# --------------------------------------------------------------------------------------------- argparse
def test_parser_actions_list_every_option_string_including_groups():
    """cli/common.py `split_method_params` reads the options from `parser._actions`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--alpha")
    parser.add_argument_group("g").add_argument("-b", "--beta")
    parser.add_mutually_exclusive_group().add_argument("--gamma", action="store_true")
    parser.add_argument("positional")
    options = {s for action in parser._actions for s in action.option_strings}
    assert options == {"-h", "--help", "--alpha", "-b", "--beta", "--gamma"}


def test_help_formatters_fill_text_is_what_formats_descriptions():
    """cli/common.py `HelpFormatter` overrides `_fill_text(text, width, indent)` to keep examples as written."""
    calls = []

    class Recording(argparse.HelpFormatter):
        def _fill_text(self, text, width, indent):
            calls.append(text)
            return indent + "<as written>\n"

    parser = argparse.ArgumentParser(prog="p", description="line one\n  line two", formatter_class=Recording)
    assert "<as written>" in parser.format_help()
    assert calls == ["line one\n  line two"]
    assert list(inspect.signature(argparse.HelpFormatter._fill_text).parameters) == ["self", "text", "width", "indent"]


# ---------------------------------------------------------------------------------------------- lm-eval
def test_task_manager_with_another_factory_is_a_task_manager_with_that_metadata(tmp_path):
    """tasks/harness.py `_with_metadata`: a copied TaskManager given `TaskFactory(meta=...)` equals a new
    `TaskManager(metadata=...)` in everything (the index it would take seconds to build again included)."""
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._factory import TaskFactory

    metadata = {"max_seq_lengths": [64]}
    base = TaskManager(include_defaults=False, include_path=str(tmp_path))
    view = copy.copy(base)
    view.metadata = metadata
    view._factory = TaskFactory(meta=metadata)
    fresh = TaskManager(include_defaults=False, include_path=str(tmp_path), metadata=metadata)
    assert isinstance(fresh._factory, TaskFactory)
    assert vars(view._factory) == vars(fresh._factory)
    assert {k: v for k, v in vars(view).items() if k != "_factory"} == {
        k: v for k, v in vars(fresh).items() if k != "_factory"
    }


def test_hflm_rank_and_world_size_are_its_private_fields():
    """tasks/harness.py `harness_model` sets `_rank`/`_world_size` on an HFLM around a loaded model; lm-eval's
    evaluator splits the requests by the public `rank`/`world_size`."""
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    lm = HFLM.__new__(HFLM)
    lm._rank, lm._world_size = 1, 3
    assert (lm.rank, lm.world_size) == (1, 3)


# ------------------------------------------------------------------------------------------- the list
PRIVATE_NAMES = {  # each private name used in ctxext -> the files besides compat.py that use it (compat.py names them)
    "_scaled_dot_product_flash_attention_for_cpu": set(),
    "_attn_implementation": set(),
    "_validate_": set(),
    "_reset_state": set(),
    "_initializing": set(),
    "_commit_hash": {"ctxext/tasks/harness.py", "ctxext/eval/session.py"},
    "_actions": {"ctxext/cli/common.py", "ctxext/cli/aliases.py"},
    "_fill_text": {"ctxext/cli/common.py"},
    "_factory": {"ctxext/tasks/harness.py"},
    "_rank": {"ctxext/tasks/harness.py"},
    "_world_size": {"ctxext/tasks/harness.py"},
}


def test_every_private_name_is_used_only_where_compat_says():
    """A private name used in a new place fails here until compat.py lists the place."""
    text = (REPO / "ctxext" / "compat.py").read_text()
    for name, allowed in PRIVATE_NAMES.items():
        assert name in text, name
        pattern = re.compile(rf"[.\"']{re.escape(name)}")
        users = {
            str(path.relative_to(REPO))
            for path in (REPO / "ctxext").rglob("*.py")
            if path.name != "compat.py" and pattern.search(path.read_text(encoding="utf-8"))
        }
        assert users <= allowed, (name, users - allowed)
        for user in users:
            assert user in text, (name, user)
