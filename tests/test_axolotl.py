"""axolotl's plugin (ctxext.integrations.axolotl): the `ctxext:` block of a training YAML checked in one line,
applied to the model axolotl builds, and recorded with the adapter.

The checks and the hooks run here on plain dict configs (the module imports without axolotl). The tests marked
`needs_axolotl` run axolotl itself (skipped where it is missing, as in ctxext's own environment; axolotl 0.19
pins transformers 5.16.1, so it lives in its own virtual environment: /work/axo/bin/python -m pytest
tests/test_axolotl.py): its PluginManager, and a real `axolotl train` of 2 LoRA steps on CPU. The oracle of the
patch is transformers' own yarn: the same weights built with rope type 'yarn' give the same logits.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from peft import LoraConfig, PeftModel, get_peft_model

import ctxext
from ctxext.errors import CtxextError
from ctxext.integrations.axolotl import CtxextPlugin, check_one_scaling, patch_call
from tests.helpers import REPO, save_tiny_checkpoint, tiny_model

needs_axolotl = pytest.mark.skipif(importlib.util.find_spec("axolotl") is None, reason="axolotl is not installed")
PLUGIN = "ctxext.integrations.axolotl.CtxextPlugin"
TOKENS = torch.randint(3, 256, (1, 100), generator=torch.Generator().manual_seed(0))  # past L = 64
# transformers' own yarn x2 over L = 64, with its default ramp written out (as the record's native form has it)
NATIVE_YARN = {
    "rope_type": "yarn",
    "factor": 2.0,
    "rope_theta": 10000.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": True,
}


def logits(model):
    with torch.no_grad():
        return model(TOKENS).logits


def transformers_yarn_model():
    """The tiny llama's weights (seed 0) under transformers' own yarn x2 over L = 64."""
    return tiny_model("llama", rope_parameters=dict(NATIVE_YARN), max_position_embeddings=128)


# ------------------------------------------------------------------------------------------ the block
@pytest.mark.parametrize(
    "block, sequence_len, call",
    [
        ({"method": "yarn", "factor": 4}, 256, {"method": "yarn", "factor": 4.0}),
        ({"method": "self_extend"}, 256, {"method": "self_extend", "target_length": 256}),
        (
            {"method": "yarn", "target_length": 512, "logn": True, "params": {"beta_fast": 16}},
            256,
            {"method": "yarn", "target_length": 512, "logn": True, "beta_fast": 16},
        ),
    ],
)
def test_the_block_becomes_the_patch_call(block, sequence_len, call):
    assert patch_call({"ctxext": block, "sequence_len": sequence_len}) == call


@pytest.mark.parametrize(
    "block, message",
    [
        ({"method": "yarm"}, "unknown ctxext method 'yarm' (did you mean 'yarn'?)"),
        ({"method": "yarn", "fator": 2}, "'ctxext.fator' is not a ctxext setting (did you mean 'factor'?)"),
        ({"method": "yarn", "params": {"beta": 1}}, "ctxext.params: method 'yarn' has no parameter 'beta'"),
        ({"factor": 2}, "needs a mapping with a method"),
        ("yarn", "needs a mapping with a method"),
    ],
)
def test_a_bad_block_is_one_line_at_register(block, message):
    with pytest.raises(CtxextError) as raised:
        CtxextPlugin().register({"ctxext": block})
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("key", ["model_config", "overrides_of_model_config"])  # raw YAML / validated spelling
def test_axolotls_own_rope_scaling_beside_the_block_is_refused(key):
    with pytest.raises(CtxextError, match="both scale the rotary; keep one"):
        check_one_scaling({"ctxext": {"method": "yarn"}, key: {"rope_scaling": {"type": "linear", "factor": 2.0}}})
    check_one_scaling({key: {"rope_scaling": {"type": "linear", "factor": 2.0}}})  # not ctxext's business alone


def test_post_model_build_patches_as_transformers_yarn():
    model = tiny_model("llama")
    CtxextPlugin().post_model_build({"ctxext": {"method": "yarn", "factor": 2}, "sequence_len": 128}, model)
    assert ctxext.applied_method(model)["method"] == "yarn"
    torch.testing.assert_close(logits(model), logits(transformers_yarn_model()), atol=1e-5, rtol=1e-5)


def test_no_block_leaves_the_model_alone():
    model = tiny_model("llama")
    CtxextPlugin().post_model_build({"sequence_len": 128}, model)
    torch.testing.assert_close(logits(model), logits(tiny_model("llama")))


def test_post_train_writes_the_record_beside_an_adapter_no_save_recorded(tmp_path):
    cfg = {"ctxext": {"method": "self_extend", "factor": 2}, "output_dir": str(tmp_path)}
    model = tiny_model("llama")
    CtxextPlugin().post_model_build(cfg, model)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(tmp_path)
    (tmp_path / "ctxext.yaml").unlink()  # as if saved by code that bypasses PEFT's save
    CtxextPlugin().post_train(cfg, peft_model)
    record = yaml.safe_load((tmp_path / "ctxext.yaml").read_text())
    assert record["patch"]["method"] == "self_extend" and record["attention"]["method"] == "self_extend"


def test_the_shipped_axolotl_config_is_a_valid_block():
    cfg = yaml.safe_load((REPO / "configs" / "integrations" / "axolotl-yarn.yaml").read_text())
    assert PLUGIN in cfg["plugins"]
    CtxextPlugin().register(cfg)
    assert patch_call(cfg) == {"method": "yarn", "factor": 4.0}


# ----------------------------------------------------------------------------------- axolotl itself
@needs_axolotl
def test_axolotls_plugin_manager_runs_the_hooks():
    from axolotl.integrations.base import PluginManager
    from axolotl.utils.dict import DictDefault

    manager = PluginManager.get_instance()
    manager.register(PLUGIN)
    assert "ctxext.integrations.axolotl.CtxextArgs" in manager.get_input_args()
    cfg = DictDefault({"plugins": [PLUGIN], "ctxext": {"method": "yarn", "factor": 2}, "sequence_len": 128})
    model = tiny_model("llama")
    manager.post_model_build(cfg, model)
    torch.testing.assert_close(logits(model), logits(transformers_yarn_model()), atol=1e-5, rtol=1e-5)


def training_yaml(tmp_path, block) -> str:
    """A 2-step LoRA run of the tiny llama on 16 random 100-word texts, with the plugin and `block`."""
    base = save_tiny_checkpoint(tmp_path / "base", tiny_model("llama"))
    data = tmp_path / "data.jsonl"
    rows = torch.randint(3, 256, (16, 100), generator=torch.Generator().manual_seed(1))
    data.write_text("".join(json.dumps({"text": " ".join(f"w{int(i)}" for i in row)}) + "\n" for row in rows))
    config = {
        "base_model": str(base),
        "plugins": [PLUGIN],
        "ctxext": block,
        "datasets": [{"path": str(data), "ds_type": "json", "type": "completion"}],
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "output_dir": str(tmp_path / "out"),
        "sequence_len": 128,
        "adapter": "lora",
        **{"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_target_modules": ["q_proj", "v_proj"]},
        **{"micro_batch_size": 2, "gradient_accumulation_steps": 1, "num_epochs": 1, "max_steps": 2},
        **{"learning_rate": 0.001, "optimizer": "adamw_torch", "lr_scheduler": "constant"},
        "attn_implementation": "sdpa",
        "special_tokens": {"pad_token": "w0", "eos_token": "w1", "bos_token": "w2"},
        "save_first_step": False,
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def axolotl_train(config: str) -> subprocess.CompletedProcess:
    bin_dir = os.path.dirname(sys.executable)  # axolotl launches `accelerate` from the environment's bin
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "AXOLOTL_DO_NOT_TRACK": "1",
    }
    command = [sys.executable, "-m", "axolotl.cli.train", config]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@needs_axolotl
def test_axolotl_train_patches_and_the_adapter_carries_the_patch(tmp_path):
    run = axolotl_train(training_yaml(tmp_path, {"method": "yarn", "factor": 2}))
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / "out"
    for folder in (out, out / "checkpoint-2"):
        record = yaml.safe_load((folder / "ctxext.yaml").read_text())
        assert record["patch"]["method"] == "yarn" and record["native_rope_parameters"]["rope_type"] == "yarn"
    # After `import ctxext`, the adapter on the unpatched base is the adapter on transformers' own yarn base.
    reloaded = PeftModel.from_pretrained(tiny_model("llama"), out).eval()
    native = PeftModel.from_pretrained(transformers_yarn_model(), out).eval()
    torch.testing.assert_close(logits(reloaded), logits(native), atol=1e-5, rtol=1e-5)
    lora = [name for name, _ in reloaded.named_parameters() if "lora_B" in name]
    assert lora and any(float(p.abs().max()) > 0 for n, p in reloaded.named_parameters() if "lora_B" in n)


@needs_axolotl
def test_axolotl_train_with_an_attention_method_records_it(tmp_path):
    run = axolotl_train(training_yaml(tmp_path, {"method": "self_extend", "factor": 2}))
    assert run.returncode == 0, run.stderr[-3000:]
    record = yaml.safe_load((tmp_path / "out" / "ctxext.yaml").read_text())
    assert record["attention"]["method"] == "self_extend"


@needs_axolotl
def test_axolotl_train_refuses_a_bad_block_before_loading(tmp_path):
    run = axolotl_train(training_yaml(tmp_path, {"method": "yarm", "factor": 2}))
    assert run.returncode != 0
    assert "unknown ctxext method 'yarm' (did you mean 'yarn'?)" in run.stdout + run.stderr
    assert not (tmp_path / "out").exists()
