"""A PEFT adapter of a model patched in memory carries the patch (ctxext/integrations/adapters.py, hooks.py), and
the directory GRPO's vLLM starts from (ctxext/integrations/trl.py).

The oracle is the model the adapter was saved from (patched, LoRA on), run in memory: every way of loading the
adapter must give its logits, past L; the adapter without its ctxext.yaml (on the unpatched base) must not.
"""

import json

import pytest
import torch
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import ctxext
from ctxext.integrations.trl import vllm_model_dir
from tests.helpers import load_in_plain_transformers, save_tiny_checkpoint, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")

METHODS = {"yarn": {"factor": 4}, "self_extend": {"group_size": 4, "window": 16}}
TOKENS = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(3))  # past L = 64


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("base"), tiny_model("llama"))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(TOKENS).logits


def saved_adapter(base_dir, folder, method, adapter_name="default"):
    """A LoRA adapter (random, non-zero B) on the base patched with `method`, saved to `folder`; its logits."""
    model = ctxext.patch(AutoModelForCausalLM.from_pretrained(base_dir), method, **METHODS[method])
    torch.manual_seed(1)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", init_lora_weights=False)
    peft_model = get_peft_model(model, config, adapter_name=adapter_name)
    peft_model.save_pretrained(folder)
    return logits(peft_model)


@pytest.mark.parametrize("method", list(METHODS))
def test_an_adapter_of_a_patched_model_reloads_patched_by_every_loader(base_dir, tmp_path, method):
    adapter = tmp_path / "adapter"
    trained = saved_adapter(base_dir, adapter, method)
    assert (adapter / "ctxext.yaml").is_file()
    loaded = {
        "AutoPeftModelForCausalLM": AutoPeftModelForCausalLM.from_pretrained(adapter),
        "PeftModel.from_pretrained": PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter),
        "AutoModelForCausalLM(adapter)": AutoModelForCausalLM.from_pretrained(adapter),
    }
    into = AutoModelForCausalLM.from_pretrained(base_dir)
    into.load_adapter(str(adapter))
    loaded["load_adapter"] = into
    for how, model in loaded.items():
        torch.testing.assert_close(logits(model), trained, rtol=0, atol=1e-5, msg=how)
    # The record is what carries the patch: without it the adapter runs on the unpatched base.
    (adapter / "ctxext.yaml").unlink()
    unpatched = logits(AutoPeftModelForCausalLM.from_pretrained(adapter))
    assert (unpatched - trained).abs().max() > 1e-2  # 1000 times the tolerance


def test_an_adapter_on_a_base_loaded_patched_is_not_patched_twice(base_dir, tmp_path):
    trained = saved_adapter(base_dir, tmp_path / "adapter", "yarn")
    patched = ctxext.patch(AutoModelForCausalLM.from_pretrained(base_dir), "yarn", factor=4)
    ctxext.save_pretrained(patched, tmp_path / "patched")  # native yarn: a base that is patched as loaded
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "patched")
    torch.testing.assert_close(
        logits(PeftModel.from_pretrained(base, tmp_path / "adapter")), trained, rtol=0, atol=1e-5
    )
    # Patched in memory the same way (as ctxext finetune's merge does it): left as it is too.
    base = ctxext.patch(AutoModelForCausalLM.from_pretrained(base_dir), "yarn", factor=4.0)
    torch.testing.assert_close(
        logits(PeftModel.from_pretrained(base, tmp_path / "adapter")), trained, rtol=0, atol=1e-5
    )


def test_an_adapter_on_another_base_is_refused_in_one_line(base_dir, tmp_path):
    saved_adapter(base_dir, tmp_path / "adapter", "yarn")
    otherwise = ctxext.patch(AutoModelForCausalLM.from_pretrained(base_dir), "yarn", factor=2)
    with pytest.raises(ctxext.CtxextError, match=r"trained on the base patched with yarn \(factor=4\)") as error:
        PeftModel.from_pretrained(otherwise, tmp_path / "adapter")
    assert "\n" not in str(error.value)
    other_rope = save_tiny_checkpoint(tmp_path / "theta", tiny_model("llama", rope_theta=500000.0))
    with pytest.raises(ctxext.CtxextError, match="neither that nor the patched one"):
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(other_rope), tmp_path / "adapter")


def test_an_unpatched_save_removes_the_record_an_earlier_one_left_and_named_adapters_get_theirs(base_dir, tmp_path):
    saved_adapter(base_dir, tmp_path / "adapter", "yarn")
    config = LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config).save_pretrained(tmp_path / "adapter")
    assert not (tmp_path / "adapter" / "ctxext.yaml").exists()
    trained = saved_adapter(base_dir, tmp_path / "named", "self_extend", adapter_name="long")
    assert (tmp_path / "named" / "long" / "ctxext.yaml").is_file()
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "named", subfolder="long", adapter_name="long")
    torch.testing.assert_close(logits(reloaded), trained, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ GRPO's vLLM directory
def test_the_vllm_directory_is_the_native_form_plain_transformers_reloads_patched(base_dir, tmp_path):
    model = ctxext.patch(AutoModelForCausalLM.from_pretrained(base_dir), "yarn", factor=4).eval()
    written = vllm_model_dir(model, tmp_path / "vllm")
    assert model.name_or_path == str(written.path) == str((tmp_path / "vllm").resolve())
    assert written.max_model_length == 256  # vLLM: original_max_position_embeddings x factor (serving/lengths.py)
    config = json.loads((written.path / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == config["rope_scaling"]["rope_type"] == "yarn"
    assert config["rope_parameters"]["factor"] == 4.0 and config["max_position_embeddings"] == 256
    tokens = load_in_plain_transformers(tmp_path, [written.path])  # a process that never imports ctxext
    plain = torch.load(written.path / "plain.pt", weights_only=True)
    with torch.no_grad():
        torch.testing.assert_close(plain[300], model(tokens).logits, rtol=0, atol=1e-5)
    # An adapter trained after it (its base_model_name_or_path is now the written directory) reloads on it as is.
    config = LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM", init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
    torch.testing.assert_close(logits(reloaded), logits(peft_model), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "method, params, says",
    [
        ("self_extend", METHODS["self_extend"], "vLLM cannot run self_extend"),
        ("yarn", {"factor": 4, "logn": True}, "vLLM cannot run its query scaling"),
        ("dynamic_ntk", {"factor": 4}, "vLLM does not run it exactly"),
    ],
)
def test_the_vllm_directory_refuses_what_vllm_cannot_run(base_dir, tmp_path, method, params, says):
    model = ctxext.patch(AutoModelForCausalLM.from_pretrained(base_dir), method, **params)
    with pytest.raises(ctxext.CtxextError, match=says) as error:
        vllm_model_dir(model, tmp_path / "vllm")
    assert "\n" not in str(error.value) and not (tmp_path / "vllm").exists()
    assert model.name_or_path == str(base_dir)
