"""HunYuan's shipped rope form: type 'dynamic' with an NTK `alpha` (and factor 1), which transformers' HunYuan rotary
reads as a fixed base rope_theta * alpha^(d / (d - 2)). The oracle is transformers' own inv_freq for that config:
ctxext must read the same base, patch from it, and not treat the model as length-dependent."""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import ctxext
from ctxext.methods.frequency import rope_inv_freq
from ctxext.patching.families import rope_layout
from ctxext.patching.rope_types import stateless_method_for
from ctxext.patching.rotary import is_dynamic
from tests.family_models import _values

SHIPPED = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0, "beta_fast": 32.0}


def hunyuan(family: str):
    """A tiny random HunYuan model built by transformers from the rope form its checkpoints ship."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = CONFIG_MAPPING[family]()
        config = CONFIG_MAPPING[family](**{**_values(family, default), "rope_parameters": dict(SHIPPED)})
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).float().eval()


@pytest.fixture(scope="module", params=["hunyuan_v1_dense", "hunyuan_v1_moe"])
def model(request):
    return hunyuan(request.param)


def test_the_base_is_the_one_transformers_computes_from_alpha(model):
    own = model.model.rotary_emb.inv_freq
    layout = rope_layout(model)
    (base,) = layout.bases.values()
    assert base != SHIPPED["rope_theta"]
    torch.testing.assert_close(rope_inv_freq(own.numel() * 2, base).float(), own, rtol=1e-5, atol=0)


def test_the_alpha_form_is_static_and_reading_it_leaves_the_logits_alone(model):
    assert not is_dynamic(model)
    assert stateless_method_for(model.config.rope_parameters) is None
    x = torch.randint(3, 128, (1, 40))
    with torch.no_grad():
        before = model(x).logits
        ctxext.patch(model, method="none")
        after = model(x).logits
    ctxext.unpatch(model)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_linear_scales_the_shipped_frequencies(model):
    own = model.model.rotary_emb.inv_freq.clone()
    ctxext.patch(model, method="linear", factor=4.0)
    try:
        scaled = model.model.rotary_emb(torch.zeros(1), torch.tensor([[1]]))[1]  # sin at position 1
        torch.testing.assert_close(scaled[0, 0, : own.numel()], torch.sin(own / 4), rtol=1e-5, atol=1e-6)
    finally:
        ctxext.unpatch(model)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, own, rtol=0, atol=0)


def test_the_wavelengths_reported_are_the_shipped_frequencies(model):
    """What eval's notes and the dpe pair report call each pair's wavelength: 2 pi / transformers' own inv_freq."""
    import math

    from ctxext.patching.families import rotary_wavelengths

    own = model.model.rotary_emb.inv_freq.double()
    reported = torch.tensor(rotary_wavelengths(model), dtype=torch.float64)
    torch.testing.assert_close(reported, 2 * math.pi / own, rtol=1e-5, atol=0)
